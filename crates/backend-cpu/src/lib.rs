//! # vellum-backend-cpu — the reference backend
//!
//! The host-memory implementation of the backend contracts: [`CpuOps`]
//! implements the model operations of `vellum_ops::Ops` (linear
//! layers, RMSNorm, RoPE, SiLU·mul, the fused K/V block write and paged
//! attention over a mixed prefill/decode batch) and the core
//! [`vellum_base::AttentionBackend`] (host KV pools, block copies for
//! copy-on-write, swapping to a host pool). The crate depends on the seam
//! (`vellum-ops`, `vellum-base`) alone; `vellum-models`' `ModelRunner<CpuOps>`
//! runs a model on it (`vellum_engine::CpuExecutor`).
//!
//! **The one decision to know:** its float32 path (`WeightFormat::F32`,
//! `--cpu-precision float32`) is the reference every other backend is
//! checked against; the default multiplies the GGUF's integer blocks by
//! activations quantized to int8, as llama.cpp does, except each weight's
//! few outlier input channels, which a calibration pass picks and which go
//! through f32 ([`outliers`]): closer to the float64 golden references than
//! llama.cpp (`KERNELS.md`). Everything
//! between the linears (norms, RoPE, attention, the residual stream) stays
//! f32; the KV cache is f32 or f16 or bf16 (`ModelRunner::with_kv_cache_dtype`;
//! the engine's `auto` takes f16 on the int8 path, as llama.cpp does, f32 on
//! the exact ones; measured cost on the golden prompts of the f32-weight
//! path: 0.0048 nats for f16, 0.036 for bf16, no greedy token changed).
//!
//! Tensor parallelism runs here too, for the same proof as on GPUs:
//! [`CpuOps::tensor_parallel_group`] gives the ranks of one in-process
//! group ([`HostGroup`]), whose all-reduce adds the ranks' partial sums in
//! rank order.

#![deny(missing_docs)]

pub mod cpu_ops;
pub mod kv_cache;
pub mod linear;
pub mod outliers;
pub mod paged_attention;
pub mod quant;
mod spin_team;
pub mod tensor_parallel;

pub use cpu_ops::{available_memory_bytes, CpuOps, HostStep, HostTensor};
pub use quant::{ActBits, WeightFormat};
pub use tensor_parallel::HostGroup;

/// How a kernel test that needs a CPU feature skips: by saying so, or, when
/// CI requires the feature (`VELLUM_REQUIRE_AVX2=1`, `VELLUM_REQUIRE_AVX512=1`,
/// as `VELLUM_REQUIRE_GPU` requires a GPU), by failing.
#[cfg(test)]
pub(crate) fn runs_or_skips(present: bool, test: &str, feature: &str) -> bool {
    if present {
        return true;
    }
    let var = match feature {
        "AVX2" => "VELLUM_REQUIRE_AVX2",
        _ => "VELLUM_REQUIRE_AVX512",
    };
    let required = std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0");
    assert!(!required, "{test}: {var} is set but this CPU lacks {feature}");
    eprintln!("SKIPPED {test}: this CPU lacks {feature} (set {var}=1 to make that a failure)");
    false
}
