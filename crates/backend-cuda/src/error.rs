//! The backend's typed errors: a missing driver or compiler is an error a
//! user can act on, never a panic.

/// What went wrong in the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library (`libcuda.so`) could be loaded.
    #[error("no CUDA driver found (libcuda.so.1 is not loadable): install an NVIDIA driver, or use --device cpu")]
    NoDriver,
    /// The driver loaded but reports no device.
    #[error("the CUDA driver reports no GPU")]
    NoDevice,
    /// NVRTC (`libnvrtc.so.12`) could not be loaded.
    #[error("NVRTC is not loadable (libnvrtc.so.12): `pip install nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH")]
    NoNvrtc,
    /// cuBLAS (`libcublas.so.12`) could not be loaded.
    #[error("cuBLAS is not loadable (libcublas.so.12): `pip install nvidia-cublas-cu12` and put its lib directory on LD_LIBRARY_PATH (16-bit weights then run on tensor cores; without it they are widened to f32)")]
    NoCublas,
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Cublas(String),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A kernel was called with buffers or shapes it cannot take.
    #[error("CUDA kernel arguments: {0}")]
    Shape(String),
    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile {kernel} for {arch}:\n{log}")]
    Compile {
        /// The kernel source file.
        kernel: String,
        /// The virtual architecture (`compute_80`, ...).
        arch: String,
        /// NVRTC's log.
        log: String,
    },
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}
