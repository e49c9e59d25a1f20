//! Tidiness as a test (rust-analyzer's idea): rules a reviewer would
//! otherwise have to remember, checked on every run over the whole
//! workspace's sources.
//!
//! - every `unsafe` block and `unsafe impl` has a `// SAFETY:` comment
//!   right above it (or on its line), and every `unsafe fn` a `# Safety`
//!   section in its doc comment;
//! - every library crate denies `missing_docs`, so a public item without
//!   docs does not compile;
//! - every dependency a crate declares is used by its code;
//! - the engine keeps its own view of sequences: nothing in
//!   `crates/engine/src` reads the scheduler's request objects;
//! - the backends stand on the seam alone: no backend crate depends, even
//!   indirectly, on `vellum-models` or on anything that parses files or text
//!   (tokenizers, chat templates, safetensors, zip), read from `cargo
//!   metadata`;
//! - a CUDA launch that reads device memory at indices it is given (slot
//!   mappings, block tables, positions, row ids) is an `unsafe fn`, unless
//!   its kernel checks each index itself (listed below with why);
//! - a crate embeds files (`include_str!`, `include_bytes!`) only from its
//!   own directory, so it builds from its published package;
//! - every package name is free on crates.io (read from its sparse index,
//!   where yanked crates still hold their names), so each crate can be
//!   published and depended on; offline, the check says it skipped.
//!
//! `cargo fmt --check` and `cargo clippy --all-targets -- -D warnings` run
//! beside this test in `.ci/run`.

use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The workspace's packages: the root facade, every `crates/*`, and
/// `kernels/`.
fn packages() -> Vec<PathBuf> {
    let mut dirs = vec![root(), root().join("kernels")];
    let mut crates: Vec<PathBuf> = fs::read_dir(root().join("crates"))
        .expect("crates/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    crates.sort();
    dirs.extend(crates);
    dirs
}

/// `.rs` files under `dir`, recursively (not into `target`).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target" && n != "crates") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// A package's sources in the given subfolders, plus the files they pull in
/// with `#[path = "..."]`.
fn sources(pkg: &Path, dirs: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for d in dirs {
        rust_files(&pkg.join(d), &mut out);
    }
    let mut included = Vec::new();
    for f in &out {
        for line in fs::read_to_string(f).unwrap_or_default().lines() {
            if let Some(rest) = line.trim().strip_prefix("#[path = \"") {
                if let (Some(rel), Some(dir)) = (rest.split('"').next(), f.parent()) {
                    included.push(dir.join(rel));
                }
            }
        }
    }
    out.extend(included);
    out
}

/// The code part of a line: string literals blanked, a trailing `//`
/// comment dropped.
fn code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    let mut in_str = false;
    while let Some(c) = chars.next() {
        match (in_str, c) {
            (false, '/') if chars.peek() == Some(&'/') => break,
            (false, '"') => in_str = true,
            (true, '\\') => {
                chars.next();
            }
            (true, '"') => in_str = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

/// The comment and attribute lines directly above line `i`.
fn preamble(lines: &[&str], i: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut j = i;
    while j > 0 {
        j -= 1;
        let t = lines[j].trim();
        if t.starts_with("//") || t.starts_with("#[") || t.starts_with("#![") {
            out.push(t.to_string());
        } else {
            break;
        }
    }
    out
}

#[test]
fn every_unsafe_says_why_it_is_sound() {
    let mut missing = Vec::new();
    for pkg in packages() {
        for file in sources(&pkg, &["src", "tests", "benches", "examples"]) {
            let text = fs::read_to_string(&file).expect("readable source");
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let c = code(line);
                let here = || format!("{}:{}: {}", file.strip_prefix(root()).unwrap_or(&file).display(), i + 1, line.trim());
                if c.contains("unsafe fn ") {
                    if !preamble(&lines, i).iter().any(|l| l.contains("# Safety")) {
                        missing.push(format!("{} (an `unsafe fn` needs a `# Safety` doc section)", here()));
                    }
                } else if c.contains("unsafe {") || c.contains("unsafe impl") {
                    let commented = line.contains("SAFETY") || preamble(&lines, i).iter().any(|l| l.contains("SAFETY"));
                    // A block opening inside a statement whose first line carries the comment.
                    let stmt_above =
                        i > 0 && preamble(&lines, i - 1).iter().any(|l| l.contains("SAFETY")) && !lines[i - 1].trim().ends_with(';');
                    if !commented && !stmt_above {
                        missing.push(format!("{} (needs a `// SAFETY:` comment)", here()));
                    }
                }
            }
        }
    }
    assert!(missing.is_empty(), "unsafe code without its justification:\n  {}", missing.join("\n  "));
}

#[test]
fn every_library_denies_missing_docs() {
    let mut missing = Vec::new();
    for pkg in packages() {
        let lib = pkg.join("src/lib.rs");
        if lib.is_file() && !fs::read_to_string(&lib).expect("lib.rs").contains("#![deny(missing_docs)]") {
            missing.push(lib.strip_prefix(root()).unwrap_or(&lib).display().to_string());
        }
    }
    assert!(missing.is_empty(), "libraries without #![deny(missing_docs)]: {missing:?}");
}

/// Dependency names of one `[section]` of a manifest.
fn declared(manifest: &str, section: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in manifest.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            inside = t == format!("[{section}]");
            continue;
        }
        if inside && !t.is_empty() && !t.starts_with('#') {
            if let Some(name) = t.split(['=', '.', ' ']).next().filter(|n| !n.is_empty()) {
                out.push(name.trim().to_string());
            }
        }
    }
    out
}

