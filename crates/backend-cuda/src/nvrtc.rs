//! Compiling the kernels to PTX with NVRTC, found at run time.
//!
//! NVRTC ships as the `nvidia-cuda-nvrtc-cu12` wheel; its `lib/` directory
//! must be on `LD_LIBRARY_PATH` (or the library installed system-wide).
//! Nothing here needs a GPU: CI compiles every kernel for `compute_80` and
//! `compute_90` on a machine without one.

use crate::kernels::Variant;
use crate::CudaError;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

/// The virtual architectures CI compiles for: Ampere (A100) and Hopper (H100).
pub const CI_ARCHS: [&str; 2] = ["compute_80", "compute_90"];

/// Whether NVRTC can be loaded.
pub fn is_available() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on NVRTC's library
    // names and drops what it opened; loading NVRTC runs no initializer
    // with preconditions of ours.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32), CudaError> {
    if !is_available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loadable (checked above); nvrtcVersion writes one
    // int through each pointer, both valid for the call.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    match r {
        cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => Ok((major, minor)),
        other => Err(CudaError::Driver(format!("nvrtcVersion: {other:?}"))),
    }
}

/// Compiles `variant` to PTX for `arch` (a `compute_XY` virtual
/// architecture), with IEEE division and square roots and no flush to zero
/// (the kernels call the fast intrinsics they want by name).
pub fn compile(variant: &Variant, arch: &str) -> Result<String, CudaError> {
    if !is_available() {
        return Err(CudaError::NoNvrtc);
    }
    let opts = CompileOptions {
        options: vec!["--std=c++17".into(), format!("--gpu-architecture={arch}")],
        name: Some(variant.source.file.into()),
        ..Default::default()
    };
    match compile_ptx_with_opts(variant.full_source(), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(e) => {
            let log = match &e {
                CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => format!("{other:?}"),
            };
            Err(CudaError::Compile { kernel: variant.label(), arch: arch.into(), log })
        }
    }
}

/// [`compile`], through a cache on disk: a configuration compiled once (by
/// any process) is read back instead of compiled again, so a second start
/// skips NVRTC. The entry is keyed by the full source with its defines,
/// the architecture and NVRTC's version; it lives in `$VELLUM_CACHE/kernels`
/// (else `$XDG_CACHE_HOME/vellum/kernels`, else `~/.cache/vellum/kernels`;
/// `VELLUM_KERNEL_CACHE=0` turns it off). A cache that cannot be read or
/// written only costs the compile.
pub fn compile_cached(variant: &Variant, arch: &str) -> Result<String, CudaError> {
    match kernel_cache_dir() {
        Some(dir) => compile_cached_in(&dir, variant, arch),
        None => compile(variant, arch),
    }
}

/// [`compile_cached`] with the cache in `dir`.
pub fn compile_cached_in(dir: &std::path::Path, variant: &Variant, arch: &str) -> Result<String, CudaError> {
    let source = variant.full_source();
    let key = format!("{arch} nvrtc {:?}\n{source}", version()?);
    let (name, digest) = cache_key(&key);
    let path = dir.join(format!("{name}.ptx"));
    let header = format!("// vellum kernel cache {digest}\n");
    if let Ok(text) = std::fs::read_to_string(&path) {
        if let Some(ptx) = text.strip_prefix(&header) {
            tracing::debug!(kernel = %variant.label(), path = %path.display(), "PTX from the kernel cache");
            return Ok(ptx.to_string());
        }
    }
    let ptx = compile(variant, arch)?;
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, format!("{header}{ptx}")))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        tracing::debug!(path = %path.display(), "kernel cache not written: {e}");
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(ptx)
}

/// Where [`compile_cached`] keeps its entries; `None` when turned off or
/// no directory is named by the environment.
fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    if std::env::var("VELLUM_KERNEL_CACHE").is_ok_and(|v| v == "0") {
        return None;
    }
    let base = var("VELLUM_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("vellum")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("vellum")))?;
    Some(base.join("kernels"))
}

/// A file name and a longer digest of `key` (two 64-bit SipHashes with
/// distinct prefixes; the digest, stored in the entry, guards the name).
fn cache_key(key: &str) -> (String, String) {
    use std::hash::{Hash, Hasher};
    let h = |salt: u64| {
        let mut s = std::collections::hash_map::DefaultHasher::new();
        salt.hash(&mut s);
        key.hash(&mut s);
        s.finish()
    };
    let (a, b, c) = (h(1), h(2), h(3));
    (format!("{a:016x}"), format!("{a:016x}{b:016x}{c:016x}-{}", key.len()))
}

/// The `.entry` names a PTX module defines.
pub fn entry_points(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix(".visible .entry ")?;
            Some(rest.split('(').next().unwrap_or(rest).trim().to_string())
        })
        .collect()
}
