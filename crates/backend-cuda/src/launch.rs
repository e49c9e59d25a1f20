//! Launching the kernels: modules compiled on first use for the device's
//! architecture and cached by configuration, and one typed call per kernel
//! that checks its shapes before anything reaches the GPU.
//!
//! Device buffers are `cudarc` slices; a KV pool is a pair of byte buffers
//! whose element type is [`PoolDtype`] (the kernels take `void *`).

use crate::kernels::{Variant, CACHE, FLASH_ATTENTION, GEMM_MMA, GEMV_Q, LAYERS, PAGED_ATTENTION, SAMPLING};
use crate::layout::QuantFormat;
use crate::{nvrtc, CudaError};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use vellum_base::KvScale;

/// Element type of a KV pool (`--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolDtype {
    /// 4 bytes an element.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// OCP FP8 E4M3 ([`vellum_base::fp8`]), stored divided by its layer's
    /// scales.
    Fp8E4m3,
}

impl PoolDtype {
    /// Bytes an element.
    pub fn size(self) -> usize {
        match self {
            PoolDtype::F32 => 4,
            PoolDtype::F16 | PoolDtype::Bf16 => 2,
            PoolDtype::Fp8E4m3 => 1,
        }
    }

    /// The entry-point suffix (`_f32`, `_f16`, `_bf16`, `_fp8`).
    pub fn suffix(self) -> &'static str {
        match self {
            PoolDtype::F32 => "f32",
            PoolDtype::F16 => "f16",
            PoolDtype::Bf16 => "bf16",
            PoolDtype::Fp8E4m3 => "fp8",
        }
    }

    /// What an element reads as in the kernels, times its stored value: an
    /// FP8 code widens to its value / 2⁸ ([`vellum_base::fp8::F16_UNIT`]).
    pub fn unit(self) -> f32 {
        match self {
            PoolDtype::Fp8E4m3 => vellum_base::fp8::F16_UNIT,
            _ => 1.0,
        }
    }
}

/// The K and V pools of one layer: `[num_blocks, block_size, num_kv_heads,
/// head_dim]` elements of `dtype` each.
pub struct KvPool {
    /// Keys.
    pub k: CudaSlice<u8>,
    /// Values.
    pub v: CudaSlice<u8>,
    /// Element type.
    pub dtype: PoolDtype,
    /// Blocks in each pool.
    pub num_blocks: usize,
    /// Tokens a block.
    pub block_size: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Dims a head.
    pub head_dim: usize,
}

impl KvPool {
    /// Zeroed pools.
    pub fn new(
        stream: &Arc<CudaStream>,
        dtype: PoolDtype,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, CudaError> {
        let bytes = num_blocks * block_size * num_kv_heads * head_dim * dtype.size();
        Ok(Self { k: stream.alloc_zeros(bytes)?, v: stream.alloc_zeros(bytes)?, dtype, num_blocks, block_size, num_kv_heads, head_dim })
    }

    /// Elements in one token's row (`num_kv_heads · head_dim`).
    pub fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// How the paged decode kernels (`paged_attention.cu`) load keys and
/// values: its `V_TILE` and `PA_PREFETCH` knobs. `VELLUM_PAGED_LOADS`
/// (`tiled`, `tiled-no-prefetch`, `plain`) picks one, for comparisons
/// (`attention_bench --loads`); every choice gives the same bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PagedLoads {
    /// A lane loads several tokens' values before it uses the first, and a
    /// warp asks L2 for its next KV block while it works on this one.
    #[default]
    Tiled,
    /// The values tiled, nothing prefetched.
    TiledNoPrefetch,
    /// A token's values at a time, nothing prefetched (the kernel the
    /// H200 measured at 72% of copy bandwidth, docs/benchmarks.md).
    Plain,
}

impl PagedLoads {
    /// Every choice, the default first.
    pub const ALL: [PagedLoads; 3] = [PagedLoads::Tiled, PagedLoads::TiledNoPrefetch, PagedLoads::Plain];

    /// Its name in `VELLUM_PAGED_LOADS`.
    pub fn name(self) -> &'static str {
        match self {
            PagedLoads::Tiled => "tiled",
            PagedLoads::TiledNoPrefetch => "tiled-no-prefetch",
            PagedLoads::Plain => "plain",
        }
    }

    /// Parses [`PagedLoads::name`]'s form.
    pub fn parse(text: &str) -> Result<Self, CudaError> {
        Self::ALL
            .into_iter()
            .find(|l| l.name() == text.trim())
            .ok_or_else(|| CudaError::Setting(format!("VELLUM_PAGED_LOADS={text:?}: expected one of tiled, tiled-no-prefetch, plain")))
    }

    /// The kernel's defines for it (none: the kernel's defaults).
    pub fn defines(self) -> &'static [(&'static str, usize)] {
        match self {
            PagedLoads::Tiled => &[],
            PagedLoads::TiledNoPrefetch => &[("PA_PREFETCH", 0)],
            PagedLoads::Plain => &[("V_TILE", 1), ("PA_PREFETCH", 0)],
        }
    }
}

/// Which paged-attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionVersion {
    /// One thread block per (head, query token) over the whole context.
    V1,
    /// Partitions of [`PARTITION_SIZE`] positions, then a reduction.
    V2,
    /// Flash prefill on tensor cores (`flash_attention.cu`) for the
    /// sequences with at least [`FLASH_MIN_QUERIES`] query tokens, v1 or v2
    /// for the others in the same step. 16-bit and FP8 caches.
    Flash,
}

/// Query tokens a tile of flash prefill holds (`FLASH_BM`).
pub const FLASH_TILE_QUERIES: usize = 64;
/// The fewest query tokens of a sequence that flash prefill attends: a
/// shorter one (a decode, a speculative verification) stays with the
/// decode kernels, which give each query token thread blocks of its own.
pub const FLASH_MIN_QUERIES: usize = 16;
/// Threads of a flash-prefill thread block (`FLASH_THREADS`).
const FLASH_THREADS: u32 = 128;

/// Keys a flash-prefill tile streams at once (`FLASH_BN`): 64, or 32 at
/// head size 256, whose shared memory would not fit consumer GPUs' 99 KiB
/// with 64.
pub fn flash_keys_per_tile(head_dim: usize) -> usize {
    if head_dim >= 256 {
        32
    } else {
        64
    }
}

/// The `flash_attention.cu` configuration for a head size and block size.
pub fn flash_variant(head_dim: usize, block_size: usize) -> Variant {
    Variant::new(FLASH_ATTENTION, &[("HEAD_DIM", head_dim), ("BLOCK_SIZE", block_size), ("FLASH_BN", flash_keys_per_tile(head_dim))])
}

/// Dynamic shared memory of a flash-prefill thread block: the query tile
/// and two stages of key and value tiles, rows of `head_dim + 8` 16-bit
/// elements (the kernel's layout).
pub fn flash_smem_bytes(head_dim: usize) -> usize {
    (FLASH_TILE_QUERIES + 4 * flash_keys_per_tile(head_dim)) * (head_dim + 8) * 2
}

/// The query tiles flash prefill takes for sequences of these query
/// lengths: ⌈q / [`FLASH_TILE_QUERIES`]⌉ for each of at least
/// [`FLASH_MIN_QUERIES`] tokens.
pub fn flash_tiles(query_lens: impl IntoIterator<Item = usize>) -> usize {
    query_lens.into_iter().filter(|&q| q >= FLASH_MIN_QUERIES).map(|q| q.div_ceil(FLASH_TILE_QUERIES)).sum()
}

/// The most query tiles any batch of `num_tokens` tokens gives flash
/// prefill, whatever its sequences: ⌈T / 64⌉ + ⌊T / 16⌋ (each long
/// sequence adds at most one partial tile). A CUDA graph launches this many
/// slots, so that every step of its shape finds its tiles.
pub fn flash_tiles_bound(num_tokens: usize) -> usize {
    num_tokens.div_ceil(FLASH_TILE_QUERIES) + num_tokens / FLASH_MIN_QUERIES
}

/// What a step's query lengths tell the attention launch (host
/// knowledge, alongside [`DeviceAttentionMetadata`]'s device arrays).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryLens {
    /// Query tokens of the batch's shortest sequence.
    pub min: usize,
    /// Query tokens of its longest.
    pub max: usize,
    /// Thread-block slots flash prefill launches: at least the query tiles
    /// of the sequences with [`FLASH_MIN_QUERIES`] query tokens or more.
    pub flash_tiles: usize,
}

impl QueryLens {
    /// The lengths of the batch whose `query_start_loc` (`[num_seqs + 1]`,
    /// nondecreasing) this is.
    pub fn of(query_start_loc: &[i32]) -> Self {
        let lens = || query_start_loc.windows(2).map(|w| usize::try_from(w[1] - w[0]).unwrap_or(0));
        Self { min: lens().min().unwrap_or(0), max: lens().max().unwrap_or(0), flash_tiles: flash_tiles(lens()) }
    }

    /// What every batch of `num_tokens` tokens satisfies: the lengths a
    /// CUDA graph of mixed steps is recorded for, so that its launches
    /// serve any composition (both kernels run; each takes its sequences
    /// on the device).
    pub fn any(num_tokens: usize) -> Self {
        Self { min: 1, max: num_tokens, flash_tiles: flash_tiles_bound(num_tokens) }
    }

    /// Decode: one query token a sequence.
    pub fn decode() -> Self {
        Self { min: 1, max: 1, flash_tiles: 0 }
    }
}

/// Where a sequence's KV blocks are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// Through the block table: the engine's layout (paper §4.1).
    Paged,
    /// Block `b` of sequence `s` at `s · max_blocks_per_seq + b`, no table
    /// read: a contiguous per-sequence cache, the baseline the bandwidth
    /// benchmark compares paging against (paper §7.1, Figure 18a).
    ContiguousBaseline,
}

/// Positions per partition of paged attention v2 (the kernels' default).
pub const PARTITION_SIZE: usize = 512;
/// Threads per paged-attention thread block.
const ATTENTION_THREADS: u32 = 128;
/// `sample_rows`' block, compiled into sampling.cu as its SAMPLE_THREADS
/// ([`sampling_variant`]).
pub const SAMPLE_THREADS: u32 = 256;

/// The `sampling.cu` configuration the launches use: its block size set
/// from [`SAMPLE_THREADS`], so the kernel's strides and reductions and the
/// launch agree.
pub fn sampling_variant() -> Variant {
    sampling_variant_with(true)
}

/// [`sampling_variant`], or with `binned` false the same kernel leaving
/// every rank cut to its radix descents (`SAMPLE_BINNED 0`: one pass over
/// the row per digit instead of two passes in all), for comparisons.
pub fn sampling_variant_with(binned: bool) -> Variant {
    if binned {
        Variant::new(SAMPLING, &[("SAMPLE_THREADS", SAMPLE_THREADS as usize)])
    } else {
        Variant::new(SAMPLING, &[("SAMPLE_THREADS", SAMPLE_THREADS as usize), ("SAMPLE_BINNED", 0)])
    }
}
/// The shared memory (static and dynamic) a thread block may take without
/// opting in.
const DEFAULT_SHARED_MEMORY: usize = 48 * 1024;

/// A mixed batch's attention metadata, on the device (int32 unless noted).
pub struct DeviceAttentionMetadata {
    /// `[num_seqs, max_blocks_per_seq]` block ids.
    pub block_tables: CudaSlice<i32>,
    /// Entries per block-table row.
    pub max_blocks_per_seq: usize,
    /// `[num_tokens]`: each query token's sequence.
    pub token_seq: CudaSlice<i32>,
    /// `[num_seqs + 1]`: first query token of each sequence.
    pub query_start_loc: CudaSlice<i32>,
    /// `[num_seqs]`: tokens in each sequence's context after this step.
    pub context_lens: CudaSlice<i32>,
    /// Query tokens in the batch.
    pub num_tokens: usize,
    /// The longest context a query sees (after the window): sizes v1's
    /// shared memory and v2's partitions.
    pub max_context: usize,
    /// The query lengths of the batch's sequences: whether flash prefill
    /// runs, and over how many tiles.
    pub query_lens: QueryLens,
}

/// Shapes and constants of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    /// Query heads.
    pub num_heads: usize,
    /// Softmax scale (usually head_dim^-½).
    pub scale: f32,
    /// Soft-cap of the scores; 0 for none.
    pub softcap: f32,
    /// Sliding window in positions; 0 for full causal attention.
    pub window: usize,
    /// The layer's scales ([`KvScale::ONE`] for an unscaled pool): the key
    /// scale joins `scale`, the value scale multiplies the outputs.
    pub kv_scale: KvScale,
}

