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
    /// NCCL (`libnccl.so`, as cudarc looks for it) could not be loaded: a
    /// tensor-parallel group needs it.
    #[error("NCCL is not loadable (libnccl.so): install NCCL (e.g. `pip install nvidia-nccl-cu12`), link its libnccl.so.2 as libnccl.so and put that directory on LD_LIBRARY_PATH (a tensor-parallel group on --device cuda needs it)")]
    NoNccl,
    /// An NCCL call failed, or a rank of the group did.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// Fewer GPUs than a tensor-parallel group asks for.
    #[error("--tensor-parallel-size {wanted} needs {wanted} GPUs; the driver reports {present}")]
    TooFewGpus {
        /// Ranks asked for.
        wanted: usize,
        /// GPUs present.
        present: usize,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Cublas(String),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A kernel was called with buffers or shapes it cannot take.
    #[error("CUDA kernel arguments: {0}")]
    Shape(String),
    /// A setting from the environment that does not parse.
    #[error("{0}")]
    Setting(String),
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
