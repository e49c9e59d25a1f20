//! The CUDA C++ sources of `kernels/cuda/`, embedded in the binary, and the
//! configurations they are compiled in.
//!
//! Each source is compiled on its own with `common.cuh` prepended (so NVRTC
//! needs no header from a CUDA installation), once per configuration: the
//! compile-time constants of a kernel (`HEAD_DIM`, `BLOCK_SIZE`, `ROWS`, ...)
//! are `-D` defines, so a model's shapes get specialized code on first use.

/// `kernels/cuda/common.cuh`: 16-bit float conversions, warp and block
/// reductions, the per-dtype entry-point macro.
pub const COMMON: &str = vellum_kernels::cuda::COMMON;

/// One kernel source file and the entry points it defines (equal when
/// their file names are: the files are the constants below).
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/cuda/`.
    pub file: &'static str,
    /// Its text.
    pub text: &'static str,
    /// Every `extern "C"` kernel it defines (after dtype instantiation).
    pub entry_points: &'static [&'static str],
}

/// `cache.cu`: the fused block write and the batched block copies.
pub const CACHE: KernelSource = KernelSource {
    file: "cache.cu",
    text: vellum_kernels::cuda::CACHE,
    entry_points: &["reshape_and_cache_f32", "reshape_and_cache_f16", "reshape_and_cache_bf16", "reshape_and_cache_fp8", "copy_blocks"],
};

/// `paged_attention.cu`: v1, v2 and v2's reduction, for mixed batches.
pub const PAGED_ATTENTION: KernelSource = KernelSource {
    file: "paged_attention.cu",
    text: vellum_kernels::cuda::PAGED_ATTENTION,
    entry_points: &[
        "paged_attention_v1_f32",
        "paged_attention_v1_f16",
        "paged_attention_v1_bf16",
        "paged_attention_v1_fp8",
        "paged_attention_v2_f32",
        "paged_attention_v2_f16",
        "paged_attention_v2_bf16",
        "paged_attention_v2_fp8",
        "paged_attention_v2_reduce",
    ],
};

/// `flash_attention.cu`: prefill attention on tensor cores over the paged
/// cache, a tile of queries against streamed tiles of keys (16-bit and FP8
/// caches).
pub const FLASH_ATTENTION: KernelSource = KernelSource {
    file: "flash_attention.cu",
    text: vellum_kernels::cuda::FLASH_ATTENTION,
    entry_points: &["flash_attention_f16", "flash_attention_bf16", "flash_attention_fp8"],
};

/// `layers.cu`: RMSNorm (fused with the residual add), RoPE, the split of
/// a stacked q/k/v product (rotated, and with its keys and values written
/// into the paged cache in the same launch), gated activations, embedding
/// gather, greedy argmax, and the executor's glue
/// (residual add, scale, bias, logits-row gather, the cast of activations
/// to 16 bits for cuBLAS).
pub const LAYERS: KernelSource = KernelSource {
    file: "layers.cu",
    text: vellum_kernels::cuda::LAYERS,
    entry_points: &[
        "rms_norm",
        "fused_add_rms_norm",
        "rope_half_split",
        "split_qkv_rope",
        "split_qkv_rope_cache_f32",
        "split_qkv_rope_cache_f16",
        "split_qkv_rope_cache_bf16",
        "split_qkv_rope_cache_fp8",
        "silu_and_mul",
        "gelu_tanh_and_mul",
        "embedding_f32",
        "embedding_f16",
        "embedding_bf16",
        "argmax_rows",
        "silu_mul_split",
        "gelu_tanh_mul_split",
        "add_inplace",
        "scale_inplace",
        "add_bias_rows",
        "gather_rows",
        "cast_f32_to_f16",
        "cast_f32_to_bf16",
    ],
};

/// `gemv_q.cu`: linear layers in f32 arithmetic on the weight layouts
/// (`layout.rs`): the GEMV for decode batches of up to 8 rows, a tiled
/// CUDA-core GEMM beyond (the float32 path), and the split-K sum.
pub const GEMV_Q: KernelSource = KernelSource {
    file: "gemv_q.cu",
    text: vellum_kernels::cuda::GEMV_Q,
    entry_points: &[
        "gemv_q8",
        "gemv_q4",
        "gemv_q4k",
        "gemv_q5k",
        "gemv_q6k",
        "gemv_f32",
        "gemm_q8",
        "gemm_q4",
        "gemm_q4k",
        "gemm_q5k",
        "gemm_q6k",
        "gemm_f32",
        "gemm_sum_splits",
    ],
};

/// `gemm_mma.cu`: linear layers on tensor cores (bf16 activations, weights
/// dequantized to bf16 as they are staged, f32 accumulation; quantized
/// weights also through deeper `cp.async` stages), and the dequantization of a whole
/// weight to bf16 for cuBLAS.
pub const GEMM_MMA: KernelSource = KernelSource {
    file: "gemm_mma.cu",
    text: vellum_kernels::cuda::GEMM_MMA,
    entry_points: &[
        "gemm_mma_q8",
        "gemm_mma_q4",
        "gemm_mma_q4k",
        "gemm_mma_q5k",
        "gemm_mma_q6k",
        "gemm_mma_f32",
        "gemm_mma_staged_q8",
        "gemm_mma_staged_q4",
        "gemm_mma_staged_q4k",
        "gemm_mma_staged_q5k",
        "gemm_mma_staged_q6k",
        "dequantize_bf16_q8",
        "dequantize_bf16_q4",
        "dequantize_bf16_q4k",
        "dequantize_bf16_q5k",
        "dequantize_bf16_q6k",
        "dequantize_bf16_f32",
    ],
};

/// `sampling.cu`: a token (and the logprobs asked for) per row of logits,
/// drawn as the host sampler draws.
pub const SAMPLING: KernelSource =
    KernelSource { file: "sampling.cu", text: vellum_kernels::cuda::SAMPLING, entry_points: &["sample_rows", "unpenalize_rows"] };

/// Every source.
pub const SOURCES: [KernelSource; 7] = [CACHE, PAGED_ATTENTION, FLASH_ATTENTION, LAYERS, GEMV_Q, GEMM_MMA, SAMPLING];

/// A source with its compile-time constants.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    /// The source.
    pub source: KernelSource,
    /// `-D NAME=VALUE` pairs, in order.
    pub defines: Vec<(&'static str, usize)>,
}

impl PartialEq for KernelSource {
    fn eq(&self, other: &Self) -> bool {
        self.file == other.file
    }
}
impl Eq for KernelSource {}

impl std::hash::Hash for KernelSource {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.file.hash(state);
    }
}

impl Variant {
    /// `source` with `defines`.
    pub fn new(source: KernelSource, defines: &[(&'static str, usize)]) -> Self {
        Self { source, defines: defines.to_vec() }
    }

    /// A short label: `paged_attention.cu HEAD_DIM=64 BLOCK_SIZE=16`.
    pub fn label(&self) -> String {
        let mut s = self.source.file.to_string();
        for (k, v) in &self.defines {
            s += &format!(" {k}={v}");
        }
        s
    }

    /// The text NVRTC compiles: the defines, `common.cuh`, then the source
    /// (with `#line` so that errors name the right file and line).
    pub fn full_source(&self) -> String {
        let mut s = String::new();
        for (k, v) in &self.defines {
            s += &format!("#define {k} {v}\n");
        }
        s += "#line 1 \"common.cuh\"\n";
        s += COMMON;
        s += &format!("\n#line 1 \"{}\"\n", self.source.file);
        s += self.source.text;
        s
    }
}

