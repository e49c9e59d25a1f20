//! # vellum-backend-wgpu — the WGSL backend
//!
//! The model operations ([`vellum_ops::Ops`]) and the paged KV
//! cache ([`vellum_base::AttentionBackend`]) on a `wgpu` device — Vulkan,
//! Metal or DirectX 12, compute only, headless — so the same model code and
//! engine run on a laptop GPU, and on lavapipe (Mesa's CPU Vulkan driver) in
//! CI. The crate depends on the seam (`vellum-ops`, `vellum-base`) alone;
//! `vellum-models`' `ModelRunner<WgpuOps>` runs a model on it
//! (`vellum_engine::WgpuExecutor`).
//!
//! ```text
//!  prepare_step ── one u32 buffer: ids | positions | slots | token→seq | query starts
//!                  | context lens | block tables | logits rows
//!  per layer ───── matmul (weights in GGUF blocks or f16/f32) · rms_norm · rope (table)
//!                  · write_kv (slot mapping) · paged_attention (block tables) · gated_mul (silu or gelu_tanh) · scale · add
//!  to_host ─────── flush: one command buffer per step, then the logits read back
//! ```
//!
//! Kernels live in `kernels/wgsl/`, one file per kernel, composed with the
//! snippet of their weight or KV format ([`kernels`]) and compiled once per
//! device. Ops record dispatches; a step is submitted as one command buffer
//! ([`recorder`]).
//!
//! **The one decision to know:** the backend picks its own layouts and
//! respects the device's real limits. Q4_1/Q8_0 weights stay 4/8-bit blocks,
//! stored column-major over output rows so that neighbouring invocations read
//! neighbouring words; a weight larger than the adapter's storage-binding
//! limit (128 MiB on lavapipe) is split into chunks of rows, a `linear` whose
//! output would exceed it runs in row ranges, and the KV pool is capped at
//! the blocks one binding holds ([`vellum_base::KvMemory::max_blocks`]).
//! No adapter, a full device or a lost one are typed errors, never panics.

#![deny(missing_docs)]

pub mod context;
pub mod kernels;
mod memory;
mod ops;
pub mod recorder;
mod weights;

pub use context::GpuContext;
pub use ops::{GpuKvCache, GpuRope, GpuStep, GpuTensor, GpuVector, WgpuOps};
pub use recorder::KernelProfile;
pub use weights::GpuWeight;
