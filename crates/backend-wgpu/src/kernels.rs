//! The WGSL kernels (`kernels/wgsl/`, one file per kernel), composed with
//! their weight- or KV-format snippet and compiled once per device, on
//! first use.

use vellum_base::KvCacheDtype;

/// How a weight is stored on the device (the backend's own layout, chosen
/// per tensor from the file's type; see `weights.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// f32, `[K, N]`.
    F32,
    /// f16 pairs along K, `[K/2, N]` words.
    F16,
    /// bf16 pairs along K, `[K/2, N]` words.
    Bf16,
    /// GGML Q4_1 blocks (5 words), `[K/32, N]`; Q4_0 arrives as Q4_1.
    Q4_1,
    /// GGML Q8_0 blocks repacked to 9 words, `[K/32, N]`.
    Q8_0,
}

impl WeightFormat {
    fn snippet(self) -> &'static str {
        match self {
            WeightFormat::F32 => vellum_kernels::wgsl::WEIGHTS_F32,
            WeightFormat::F16 => vellum_kernels::wgsl::WEIGHTS_F16,
            WeightFormat::Bf16 => vellum_kernels::wgsl::WEIGHTS_BF16,
            WeightFormat::Q4_1 => vellum_kernels::wgsl::WEIGHTS_Q4_1,
            WeightFormat::Q8_0 => vellum_kernels::wgsl::WEIGHTS_Q8_0,
        }
    }
}

fn kv_snippet(dtype: KvCacheDtype) -> &'static str {
    match dtype {
        KvCacheDtype::F32 => vellum_kernels::wgsl::KV_F32,
        KvCacheDtype::F16 => vellum_kernels::wgsl::KV_F16,
        KvCacheDtype::Bf16 => vellum_kernels::wgsl::KV_BF16,
        KvCacheDtype::Fp8E4m3 => vellum_kernels::wgsl::KV_FP8,
    }
}

/// One compiled variant of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `x · Wᵀ (+ b)` on `tm` rows per workgroup.
    Matmul {
        /// The weight's storage.
        format: WeightFormat,
        /// Rows per workgroup: 1, 4, 8 or 16.
        tm: u32,
    },
    /// Embedding rows for the step's token ids.
    Embed(WeightFormat),
    /// RMSNorm of rows or per-head slices.
    RmsNorm,
    /// Half-split RoPE from a table.
    Rope,
    /// `act(gate) · up`.
    GatedMul(Activation),
    /// `x *= factor`.
    Scale,
    /// `x += y`.
    Add,
    /// The logits rows.
    GatherRows,
    /// The fused K/V block write.
    WriteKv(KvCacheDtype),
    /// Paged attention over a mixed batch.
    PagedAttention(KvCacheDtype),
    /// Copy-on-write block copies in one pool.
    CopyBlocks,
}

impl Kernel {
    /// The kernel's file name, for profiles.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Matmul { .. } => "matmul",
            Kernel::Embed(_) => "embed",
            Kernel::RmsNorm => "rms_norm",
            Kernel::Rope => "rope",
            Kernel::GatedMul(Activation::Silu) => "silu_mul",
            Kernel::GatedMul(Activation::GeluTanh) => "gelu_tanh_mul",
            Kernel::Scale => "scale",
            Kernel::Add => "add",
            Kernel::GatherRows => "gather_rows",
            Kernel::WriteKv(_) => "write_kv",
            Kernel::PagedAttention(_) => "paged_attention",
            Kernel::CopyBlocks => "copy_blocks",
        }
    }

    /// The WGSL module: snippet and constants first, then the kernel.
    pub fn source(self) -> String {
        match self {
            Kernel::Matmul { format, tm } => {
                // Stage 8 KiB of x per pass, at least 128 values of each row.
                let kc = (2048 / tm).clamp(128, 1024);
                format!("const TM: u32 = {tm}u;\nconst KC: u32 = {kc}u;\n{}\n{}", format.snippet(), vellum_kernels::wgsl::MATMUL)
            }
            Kernel::Embed(format) => format!("{}\n{}", format.snippet(), vellum_kernels::wgsl::EMBED),
            Kernel::RmsNorm => vellum_kernels::wgsl::RMS_NORM.to_string(),
            Kernel::Rope => vellum_kernels::wgsl::ROPE.to_string(),
            Kernel::GatedMul(act) => format!("{}\n{}", act.snippet(), vellum_kernels::wgsl::GATED_MUL),
            Kernel::Scale => vellum_kernels::wgsl::SCALE.to_string(),
            Kernel::Add => vellum_kernels::wgsl::ADD.to_string(),
            Kernel::GatherRows => vellum_kernels::wgsl::GATHER_ROWS.to_string(),
            Kernel::WriteKv(dtype) => format!("{}\n{}", kv_snippet(dtype), vellum_kernels::wgsl::WRITE_KV),
            Kernel::PagedAttention(dtype) => {
                format!("{}\n{}", kv_snippet(dtype), vellum_kernels::wgsl::PAGED_ATTENTION)
            }
            Kernel::CopyBlocks => vellum_kernels::wgsl::COPY_BLOCKS.to_string(),
        }
    }
}

/// The activation of a gated MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `silu(x) = x / (1 + e^-x)` (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU, Gemma), as `x·σ(2u)` with
    /// `u = √(2/π)·(x + 0.044715·x³)`; the exponent is clamped so that
    /// `exp` stays finite on every driver.
    GeluTanh,
}

impl Activation {
    fn snippet(self) -> &'static str {
        match self {
            Activation::Silu => "fn act(x: f32) -> f32 { return x / (1.0 + exp(-x)); }",
            Activation::GeluTanh => {
                "fn act(x: f32) -> f32 {\n    let u = 0.7978845608 * (x + 0.044715 * x * x * x);\n    \
                 return x / (1.0 + exp(clamp(-2.0 * u, -80.0, 80.0)));\n}"
            }
        }
    }
}
