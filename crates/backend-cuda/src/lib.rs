//! # vellum-backend-cuda — the CUDA backend
//!
//! The paged kernels of `kernels/cuda/` for NVIDIA GPUs, compiled at run
//! time with NVRTC and launched through `cudarc` (paper §4.1, §5.1).
//!
//! | module | what it holds |
//! |---|---|
//! | [`kernels`] | the CUDA C++ sources (embedded), their entry points, the configurations CI compiles |
//! | [`nvrtc`] | compiling a source to PTX for a `compute_XY` architecture, with no GPU needed |
//! | [`blas`] | cuBLAS, loaded at run time: 16-bit weights' GEMMs on tensor cores |
//! | [`device`] | finding a GPU: a typed error, never a panic, when there is no driver |
//! | [`graphs`] | CUDA graphs for decode steps: capture sizes, padding, context bounds, each shape's state (host logic) |
//! | [`launch`] | [`launch::Kernels`]: modules compiled on first use per configuration, one shape-checked call per kernel |
//! | [`layout`] | how a quantized weight sits on the device: the file's blocks as planes of codes and scales |
//! | [`ops`] | [`CudaOps`]: the model operations and the paged-attention contract, so that `ModelRunner<CudaOps>` is the CUDA `ModelExecutor` (`--device cuda`) |
//! | [`sampling`] | sampling on the device, host side: a step's sampling rows packed (and checked) for `sample_rows`, its outputs read back |
//!
//! The kernels — `reshape_and_cache`, paged attention v1/v2 for mixed
//! prefill/decode batches, `copy_blocks`, RMSNorm (fused with the residual
//! add), RoPE, SwiGLU/GeGLU, embedding gather, greedy argmax, sampling
//! (temperature, top-k/p, min-p, penalties, logprobs), the
//! f32 GEMV, the bf16 tensor-core GEMM on Q8_0/Q4_0/Q4_1/K-quant weights kept as
//! their blocks, and the executor's glue — compile for `compute_80`
//! and `compute_90` in CI, with registers and spills recorded per kernel
//! (`docs/cuda_kernels.md`). [`launch::Kernels`] launches them; a launch
//! that reads device memory at indices it is given is an `unsafe fn`, and
//! [`CudaOps`] checks those indices against the step's bounds before it
//! calls one. `tests/gpu.rs` checks the kernels against float64 references
//! and the executor against the CPU's f32 path on a tiny Llama, on a GPU
//! (skipped by name without one). README.md says where it has run.
//!
//! The libraries are loaded dynamically (cudarc's `dynamic-loading`), so
//! this crate builds and links on machines with no CUDA at all; every entry
//! point checks that the library it needs is present first
//! ([`device::driver_is_present`], [`nvrtc::is_available`],
//! [`blas::cublas_is_present`]).

#![deny(missing_docs)]

pub mod blas;
pub mod device;
mod error;
pub mod graphs;
pub mod kernels;
pub mod launch;
pub mod layout;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod sampling;

pub use error::CudaError;
pub use graphs::{CaptureSizes, GraphKey};
pub use ops::{CudaOps, CudaPrecision, GraphOptions};