/// A weight `[n, k]` on the device in one of the layouts of
/// [`crate::layout`]: a plane of codes and a plane of f16 scales.
pub struct QuantMatrix {
    /// The codes (int8, nibbles or f32 bytes), row-major.
    pub codes: CudaSlice<u8>,
    /// The scales (f16 bits; one element for [`QuantFormat::F32`]).
    pub scales: CudaSlice<u16>,
    /// Their layout.
    pub format: QuantFormat,
    /// Output features (rows of W).
    pub n: usize,
    /// Input features (a multiple of 32).
    pub k: usize,
}

impl QuantMatrix {
    /// `Ok` when k is whole blocks of the layout (32 values, 256 for the
    /// K-quants) and both planes hold the layout's bytes for `[n, k]`: what
    /// every kernel reading it relies on.
    pub fn check(&self) -> Result<(), CudaError> {
        let (n, k, f) = (self.n, self.k, self.format);
        if n == 0
            || k == 0
            || !k.is_multiple_of(f.block())
            || self.codes.len() < f.code_bytes(n, k)
            || self.scales.len() < f.scale_words(n, k)
        {
            return Err(shape_error(format!(
                "a {f:?} weight [{n}, {k}] over {} code bytes and {} scales (k must be a nonzero multiple of {})",
                self.codes.len(),
                self.scales.len(),
                f.block()
            )));
        }
        Ok(())
    }
}

/// The tile heights of `gemm_mma.cu` (`MMA_BM`).
pub const MMA_TILE_ROWS: [usize; 3] = [32, 64, 128];
/// The tile width of `gemm_mma.cu`.
pub const MMA_TILE_COLS: usize = 128;

/// How many parts a GEMM of `tiles` output tiles splits k (`blocks`
/// blocks of 32) into on a GPU of `num_sms` multiprocessors: one when the
/// tiles fill the GPU twice over, else enough to (at most 16, at least two
/// blocks a part), rounded to parts of equal size.
fn splits_for(tiles: usize, blocks: usize, num_sms: usize) -> usize {
    let wanted = (2 * num_sms).div_ceil(tiles.max(1));
    let splits = wanted.min(16).min(blocks / 2).max(1);
    blocks.div_ceil(blocks.div_ceil(splits).max(1)).max(1)
}

/// How the tensor-core GEMMs (`gemm_mma_*` and `gemm_mma_staged_*`) cut a
/// product: the tile height, and k in `parts` of `blocks_per_part` blocks
/// of 32 (the last part may be shorter), summed in order when more than one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaPlan {
    /// `MMA_BM`: 32, 64 or 128.
    pub tile_rows: usize,
    /// Parts of k (grid z).
    pub parts: usize,
    /// Blocks of 32 a part.
    pub blocks_per_part: usize,
}

/// The plan for `rows` rows and an `[n, k]` weight on `num_sms`
/// multiprocessors: the smallest tile height that holds the rows (128 past
/// them), and k split where the output tiles are too few for the GPU. When
/// k/32 is even the parts are even too (the last one included), for the
/// staged kernel's steps of two blocks; both kernels take this one plan,
/// so that they give the same bits.
pub fn mma_plan_for(rows: usize, n: usize, k: usize, num_sms: usize) -> MmaPlan {
    let tile_rows = MMA_TILE_ROWS.into_iter().find(|&bm| rows <= bm).unwrap_or(128);
    let blocks = k / 32;
    let splits = splits_for(rows.div_ceil(tile_rows) * n.div_ceil(MMA_TILE_COLS), blocks, num_sms);
    let mut per_part = blocks.div_ceil(splits).max(1);
    if blocks.is_multiple_of(2) {
        per_part = per_part.div_ceil(2) * 2;
    }
    MmaPlan { tile_rows, parts: blocks.div_ceil(per_part).max(1), blocks_per_part: per_part }
}

/// `gemm_mma.cu`'s default `MMA_STAGES` at tile height `bm`.
pub fn mma_default_stages(bm: usize) -> usize {
    if bm == 128 {
        3
    } else {
        4
    }
}

/// The dynamic shared memory of `gemm_mma_staged_*` for a weight format,
/// tile height and number of stages (`gemm_mma.cu`'s `StagedSizes` times
/// `MMA_STAGES`): `None` for a format it does not take (f32).
pub fn mma_staged_smem_bytes(format: QuantFormat, bm: usize, stages: usize) -> Option<usize> {
    // A column's codes a step and their row pitch, its scales a step.
    let (code_ld, scale_bytes) = match format {
        QuantFormat::Q8 => (80, 4),
        QuantFormat::Q4 | QuantFormat::Q4K => (48, 8),
        QuantFormat::Q5K | QuantFormat::Q6K => (80, 8),
        QuantFormat::F32 => return None,
    };
    let stage = bm * (64 + 8) * 2 + MMA_TILE_COLS * (code_ld + scale_bytes);
    Some(stage * stages)
}

/// The operands of [`Kernels::elementwise`].
#[derive(Clone, Copy)]
pub enum Elementwise<'a> {
    /// `x += y`.
    Add(&'a CudaSlice<f32>),
    /// `x *= factor`.
    Scale(f32),
    /// `x = silu(gate) · up`.
    SiluMul(&'a CudaSlice<f32>, &'a CudaSlice<f32>),
    /// `x = gelu_tanh(gate) · up`.
    GeluTanhMul(&'a CudaSlice<f32>, &'a CudaSlice<f32>),
}

/// A configuration's module and the entry points looked up in it.
struct Compiled {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// The compiled kernels of one device, by configuration.
pub struct Kernels {
    info: crate::device::DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    num_sms: usize,
    /// Each configuration's module (compiled on first use) and the entry
    /// points already looked up in it, so that a launch finds its function
    /// without allocating or calling the driver.
    modules: Mutex<HashMap<Variant, Compiled>>,
    /// `VELLUM_GEMV`, when set: one GEMV plan for every launch (benchmarks
    /// compare plans with it).
    gemv_override: Option<GemvPlan>,
    /// Whether flash prefill runs where it applies (`VELLUM_FLASH_ATTENTION=0`
    /// turns it off, for comparisons).
    flash_attention: bool,
    /// How the paged decode kernels load keys and values
    /// (`VELLUM_PAGED_LOADS`, for comparisons).
    paged_loads: PagedLoads,
    /// Whether `sample_rows` draws rows without min-p from its score bins
    /// (`VELLUM_SAMPLE_BINNED=0` turns it off, for comparisons; the same
    /// tokens either way).
    sample_binned: std::sync::atomic::AtomicBool,
    /// Whether [`Kernels::gemm_mma`] takes `gemm_mma_staged_*` where it
    /// applies (`VELLUM_GEMM_MMA=registers` turns it off, for comparisons;
    /// the same bits either way).
    gemm_staged: std::sync::atomic::AtomicBool,
    /// The staged GEMM's stages when not its default (0), for benchmarks.
    gemm_stages: std::sync::atomic::AtomicUsize,
}

/// How the GEMV of `gemv_q.cu` spreads a linear layer over warps: its
/// compile-time knobs (the kernel's header explains each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvPlan {
    /// Columns a warp streams at once (`GEMV_NC`, 1..4).
    pub columns_per_warp: usize,
    /// Warps sharing a group of columns, each a slice of k (`GEMV_KSPLIT`:
    /// 1, 2 or 4).
    pub k_split: usize,
    /// Q8 codes decoded without an integer conversion, the scale applied
    /// once per 16 products (`GEMV_MAGIC`).
    pub magic: bool,
}

impl GemvPlan {
    /// The plan the GEMV uses for `rows` rows (of any weight layout).
    ///
    /// Measured on an H100 (`gemm_bench --gemv-plans`, Llama 3 8B's Q8_0
    /// shapes and a Q4_1 one, docs/benchmarks.md): at 1 and 2 rows (the
    /// default path's GEMV rows) two columns a warp and two warps a column
    /// group, the fastest plan at one row (2.37 TB/s on the 14336 × 4096
    /// weight, against 1.60 with the plan before it) and 1.7× that plan at
    /// two (1.65 against 0.96 TB/s); the GPU suite's GEMV test passed it (at
    /// 1, 2, 3, 5 and 8 rows; the test now runs 1–5, 7 and 8 rows of two k
    /// under every plan this function or the benchmark's table names). From
    /// 3 rows (the float32 path's) the plan the kernel had before, ⌈rows / 2⌉
    /// columns a warp and one warp a group, which the measurement did not
    /// compare at those rows. Four columns a warp with two warps a group ran
    /// faster from two rows (2.08 TB/s at two, 1.34 at four, 0.82 at eight)
    /// but has not yet passed that test: it is `VELLUM_GEMV=4:2:1` until it
    /// does. The conversion-free Q8 decode alone changed nothing measurable;
    /// the plans measured carry it.
    pub fn for_rows(rows: usize) -> Self {
        if rows <= 2 {
            Self { columns_per_warp: 2, k_split: 2, magic: true }
        } else {
            Self { columns_per_warp: rows.div_ceil(2).min(4), k_split: 1, magic: false }
        }
    }

    /// The `gemv_q.cu` configuration that launches this plan for `rows`.
    pub fn variant(&self, rows: usize) -> Variant {
        self.fused_variant(rows, GemvFusion::default())
    }

    /// [`GemvPlan::variant`] with `fusion` around the product (its defines
    /// only where it fuses something, so a plain GEMV's configuration and
    /// its cached module stay the same).
    pub fn fused_variant(&self, rows: usize, fusion: GemvFusion) -> Variant {
        let mut defines = vec![
            ("ROWS", rows),
            ("GEMV_NC", self.columns_per_warp),
            ("GEMV_KSPLIT", self.k_split),
            ("GEMV_MAGIC", usize::from(self.magic)),
        ];
        if fusion.input != GemvInput::Plain {
            defines.push(("GEMV_IN", fusion.input as usize));
        }
        if fusion.output != GemvOutput::Store {
            defines.push(("GEMV_OUT", fusion.output as usize));
        }
        Variant::new(GEMV_Q, &defines)
    }

    /// This plan for a gated output, whose warps take gate and up columns
    /// in pairs: an odd number of columns a warp rounded up (at most 4).
    pub fn paired(self) -> Self {
        Self { columns_per_warp: (self.columns_per_warp + self.columns_per_warp % 2).min(4), ..self }
    }

    /// Whether the kernel takes this plan: 1–4 columns a warp, 1, 2 or 4
    /// warps a group.
    pub fn is_valid(&self) -> bool {
        (1..=4).contains(&self.columns_per_warp) && matches!(self.k_split, 1 | 2 | 4)
    }

    /// Parses `VELLUM_GEMV`'s form, `columns_per_warp:k_split:magic`
    /// (`2:2:1`).
    pub fn parse(text: &str) -> Result<Self, CudaError> {
        let bad = || {
            CudaError::Setting(format!(
                "GEMV plan {text:?} (VELLUM_GEMV, gemm_bench --gemv-plans): expected columns:k_split:magic, as 2:2:1 (columns 1..4, k_split 1, 2 or 4, magic 0 or 1)"
            ))
        };
        let parts: Vec<usize> = text.split(':').map(|p| p.trim().parse::<usize>().map_err(|_| bad())).collect::<Result<_, _>>()?;
        let [columns_per_warp, k_split, m @ (0 | 1)] = parts[..] else { return Err(bad()) };
        let plan = Self { columns_per_warp, k_split, magic: m == 1 };
        if plan.is_valid() {
            Ok(plan)
        } else {
            Err(bad())
        }
    }
}

/// What the GEMV reads as its input rows (`gemv_q.cu`'s `GEMV_IN`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GemvInput {
    /// `x [rows, k]` as it is.
    #[default]
    Plain = 0,
    /// The RMSNorm of each row of `x [rows, k]` times the norm's weight.
    RmsNorm = 1,
}

/// What the GEMV writes (`gemv_q.cu`'s `GEMV_OUT`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GemvOutput {
    /// `y = x·Wᵀ`.
    #[default]
    Store = 0,
    /// `y += x·Wᵀ` (the residual stream).
    Add = 1,
    /// W stacks gate and up (`[2n, k]`); `y [rows, n] = silu(gate) · up`.
    Silu = 2,
    /// As [`GemvOutput::Silu`] with GELU-tanh.
    GeluTanh = 3,
}

