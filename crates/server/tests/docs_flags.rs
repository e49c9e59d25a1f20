//! The documentation's flags against the binary's `--help`: the flag table
//! of docs/serving.md lists every flag of `vellum serve` with the default
//! the help gives, and README.md names no flag that `vellum` does not have.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

fn help(subcommand: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_vellum")).args(subcommand).arg("--help").output().expect("vellum --help runs");
    assert!(out.status.success(), "vellum {subcommand:?} --help failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `--flags` named in `text`.
fn flags_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let before_ok = start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'-');
        let end = start
            + 2
            + text[start + 2..]
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                .unwrap_or(text.len() - start - 2);
        if before_ok && end > start + 2 && b[start + 2].is_ascii_lowercase() {
            found.insert(text[start..end].to_string());
        }
        i = end.max(start + 2);
    }
    found
}

/// Each flag of a clap help text with its `[default: …]`, if it has one.
fn help_defaults(help: &str) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let t = line.trim_start();
        if t.starts_with("--") || t.starts_with("-h, --help") {
            let flag = t.trim_start_matches("-h, ").split([' ', '\t']).next().unwrap_or("").to_string();
            out.insert(flag.clone(), None);
            current = Some(flag);
        } else if let (Some(f), Some(d)) = (&current, t.strip_prefix("[default: ").and_then(|d| d.strip_suffix(']'))) {
            out.insert(f.clone(), Some(d.to_string()));
        }
    }
    out.remove("--help");
    out
}

#[test]
fn the_serving_doc_lists_every_serve_flag_with_its_default() {
    let help = help_defaults(&help(&["serve"]));
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/serving.md")).expect("docs/serving.md");
    let table_start = doc.find("| flag | default | meaning |").expect("docs/serving.md has the flag table");
    let mut rows: BTreeMap<String, String> = BTreeMap::new();
    for line in doc[table_start..].lines().skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (name, default) = (cells.get(1).copied().unwrap_or(""), cells.get(2).copied().unwrap_or(""));
        for flag in flags_in(name) {
            rows.insert(flag, default.to_string());
        }
    }
    let documented: BTreeSet<&String> = rows.keys().collect();
    let real: BTreeSet<&String> = help.keys().collect();
    assert_eq!(documented, real, "docs/serving.md's flag table against `vellum serve --help`");
    for (flag, default) in &help {
        if let Some(d) = default {
            let cell = &rows[flag];
            assert!(cell.contains(d.as_str()), "docs/serving.md gives {flag} the default {cell:?}; --help says {d}");
        }
    }
}

#[test]
fn the_readme_names_only_flags_vellum_has() {
    let mut known = BTreeSet::new();
    for sub in [
        &["serve"][..],
        &["generate"],
        &["chat"],
        &["simulate"],
        &["bench", "throughput"],
        &["bench", "latency"],
        &["bench", "serve"],
        &["bench", "serve-plot"],
    ] {
        known.extend(flags_in(&help(sub)));
    }
    // Cargo's own, in the commands that build and test.
    known.extend(["--release", "--locked", "--workspace", "--features", "--example"].map(String::from));
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).expect("README.md");
    let unknown: Vec<String> = flags_in(&readme).into_iter().filter(|f| !known.contains(f)).collect();
    assert!(unknown.is_empty(), "README.md names flags no `vellum` subcommand has: {unknown:?}");
}

#[test]
fn flags_are_found_in_text() {
    let f = flags_in("use `--max-num-seqs 3`, a--b, --x and ---; --no-enable-prefix-caching.");
    assert_eq!(f.into_iter().collect::<Vec<_>>(), ["--max-num-seqs", "--no-enable-prefix-caching", "--x"]);
}