/// The configurations CI compiles and `docs/cuda_kernels.md` records: the
/// attention shapes of the models we serve (head size 64 with GQA groups of
/// 3: SmolLM2; 128 with 4: Llama 3 8B; 256 with 4: Gemma 3) at the default
/// block size 16, one head a thread block (multi-head attention) and a
/// group of 8 (Llama 3 70B) at 128,
/// block sizes 8 and 32 at 128, the bandwidth benchmark's contiguous
/// baseline and the paged loads it compares (`PagedLoads`), the GEMV at 1, 2, 4 and 8 rows as launched and with four
/// columns a warp, the tensor-core GEMM at each of its tile heights,
/// flash prefill at each head size with the key tile it launches with, and
/// the fused GEMVs of a decode step.
pub fn ci_variants() -> Vec<Variant> {
    let mut v = vec![Variant::new(CACHE, &[]), Variant::new(LAYERS, &[]), crate::launch::sampling_variant()];
    for (head_dim, queries) in [(64, 3), (128, 4), (256, 4), (128, 1), (128, 8)] {
        v.push(Variant::new(PAGED_ATTENTION, &[("HEAD_DIM", head_dim), ("BLOCK_SIZE", 16), ("QUERIES", queries)]));
    }
    for block_size in [8, 32] {
        v.push(Variant::new(PAGED_ATTENTION, &[("HEAD_DIM", 128), ("BLOCK_SIZE", block_size), ("QUERIES", 4)]));
    }
    v.push(Variant::new(PAGED_ATTENTION, &[("HEAD_DIM", 128), ("BLOCK_SIZE", 16), ("QUERIES", 4), ("CONTIGUOUS_KV", 1)]));
    // Llama's shape with the loads the benchmark compares the default with.
    for loads in [crate::launch::PagedLoads::TiledNoPrefetch, crate::launch::PagedLoads::Plain] {
        let mut defines = vec![("HEAD_DIM", 128), ("BLOCK_SIZE", 16), ("QUERIES", 4)];
        defines.extend_from_slice(loads.defines());
        v.push(Variant::new(PAGED_ATTENTION, &defines));
    }
    // The GEMV with the plans launch.rs picks at 1, 2, 4 and 8 rows, and
    // with four columns a warp and two warps a group (measured faster from
    // 2 rows, not yet the default).
    for rows in [1, 2, 4, 8] {
        v.push(crate::launch::GemvPlan::for_rows(rows).variant(rows));
        if rows > 1 {
            v.push(crate::launch::GemvPlan { columns_per_warp: 4, k_split: 2, magic: true }.variant(rows));
        }
    }
    for bm in [32, 64, 128] {
        v.push(Variant::new(GEMM_MMA, &[("MMA_BM", bm)]));
    }
    // The staged GEMM with three stages where four is the default (the
    // benchmark compares them).
    for bm in [32, 64] {
        v.push(Variant::new(GEMM_MMA, &[("MMA_BM", bm), ("MMA_STAGES", 3)]));
    }
    for head_dim in [64, 128, 256] {
        v.push(crate::launch::flash_variant(head_dim, 16));
    }
    // The fused GEMV as a decode step launches it at one and two rows (a
    // block's first product normed, its last added into the residual, the
    // gate/up product normed and activated), and the float32 path's widest
    // (eight rows, normed and activated).
    use crate::launch::{GemvFusion, GemvInput as In, GemvOutput as Out, GemvPlan};
    let fused = |input, output| GemvFusion { input, output };
    for rows in [1, 2] {
        let plan = GemvPlan::for_rows(rows);
        v.push(plan.fused_variant(rows, fused(In::RmsNorm, Out::Store)));
        v.push(plan.fused_variant(rows, fused(In::Plain, Out::Add)));
        v.push(plan.paired().fused_variant(rows, fused(In::RmsNorm, Out::Silu)));
    }
    // Gate/up activated without the norm (the add before it pending, or a
    // tensor-parallel rank's).
    v.push(GemvPlan::for_rows(1).paired().fused_variant(1, fused(In::Plain, Out::Silu)));
    v.push(GemvPlan::for_rows(8).paired().fused_variant(8, fused(In::RmsNorm, Out::GeluTanh)));
    v
}