impl GemvOutput {
    /// Whether the weight stacks gate and up and the output is their
    /// activated product (half the weight's rows wide).
    pub fn is_gated(self) -> bool {
        matches!(self, GemvOutput::Silu | GemvOutput::GeluTanh)
    }
}

/// What a GEMV launch fuses around its product: the launches of a decode
/// step it saves (the norm before it; the residual add, or the gated
/// activation, after it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GemvFusion {
    /// What the product reads.
    pub input: GemvInput,
    /// What it writes.
    pub output: GemvOutput,
}

fn cfg(grid: (u32, u32, u32), threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 }
}

/// What the q/k/v splits (`split_qkv_rope`, `split_qkv_rope_cache_*`)
/// take for RoPE.
struct SplitRotation<'a> {
    /// The cos/sin table (without RoPE, unread: `qkv` stands in).
    table: &'a CudaSlice<f32>,
    /// One position a row (`None`: a null pointer, unread).
    positions: Option<&'a CudaSlice<i64>>,
    head_dim: usize,
    /// 1 to rotate q and k, 0 not to.
    rotate: i32,
}

/// `rope` for a split of `tokens` rows `[nq, nk, _]` wide, checked: whole
/// heads of an even size, a position a row.
fn split_rotation<'a>(
    op: &str,
    qkv: &'a CudaSlice<f32>,
    tokens: usize,
    [nq, nk, _]: [usize; 3],
    rope: Option<(&'a CudaSlice<f32>, &'a CudaSlice<i64>, usize)>,
) -> Result<SplitRotation<'a>, CudaError> {
    let Some((table, positions, head_dim)) = rope else {
        return Ok(SplitRotation { table: qkv, positions: None, head_dim: 2, rotate: 0 });
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) || !nq.is_multiple_of(head_dim) || !nk.is_multiple_of(head_dim) {
        return Err(shape_error(format!("{op}: q and k of {nq} and {nk} are not heads of {head_dim}")));
    }
    if positions.len() < tokens {
        return Err(shape_error(format!("{op}: {} positions for {tokens} rows", positions.len())));
    }
    Ok(SplitRotation { table, positions: Some(positions), head_dim, rotate: 1 })
}

fn shape_error(what: String) -> CudaError {
    CudaError::Shape(what)
}

fn to_u32(n: usize, what: &str) -> Result<u32, CudaError> {
    u32::try_from(n).map_err(|_| shape_error(format!("{what} = {n} exceeds a CUDA grid dimension")))
}

fn to_i32(n: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(n).map_err(|_| shape_error(format!("{what} = {n} exceeds int32")))
}

impl Kernels {
    /// Kernels for device `ordinal` (compiled on first use), launched on a
    /// stream of their own.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let (ctx, info) = crate::device::open(ordinal)?;
        // cudarc gives every allocation two events by default, to order its
        // uses across streams: four driver calls per buffer, for nothing
        // here. SAFETY: before any buffer exists; every allocation, copy
        // and kernel of this crate runs on the one stream below, in order,
        // so no use of a buffer needs ordering against another stream.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default stream: a decode
        // step's launches are recorded as a CUDA graph on it (crate::graphs),
        // which the default stream cannot do.
        let stream = ctx.new_stream()?;
        let gemv_override = match std::env::var("VELLUM_GEMV") {
            Ok(v) if !v.is_empty() => Some(GemvPlan::parse(&v)?),
            _ => None,
        };
        let paged_loads = match std::env::var("VELLUM_PAGED_LOADS") {
            Ok(v) if !v.is_empty() => PagedLoads::parse(&v)?,
            _ => PagedLoads::default(),
        };
        Ok(Self {
            arch: info.arch(),
            num_sms: info.num_sms.max(1) as usize,
            info,
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            gemv_override,
            flash_attention: std::env::var("VELLUM_FLASH_ATTENTION").map_or(true, |v| v != "0"),
            paged_loads,
            sample_binned: std::sync::atomic::AtomicBool::new(std::env::var("VELLUM_SAMPLE_BINNED").map_or(true, |v| v != "0")),
            gemm_staged: std::sync::atomic::AtomicBool::new(std::env::var("VELLUM_GEMM_MMA").map_or(true, |v| v != "registers")),
            gemm_stages: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// The device.
    pub fn info(&self) -> &crate::device::DeviceInfo {
        &self.info
    }

    /// The device's default memory pool, where the stream-ordered
    /// allocations of every buffer come from.
    fn memory_pool(&self) -> Option<cudarc::driver::sys::CUmemoryPool> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread().ok()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid place for the handle; the device handle
        // is this context's.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) };
        (r == sys::CUresult::CUDA_SUCCESS && !pool.is_null() && self.ctx.has_async_alloc()).then_some(pool)
    }

    fn pool_attribute(pool: cudarc::driver::sys::CUmemoryPool, attr: cudarc::driver::sys::CUmemPool_attribute) -> Option<u64> {
        use cudarc::driver::sys;
        let mut v: u64 = 0;
        // SAFETY: the memory attributes read here are 64-bit (cuuint64_t),
        // written through a pointer to `v`; `pool` came from the driver.
        let r = unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
    }

    /// Memory profiling: resets the pool's high-water mark and returns the
    /// bytes in use now; `None` where allocations do not come from the pool.
    pub fn begin_memory_profile(&self) -> Option<u64> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        let pool = self.memory_pool()?;
        self.stream.synchronize().ok()?;
        let mut zero: u64 = 0;
        // SAFETY: USED_MEM_HIGH takes a 64-bit value, which may only be
        // zero (a reset); the pointer is to `zero`.
        let r = unsafe { sys::cuMemPoolSetAttribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, (&mut zero as *mut u64).cast()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        Self::pool_attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// The most bytes in use from the pool since [`Kernels::begin_memory_profile`],
    /// once the queued work is done.
    pub fn memory_profile_peak(&self) -> Option<u64> {
        let pool = self.memory_pool()?;
        self.stream.synchronize().ok()?;
        let peak = Self::pool_attribute(pool, cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH);
        // Hand what the pool keeps back to the device, so that its free
        // memory (which sizes the KV cache) does not count it as in use.
        // SAFETY: `pool` came from the driver; trimming frees only memory
        // no allocation holds.
        unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) };
        peak
    }

