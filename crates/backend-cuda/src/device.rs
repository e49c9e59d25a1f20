//! Finding a GPU without ever panicking: cudarc loads the driver library
//! lazily and panics when it is missing, so every path into the driver
//! starts with [`probe`].

use crate::CudaError;
use cudarc::driver::{sys::CUdevice_attribute, CudaContext};
use std::sync::Arc;

/// What [`probe`] found.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub num_sms: i32,
    /// Device memory in bytes.
    pub total_memory: usize,
    /// The most shared memory one thread block may take when its kernel
    /// opts in (227 KiB on an H100, 99 KiB on most consumer GPUs).
    pub max_shared_memory_optin: usize,
}

impl DeviceInfo {
    /// The NVRTC virtual architecture for this device (`compute_90`).
    pub fn arch(&self) -> String {
        format!("compute_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// Whether a CUDA driver library can be loaded (no GPU needed to ask).
pub fn driver_is_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the driver's
    // library names and drops what it opened; loading libcuda runs no
    // initializer with preconditions of ours.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Opens device `ordinal`: a typed error when there is no driver or no
/// device, never a panic.
pub fn open(ordinal: usize) -> Result<(Arc<CudaContext>, DeviceInfo), CudaError> {
    if !driver_is_present() {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count()?;
    if count <= 0 || ordinal >= count as usize {
        return Err(CudaError::NoDevice);
    }
    let ctx = CudaContext::new(ordinal)?;
    let info = DeviceInfo {
        ordinal,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        num_sms: ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        total_memory: ctx.total_mem()?,
        max_shared_memory_optin: ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as usize,
    };
    Ok((ctx, info))
}

/// [`open`] for device 0, keeping only what it found.
pub fn probe() -> Result<DeviceInfo, CudaError> {
    open(0).map(|(_, info)| info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probing_without_a_driver_is_a_typed_error_and_with_one_names_the_gpu() {
        match probe() {
            Ok(info) => {
                assert!(driver_is_present());
                assert!(info.compute_capability.0 >= 5 && info.total_memory > 0, "{info:?}");
                eprintln!("found {info:?}");
            }
            Err(e) => {
                if !driver_is_present() {
                    assert!(matches!(e, CudaError::NoDriver), "{e}");
                }
                eprintln!("no GPU: {e}");
            }
        }
    }
}