fn uses(files: &[PathBuf], krate: &str) -> bool {
    let ident = krate.replace('-', "_");
    files.iter().any(|f| {
        let text = fs::read_to_string(f).unwrap_or_default();
        text.match_indices(&ident).any(|(i, _)| {
            let before = text[..i].chars().next_back().is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
            let after = &text[i + ident.len()..];
            before
                && (after.starts_with("::")
                    || after.starts_with(" as ")
                    || after.starts_with(';')
                    || after.starts_with(',')
                    || after.starts_with('}'))
        })
    })
}

#[test]
fn every_dependency_is_used() {
    let mut unused = Vec::new();
    for pkg in packages() {
        let manifest = fs::read_to_string(pkg.join("Cargo.toml")).expect("Cargo.toml");
        let name = pkg.strip_prefix(root()).map(|p| p.display().to_string()).unwrap_or_default();
        let lib_files = sources(&pkg, &["src"]);
        let all_files = sources(&pkg, &["src", "tests", "benches", "examples"]);
        for dep in declared(&manifest, "dependencies") {
            if !uses(&lib_files, &dep) {
                unused.push(format!("{name}: {dep}"));
            }
        }
        for dep in declared(&manifest, "dev-dependencies") {
            if !uses(&all_files, &dep) {
                unused.push(format!("{name} (dev): {dep}"));
            }
        }
    }
    assert!(unused.is_empty(), "declared but unused dependencies:\n  {}", unused.join("\n  "));
}

