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

/// The `.entry` names a PTX module defines.
pub fn entry_points(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix(".visible .entry ")?;
            Some(rest.split('(').next().unwrap_or(rest).trim().to_string())
        })
        .collect()
}
