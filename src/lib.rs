//! # vellum — an LLM inference and serving engine built on PagedAttention
//!
//! This facade re-exports the workspace's crates so that a user can depend on
//! one package and pick backends with Cargo features (`cpu` by default,
//! `wgpu`, `cuda`). Each re-exported crate can also be used on its own.
//!
//! * [`core`] — request state, sampling parameters, configs, backend traits.
//! * [`kvcache`] — the paged KV-cache manager and the Orca baselines.
//! * [`scheduler`] — continuous batching in the unified token model.
//! * [`models`] — model definitions and loaders.
//! * [`engine`] — the engine core and the offline API.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub use vellum_base as core;
pub use vellum_engine as engine;
pub use vellum_kvcache as kvcache;
pub use vellum_models as models;
pub use vellum_ops as ops;
pub use vellum_scheduler as scheduler;

/// The CPU backend (feature `cpu`, on by default).
#[cfg(feature = "cpu")]
pub use vellum_backend_cpu as backend_cpu;
/// The CUDA backend (feature `cuda`).
#[cfg(feature = "cuda")]
pub use vellum_backend_cuda as backend_cuda;
/// The WGSL backend (feature `wgpu`).
#[cfg(feature = "wgpu")]
pub use vellum_backend_wgpu as backend_wgpu;
