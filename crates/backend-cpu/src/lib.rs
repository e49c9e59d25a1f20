//! # vellum-backend-cpu — the reference backend
//!
//! Will hold the host-memory implementation of the core traits
//! ([`vellum_core::ModelExecutor`], [`vellum_core::AttentionBackend`]): GEMM,
//! RMSNorm, RoPE, SiLU·mul, the fused K/V block write, paged attention over a
//! mixed prefill/decode batch, block copies for copy-on-write and swapping
//! between the device pool and the host pool.
//!
//! Status: empty. It is filled by the "Real models on the CPU backend" issue.

pub mod kv_cache;
pub mod paged_attention;