    /// The stream kernels launch on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Entry point `name` of `variant`, compiling and loading the module on
    /// first use.
    pub fn function(&self, variant: &Variant, name: &str) -> Result<CudaFunction, CudaError> {
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let compiled = match modules.get_mut(variant) {
            Some(c) => c,
            None => {
                let ptx = nvrtc::compile_cached(variant, &self.arch)?;
                let module = self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
                modules.entry(variant.clone()).or_insert(Compiled { module, functions: HashMap::new() })
            }
        };
        if let Some(f) = compiled.functions.get(name) {
            return Ok(f.clone());
        }
        let f = compiled.module.load_function(name)?;
        compiled.functions.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Writes each token's K and V rows (`[num_tokens, row]` f32) into the
    /// pools at `slot_mapping[t]` (a negative slot writes nothing), stored
    /// as `k · (1 / scale.k)`, `v · (1 / scale.v)` ([`KvScale::ONE`] for an
    /// unscaled pool).
    ///
    /// # Safety
    /// Every slot in `slot_mapping` is negative or below the pool's
    /// `num_blocks · block_size`: the kernel writes at each slot unchecked.
    pub unsafe fn reshape_and_cache(
        &self,
        key: &CudaSlice<f32>,
        value: &CudaSlice<f32>,
        pool: &mut KvPool,
        slot_mapping: &CudaSlice<i64>,
        scale: KvScale,
    ) -> Result<(), CudaError> {
        let (row, n) = (pool.row(), slot_mapping.len());
        if key.len() < n * row || value.len() < n * row {
            return Err(shape_error(format!("{n} slots need {} K/V elements, got {}/{}", n * row, key.len(), value.len())));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(CACHE, &[]), &format!("reshape_and_cache_{}", pool.dtype.suffix()))?;
        let row_i = to_i32(row, "row")?;
        let (k_inv, v_inv) = (1.0f32 / scale.k, 1.0f32 / scale.v);
        let mut b = self.stream.launch_builder(&f);
        b.arg(key).arg(value).arg(&mut pool.k).arg(&mut pool.v).arg(slot_mapping).arg(&row_i).arg(&k_inv).arg(&v_inv);
        // SAFETY: the signature matches reshape_and_cache_* in cache.cu
        // (f32*, f32*, void*, void*, long long*, int, float, float); key and value hold n·row
        // floats (checked above); the kernel writes row elements at each
        // slot, and the caller promises every slot is below num_blocks ·
        // block_size (this function's contract).
        unsafe { b.launch(cfg((to_u32(n, "tokens")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Copies block `pairs[2i]` to block `pairs[2i + 1]` in both pools.
    ///
    /// # Safety
    /// Every id in `pairs` is below the pool's `num_blocks`: the kernel
    /// copies whole blocks at those ids unchecked.
    pub unsafe fn copy_blocks(&self, pool: &mut KvPool, pairs: &CudaSlice<i64>) -> Result<(), CudaError> {
        let num_pairs = pairs.len() / 2;
        if num_pairs == 0 {
            return Ok(());
        }
        let block_bytes = pool.block_size * pool.row() * pool.dtype.size();
        let block_words = (block_bytes / 4) as i64;
        let f = self.function(&Variant::new(CACHE, &[]), "copy_blocks")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut pool.k).arg(&mut pool.v).arg(pairs).arg(&block_words);
        // SAFETY: matches copy_blocks(unsigned*, unsigned*, long long*, long
        // long); a block is block_bytes (a multiple of 4: head_dim is a
        // multiple of 64); the caller promises the ids are < num_blocks
        // (this function's contract).
        unsafe { b.launch(cfg((to_u32(num_pairs, "pairs")?, 4, 1), 256, 0)) }?;
        Ok(())
    }

    /// Shared memory of a v1 thread block: the scores (dynamic) and the
    /// group's queries and outputs (static, with slack for the statistics).
    fn v1_shared_memory(queries: usize, head_dim: usize, max_context: usize) -> usize {
        queries * max_context.max(1) * 4 + 2 * queries * head_dim * 4 + 256
    }

    /// The query heads one thread block of paged attention serves: the
    /// largest divisor of the GQA group size (`num_heads / num_kv_heads`)
    /// whose heads fit 32 accumulators a thread (`queries · head_dim ≤
    /// 1024`), at most 8.
    pub fn attention_queries(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> usize {
        let group = num_heads / num_kv_heads.max(1);
        (1..=group.min(8)).rev().find(|&q| group.is_multiple_of(q) && q * head_dim <= 1024).unwrap_or(1)
    }

    /// The version [`Kernels::paged_attention`] picks for thread blocks of
    /// `queries` heads: v1 unless the context's scores do not fit its
    /// shared memory, or the context is long and the batch gives too few
    /// thread blocks to fill the GPU.
    pub fn attention_version(
        &self,
        num_tokens: usize,
        num_heads: usize,
        queries: usize,
        head_dim: usize,
        max_context: usize,
    ) -> AttentionVersion {
        let parts = max_context.div_ceil(PARTITION_SIZE);
        let blocks = num_tokens * num_heads / queries.max(1);
        if Self::v1_shared_memory(queries, head_dim, max_context) > DEFAULT_SHARED_MEMORY || (parts > 1 && blocks < 2 * self.num_sms) {
            AttentionVersion::V2
        } else {
            AttentionVersion::V1
        }
    }

    /// Paged attention over a mixed batch: `out [num_tokens, num_heads,
    /// head_dim]` from `q` (same shape) and the pools through `meta`.
    /// `version` forces a kernel (tests); `None` picks one.
    ///
    /// # Safety
    /// As [`Kernels::attention_with_layout`]: `meta`'s block tables hold
    /// ids below the pool's `num_blocks`, and its context lengths and
    /// query starts describe `meta.num_tokens` tokens whose keys the
    /// tables cover.
    pub unsafe fn paged_attention(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        pool: &KvPool,
        meta: &DeviceAttentionMetadata,
        p: AttentionParams,
        version: Option<AttentionVersion>,
    ) -> Result<(), CudaError> {
        // SAFETY: this function's contract is attention_with_layout's.
        unsafe { self.attention_with_layout(out, q, pool, meta, p, version, KvLayout::Paged) }
    }

    /// [`Kernels::paged_attention`] with the KV layout chosen: the
    /// bandwidth benchmark's contiguous baseline runs the same kernel
    /// without its block table.
    ///
    /// # Safety
    /// `meta`'s block tables hold ids below the pool's `num_blocks` (for
    /// [`KvLayout::ContiguousBaseline`], each sequence's context fits the pool
    /// from its start), and its context lengths and query starts describe
    /// `meta.num_tokens` tokens whose keys the tables cover: the kernels
    /// read K/V through them unchecked.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention_with_layout(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        pool: &KvPool,
        meta: &DeviceAttentionMetadata,
        p: AttentionParams,
        version: Option<AttentionVersion>,
        layout: KvLayout,
    ) -> Result<(), CudaError> {
        let (t, d) = (meta.num_tokens, pool.head_dim);
        if p.num_heads == 0 || pool.num_kv_heads == 0 || !p.num_heads.is_multiple_of(pool.num_kv_heads) {
            return Err(shape_error(format!("{} heads over {} kv heads", p.num_heads, pool.num_kv_heads)));
        }
        if q.len() < t * p.num_heads * d || out.len() < t * p.num_heads * d {
            return Err(shape_error(format!("q/out need {} elements", t * p.num_heads * d)));
        }
        if t == 0 {
            return Ok(());
        }
        if layout == KvLayout::ContiguousBaseline && meta.block_tables.len() > pool.num_blocks {
            // One block per block-table entry, sequence after sequence.
            return Err(shape_error(format!(
                "the contiguous layout needs {} blocks, the pool has {}",
                meta.block_tables.len(),
                pool.num_blocks
            )));
        }
        let queries = Self::attention_queries(p.num_heads, pool.num_kv_heads, d);
        let mut defines = vec![("HEAD_DIM", d), ("BLOCK_SIZE", pool.block_size), ("QUERIES", queries)];
        if layout == KvLayout::ContiguousBaseline {
            defines.push(("CONTIGUOUS_KV", 1));
        }
        defines.extend_from_slice(self.paged_loads.defines());
        let variant = Variant::new(PAGED_ATTENTION, &defines);
        // Scores and outputs in the pool's units (an FP8 code reads as its value / 2^8).
        let unit = pool.dtype.unit();
        let (qk_scale, v_scale) = (p.scale * (p.kv_scale.k * unit), p.kv_scale.v * unit);
        let flash = match version {
            Some(AttentionVersion::Flash) => {
                if let Some(why) = self.flash_unsupported(pool, layout) {
                    return Err(shape_error(format!("flash prefill: {why}")));
                }
                true
            }
            Some(_) => false,
            None => self.flash_attention && meta.query_lens.max >= FLASH_MIN_QUERIES && self.flash_unsupported(pool, layout).is_none(),
        };
        let skip_min_q = if flash {
            // SAFETY: this function's contract (the tables cover every
            // sequence's context, ids below the pool's blocks).
            unsafe { self.flash_prefill(out, q, pool, meta, p, qk_scale, v_scale) }?;
            if meta.query_lens.min >= FLASH_MIN_QUERIES {
                return Ok(());
            }
            to_i32(FLASH_MIN_QUERIES, "flash threshold")?
        } else {
            0
        };
        let version = match version {
            Some(v @ (AttentionVersion::V1 | AttentionVersion::V2)) => v,
            _ => self.attention_version(t, p.num_heads, queries, d, meta.max_context),
        };
        let grid_xy = (to_u32(p.num_heads / queries, "head groups")?, to_u32(t, "tokens")?);
        let ints = [
            to_i32(meta.max_blocks_per_seq, "max_blocks_per_seq")?,
            to_i32(p.num_heads, "heads")?,
            to_i32(pool.num_kv_heads, "kv heads")?,
            to_i32(p.window, "window")?,
        ];
        let [max_blocks, num_heads, num_kv_heads, window] = ints;
        match version {
            AttentionVersion::V1 => {
                let smem = queries * meta.max_context.max(1) * 4;
                if Self::v1_shared_memory(queries, d, meta.max_context) > DEFAULT_SHARED_MEMORY {
                    return Err(shape_error(format!("v1 over {} positions exceeds shared memory; use v2", meta.max_context)));
                }
                let f = self.function(&variant, &format!("paged_attention_v1_{}", pool.dtype.suffix()))?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(out).arg(q).arg(&pool.k).arg(&pool.v).arg(&meta.block_tables).arg(&max_blocks);
                b.arg(&meta.token_seq).arg(&meta.query_start_loc).arg(&meta.context_lens);
                b.arg(&num_heads).arg(&num_kv_heads).arg(&qk_scale).arg(&p.softcap).arg(&window).arg(&v_scale).arg(&skip_min_q);
                // SAFETY: the arguments match paged_attention_v1_* in order
                // and type; q/out hold num_tokens·num_heads·head_dim floats
                // (checked); the metadata was built for this batch (each
                // token's context ≤ max_context, sized into the dynamic
                // shared memory; block ids < the pool's blocks).
                unsafe { b.launch(cfg((grid_xy.0, grid_xy.1, 1), ATTENTION_THREADS, smem)) }?;
            }
            // (`version` is v1 or v2 here: flash prefill ran above.)
            AttentionVersion::V2 | AttentionVersion::Flash => {
                let parts = meta.max_context.max(1).div_ceil(PARTITION_SIZE);
                let n = t * p.num_heads * parts;
                // SAFETY: uninitialized device memory of the right length; v2
                // writes the slots of every partition a token has, and the
                // reduction reads only those.
                let mut tmp: CudaSlice<f32> = unsafe { self.stream.alloc(n * d) }?;
                // SAFETY: as for tmp.
                let mut max_logits: CudaSlice<f32> = unsafe { self.stream.alloc(n) }?;
                // SAFETY: as for tmp.
                let mut exp_sums: CudaSlice<f32> = unsafe { self.stream.alloc(n) }?;
                let f = self.function(&variant, &format!("paged_attention_v2_{}", pool.dtype.suffix()))?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(&mut tmp).arg(&mut max_logits).arg(&mut exp_sums).arg(q).arg(&pool.k).arg(&pool.v);
                b.arg(&meta.block_tables).arg(&max_blocks).arg(&meta.token_seq).arg(&meta.query_start_loc);
                b.arg(&meta.context_lens).arg(&num_heads).arg(&num_kv_heads).arg(&qk_scale).arg(&p.softcap).arg(&window).arg(&v_scale);
                b.arg(&skip_min_q);
                // SAFETY: as for v1; tmp/max_logits/exp_sums hold `parts`
                // partitions per (token, head), the grid's z extent.
                unsafe { b.launch(cfg((grid_xy.0, grid_xy.1, to_u32(parts, "partitions")?), ATTENTION_THREADS, 0)) }?;
                let r = self.function(&variant, "paged_attention_v2_reduce")?;
                let parts_i = to_i32(parts, "partitions")?;
                let mut b = self.stream.launch_builder(&r);
                b.arg(out).arg(&tmp).arg(&max_logits).arg(&exp_sums).arg(&meta.token_seq).arg(&meta.query_start_loc);
                b.arg(&meta.context_lens).arg(&num_heads).arg(&parts_i).arg(&window).arg(&skip_min_q);
                // SAFETY: matches paged_attention_v2_reduce; the statistics
                // were written above for every partition a token has; the
                // dynamic shared memory holds `parts` weights.
                unsafe { b.launch(cfg((to_u32(p.num_heads, "heads")?, grid_xy.1, 1), ATTENTION_THREADS, parts * 4)) }?;
            }
        }
        Ok(())
    }

    /// Whether flash prefill runs where it applies (unless
    /// `VELLUM_FLASH_ATTENTION=0`, or turned off by
    /// [`Kernels::without_flash_attention`]).
    pub fn flash_enabled(&self) -> bool {
        self.flash_attention
    }

    /// These kernels with prompts attended by the decode kernels, in f32
    /// (the float32 path's choice).
    pub fn without_flash_attention(mut self) -> Self {
        self.flash_attention = false;
        self
    }

    /// How the paged decode kernels load keys and values now.
    pub fn paged_loads(&self) -> PagedLoads {
        self.paged_loads
    }

    /// Whether `sample_rows` takes its score bins now
    /// ([`sampling_variant_with`]).
    pub fn sample_binned(&self) -> bool {
        self.sample_binned.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes `sample_rows` take its score bins or not from its next launch
    /// (the same tokens; benchmarks compare the speed). A step already
    /// recorded as a CUDA graph keeps the kernel it recorded.
    pub fn set_sample_binned(&self, on: bool) {
        self.sample_binned.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`Kernels::gemm_mma`] takes the staged kernel where it
    /// applies ([`Kernels::mma_staged_applies`]).
    pub fn gemm_staged(&self) -> bool {
        self.gemm_staged.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes [`Kernels::gemm_mma`] take the staged kernel or not from its
    /// next launch (the same bits; benchmarks compare the speed). A step
    /// already recorded as a CUDA graph keeps the kernel it recorded.
    pub fn set_gemm_staged(&self, on: bool) {
        self.gemm_staged.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Gives the staged GEMM `stages` stages (2 to 6) from its next launch,
    /// or its default ([`mma_default_stages`]) with `None`: for benchmarks
    /// (the same bits either way).
    pub fn set_gemm_stages(&self, stages: Option<usize>) {
        let stages = stages.map_or(0, |s| s.clamp(2, 6));
        self.gemm_stages.store(stages, std::sync::atomic::Ordering::Relaxed);
    }

    /// The staged GEMM's stages at tile height `bm` now.
    pub fn gemm_stages(&self, bm: usize) -> usize {
        match self.gemm_stages.load(std::sync::atomic::Ordering::Relaxed) {
            0 => mma_default_stages(bm),
            s => s,
        }
    }

    /// Makes the paged decode kernels load keys and values as `loads` says
    /// (the outputs are the same bits; benchmarks compare the speed).
    pub fn set_paged_loads(&mut self, loads: PagedLoads) {
        self.paged_loads = loads;
    }

    /// Why flash prefill cannot attend over `pool` here, if it cannot: a GPU
    /// before Ampere, a float32 cache (the float32 path keeps f32 products), a head size
    /// other than 64, 128 or 256, the contiguous baseline, or a device
    /// whose thread blocks cannot hold its shared memory.
    pub fn flash_unsupported(&self, pool: &KvPool, layout: KvLayout) -> Option<String> {
        if self.info.compute_capability < (8, 0) {
            return Some(format!("compute capability {:?} (its mma and cp.async need 8.0)", self.info.compute_capability));
        }
        if pool.dtype == PoolDtype::F32 {
            return Some("a float32 KV cache multiplies in f32 (the decode kernels attend it)".into());
        }
        if !matches!(pool.head_dim, 64 | 128 | 256) {
            return Some(format!("head size {} (flash prefill takes 64, 128 or 256)", pool.head_dim));
        }
        if layout != KvLayout::Paged {
            return Some("the contiguous baseline layout".into());
        }
        let smem = flash_smem_bytes(pool.head_dim);
        if smem > self.info.max_shared_memory_optin {
            return Some(format!("{smem} bytes of shared memory a block, the device allows {}", self.info.max_shared_memory_optin));
        }
        None
    }

    /// Flash prefill over the sequences of `meta` with at least
    /// [`FLASH_MIN_QUERIES`] query tokens: their rows of `out`, from `q`
    /// and the pools; the other rows are untouched.
    ///
    /// # Safety
    /// As [`Kernels::attention_with_layout`]; the pool is one
    /// [`Kernels::flash_unsupported`] accepts.
    #[allow(clippy::too_many_arguments)]
    unsafe fn flash_prefill(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        pool: &KvPool,
        meta: &DeviceAttentionMetadata,
        p: AttentionParams,
        qk_scale: f32,
        v_scale: f32,
    ) -> Result<(), CudaError> {
        let slots = meta.query_lens.flash_tiles;
        if slots == 0 {
            return Ok(());
        }
        let f = self.function(&flash_variant(pool.head_dim, pool.block_size), &format!("flash_attention_{}", pool.dtype.suffix()))?;
        let smem = flash_smem_bytes(pool.head_dim);
        if smem > DEFAULT_SHARED_MEMORY {
            // Not a stream operation: allowed while a graph is captured.
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                to_i32(smem, "flash shared memory")?,
            )?;
        }
        let ints = [
            to_i32(meta.max_blocks_per_seq, "max_blocks_per_seq")?,
            to_i32(meta.context_lens.len(), "sequences")?,
            to_i32(FLASH_MIN_QUERIES, "flash threshold")?,
            to_i32(p.num_heads, "heads")?,
            to_i32(pool.num_kv_heads, "kv heads")?,
            to_i32(p.window, "window")?,
        ];
        let [max_blocks, num_seqs, min_q, num_heads, num_kv_heads, window] = ints;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(q).arg(&pool.k).arg(&pool.v).arg(&meta.block_tables).arg(&max_blocks);
        b.arg(&meta.query_start_loc).arg(&meta.context_lens).arg(&num_seqs).arg(&min_q);
        b.arg(&num_heads).arg(&num_kv_heads).arg(&qk_scale).arg(&p.softcap).arg(&window).arg(&v_scale);
        // SAFETY: the arguments match flash_attention_* in order and type;
        // q/out hold num_tokens·num_heads·head_dim floats (checked by the
        // caller); query_start_loc has num_seqs + 1 entries and the block
        // tables num_seqs rows covering each context (the caller's
        // contract); a slot past the batch's tiles returns at once; the
        // dynamic shared memory is the kernel's layout, opted in above.
        unsafe { b.launch(cfg((to_u32(slots, "flash tiles")?, to_u32(p.num_heads, "heads")?, 1), FLASH_THREADS, smem)) }?;
        Ok(())
    }

    /// Checks `y [rows, n] = x [rows, k] · Wᵀ`'s buffers against the weight.
    fn check_linear(w: &QuantMatrix, x_len: usize, y_len: usize, rows: usize) -> Result<(), CudaError> {
        w.check()?;
        if x_len < rows * w.k || y_len < rows * w.n {
            return Err(shape_error(format!("linear [{rows}x{}]·[{}x{}]ᵀ: x or y too small", w.k, w.n, w.k)));
        }
        Ok(())
    }

    /// `y [rows, n] = x [rows, k] · Wᵀ` in f32 by the GEMV (1..8 rows, one
    /// launch reading the weight once).
    pub fn gemv_q(&self, y: &mut CudaSlice<f32>, w: &QuantMatrix, x: &CudaSlice<f32>, rows: usize) -> Result<(), CudaError> {
        self.gemv_q_planned(y, w, x, rows, self.gemv_plan(rows))
    }

    /// [`Self::gemv_q`] with the given plan instead of the chosen one (the
    /// GEMM benchmark compares plans).
    pub fn gemv_q_planned(
        &self,
        y: &mut CudaSlice<f32>,
        w: &QuantMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        plan: GemvPlan,
    ) -> Result<(), CudaError> {
        self.gemv_checked(y, w, x, rows, plan, GemvFusion::default(), None)
    }

    /// `y = out(in(x) · Wᵀ)` by the GEMV (1..8 rows) with `fusion`: `x` is
    /// `[rows, k]`; `y` is `[rows, n]`, or `[rows, n / 2]` for a gated
    /// output (W stacking gate and up); `norm` is the RMSNorm's weight (k
    /// floats) and epsilon, which [`GemvInput::RmsNorm`] needs and nothing
    /// else takes.
    pub fn gemv_fused(
        &self,
        y: &mut CudaSlice<f32>,
        w: &QuantMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        fusion: GemvFusion,
        norm: Option<(&CudaSlice<f32>, f32)>,
    ) -> Result<(), CudaError> {
        let plan = if fusion.output.is_gated() { self.gemv_plan(rows).paired() } else { self.gemv_plan(rows) };
        self.gemv_checked(y, w, x, rows, plan, fusion, norm)
    }

    /// The GEMV launch after checking everything it reads and writes: the
    /// weight's planes, x and y for `rows` (1..8) rows, the plan (paired
    /// for a gated output), the norm's weight where the input is normed.
    #[allow(clippy::too_many_arguments)]
    fn gemv_checked(
        &self,
        y: &mut CudaSlice<f32>,
        w: &QuantMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        plan: GemvPlan,
        fusion: GemvFusion,
        norm: Option<(&CudaSlice<f32>, f32)>,
    ) -> Result<(), CudaError> {
        w.check()?;
        let gated = fusion.output.is_gated();
        let n_out = if gated { w.n / 2 } else { w.n };
        if gated && !(w.n.is_multiple_of(2) && plan.columns_per_warp.is_multiple_of(2)) {
            return Err(shape_error(format!("a gated GEMV takes a stacked gate/up weight ({} rows) and paired columns ({plan:?})", w.n)));
        }
        if x.len() < rows * w.k || y.len() < rows * n_out {
            return Err(shape_error(format!("GEMV [{rows}x{}] into [{rows}x{n_out}]: x or y too small", w.k)));
        }
        if rows == 0 || rows > 8 {
            return Err(shape_error(format!("gemv takes 1..8 rows, got {rows}")));
        }
        if !plan.is_valid() {
            return Err(shape_error(format!("{plan:?}: a GEMV plan takes 1..4 columns a warp and 1, 2 or 4 warps a group")));
        }
        match (fusion.input, norm) {
            (GemvInput::RmsNorm, Some((n, _))) if n.len() == w.k => {}
            (GemvInput::RmsNorm, _) => return Err(shape_error(format!("a normed GEMV needs the norm's {} weights", w.k))),
            (_, None) => {}
            (_, Some(_)) => return Err(shape_error("only a normed GEMV takes a norm".into())),
        }
        self.gemv_launch_planned(y, w, x, rows, plan, fusion, norm)
    }

    /// The GEMV's plan for `rows` rows: `VELLUM_GEMV`'s, else
    /// [`GemvPlan::for_rows`].
    fn gemv_plan(&self, rows: usize) -> GemvPlan {
        self.gemv_override.unwrap_or_else(|| GemvPlan::for_rows(rows))
    }

    /// The GEMV launch with `plan`; the caller checked the buffers, that
    /// `rows` is 1..8 and that the plan is valid (`gemv_checked`, or
    /// `gemv_rows`' check of the buffers with the default plan).
    #[allow(clippy::too_many_arguments)]
    fn gemv_launch_planned(
        &self,
        y: &mut CudaSlice<f32>,
        w: &QuantMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        plan: GemvPlan,
        fusion: GemvFusion,
        norm: Option<(&CudaSlice<f32>, f32)>,
    ) -> Result<(), CudaError> {
        let f = self.function(&plan.fused_variant(rows, fusion), &format!("gemv_{}", w.format.suffix()))?;
        // Output columns: a gated output's are half the weight's rows, a
        // warp's columns_per_warp weight rows half gate, half up.
        let (n_out, cols_per_warp) =
            if fusion.output.is_gated() { (w.n / 2, plan.columns_per_warp / 2) } else { (w.n, plan.columns_per_warp) };
        let (n_i, k_i) = (to_i32(n_out, "n")?, to_i32(w.k, "k")?);
        // 4 warps a block; a group of k_split warps owns cols_per_warp output
        // columns (gemv_q.cu).
        let per_block = 4 / plan.k_split * cols_per_warp;
        // Without a norm the kernel never reads `aux`: x stands in.
        let (aux, eps) = norm.unwrap_or((x, 0.0));
        let mut b = self.stream.launch_builder(&f);
        b.arg(y).arg(&w.codes).arg(&w.scales).arg(x).arg(&n_i).arg(&k_i).arg(aux).arg(&eps);
        // SAFETY: matches gemv_*(float*, const unsigned char*, const
        // unsigned short*, const float*, int, int, const float*, float); the
        // caller checked (check_linear, gemv_checked) that the planes hold the
        // layout's bytes for [n, k] (k whole blocks), x rows·k floats and y
        // rows·n_out (n / 2 for a gated output, n even), and a norm's weight
        // k floats (read only by a normed variant); a warp's columns past
        // n_out read the last one's weight rows and write nothing; the
        // block's 4 / k_split groups of cols_per_warp output columns match
        // per_block.
        unsafe { b.launch(cfg((to_u32(n_out.div_ceil(per_block), "columns")?, 1, 1), 128, 0)) }?;
        Ok(())
    }

    /// `y [rows, n] = x [rows, k] · Wᵀ` in f32 arithmetic for any number of
    /// rows: the GEMV up to 8 rows, the tiled CUDA-core GEMM beyond.
    pub fn gemv_rows(&self, y: &mut CudaSlice<f32>, w: &QuantMatrix, x: &CudaSlice<f32>, rows: usize) -> Result<(), CudaError> {
        Self::check_linear(w, x.len(), y.len(), rows)?;
        match rows {
            0 => Ok(()),
            1..=8 => self.gemv_launch_planned(y, w, x, rows, self.gemv_plan(rows), GemvFusion::default(), None),
            _ => self.gemm_f32_cores(y, w, x, rows),
        }
    }

    /// How many parts a GEMM of `tiles` output tiles splits k (`blocks`
    /// blocks of 32) into: one when the tiles fill the GPU twice over,
    /// else enough to (at most 16, at least two blocks a part), rounded to
    /// parts of equal size.
    fn splits_for(&self, tiles: usize, blocks: usize) -> usize {
        splits_for(tiles, blocks, self.num_sms)
    }

    /// How many parts the CUDA-core GEMM (64 × 64 tiles) splits k into.
    pub fn gemm_splits(&self, rows: usize, n: usize, k: usize) -> usize {
        self.splits_for(rows.div_ceil(64) * n.div_ceil(64), k / 32)
    }

    /// How the tensor-core GEMMs cut a product of `rows` rows with an
    /// `[n, k]` weight on this device ([`mma_plan_for`]).
    pub fn mma_plan(&self, rows: usize, n: usize, k: usize) -> MmaPlan {
        mma_plan_for(rows, n, k, self.num_sms)
    }

    /// Whether a product of `rows` rows with `w` takes `gemm_mma_staged_*`
    /// (as [`Kernels::gemm_mma`] decides): the staged kernel on, a quantized
    /// weight whose k is an even number of blocks of 32 (of 256 for Q6_K,
    /// whose scale rows are then 4-byte aligned), and the stages within the
    /// device's shared memory.
    pub fn mma_staged_applies(&self, w: &QuantMatrix, rows: usize) -> bool {
        self.staged_applies_at(w, self.mma_plan(rows, w.n, w.k).tile_rows)
    }

    /// [`Kernels::mma_staged_applies`] at tile height `bm`.
    fn staged_applies_at(&self, w: &QuantMatrix, bm: usize) -> bool {
        self.gemm_staged()
            && (w.k / 32).is_multiple_of(2)
            && (w.format != QuantFormat::Q6K || (w.k / 256).is_multiple_of(2))
            && mma_staged_smem_bytes(w.format, bm, self.gemm_stages(bm)).is_some_and(|b| b <= self.info.max_shared_memory_optin)
    }

    /// Launches a GEMM kernel `f(float *y, codes, scales, x, int rows, int
    /// n, int k, int kb_per_split)` over `grid` (z: the parts of k) with
    /// `smem` bytes of dynamic shared memory, k split in `splits` parts of
    /// `per_split` blocks of 32: straight into `y` for one part, else into
    /// a workspace of `splits · rows · n` floats that `gemm_sum_splits`
    /// adds into `y` in order.
    ///
    /// # Safety
    /// `f` has that signature, with `x`'s element type, and writes, for
    /// each z < `splits`, every one of the `rows · n` floats at `y + z ·
    /// rows · n` and nothing else, reading only within `w`'s checked planes
    /// and `rows · k` elements of `x`; `splits · per_split` blocks cover k;
    /// `f` may use `smem` bytes of dynamic shared memory.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_split<X: cudarc::driver::DeviceRepr>(
        &self,
        f: &CudaFunction,
        y: &mut CudaSlice<f32>,
        w: &QuantMatrix,
        x: &CudaSlice<X>,
        rows: usize,
        (splits, per_split): (usize, usize),
        grid: (u32, u32, u32),
        smem: usize,
    ) -> Result<(), CudaError> {
        let per_split = to_i32(per_split, "blocks")?;
        let (rows_i, n_i, k_i) = (to_i32(rows, "rows")?, to_i32(w.n, "n")?, to_i32(w.k, "k")?);
        if splits == 1 {
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut *y).arg(&w.codes).arg(&w.scales).arg(x).arg(&rows_i).arg(&n_i).arg(&k_i).arg(&per_split);
            // SAFETY: the caller's contract: f writes the rows·n floats of y.
            unsafe { b.launch(cfg(grid, 256, smem)) }?;
            return Ok(());
        }
        let len = rows * w.n;
        // SAFETY: uninitialized device memory; split z writes every
        // element of parts[z · len ..][..len] (the caller's contract), and
        // the sum reads only those.
        let mut parts: CudaSlice<f32> = unsafe { self.stream.alloc(splits * len) }?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut parts).arg(&w.codes).arg(&w.scales).arg(x).arg(&rows_i).arg(&n_i).arg(&k_i).arg(&per_split);
        // SAFETY: as above, into parts, which holds splits · len floats.
        unsafe { b.launch(cfg(grid, 256, smem)) }?;
        // In the module of the one-row GEMV (gemv_q.cu holds both).
        let sum = self.function(&GemvPlan::for_rows(1).variant(1), "gemm_sum_splits")?;
        let (len_i, splits_i) = (len as i64, to_i32(splits, "splits")?);
        let mut b = self.stream.launch_builder(&sum);
        b.arg(&mut *y).arg(&parts).arg(&len_i).arg(&splits_i);
        // SAFETY: matches gemm_sum_splits(float*, const float*, long long,
        // int); y holds len floats (checked by the callers), parts splits · len.
        unsafe { b.launch(cfg((to_u32(len.div_ceil(256).min(4096), "sum blocks")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// The CUDA-core GEMM: 64 × 64 outputs a 256-thread block, k split in
    /// parts (then summed in order) when the tiles are too few for the GPU.
    fn gemm_f32_cores(&self, y: &mut CudaSlice<f32>, w: &QuantMatrix, x: &CudaSlice<f32>, rows: usize) -> Result<(), CudaError> {
        let f = self.function(&GemvPlan::for_rows(1).variant(1), &format!("gemm_{}", w.format.suffix()))?;
        let splits = self.gemm_splits(rows, w.n, w.k);
        let grid = (to_u32(w.n.div_ceil(64), "column tiles")?, to_u32(rows.div_ceil(64), "row tiles")?, to_u32(splits, "splits")?);
        // SAFETY: gemm_*(float*, const unsigned char*, const unsigned
        // short*, const float*, int, int, int, int); the callers checked
        // the planes (layout bytes for [n, k]), x (rows·k) and y (rows·n);
        // the kernel guards rows and columns past the edges and writes every
        // in-range output of split z at y + z·rows·n; the splits cover k.
        unsafe { self.launch_split(&f, y, w, x, rows, (splits, (w.k / 32).div_ceil(splits)), grid, 0) }
    }

    /// `y [rows, n] = x16 [rows, k] · Wᵀ` on tensor cores: `x16` bf16
    /// (`cast_to_16`), the weight dequantized to bf16 as it is staged, f32
    /// accumulation and output. Any number of rows (tiles of 32, 64 or 128
    /// by [`Kernels::mma_plan`], k split when the tiles are too few).
    /// Quantized weights take `gemm_mma_staged_*` where
    /// [`Kernels::mma_staged_applies`] (the same bits, more of the weight
    /// in flight), the rest `gemm_mma_*`.
    pub fn gemm_mma(&self, y: &mut CudaSlice<f32>, w: &QuantMatrix, x16: &CudaSlice<u16>, rows: usize) -> Result<(), CudaError> {
        Self::check_linear(w, x16.len(), y.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        // Both kernels take the same plan, so that they give the same bits.
        let plan = self.mma_plan(rows, w.n, w.k);
        let bm = plan.tile_rows;
        let grid =
            (to_u32(w.n.div_ceil(MMA_TILE_COLS), "column tiles")?, to_u32(rows.div_ceil(bm), "row tiles")?, to_u32(plan.parts, "parts")?);
        let parts = (plan.parts, plan.blocks_per_part);
        if self.staged_applies_at(w, bm) {
            let stages = self.gemm_stages(bm);
            let smem = mma_staged_smem_bytes(w.format, bm, stages).unwrap_or(0);
            // The default stages compile with the module's default defines.
            let variant = if stages == mma_default_stages(bm) {
                Variant::new(GEMM_MMA, &[("MMA_BM", bm)])
            } else {
                Variant::new(GEMM_MMA, &[("MMA_BM", bm), ("MMA_STAGES", stages)])
            };
            let f = self.function(&variant, &format!("gemm_mma_staged_{}", w.format.suffix()))?;
            if smem > DEFAULT_SHARED_MEMORY {
                // Not a stream operation: allowed while a graph is captured.
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    to_i32(smem, "staged GEMM shared memory")?,
                )?;
            }
            // SAFETY: gemm_mma_staged_*(float*, const unsigned char*, const
            // unsigned short*, const unsigned short*, int, int, int, int);
            // check_linear verified the planes for [n, k] (k a multiple of
            // 32), x16 (rows·k) and y (rows·n); mma_staged_applies checked k/32
            // even and the format (whose copies are then aligned), and the
            // plan's parts are then even (mma_plan_for), so every step's two
            // blocks lie in k; the kernel clamps its loads to row rows − 1 and
            // column n − 1, uses `smem` bytes (within the device's limit,
            // checked) and writes every in-range output of part z at
            // y + z·rows·n.
            return unsafe { self.launch_split(&f, y, w, x16, rows, parts, grid, smem) };
        }
        let f = self.function(&Variant::new(GEMM_MMA, &[("MMA_BM", bm)]), &format!("gemm_mma_{}", w.format.suffix()))?;
        // SAFETY: gemm_mma_*(float*, const unsigned char*, const unsigned
        // short*, const unsigned short*, int, int, int, int); check_linear
        // verified the planes for [n, k] (k a multiple of 32), x16 (rows·k)
        // and y (rows·n); the kernel clamps its loads to row rows − 1 and
        // column n − 1 and writes every in-range output of part z at
        // y + z·rows·n; the parts cover k.
        unsafe { self.launch_split(&f, y, w, x16, rows, parts, grid, 0) }
    }

    /// `out [n, k]` = the weight's values as bf16 (round to nearest even):
    /// a scratch copy for cuBLAS.
    pub fn dequantize_bf16(&self, out: &mut CudaSlice<u16>, w: &QuantMatrix) -> Result<(), CudaError> {
        w.check()?;
        if out.len() < w.n * w.k {
            return Err(shape_error(format!("dequantize [{}, {}] into {} elements", w.n, w.k, out.len())));
        }
        let f = self.function(&Variant::new(GEMM_MMA, &[("MMA_BM", 128)]), &format!("dequantize_bf16_{}", w.format.suffix()))?;
        let (n_i, k_i) = (to_i32(w.n, "n")?, to_i32(w.k, "k")?);
        let chunks = w.n * w.k / 16;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(&w.codes).arg(&w.scales).arg(&n_i).arg(&k_i);
        // SAFETY: dequantize_bf16_*(unsigned short*, const unsigned char*,
        // const unsigned short*, int, int); the planes hold [n, k] (checked),
        // out n·k elements; a grid-stride loop over n·k/16 chunks.
        unsafe { b.launch(cfg((to_u32(chunks.div_ceil(256).min(8 * self.num_sms), "chunks")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `y = rms_norm(x) · w` per group of `w.len()` values (`x` and `y` of
    /// `groups · w.len()` floats; per-head norms use groups of a head).
    pub fn rms_norm_into(
        &self,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        groups: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let cols = w.len();
        if x.len() < groups * cols || y.len() < groups * cols {
            return Err(shape_error(format!("rms_norm of {groups} groups of {cols}: buffer too small")));
        }
        if groups == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), "rms_norm")?;
        let (cols_i, offset) = (to_i32(cols, "cols")?, 0f32);
        let mut b = self.stream.launch_builder(&f);
        b.arg(y).arg(x).arg(w).arg(&cols_i).arg(&eps).arg(&offset);
        // SAFETY: matches rms_norm(float*, const float*, const float*, int,
        // float, float); one thread block per group, sizes checked above.
        unsafe { b.launch(cfg((to_u32(groups, "groups")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Splits each row of `qkv [tokens, nq + nk + nv]` into `q`, `k` and
    /// `v`, rotating q and k by RoPE at `positions` when `rope` gives the
    /// table and the head size (`split_qkv_rope`).
    ///
    /// # Safety
    /// With `rope`, every position is below the rows of its table: the
    /// kernel reads the table at each position unchecked.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn split_qkv(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        tokens: usize,
        widths: [usize; 3],
        rope: Option<(&CudaSlice<f32>, &CudaSlice<i64>, usize)>,
    ) -> Result<(), CudaError> {
        let [nq, nk, nv] = widths;
        if qkv.len() < tokens * (nq + nk + nv) || q.len() < tokens * nq || k.len() < tokens * nk || v.len() < tokens * nv {
            return Err(shape_error(format!("split_qkv of {tokens} rows of {nq} + {nk} + {nv}: buffer too small")));
        }
        let SplitRotation { table, positions, head_dim, rotate } = split_rotation("split_qkv", qkv, tokens, widths, rope)?;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), "split_qkv_rope")?;
        let ints = [to_i32(nq, "nq")?, to_i32(nk, "nk")?, to_i32(nv, "nv")?, to_i32(head_dim, "head_dim")?];
        let mut b = self.stream.launch_builder(&f);
        b.arg(q).arg(k).arg(v).arg(qkv).arg(table);
        match positions {
            Some(p) => b.arg(p),
            // A null pointer: never read without rotation.
            None => b.arg(&0u64),
        };
        b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&ints[3]).arg(&rotate);
        // SAFETY: matches split_qkv_rope(float*, float*, float*, const
        // float*, const float*, const long long*, int, int, int, int, int);
        // the buffers hold the rows checked above; with rotation the
        // positions (one per row) are below the table's rows (the caller's
        // contract) and q and k are whole heads.
        unsafe { b.launch(cfg((to_u32(tokens, "tokens")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// [`Kernels::split_qkv`] with the keys and values written into `pool`
    /// at `slot_mapping` (one slot a row; a negative slot writes nothing)
    /// as [`Kernels::reshape_and_cache`] writes them, and only `q` to
    /// memory (`split_qkv_rope_cache_*`): one launch instead of two.
    ///
    /// # Safety
    /// Every slot is below the pool's `num_blocks · block_size`, and with
    /// `rope` every position is below the rows of its table: the kernel
    /// writes the pool and reads the table at them unchecked.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn split_qkv_into_cache(
        &self,
        q: &mut CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        tokens: usize,
        widths: [usize; 3],
        rope: Option<(&CudaSlice<f32>, &CudaSlice<i64>, usize)>,
        pool: &mut KvPool,
        slot_mapping: &CudaSlice<i64>,
        scale: KvScale,
    ) -> Result<(), CudaError> {
        let [nq, nk, nv] = widths;
        let row = pool.row();
        if nk != row || nv != row {
            return Err(shape_error(format!("split_qkv_into_cache: k and v of {nk} and {nv} for a pool row of {row}")));
        }
        if qkv.len() < tokens * (nq + nk + nv) || q.len() < tokens * nq || slot_mapping.len() < tokens {
            return Err(shape_error(format!("split_qkv_into_cache of {tokens} rows of {nq} + {nk} + {nv}: buffer too small")));
        }
        let SplitRotation { table, positions, head_dim, rotate } = split_rotation("split_qkv_into_cache", qkv, tokens, widths, rope)?;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), &format!("split_qkv_rope_cache_{}", pool.dtype.suffix()))?;
        let ints = [to_i32(nq, "nq")?, to_i32(row, "row")?, to_i32(head_dim, "head_dim")?];
        let (k_inv, v_inv) = (1.0f32 / scale.k, 1.0f32 / scale.v);
        let mut b = self.stream.launch_builder(&f);
        b.arg(q).arg(qkv).arg(table);
        match positions {
            Some(p) => b.arg(p),
            // A null pointer: never read without rotation.
            None => b.arg(&0u64),
        };
        b.arg(&mut pool.k).arg(&mut pool.v).arg(slot_mapping);
        b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&rotate).arg(&k_inv).arg(&v_inv);
        // SAFETY: matches split_qkv_rope_cache_*(float*, const float*, const
        // float*, const long long*, void*, void*, const long long*, int, int,
        // int, int, float, float); q and qkv hold the rows checked above, k
        // and v are whole pool rows; every slot is below the pool's slots
        // and, with rotation, every position below the table's rows (the
        // caller's contract).
        unsafe { b.launch(cfg((to_u32(tokens, "tokens")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `out [tokens, inter] = act(x[:, :inter]) · x[:, inter:]` for `x
    /// [tokens, 2·inter]` (the gate and up products stacked):
    /// `silu_and_mul`, or `gelu_tanh_and_mul` with `gelu`.
    pub fn gated_and_mul(
        &self,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        tokens: usize,
        inter: usize,
        gelu: bool,
    ) -> Result<(), CudaError> {
        if x.len() < tokens * 2 * inter || out.len() < tokens * inter {
            return Err(shape_error(format!("gated activation of {tokens} rows of 2 × {inter}: buffer too small")));
        }
        if tokens == 0 || inter == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), if gelu { "gelu_tanh_and_mul" } else { "silu_and_mul" })?;
        let inter_i = to_i32(inter, "inter")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(x).arg(&inter_i);
        // SAFETY: matches silu_and_mul / gelu_tanh_and_mul(float*, const
        // float*, int); one block per row, sizes checked above.
        unsafe { b.launch(cfg((to_u32(tokens, "tokens")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// [`Kernels::rope`] of `q [tokens, heads, head_dim]` and `k [tokens,
    /// kv_heads, head_dim]` in one launch.
    ///
    /// # Safety
    /// As [`Kernels::rope`]: every position is below the rows of `cos_sin`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_qk(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        cos_sin: &CudaSlice<f32>,
        positions: &CudaSlice<i64>,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: this function's contract is rope_half_split's; q and k are
        // distinct buffers, each written only by the kernel.
        unsafe { self.rope_half_split(q, k, cos_sin, positions, [heads, kv_heads], head_dim) }
    }

    /// Half-split RoPE in place on every head of `x [tokens, heads,
    /// head_dim]` at `positions` (int64, one per token), from `cos_sin
    /// [max_positions, head_dim]` (cos of the pairs, then sin).
    ///
    /// # Safety
    /// Every position is below `cos_sin`'s `max_positions`: the kernel
    /// reads the table at each position unchecked.
    pub unsafe fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        cos_sin: &CudaSlice<f32>,
        positions: &CudaSlice<i64>,
        heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: this function's contract is rope_half_split's; with no KV
        // heads the kernel touches only the first buffer.
        unsafe { self.rope_half_split(x, x, cos_sin, positions, [heads, 0], head_dim) }
    }

    /// `rope_half_split` over `q [tokens, heads, head_dim]` and `k [tokens,
    /// kv_heads, head_dim]` (`[heads, kv_heads]`), lengths checked.
    ///
    /// # Safety
    /// Every position is below `cos_sin`'s rows.
    unsafe fn rope_half_split(
        &self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        cos_sin: &CudaSlice<f32>,
        positions: &CudaSlice<i64>,
        [heads, kv_heads]: [usize; 2],
        head_dim: usize,
    ) -> Result<(), CudaError> {
        let tokens = positions.len();
        if q.len() < tokens * heads * head_dim || k.len() < tokens * kv_heads * head_dim || !head_dim.is_multiple_of(2) {
            return Err(shape_error(format!(
                "rope of {tokens} tokens × {heads} + {kv_heads} heads × {head_dim}: buffer too small or odd head_dim"
            )));
        }
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), "rope_half_split")?;
        let ints = [to_i32(heads, "heads")?, to_i32(kv_heads, "kv heads")?, to_i32(head_dim, "head_dim")?, to_i32(head_dim, "rot")?];
        let mut b = self.stream.launch_builder(&f);
        b.arg(q).arg(k).arg(cos_sin).arg(positions).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&ints[3]);
        // SAFETY: matches rope_half_split(float*, float*, const float*,
        // const long long*, int, int, int, int); q holds [tokens, heads,
        // head_dim] and k [tokens, kv_heads, head_dim] (checked above), each
        // pair rotated by one thread; positions are below the table's rows
        // (the caller's contract).
        unsafe { b.launch(cfg((to_u32(tokens, "tokens")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// An element-wise kernel of `layers.cu` over `n` floats:
    /// `add_inplace` (x += y), `scale_inplace` (x *= factor),
    /// `silu_mul_split` / `gelu_tanh_mul_split` (x = act(a) · b).
    pub fn elementwise(&self, op: Elementwise<'_>, x: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        let short = |s: &CudaSlice<f32>| s.len() < n;
        let bad = match op {
            Elementwise::Add(y) => short(y),
            Elementwise::Scale(_) => false,
            Elementwise::SiluMul(a, b) | Elementwise::GeluTanhMul(a, b) => short(a) || short(b),
        };
        if x.len() < n || bad {
            return Err(shape_error(format!("element-wise op over {n} values: buffer too small")));
        }
        if n == 0 {
            return Ok(());
        }
        let n_i = n as i64;
        let grid = to_u32(n.div_ceil(256).min(65_535), "element blocks")?;
        let launch = cfg((grid, 1, 1), 256, 0);
        match op {
            Elementwise::Add(y) => {
                let f = self.function(&Variant::new(LAYERS, &[]), "add_inplace")?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(x).arg(y).arg(&n_i);
                // SAFETY: add_inplace(float*, const float*, long long); both
                // hold n floats (checked); a grid-stride loop.
                unsafe { b.launch(launch) }?;
            }
            Elementwise::Scale(factor) => {
                let f = self.function(&Variant::new(LAYERS, &[]), "scale_inplace")?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(x).arg(&factor).arg(&n_i);
                // SAFETY: scale_inplace(float*, float, long long) over n floats.
                unsafe { b.launch(launch) }?;
            }
            Elementwise::SiluMul(g, u) | Elementwise::GeluTanhMul(g, u) => {
                let name = if matches!(op, Elementwise::SiluMul(..)) { "silu_mul_split" } else { "gelu_tanh_mul_split" };
                let f = self.function(&Variant::new(LAYERS, &[]), name)?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(x).arg(g).arg(u).arg(&n_i);
                // SAFETY: *_mul_split(float*, const float*, const float*,
                // long long); all three hold n floats (checked).
                unsafe { b.launch(launch) }?;
            }
        }
        Ok(())
    }

    /// `y[i] = x[i]` rounded to nearest (even) in `dtype`, for the first
    /// `n` elements: activations cast for a 16-bit tensor-core GEMM.
    pub fn cast_to_16(&self, y: &mut CudaSlice<u16>, x: &CudaSlice<f32>, n: usize, dtype: crate::blas::Half) -> Result<(), CudaError> {
        if y.len() < n || x.len() < n {
            return Err(shape_error(format!("cast of {n} elements: buffers of {} and {}", y.len(), x.len())));
        }
        if n == 0 {
            return Ok(());
        }
        let name = match dtype {
            crate::blas::Half::F16 => "cast_f32_to_f16",
            crate::blas::Half::Bf16 => "cast_f32_to_bf16",
        };
        let f = self.function(&Variant::new(LAYERS, &[]), name)?;
        let n_i = i64::try_from(n).map_err(|_| shape_error(format!("cast of {n} elements")))?;
        let grid = to_u32(n.div_ceil(256).min(65_535), "element blocks")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(y).arg(x).arg(&n_i);
        // SAFETY: cast_f32_to_{f16,bf16}(T*, const float*, long long), a
        // 16-bit T; both buffers hold at least n elements (checked); a
        // grid-stride loop of NUM_THREADS (256) a block.
        unsafe { b.launch(cfg((grid, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `y[r, :] += bias` for `rows` rows of `bias.len()`.
    pub fn add_bias_rows(&self, y: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, rows: usize) -> Result<(), CudaError> {
        let cols = bias.len();
        if y.len() < rows * cols {
            return Err(shape_error(format!("bias over {rows} rows of {cols}: buffer too small")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), "add_bias_rows")?;
        let cols_i = to_i32(cols, "cols")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(y).arg(bias).arg(&cols_i);
        // SAFETY: add_bias_rows(float*, const float*, int); one block a row
        // of `cols` (checked).
        unsafe { b.launch(cfg((to_u32(rows, "rows")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `out[r]` = the argmax of row `r` of `logits [rows, vocab]` (the lowest
    /// id among equal maxima, as the host sampler breaks ties).
    pub fn argmax_rows(&self, out: &mut CudaSlice<i32>, logits: &CudaSlice<f32>, rows: usize, vocab: usize) -> Result<(), CudaError> {
        if out.len() < rows || logits.len() < rows * vocab || vocab == 0 {
            return Err(shape_error(format!("argmax of {rows} rows of {vocab}: buffers too small")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), "argmax_rows")?;
        let vocab_i = to_i32(vocab, "vocab")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(logits).arg(&vocab_i);
        // SAFETY: argmax_rows(int*, const float*, int); a block of
        // NUM_THREADS (256, layers.cu's default) per row; sizes checked above.
        unsafe { b.launch(cfg((to_u32(rows, "rows")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// A token a row of `logits [rows, vocab]` (`sampling.cu`): `params`
    /// holds each row's sampling parameters as the kernel reads them,
    /// `out` receives the tokens, logprobs and `top_stride` top entries a
    /// row; rows with penalty entries are overwritten with their scores.
    ///
    /// # Safety
    /// `params` must come from [`crate::sampling::pack`] for these rows and
    /// this `vocab` (uploaded as is): the kernel reads each row's penalty
    /// entries at the indices `iparams` gives, unchecked, and binary-searches
    /// them, so the ranges must lie inside `pen_tokens` (and three times that
    /// inside `pen_values`) and hold increasing tokens; `out.pen_raw` must
    /// have an element per penalty entry.
    pub unsafe fn sample_rows(
        &self,
        out: &mut SampleOutputs,
        logits: &CudaSlice<f32>,
        vocab: usize,
        params: &SampleInputs,
    ) -> Result<(), CudaError> {
        let rows = params.uniform.len();
        let ok = logits.len() >= rows * vocab
            && params.fparams.len() >= rows * 4
            && params.iparams.len() >= rows * 5
            && out.tokens.len() >= rows
            && out.logprobs.len() >= rows
            && out.top_ids.len() >= rows * out.top_stride.max(1)
            && out.top_logprobs.len() >= rows * out.top_stride.max(1)
            && out.pen_raw.len() >= params.pen_tokens.len()
            && params.pen_values.len() >= params.pen_tokens.len() * 3
            && vocab > 0;
        if !ok {
            return Err(shape_error(format!("sampling {rows} rows of {vocab}: buffers too small")));
        }
        // A thread's 16-bit radix counts hold its entries of a row.
        if vocab.div_ceil(SAMPLE_THREADS as usize) > usize::from(u16::MAX) {
            return Err(shape_error(format!("sampling rows of {vocab}: a vocabulary over {} entries", 65535 * SAMPLE_THREADS)));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&sampling_variant_with(self.sample_binned()), "sample_rows")?;
        let (vocab_i, stride) = (to_i32(vocab, "vocab")?, to_i32(out.top_stride.max(1), "top logprobs")?);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut out.tokens).arg(&mut out.logprobs).arg(&mut out.top_ids).arg(&mut out.top_logprobs).arg(&stride);
        b.arg(logits).arg(&mut out.pen_raw).arg(&vocab_i).arg(&params.fparams).arg(&params.iparams).arg(&params.uniform);
        b.arg(&params.pen_tokens).arg(&params.pen_values);
        // SAFETY: sample_rows(int*, float*, int*, float*, int, float*,
        // float*, int, const float*, const int*, const double*, const int*,
        // const float*); one block of SAMPLE_THREADS per row, the block
        // size the module was compiled for (sampling_variant_with); the buffers' sizes are checked above, and the
        // penalty ranges inside them are the caller's contract (`pack`'s).
        // The kernel writes `logits`, passed by shared reference: cudarc
        // records it as read, which orders nothing on this one stream.
        unsafe { b.launch(cfg((to_u32(rows, "rows")?, 1, 1), SAMPLE_THREADS, 0)) }?;
        Ok(())
    }

    /// Puts back the raw logits [`Kernels::sample_rows`] replaced in the
    /// rows it sampled (`out.tokens` ≥ 0), so that the host can sample the
    /// step from `logits` after all.
    ///
    /// # Safety
    /// `params` and `out` must be those of the [`Kernels::sample_rows`] call
    /// that ran on `logits` (same contract: `pack`'s output, a `pen_raw`
    /// element per entry), after it completed on this stream.
    pub unsafe fn unpenalize_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        params: &SampleInputs,
        out: &SampleOutputs,
    ) -> Result<(), CudaError> {
        let rows = params.uniform.len();
        if logits.len() < rows * vocab
            || params.iparams.len() < rows * 5
            || out.tokens.len() < rows
            || out.pen_raw.len() < params.pen_tokens.len()
        {
            return Err(shape_error(format!("unpenalizing {rows} rows of {vocab}: buffers too small")));
        }
        if rows == 0 || !params.any_penalties {
            return Ok(());
        }
        let f = self.function(&sampling_variant_with(self.sample_binned()), "unpenalize_rows")?;
        let vocab_i = to_i32(vocab, "vocab")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(logits).arg(&vocab_i).arg(&params.iparams).arg(&out.tokens).arg(&params.pen_tokens).arg(&out.pen_raw);
        // SAFETY: unpenalize_rows(float*, int, const int*, const int*,
        // const int*, const float*); a block of 128 per row; sizes checked
        // above, the penalty ranges inside them by the caller's contract.
        // It writes `logits` through a shared reference, as sample_rows does.
        unsafe { b.launch(cfg((to_u32(rows, "rows")?, 1, 1), 128, 0)) }?;
        Ok(())
    }

    /// `out[r, :] = x[rows[r], :]` for the first `n` indices.
    ///
    /// # Safety
    /// Every index in `rows[..n]` is below `x`'s rows (`x.len() / cols`):
    /// the kernel reads `x` at each index unchecked.
    pub unsafe fn gather_rows(
        &self,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        n: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        if out.len() < n * cols || rows.len() < n {
            return Err(shape_error(format!("gather of {n} rows of {cols}: output too small")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), "gather_rows")?;
        let cols_i = to_i32(cols, "cols")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(x).arg(rows).arg(&cols_i);
        // SAFETY: gather_rows(float*, const float*, const int*, int); the
        // indices were checked against x by the caller; out sized above.
        unsafe { b.launch(cfg((to_u32(n, "rows")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `out[t, :] = table[ids[t] - first, :]` from an f32 table `[vocab,
    /// cols]` holding the vocabulary rows `first..first + vocab` (as bytes,
    /// as a [`QuantFormat::F32`] weight holds its values); an id outside
    /// them gives a row of zeros (a vocabulary-parallel shard's other ranks'
    /// tokens).
    pub fn embedding(
        &self,
        out: &mut CudaSlice<f32>,
        table: &CudaSlice<u8>,
        ids: &CudaSlice<i32>,
        first: usize,
        vocab: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        let n = ids.len();
        if out.len() < n * cols || table.len() < vocab * cols * 4 {
            return Err(shape_error(format!("embedding of {n} ids from [{vocab}, {cols}]: buffer too small")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&Variant::new(LAYERS, &[]), "embedding_f32")?;
        let (first_i, vocab_i, cols_i, scale) = (to_i32(first, "first row")?, to_i32(vocab, "vocab")?, to_i32(cols, "cols")?, 1f32);
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(table).arg(ids).arg(&first_i).arg(&vocab_i).arg(&cols_i).arg(&scale);
        // SAFETY: embedding_f32(float*, const void*, const int*, int, int,
        // int, float); the table holds vocab·cols floats (checked); an id
        // outside first..first + vocab reads row 0 and writes zeros; out
        // holds n·cols floats (checked).
        unsafe { b.launch(cfg((to_u32(n, "ids")?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// RMSNorm of `rows` rows of `cols` in place (`x · rsqrt(mean x² + eps)
    /// · (w + offset)`), or fused with the residual add when `residual` is
    /// given (`residual += x; x = norm(residual)`).
    pub fn rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        residual: Option<&mut CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
        offset: f32,
    ) -> Result<(), CudaError> {
        let cols = w.len();
        if x.len() < rows * cols || residual.as_ref().is_some_and(|r| r.len() < rows * cols) {
            return Err(shape_error(format!("rms_norm of {rows} rows of {cols}: buffer too small")));
        }
        if rows == 0 {
            return Ok(());
        }
        let cols_i = to_i32(cols, "cols")?;
        let launch = cfg((to_u32(rows, "rows")?, 1, 1), 256, 0);
        match residual {
            Some(r) => {
                let f = self.function(&Variant::new(LAYERS, &[]), "fused_add_rms_norm")?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(x).arg(r).arg(w).arg(&cols_i).arg(&eps).arg(&offset);
                // SAFETY: matches fused_add_rms_norm(float*, float*, const
                // float*, int, float, float); sizes checked above.
                unsafe { b.launch(launch) }?;
            }
            None => {
                let f = self.function(&Variant::new(LAYERS, &[]), "rms_norm")?;
                // The kernel reads and writes the same row (y == x is allowed).
                let y: &CudaSlice<f32> = x;
                let mut b = self.stream.launch_builder(&f);
                b.arg(y).arg(y).arg(w).arg(&cols_i).arg(&eps).arg(&offset);
                // SAFETY: matches rms_norm(float*, const float*, const float*,
                // int, float, float); in place, each thread reads then writes
                // only its own elements after the block-wide sum.
                unsafe { b.launch(launch) }?;
            }
        }
        Ok(())
    }
}

/// A step's sampling parameters on the device, as `sample_rows` reads
/// them (see [`Kernels::sample_rows`]).
pub struct SampleInputs {
    /// Per row: temperature, top-p, min-p, unused.
    pub fparams: CudaSlice<f32>,
    /// Per row: top-k, top logprobs, penalty start, penalty end, wants the logprob.
    pub iparams: CudaSlice<i32>,
    /// Per row: the draw.
    pub uniform: CudaSlice<f64>,
    /// Penalty entries' tokens (one entry at least, so that the buffer exists).
    pub pen_tokens: CudaSlice<i32>,
    /// Penalty entries' repetition, subtract and bias.
    pub pen_values: CudaSlice<f32>,
    /// Whether any row has penalty entries.
    pub any_penalties: bool,
}

/// Where `sample_rows` writes.
pub struct SampleOutputs {
    /// Per row: the token.
    pub tokens: CudaSlice<i32>,
    /// Per row: its logprob (NaN unless asked).
    pub logprobs: CudaSlice<f32>,
    /// `top_stride` ids a row.
    pub top_ids: CudaSlice<i32>,
    /// `top_stride` logprobs a row.
    pub top_logprobs: CudaSlice<f32>,
    /// Top entries a row has room for (at least 1).
    pub top_stride: usize,
    /// The raw logits of the penalized tokens, one per penalty entry.
    pub pen_raw: CudaSlice<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both tensor-core GEMMs' plan: parts that cover k with none empty,
    /// even (the staged kernel's steps) wherever k/32 is, on the GPUs'
    /// multiprocessor counts, at decode and prefill sizes and the shapes of
    /// the models this repository runs.
    #[test]
    fn mma_plans_cover_k_in_nonempty_parts_even_where_k_blocks_are() {
        for num_sms in [46, 84, 108, 132] {
            for rows in [1, 3, 8, 31, 33, 64, 65, 100, 128, 129, 300, 8192] {
                for n in [8, 77, 576, 1024, 4096, 14336, 128256] {
                    for k in [32, 64, 96, 320, 576, 1536, 4096, 11008, 14336, 18944] {
                        let plan = mma_plan_for(rows, n, k, num_sms);
                        let blocks = k / 32;
                        let what = format!("{rows} x [{n}, {k}] on {num_sms} SMs: {plan:?}");
                        assert!(plan.tile_rows >= rows.min(128) && MMA_TILE_ROWS.contains(&plan.tile_rows), "{what}");
                        assert!(plan.parts * plan.blocks_per_part >= blocks, "{what}: k not covered");
                        assert!((plan.parts - 1) * plan.blocks_per_part < blocks, "{what}: an empty part");
                        assert!(plan.parts <= 16, "{what}");
                        if blocks.is_multiple_of(2) {
                            assert!(plan.blocks_per_part.is_multiple_of(2), "{what}: odd parts for the staged kernel");
                        }
                    }
                }
            }
        }
        // Llama 3 8B's FFN weight at 8 rows on an H100: three parts of 44.
        assert_eq!(mma_plan_for(8, 14336, 4096, 132), MmaPlan { tile_rows: 32, parts: 3, blocks_per_part: 44 });
    }

    #[test]
    fn paged_loads_parse_by_name_and_refuse_the_rest() {
        for loads in PagedLoads::ALL {
            assert_eq!(PagedLoads::parse(loads.name()).ok(), Some(loads));
        }
        assert_eq!(PagedLoads::ALL[0], PagedLoads::default());
        assert!(PagedLoads::default().defines().is_empty(), "the default is the kernel's own");
        assert_eq!(PagedLoads::Plain.defines(), [("V_TILE", 1), ("PA_PREFETCH", 0)]);
        for bad in ["", "Tiled", "tiled,plain", "v1"] {
            let err = PagedLoads::parse(bad).expect_err(bad).to_string();
            assert!(err.contains("VELLUM_PAGED_LOADS") && err.contains("tiled-no-prefetch"), "{bad}: {err}");
        }
    }

    #[test]
    fn gemv_plans_parse_in_range_and_refuse_the_rest_by_name() {
        assert_eq!(GemvPlan::parse("2:2:1").ok(), Some(GemvPlan { columns_per_warp: 2, k_split: 2, magic: true }));
        assert_eq!(GemvPlan::parse(" 4:4:0").ok(), Some(GemvPlan { columns_per_warp: 4, k_split: 4, magic: false }));
        for bad in ["", "2:2", "0:1:0", "5:1:0", "8:1:0", "2:3:1", "2:2:2", "2:2:1:1", "a:b:c", "-1:1:0"] {
            let err = GemvPlan::parse(bad).expect_err(bad).to_string();
            assert!(err.contains("VELLUM_GEMV") && err.contains("columns:k_split:magic"), "{bad}: {err}");
        }
        // The default plan is one the parser accepts, at every row count.
        for rows in 1..=8 {
            let p = GemvPlan::for_rows(rows);
            assert!(p.is_valid(), "{rows} rows: {p:?}");
            let text = format!("{}:{}:{}", p.columns_per_warp, p.k_split, u8::from(p.magic));
            assert_eq!(GemvPlan::parse(&text).ok(), Some(p));
        }
        assert!(!GemvPlan { columns_per_warp: 5, k_split: 1, magic: false }.is_valid());
        assert!(!GemvPlan { columns_per_warp: 2, k_split: 3, magic: false }.is_valid());
    }

    #[test]
    fn flash_tiles_count_the_long_sequences_and_a_graphs_bound_covers_every_batch_of_its_tokens() {
        // Decodes and a 15-token verification stay with the decode kernels;
        // 16 tokens is one tile, 64 one, 65 two, 200 four.
        let lens = QueryLens::of(&[0, 1, 17, 32, 96, 161, 361, 362]);
        assert_eq!(lens, QueryLens { min: 1, max: 200, flash_tiles: 1 + 1 + 2 + 4 });
        assert_eq!(QueryLens::of(&[0, 1, 2, 3]), QueryLens { min: 1, max: 1, flash_tiles: 0 });
        assert_eq!(QueryLens::of(&[0]), QueryLens { min: 0, max: 0, flash_tiles: 0 });
        assert_eq!(QueryLens::decode().flash_tiles, 0);
        // Every split of T tokens into sequences gives at most the bound's
        // tiles (random splits, and the worst: sequences of 16 or 65).
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for t in 1..=1200usize {
            for _ in 0..4 {
                let (mut qsl, mut at) = (vec![0i32], 0usize);
                while at < t {
                    s ^= s >> 12;
                    s ^= s << 25;
                    s ^= s >> 27;
                    let len = (1 + (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % 140).min(t - at);
                    at += len;
                    qsl.push(at as i32);
                }
                assert!(QueryLens::of(&qsl).flash_tiles <= QueryLens::any(t).flash_tiles, "{t} tokens: {qsl:?}");
            }
            for piece in [16usize, 65] {
                let qsl: Vec<i32> = (0..=t / piece).map(|i| (i * piece) as i32).collect();
                assert!(QueryLens::of(&qsl).flash_tiles <= flash_tiles_bound(t), "{t} tokens in pieces of {piece}");
            }
        }
        assert_eq!(QueryLens::any(512), QueryLens { min: 1, max: 512, flash_tiles: 8 + 32 });
    }

    #[test]
    fn flash_prefill_takes_head_sizes_64_128_256_with_the_shared_memory_the_kernel_lays_out() {
        assert_eq!((flash_keys_per_tile(64), flash_keys_per_tile(128), flash_keys_per_tile(256)), (64, 64, 32));
        // Q [64] + K, V [2][BN] rows of head_dim + 8 bf16.
        assert_eq!(flash_smem_bytes(128), (64 + 4 * 64) * 136 * 2);
        assert_eq!(flash_smem_bytes(256), (64 + 4 * 32) * 264 * 2);
        // Within a consumer GPU's 99 KiB opt-in (and an A100's and H100's).
        assert!([64, 128, 256].iter().all(|&d| flash_smem_bytes(d) <= 101_376), "{}", flash_smem_bytes(256));
        let v = flash_variant(256, 16);
        assert_eq!(v.label(), "flash_attention.cu HEAD_DIM=256 BLOCK_SIZE=16 FLASH_BN=32");
    }
}
