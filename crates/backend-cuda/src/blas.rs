//! cuBLAS, loaded at run time like the driver and NVRTC: the products of
//! 16-bit (f16, bf16) weights on tensor cores.
//!
//! [`Blas::linear_16`] is `y = x · Wᵀ` for row-major `x [rows, k]` and
//! `W [n, k]`, both 16-bit, into f32 `y [rows, n]`, accumulating in f32
//! (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`). In cuBLAS's column-major terms
//! the row-major `W` is `Wᵀ` with leading dimension `k`, so the call is the
//! "TN" GEMM `yᵀ (n × rows) = W · xᵀ`, the layout PyTorch's `linear` uses.
//! Every length is checked against the buffers before the call, so the
//! safe API cannot read or write past them.

use crate::CudaError;
use cudarc::cublas::{result, sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// Whether the cuBLAS library can be loaded (no GPU needed to ask).
pub fn cublas_is_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on cuBLAS's library
    // names and drops what it opened; loading it runs no initializer with
    // preconditions of ours.
    unsafe { sys::is_culib_present() }
}

/// `Ok` when cuBLAS can be loaded, else [`CudaError::NoCublas`]: the check
/// every path into cuBLAS starts with.
pub fn require_cublas() -> Result<(), CudaError> {
    if cublas_is_present() {
        Ok(())
    } else {
        Err(CudaError::NoCublas)
    }
}

/// A 16-bit element type of weights and of the activations cast for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl Half {
    fn cuda_type(self) -> sys::cudaDataType {
        match self {
            Half::F16 => sys::cudaDataType::CUDA_R_16F,
            Half::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        }
    }
}

/// A cuBLAS handle bound to one stream.
pub struct Blas {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas").finish_non_exhaustive()
    }
}

fn dim(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} = {v} does not fit cuBLAS's int")))
}

impl Blas {
    /// A handle on `stream`; [`CudaError::NoCublas`] when the library is
    /// missing (checked before cudarc touches it, which would panic).
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        require_cublas()?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Cublas(e.to_string()))?;
        Ok(Self { blas, stream })
    }

    /// `y [rows, n] = x [rows, k] · w [n, k]ᵀ`: `x` and `w` row-major in
    /// `dtype`, `y` f32, accumulated in f32 on tensor cores. The three
    /// buffers must live in this handle's context (checked). f16 inputs
    /// hold only values within ±65504: the caller's cast decides that.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_16(
        &self,
        y: &mut CudaSlice<f32>,
        w: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        dtype: Half,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        if w.len() < n * k || x.len() < rows * k || y.len() < rows * n {
            return Err(CudaError::Shape(format!(
                "linear_16: [{rows}x{k}]·[{n}x{k}]ᵀ over buffers of {}, {} and {} elements",
                x.len(),
                w.len(),
                y.len()
            )));
        }
        let ours = self.stream.context();
        if ![w.context(), x.context(), y.context()].iter().all(|c| Arc::ptr_eq(c, ours)) {
            return Err(CudaError::Shape("linear_16: a buffer of another device's context".into()));
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        // cuBLAS wants every leading dimension ≥ 1, also for k = 0 (where
        // beta = 0 makes it write zeros).
        let (m_i, n_i, k_i) = (dim(n, "n")?, dim(rows, "rows")?, dim(k, "k")?);
        let (ld_k, ld_n) = (k_i.max(1), m_i.max(1));
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (w_ptr, _w_sync) = w.device_ptr(&self.stream);
        let (x_ptr, _x_sync) = x.device_ptr(&self.stream);
        let (y_ptr, _y_sync) = y.device_ptr_mut(&self.stream);
        let t = dtype.cuda_type();
        // SAFETY: the handle is bound to `self.stream`, in whose context
        // the three buffers live (checked), so their pointers are valid (the sync guards order this call after their
        // writers and before their next users); cuBLAS reads n·k elements
        // of `w` (lda = k), rows·k of `x` (ldb = k) and writes rows·n f32
        // of `y` (ldc = n), all within the lengths checked above; alpha
        // and beta are host f32, as the default pointer mode and
        // CUBLAS_COMPUTE_32F expect.
        unsafe {
            result::gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m_i,
                n_i,
                k_i,
                (&alpha as *const f32).cast(),
                w_ptr as *const _,
                t,
                ld_k,
                x_ptr as *const _,
                t,
                ld_k,
                (&beta as *const f32).cast(),
                y_ptr as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                ld_n,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Cublas(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cublas_is_required_with_a_typed_error_that_says_how_to_install_it() {
        match require_cublas() {
            Ok(()) => assert!(cublas_is_present()),
            Err(e) => {
                assert!(!cublas_is_present());
                assert!(matches!(e, CudaError::NoCublas), "{e}");
                let message = e.to_string();
                assert!(message.contains("libcublas") && message.contains("nvidia-cublas-cu12"), "{message}");
            }
        }
    }
}