#[test]
fn the_engine_never_reads_scheduler_requests() {
    let mut reads = Vec::new();
    for file in sources(&root().join("crates/engine"), &["src"]) {
        let text = fs::read_to_string(&file).expect("readable source");
        for (i, line) in text.lines().enumerate() {
            let c = code(line);
            if ["scheduler.request(", "take_finished_requests(", "scheduler().request("].iter().any(|p| c.contains(p)) {
                reads.push(format!("{}:{}: {}", file.strip_prefix(root()).unwrap_or(&file).display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        reads.is_empty(),
        "the engine reads scheduler request objects (keep a view from StepUpdate instead):\n  {}",
        reads.join("\n  ")
    );
}

/// Crates a backend must not pull in (as normal dependencies, directly or
/// through others): the model zoo and what parses files or text.
const NOT_UNDER_A_BACKEND: [&str; 8] =
    ["vellum-models", "vellum-formats", "vellum-tokenizer", "tokenizers", "minijinja", "safetensors", "zip", "sha2"];

/// One job per crate, read from the dependency graph: each entry is a
/// package (or a name prefix ending in `-`) and the crates it must not pull
/// in as normal dependencies, directly or through others.
const MUST_NOT_REACH: [(&str, &[&str]); 3] = [
    ("vellum-backend-", &NOT_UNDER_A_BACKEND),
    // The file readers parse no text and render no templates.
    ("vellum-formats", &["vellum-tokenizer", "tokenizers", "minijinja", "vellum-models"]),
    // The tokenizer knows nothing of weights or backends.
    ("vellum-tokenizer", &["vellum-models", "vellum-backend-cpu", "vellum-backend-wgpu", "vellum-backend-cuda"]),
];

#[test]
fn backends_depend_on_the_seam_alone_and_each_crate_keeps_to_its_job() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // This machine's platform only: the other platforms' crates may not be
    // downloaded, and a crate's dependencies are the same question on each.
    let rustc = std::process::Command::new("rustc").arg("-vV").output().expect("rustc -vV runs");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("rustc names its host");
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--all-features", "--locked", "--offline", "--filter-platform", &host])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let names: std::collections::HashMap<&str, &str> =
        meta["packages"].as_array().into_iter().flatten().filter_map(|p| Some((p["id"].as_str()?, p["name"].as_str()?))).collect();
    let name_of = |id: &str| -> String { names.get(id).copied().unwrap_or(id).to_string() };
    // Normal (not dev, not build) edges of the resolved graph.
    let mut edges: std::collections::HashMap<String, Vec<String>> = Default::default();
    for node in meta["resolve"]["nodes"].as_array().expect("a resolve graph") {
        let from = node["id"].as_str().unwrap_or_default().to_string();
        for dep in node["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"].as_array().into_iter().flatten().any(|k| k["kind"].is_null());
            if normal {
                edges.entry(from.clone()).or_default().push(dep["pkg"].as_str().unwrap_or_default().to_string());
            }
        }
    }
    let mut found = Vec::new();
    for (pattern, forbidden) in MUST_NOT_REACH {
        let matches = |n: &str| if pattern.ends_with('-') { n.starts_with(pattern) } else { n == pattern };
        let roots: Vec<(&str, &str)> = names.iter().filter(|(_, n)| matches(n)).map(|(id, n)| (*id, *n)).collect();
        assert!(!roots.is_empty(), "no package matches {pattern}");
        if pattern == "vellum-backend-" {
            assert_eq!(roots.len(), 3, "three backend crates");
        }
        for (start, root_name) in roots {
            let mut seen = std::collections::HashSet::from([start.to_string()]);
            let mut stack = vec![(start.to_string(), vec![root_name.to_string()])];
            while let Some((id, path)) = stack.pop() {
                for next in edges.get(&id).into_iter().flatten() {
                    if !seen.insert(next.clone()) {
                        continue;
                    }
                    let name = name_of(next);
                    let mut path = path.clone();
                    path.push(name.clone());
                    if forbidden.contains(&name.as_str()) {
                        found.push(path.join(" -> "));
                    }
                    stack.push((next.clone(), path));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "backend crates depend on the seam (vellum-ops, vellum-base) alone, and each crate keeps to its job (MUST_NOT_REACH), but:\n  {}",
        found.join("\n  ")
    );
}

/// A crate whose code has no `unsafe` says so to the compiler, so that
/// none can arrive unnoticed: its root has `#![forbid(unsafe_code)]`.
#[test]
fn crates_without_unsafe_forbid_it() {
    let mut missing = Vec::new();
    for pkg in packages() {
        let files = sources(&pkg, &["src"]);
        let has_unsafe = files.iter().any(|f| {
            fs::read_to_string(f).unwrap_or_default().lines().any(|l| {
                let c = code(l);
                c.contains("unsafe ") || c.contains("unsafe{")
            })
        });
        let root = ["src/lib.rs", "src/main.rs"].iter().map(|r| pkg.join(r)).find(|p| p.is_file());
        let Some(root) = root else { continue };
        let forbids = fs::read_to_string(&root).unwrap_or_default().lines().any(|l| l.trim() == "#![forbid(unsafe_code)]");
        if !has_unsafe && !forbids {
            missing.push(root.display().to_string());
        }
    }
    assert!(missing.is_empty(), "no unsafe code, but no #![forbid(unsafe_code)]:\n  {}", missing.join("\n  "));
}

/// What a registry page shows for a package: each package's `[package]`
/// table names a description, a license, a repository and a readme, and
/// the readme exists.
#[test]
fn every_package_has_registry_metadata_and_a_readme() {
    let mut missing = Vec::new();
    for pkg in packages() {
        let manifest = fs::read_to_string(pkg.join("Cargo.toml")).expect("Cargo.toml");
        let mut in_package = false;
        let mut keys = Vec::new();
        for line in manifest.lines() {
            let t = line.trim();
            if t.starts_with('[') {
                in_package = t == "[package]";
            } else if in_package {
                if let Some((key, value)) = t.split_once('=') {
                    keys.push((key.trim().trim_end_matches(".workspace").to_string(), value.trim().trim_matches('"').to_string()));
                }
            }
        }
        for wanted in ["description", "license", "repository", "readme"] {
            if !keys.iter().any(|(k, _)| k == wanted) {
                missing.push(format!("{}: no `{wanted}`", pkg.display()));
            }
        }
        if let Some((_, readme)) = keys.iter().find(|(k, _)| k == "readme") {
            if !pkg.join(readme).is_file() {
                missing.push(format!("{}: readme {readme} does not exist", pkg.display()));
            }
        }
    }
    assert!(missing.is_empty(), "package metadata:\n  {}", missing.join("\n  "));
}

/// Names on crates.io that are ours (none is published yet): a package may
/// keep a name only the project holds.
const OURS_ON_CRATES_IO: [&str; 0] = [];

/// The sparse-index path of a crate name (crates.io's layout).
fn index_path(name: &str) -> String {
    let n = name.to_ascii_lowercase();
    match n.len() {
        1 => format!("1/{n}"),
        2 => format!("2/{n}"),
        3 => format!("3/{}/{n}", &n[..1]),
        _ => format!("{}/{}/{n}", &n[..2], &n[2..4]),
    }
}

#[test]
fn package_names_are_free_on_crates_io_or_skipped_offline() {
    let mut names = Vec::new();
    for pkg in packages() {
        let manifest = fs::read_to_string(pkg.join("Cargo.toml")).expect("Cargo.toml");
        let mut in_package = false;
        for line in manifest.lines() {
            let t = line.trim();
            if t.starts_with('[') {
                in_package = t == "[package]";
            } else if in_package {
                if let Some(v) = t.strip_prefix("name").map(str::trim).and_then(|r| r.strip_prefix('=')) {
                    names.push(v.trim().trim_matches('"').to_string());
                }
            }
        }
    }
    assert!(names.len() >= 12, "read every package's name: {names:?}");
    // python3 is what CI installs; its urllib reads the index without a Rust HTTP client.
    let script = "import sys, urllib.request, urllib.error\n\
        for path in sys.argv[1:]:\n\
        \ttry:\n\
        \t\turllib.request.urlopen('https://index.crates.io/' + path, timeout=10); print('taken')\n\
        \texcept urllib.error.HTTPError as e:\n\
        \t\tprint('free' if e.code == 404 else 'unknown')\n\
        \texcept Exception:\n\
        \t\tprint('unknown')\n";
    let paths: Vec<String> = names.iter().map(|n| index_path(n)).collect();
    let out = std::process::Command::new("python3").arg("-c").arg(script).args(&paths).output();
    let answers: Vec<String> = match &out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).lines().map(str::to_string).collect(),
        _ => Vec::new(),
    };
    if answers.len() != names.len() || answers.iter().any(|a| a == "unknown") {
        println!("SKIPPED: crates.io's index is not reachable from here; package names not checked against the registry");
        return;
    }
    let taken: Vec<&String> =
        names.iter().zip(&answers).filter(|(n, a)| *a == "taken" && !OURS_ON_CRATES_IO.contains(&n.as_str())).map(|(n, _)| n).collect();
    assert!(taken.is_empty(), "package names already on crates.io (someone else's; rename the package, keep the directory): {taken:?}");
}

/// Launches taking index buffers whose kernels bounds-check every index.
const LAUNCHES_THAT_CHECK_THEIR_INDICES: [(&str, &str); 1] =
    [("embedding", "embedding_* in layers.cu reads row 0 and writes zeros for an id outside the vocabulary")];

#[test]
fn cuda_launches_that_index_device_memory_are_unsafe() {
    let path = root().join("crates/backend-cuda/src/launch.rs");
    let text = fs::read_to_string(&path).expect("launch.rs");
    let mut safe = Vec::new();
    let mut seen = 0;
    let mut rest = text.as_str();
    while let Some(at) = rest.find("pub ") {
        rest = &rest[at + 4..];
        let is_unsafe = rest.starts_with("unsafe fn ");
        let Some(sig) = rest.strip_prefix("unsafe fn ").or_else(|| rest.strip_prefix("fn ")) else { continue };
        let name: String = sig.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let params = sig.split_once(')').map_or("", |(p, _)| p);
        let indexes = ["&CudaSlice<i64>", "&CudaSlice<i32>", "&DeviceAttentionMetadata"].iter().any(|t| params.contains(t));
        if indexes {
            seen += 1;
            if !is_unsafe && !LAUNCHES_THAT_CHECK_THEIR_INDICES.iter().any(|(n, _)| *n == name) {
                safe.push(name);
            }
        }
    }
    assert!(seen >= 6, "found the launches that take index buffers ({seen})");
    assert!(
        safe.is_empty(),
        "these launches read device memory at caller-given indices but are safe to call (make them `unsafe fn` with a `# Safety` section): {safe:?}"
    );
}

#[test]
fn crates_embed_only_their_own_files() {
    let mut outside = Vec::new();
    let all = packages();
    for pkg in &all {
        // A package's own files: under its directory, not under a package nested in it.
        let own = |p: &Path| p.starts_with(pkg) && !all.iter().any(|q| q != pkg && q.starts_with(pkg) && p.starts_with(q));
        for file in sources(pkg, &["src", "tests", "benches", "examples"]) {
            let text = fs::read_to_string(&file).expect("readable source");
            for (i, line) in text.lines().enumerate() {
                let c = code(line);
                for mac in ["include_str!(\"", "include_bytes!(\""] {
                    // `code` blanks string contents: find the macro there (not
                    // in a comment), read its path from the line itself.
                    if !c.contains(&mac[..mac.len() - 1]) {
                        continue;
                    }
                    let Some(at) = line.find(mac) else { continue };
                    let rel = line[at + mac.len()..].split('"').next().unwrap_or_default();
                    let target = file.parent().map(|d| d.join(rel)).unwrap_or_default();
                    // Normalise `..` by hand: the file may not exist yet.
                    let mut parts: Vec<std::path::Component> = Vec::new();
                    for comp in target.components() {
                        match comp {
                            std::path::Component::ParentDir => {
                                parts.pop();
                            }
                            std::path::Component::CurDir => {}
                            other => parts.push(other),
                        }
                    }
                    let resolved: PathBuf = parts.iter().collect();
                    if !own(&resolved) {
                        outside.push(format!("{}:{}: {}", file.strip_prefix(root()).unwrap_or(&file).display(), i + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(
        outside.is_empty(),
        "files embedded from outside their crate (a published package would not have them):\n  {}",
        outside.join("\n  ")
    );
}
