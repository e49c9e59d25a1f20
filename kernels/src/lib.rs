//! # vellum-kernels — the GPU kernel sources
//!
//! The kernels live as source files beside this crate, as the project's
//! layout has it (`kernels/wgsl/`, `kernels/cuda/`, described in
//! `README.md`); this crate embeds them so that a backend built from its
//! published package finds them: `vellum-backend-wgpu` composes and compiles
//! [`wgsl`] on the device, `vellum-backend-cuda` compiles [`cuda`] to PTX with
//! NVRTC. Nothing here runs; each constant is a file's text.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

/// WGSL compute shaders (`kernels/wgsl/`), one per kernel, and the format
/// snippets a kernel is composed with (`WEIGHTS_*`: how a weight format
/// decodes; `KV_*`: how a KV-cache element type packs into words).
pub mod wgsl {
    /// `wgsl/add.wgsl`.
    pub const ADD: &str = include_str!("../wgsl/add.wgsl");
    /// `wgsl/copy_blocks.wgsl`.
    pub const COPY_BLOCKS: &str = include_str!("../wgsl/copy_blocks.wgsl");
    /// `wgsl/embed.wgsl`.
    pub const EMBED: &str = include_str!("../wgsl/embed.wgsl");
    /// `wgsl/gated_mul.wgsl`.
    pub const GATED_MUL: &str = include_str!("../wgsl/gated_mul.wgsl");
    /// `wgsl/gather_rows.wgsl`.
    pub const GATHER_ROWS: &str = include_str!("../wgsl/gather_rows.wgsl");
    /// `wgsl/kv_bf16.wgsl`.
    pub const KV_BF16: &str = include_str!("../wgsl/kv_bf16.wgsl");
    /// `wgsl/kv_f16.wgsl`.
    pub const KV_F16: &str = include_str!("../wgsl/kv_f16.wgsl");
    /// `wgsl/kv_f32.wgsl`.
    pub const KV_F32: &str = include_str!("../wgsl/kv_f32.wgsl");
    /// `wgsl/kv_fp8.wgsl`.
    pub const KV_FP8: &str = include_str!("../wgsl/kv_fp8.wgsl");
    /// `wgsl/matmul.wgsl`.
    pub const MATMUL: &str = include_str!("../wgsl/matmul.wgsl");
    /// `wgsl/paged_attention.wgsl`.
    pub const PAGED_ATTENTION: &str = include_str!("../wgsl/paged_attention.wgsl");
    /// `wgsl/rms_norm.wgsl`.
    pub const RMS_NORM: &str = include_str!("../wgsl/rms_norm.wgsl");
    /// `wgsl/rope.wgsl`.
    pub const ROPE: &str = include_str!("../wgsl/rope.wgsl");
    /// `wgsl/scale.wgsl`.
    pub const SCALE: &str = include_str!("../wgsl/scale.wgsl");
    /// `wgsl/weights_bf16.wgsl`.
    pub const WEIGHTS_BF16: &str = include_str!("../wgsl/weights_bf16.wgsl");
    /// `wgsl/weights_f16.wgsl`.
    pub const WEIGHTS_F16: &str = include_str!("../wgsl/weights_f16.wgsl");
    /// `wgsl/weights_f32.wgsl`.
    pub const WEIGHTS_F32: &str = include_str!("../wgsl/weights_f32.wgsl");
    /// `wgsl/weights_q4_1.wgsl`.
    pub const WEIGHTS_Q4_1: &str = include_str!("../wgsl/weights_q4_1.wgsl");
    /// `wgsl/weights_q8_0.wgsl`.
    pub const WEIGHTS_Q8_0: &str = include_str!("../wgsl/weights_q8_0.wgsl");
    /// `wgsl/write_kv.wgsl`.
    pub const WRITE_KV: &str = include_str!("../wgsl/write_kv.wgsl");
}

/// CUDA C++ sources (`kernels/cuda/`) for NVRTC; [`cuda::COMMON`] is
/// prepended to each (16-bit conversions in PTX, reductions), so they need
/// no CUDA header.
pub mod cuda {
    /// `cuda/common.cuh`.
    pub const COMMON: &str = include_str!("../cuda/common.cuh");
    /// `cuda/cache.cu`.
    pub const CACHE: &str = include_str!("../cuda/cache.cu");
    /// `cuda/paged_attention.cu`.
    pub const PAGED_ATTENTION: &str = include_str!("../cuda/paged_attention.cu");
    /// `cuda/layers.cu`.
    pub const LAYERS: &str = include_str!("../cuda/layers.cu");
    /// `cuda/gemv_q.cu`.
    pub const GEMV_Q: &str = include_str!("../cuda/gemv_q.cu");
    /// `cuda/gemm_mma.cu`.
    pub const GEMM_MMA: &str = include_str!("../cuda/gemm_mma.cu");
    /// `cuda/flash_attention.cu`.
    pub const FLASH_ATTENTION: &str = include_str!("../cuda/flash_attention.cu");
    /// `cuda/sampling.cu`.
    pub const SAMPLING: &str = include_str!("../cuda/sampling.cu");
}

#[cfg(test)]
mod tests {
    /// Every source file of the two directories is embedded (a new kernel
    /// file without its constant would be missing from the package).
    #[test]
    fn every_kernel_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let count = |sub: &str, exts: &[&str]| {
            std::fs::read_dir(dir.join(sub))
                .map(|d| d.filter_map(|e| e.ok()).filter(|e| exts.iter().any(|x| e.path().extension().is_some_and(|y| y == *x))).count())
                .unwrap_or(0)
        };
        // This file's own text: one `include_str!` per kernel file.
        let embedded = |sub: &str| include_str!("lib.rs").matches(&format!("include_str!(\"../{sub}/")).count();
        assert_eq!(count("wgsl", &["wgsl"]), embedded("wgsl"), "a constant per WGSL file in src/lib.rs");
        assert_eq!(count("cuda", &["cu", "cuh"]), embedded("cuda"), "a constant per CUDA file in src/lib.rs");
        assert!(embedded("wgsl") >= 20 && embedded("cuda") >= 8);
        assert!(super::wgsl::MATMUL.contains("fn ") && super::cuda::PAGED_ATTENTION.contains("__global__"));
    }
}
