//! [`CudaOps`]: the model operations and the paged-attention contract on an
//! NVIDIA GPU, so that `vellum_models::ModelRunner<CudaOps>` (`vellum_engine::CudaExecutor`) is the CUDA
//! backend's `ModelExecutor` — the same model code as the CPU and wgpu
//! backends, on the kernels of `kernels/cuda/`.
//!
//! What runs where:
//! - **Linears** (`--dtype`, [`CudaPrecision`]): Q8_0, Q4_0, Q4_1, Q4_K,
//!   Q5_K and Q6_K kept as their own values in planes of codes and scales
//!   ([`crate::layout`]);
//!   with bf16 products (the default) the f32 GEMV up to
//!   [`GEMV_MAX_ROWS`] rows, then cuBLAS over the bf16 copy a weight keeps
//!   ([`WeightCopies`]: by default while the copies fit in a quarter of the
//!   GPU); a weight without one takes the tensor-core GEMM of `gemm_mma.cu`
//!   (bf16 activations, the weight dequantized as it is staged) to
//!   [`CUBLAS_MIN_ROWS`], cuBLAS over a copy made for the product beyond;
//!   bf16 weights as stored, and every type without a native layout
//!   rounded to bf16 once, through cuBLAS at every size. With f32 products
//!   (`--dtype float32`) the GEMV up to 8 rows and the CUDA-core GEMM
//!   beyond, every other type widened to f32 (docs/cuda_kernels.md).
//! - **Embeddings** are dequantized to an f32 table; a tied LM head reads it
//!   as an F32 weight (the GEMV, or `gemm_mma` rounding it to bf16 as it
//!   stages it).
//! - **Attention**: `reshape_and_cache` through each KV-cache group's slot
//!   mapping, then paged attention v1/v2 over the group's block tables.
//! - **KV memory** (thesis §4.2.1): with `--gpu-memory-utilization f`
//!   (the default on this device, 0.9 as in vLLM) a profile run of the step
//!   budget measures the activations' peak in the allocator's pool, and the
//!   cache gets `f` of the GPU less what is in use and that peak; with
//!   `--kv-cache-memory` a share of the free memory less a fixed reserve
//!   ([`ACTIVATION_RESERVE`]), or a size.
//! - **Swap**: block by block between the device pools and host vectors on
//!   the compute stream (a pinned, side-stream copy is left to do).
//!
//! Every op checks shapes and indices on the host first and returns a
//! typed [`vellum_base::Error`]; nothing here panics on a bad batch.
//!
//! Status: compiled in CI; run where a GPU is lent (`tests/gpu.rs`, and
//! the golden prompts through `--device cuda` in `tests/golden.rs`).

use crate::blas::{Blas, Half};
use crate::graphs::{Action, Bound, CaptureSizes, GraphCache, GraphKey, HostInputs, Limits, PaddedStep};
use crate::launch::{
    AttentionParams, DeviceAttentionMetadata, Elementwise, GemvFusion, GemvInput, GemvOutput, Kernels, KvPool, PoolDtype, QuantMatrix,
    QueryLens, SampleInputs, SampleOutputs, FLASH_MIN_QUERIES,
};
use crate::layout::{f32_layout, repack, QuantFormat, Repacked};
use crate::nccl::NcclGroup;
use crate::CudaError;
use cudarc::driver::{CudaGraph, CudaSlice, PinnedHostSlice};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use vellum_base::{
    AttentionBackend, AttentionRequirements, AttentionShape, BlockCopy, BlockSwap, Capabilities, CudaGraphMode, DeviceMemory, DeviceSample,
    Error, ForwardBatch, KvAbsmax, KvCacheDtype, KvCacheSpec, KvMemory, KvScale, PenaltyEntry, RowSampling, Sizes, StepBounds,
    WeightCopies,
};
use vellum_ops::quant::GgmlType;
use vellum_ops::rope::RopeTable;
use vellum_ops::WeightView;
use vellum_ops::{ActivationDtype, HostIo, Norm, OpResult, Ops};

/// Device memory kept free for activations and kernel workspaces when the
/// KV cache is sized: a tenth of the GPU.
pub const ACTIVATION_RESERVE: f64 = 0.1;

fn backend(e: CudaError) -> Error {
    Error::Backend(e.to_string())
}

fn check(cond: bool, what: impl FnOnce() -> String) -> OpResult<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::Backend(what()))
    }
}

/// Activations `[rows, cols]`, f32, on the device.
pub struct CudaTensor {
    /// Rows (tokens).
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    buf: CudaSlice<f32>,
}

/// A linear or embedding weight `[out, inp]`.
pub struct CudaWeight {
    m: Stored,
    /// A layout's values rounded to bf16 once, row-major `[n, k]`, for
    /// cuBLAS ([`WeightCopies`]); `None`: none kept.
    bf16_copy: Option<CudaSlice<u16>>,
}

/// The bytes the weights' bf16 copies ([`WeightCopies`]) may take on a GPU
/// of `total` bytes (under `Auto` a copy must also leave half the GPU free:
/// `CudaOps::bf16_copy`). With a copy, a product of more than
/// [`GEMV_MAX_ROWS`] rows is cuBLAS over it; without, the tensor-core GEMM,
/// or from [`CUBLAS_MIN_ROWS`] cuBLAS over a copy dequantized for that
/// product alone. On an H100 (`gemm_bench`, Llama 3 8B's Q8_0 weights,
/// `benchmarks/results/2026-11-27-h100-gemm.jsonl`) cuBLAS over a kept copy
/// took 0.39–0.61× the time of that path on the two FFN weights from 4 to
/// 256 rows (14336 × 4096: 0.050 against 0.099 ms at 64 rows, 0.061
/// against 0.148 at 256), 0.32–1.05× on the 4096 × 4096 one; the GEMV
/// stays the faster at 1–2 rows, reading the quantized weight. The copies
/// cost two bytes a weight (15 GB for Llama 3 8B).
fn copies_budget(copies: WeightCopies, total: u64) -> u64 {
    match copies {
        WeightCopies::Auto => total / 4,
        WeightCopies::All => u64::MAX,
        WeightCopies::None => 0,
    }
}

/// How a weight sits on the device.
enum Stored {
    /// A layout of [`crate::layout`] (Q8, Q4, F32), read by the kernels of
    /// `gemv_q.cu` and `gemm_mma.cu`.
    Blocks(QuantMatrix),
    /// f16/bf16 values as the file stores them, row-major `[n, k]`, for
    /// cuBLAS on tensor cores.
    Half { data: CudaSlice<u16>, dtype: Half, n: usize, k: usize },
}

impl CudaWeight {
    /// Output features.
    fn n(&self) -> usize {
        match &self.m {
            Stored::Blocks(q) => q.n,
            Stored::Half { n, .. } => *n,
        }
    }

    /// Input features.
    fn k(&self) -> usize {
        match &self.m {
            Stored::Blocks(q) => q.k,
            Stored::Half { k, .. } => *k,
        }
    }
}

/// A 1-D parameter (norm weight, bias).
pub struct CudaVector {
    data: CudaSlice<f32>,
}

/// The RoPE table `[positions, head_dim]`: for each position the cosines of
/// the `head_dim / 2` pairs, then their sines, computed on the host in f64.
pub struct CudaRope {
    head_dim: usize,
    positions: usize,
    table: CudaSlice<f32>,
}

/// One KV-cache group's slot mapping and attention metadata.
struct GroupStep {
    slots: CudaSlice<i64>,
    meta: DeviceAttentionMetadata,
}

/// A step's inputs on the device.
struct StepInputs {
    ids: CudaSlice<i32>,
    positions: CudaSlice<i64>,
    logits: CudaSlice<i32>,
    groups: Vec<GroupStep>,
}

/// One step's inputs on the device, uploaded once in `prepare_step`: its
/// own buffers, or, for a step of a [`GraphKey`], the key's persistent
/// buffers with the step padded to the key's shape.
pub struct CudaStep {
    inputs: Arc<StepInputs>,
    tokens: usize,
    logits_rows: usize,
    /// The logits rows the batch asked for (fewer than `logits_rows` when
    /// padded).
    rows_out: usize,
    block_size: usize,
    bounds: StepBounds,
    graph: Option<GraphKey>,
}

/// How a backend instance uses CUDA graphs (`--enforce-eager`,
/// `--cuda-graph-sizes`, `--compilation-config`'s `cudagraph_mode`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphOptions {
    /// Which steps are replayed as graphs ([`CudaGraphMode::None`]: every op is
    /// launched, vLLM's `--enforce-eager`).
    pub mode: CudaGraphMode,
    /// The token counts steps are padded to and recorded at.
    pub capture_sizes: CaptureSizes,
}

/// A recorded step: the graph, the buffer its logits land in (an index
/// into `Graphs::outputs`), and the limits its ops checked.
struct Recorded {
    graph: SendGraph,
    output: usize,
    cols: usize,
    limits: Limits,
}

/// [`CudaGraph`] moved between threads.
struct SendGraph(CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as no two
// threads use it at once; it lives in `CudaOps::graphs`, whose mutex is
// held for every use (recording, replay, drop on clear).
unsafe impl Send for SendGraph {}

impl Graphs {
    /// Forgets every recorded graph, the inputs and the warm-ups.
    fn clear(&mut self) {
        self.cache.clear();
        self.inputs.clear();
        self.shapes.clear();
        self.outputs.clear();
    }

    /// Device bytes of the keys' persistent inputs and the shared outputs
    /// (beside the graphs' own memory, which the driver reports).
    fn buffer_bytes(&self) -> u64 {
        let inputs: usize = self.inputs.values().map(|i| i.bytes()).sum();
        let outputs: usize = self.outputs.iter().map(|o| o.len() * 4).sum();
        (inputs + outputs) as u64
    }
}

impl StepInputs {
    /// Device bytes of these buffers.
    fn bytes(&self) -> usize {
        let groups: usize = self
            .groups
            .iter()
            .map(|g| {
                let m = &g.meta;
                g.slots.len() * 8 + (m.block_tables.len() + m.token_seq.len() + m.query_start_loc.len() + m.context_lens.len()) * 4
            })
            .sum();
        self.ids.len() * 4 + self.positions.len() * 8 + self.logits.len() * 4 + groups
    }
}

/// Why a step was not recorded.
enum RecordError {
    /// The step's own ops failed (a bad input, out of memory): the eager
    /// run says which.
    Step(Error),
    /// The capture, instantiation or upload failed: the shape runs eagerly.
    Capture(String),
}

/// Ends a stream's capture if it is still capturing when dropped (a failed
/// or panicking recording), so that later work on the stream runs.
struct CaptureGuard<'a> {
    stream: &'a Arc<cudarc::driver::CudaStream>,
}

impl Drop for CaptureGuard<'_> {
    fn drop(&mut self) {
        use cudarc::driver::sys;
        // Errors cudarc stored would stop the status query before it runs.
        let _ = self.stream.context().check_err();
        if matches!(self.stream.capture_status(), Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)) {
            return;
        }
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is this instance's own, capturing (checked
        // above); the graph the driver returns, if any, is destroyed here
        // and used nowhere else.
        unsafe {
            let _ = sys::cuStreamEndCapture(self.stream.cu_stream(), &mut graph);
            if !graph.is_null() {
                let _ = sys::cuGraphDestroy(graph);
            }
        }
    }
}

/// The graph state of one backend instance.
struct Graphs {
    options: GraphOptions,
    cache: GraphCache<Recorded>,
    /// Each key's persistent inputs (from its first step on).
    inputs: HashMap<GraphKey, Arc<StepInputs>>,
    /// Each key's logits shape, from its eager warm-up.
    shapes: HashMap<GraphKey, (usize, usize)>,
    /// The buffers recorded steps leave their logits in, shared: a replay
    /// and the copy of its rows out run in order on the one stream, under
    /// the `graphs` lock, so the next replay cannot overwrite rows not yet
    /// copied. Decode sizes are recorded largest first, so one buffer
    /// usually serves every key.
    outputs: Vec<CudaSlice<f32>>,
    /// Milliseconds spent recording, over every key.
    record_ms: f64,
}

/// The paged KV cache: a K and a V pool per layer slot on the device and
/// the host swap pools with the same per-block layout.
pub struct CudaKvCache {
    spec: KvCacheSpec,
    num_blocks: usize,
    pools: Vec<KvPool>,
    host: Vec<[Vec<u8>; 2]>,
    num_host_blocks: usize,
    /// Each layer's scales ([`KvScale::ONE`] unless the dtype is scaled).
    scales: Vec<KvScale>,
}

impl CudaKvCache {
    /// Layer `layer`'s scales: it stores `x / scale`.
    pub fn scale(&self, layer: usize) -> KvScale {
        self.scales.get(layer).copied().unwrap_or(KvScale::ONE)
    }
}

/// What the CUDA backend multiplies in (`--dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaPrecision {
    /// Tensor cores: activations rounded to bf16 before a product, weights
    /// dequantized to bf16 as they are staged (bf16 files multiplied as
    /// stored), f32 accumulation; decode batches of up to
    /// [`GEMV_MAX_ROWS`] rows stay in f32 arithmetic (the GEMV, bound by
    /// memory). The default.
    #[default]
    Bf16,
    /// f32 arithmetic throughout on CUDA cores: the reference path (the
    /// golden prompts within 0.02 nats of float64).
    Float32,
}

/// The largest batch a quantized weight's product takes through the f32
/// GEMV with bf16 products; larger ones go to the tensor cores.
///
/// Measured on an H100 (`gemm_bench --gemv-plans`, Llama 3 8B's Q8_0
/// shapes and a Q4_1 one, docs/benchmarks.md): with the plan
/// `GemvPlan::for_rows` picks, the GEMV reads every weight faster than the
/// tensor-core GEMM at 2 rows (1.65 against 1.00 TB/s on the 14336 × 4096
/// Q8_0 weight) and slower at 4 (0.89 against 1.00). (With four columns a
/// warp it led up to 4 rows: see `GemvPlan::for_rows`.)
pub const GEMV_MAX_ROWS: usize = 2;

/// Batches of at least this many rows multiply quantized weights through
/// cuBLAS on a bf16 copy of the weight (dequantized into a scratch each
/// call), fewer through `gemm_mma.cu` (which dequantizes as it stages).
///
/// Measured as [`GEMV_MAX_ROWS`]: below 128 rows the step is bound by the
/// weight's bytes and reading them once (1.06 bytes a Q8_0 weight) wins;
/// at 128 rows the two tie, and past them cuBLAS's GEMM (650 TFLOP/s at
/// 8,192 rows against 160 for ours) more than pays for the copy.
pub const CUBLAS_MIN_ROWS: usize = 128;

/// The model operations on one NVIDIA GPU.
pub struct CudaOps {
    k: Kernels,
    precision: CudaPrecision,
    /// cuBLAS, when it loads: f16/bf16 weights then stay 16-bit and their
    /// products run on tensor cores; without it they are widened to f32.
    blas: Option<Blas>,
    /// Page-locked staging for copies to the host (a step's logits: 50 MB
    /// for 256 rows of a 49k vocabulary), so that they run at the link's
    /// speed; grown as needed.
    staging: Mutex<Option<PinnedHostSlice<f32>>>,
    /// Host buffers handed back once sampled, reused so that a step's
    /// logits land in memory that is already mapped.
    spare: Mutex<Vec<Vec<f32>>>,
    /// The tensor-parallel group this instance is rank `.1` of (`None`: a
    /// group of one).
    group: Option<(Arc<NcclGroup>, usize)>,
    /// Steps recorded as CUDA graphs ([`crate::graphs`]).
    graphs: Mutex<Graphs>,
    /// While a step is recorded: the limits its ops check indices against.
    recording: Mutex<Option<Limits>>,
    /// Set during a calibration pass ([`Ops::set_calibrating`]): `write_kv`
    /// records each layer's largest |key| and |value| in `kv_absmax`, from
    /// which FP8 caches allocated afterwards take their scales.
    calibrating: std::sync::atomic::AtomicBool,
    kv_absmax: KvAbsmax,
    /// The bytes the weights' bf16 copies may take ([`WeightCopies`]), and
    /// the bytes they take; under `Auto`, also the device memory that must
    /// stay free after a copy.
    copies_budget: u64,
    copies_keep_free: u64,
    copies_bytes: std::sync::atomic::AtomicU64,
    /// Layers whose keys and values the q/k/v split wrote into the cache
    /// itself ([`Ops::attention_stacked`]), counted for the tests.
    split_kv_writes: std::sync::atomic::AtomicU64,
    /// Whether the GEMV fuses the norm before it, the gated activation
    /// before it and the residual add after it (`Ops::norm_linear`,
    /// `Ops::linear_add`); `VELLUM_FUSED_GEMV=0` turns it off.
    fused_gemv: bool,
    /// The fewest rows a product takes a weight's bf16 copy for
    /// (`VELLUM_COPIES_FROM_ROWS`, for comparisons: fewer rows then take
    /// the tensor-core GEMM on the quantized blocks); by default every
    /// product past the GEMV's rows.
    copies_from_rows: usize,
}

/// `m` locked, whether or not a thread panicked holding it (what it guards
/// stays consistent: every update is a single assignment or insert).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for CudaOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaOps").field("device", &self.k.info().name).finish()
    }
}

impl CudaOps {
    /// Operations on GPU `ordinal` with the default precision
    /// ([`CudaPrecision::Bf16`]): a typed error (never a panic) without a
    /// driver, a GPU or NVRTC.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Self::with_precision(ordinal, CudaPrecision::default())
    }

    /// Operations on GPU `ordinal` multiplying in `precision`.
    pub fn with_precision(ordinal: usize, precision: CudaPrecision) -> Result<Self, CudaError> {
        // The float32 path attends prompts with the decode kernels too (f32
        // products), not flash prefill's 16-bit ones.
        let k = Kernels::open(ordinal)?;
        let k = if precision == CudaPrecision::Float32 { k.without_flash_attention() } else { k };
        if !crate::nvrtc::is_available() {
            return Err(CudaError::NoNvrtc);
        }
        let blas = match Blas::new(k.stream().clone()) {
            Ok(blas) => Some(blas),
            Err(e) => {
                tracing::warn!("{e}");
                None
            }
        };
        let total_memory = k.info().total_memory as u64;
        let graphs = Graphs {
            options: GraphOptions::default(),
            cache: GraphCache::default(),
            inputs: HashMap::new(),
            shapes: HashMap::new(),
            outputs: Vec::new(),
            record_ms: 0.0,
        };
        Ok(Self {
            k,
            precision,
            blas,
            staging: Mutex::new(None),
            spare: Mutex::new(Vec::new()),
            group: None,
            graphs: Mutex::new(graphs),
            recording: Mutex::new(None),
            calibrating: Default::default(),
            kv_absmax: KvAbsmax::default(),
            copies_budget: copies_budget(WeightCopies::default(), total_memory),
            copies_keep_free: total_memory / 2,
            copies_bytes: Default::default(),
            split_kv_writes: Default::default(),
            fused_gemv: std::env::var("VELLUM_FUSED_GEMV").map_or(true, |v| v != "0"),
            copies_from_rows: std::env::var("VELLUM_COPIES_FROM_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
        })
    }

    /// Sets which quantized linear weights keep a bf16 copy
    /// ([`WeightCopies`]; `Auto` by default). Weights loaded after this
    /// call follow it.
    pub fn with_weight_copies(mut self, copies: WeightCopies) -> Self {
        let total = self.k.info().total_memory as u64;
        self.copies_budget = copies_budget(copies, total);
        self.copies_keep_free = if copies == WeightCopies::Auto { total / 2 } else { 0 };
        self
    }

    /// The bytes the weights' bf16 copies take on the device.
    pub fn weight_copies_bytes(&self) -> u64 {
        self.copies_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many times the q/k/v split wrote a layer's keys and values into
    /// the cache itself (the fused path of [`Ops::attention_stacked`]).
    pub fn split_kv_writes(&self) -> u64 {
        self.split_kv_writes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets which steps use CUDA graphs (uniform decode steps up to 512
    /// rows by default). Graphs recorded so far are dropped.
    pub fn with_graphs(self, options: GraphOptions) -> Self {
        {
            let mut g = lock(&self.graphs);
            g.options = options;
            g.clear();
        }
        self
    }

    /// The steps recorded so far (each graph's key, by rows), and the
    /// milliseconds spent recording them.
    pub fn recorded_graphs(&self) -> (Vec<GraphKey>, f64) {
        let g = lock(&self.graphs);
        let mut keys: Vec<GraphKey> = g.cache.recorded_graphs().map(|(k, _)| *k).collect();
        keys.sort_unstable_by_key(|k| (k.mixed, k.rows, k.logits_rows, k.context_bucket, k.groups, k.block_size));
        (keys, g.record_ms)
    }

    /// The device memory CUDA graphs hold (their recorded allocations), in
    /// bytes: what the driver reports as in use now and at its peak.
    pub fn graph_memory(&self) -> (u64, u64) {
        use cudarc::driver::sys::{cuDeviceGetGraphMemAttribute, CUgraphMem_attribute};
        let read = |attr| {
            let mut v: u64 = 0;
            // SAFETY: the attribute is a 64-bit value written into `v`; the
            // device handle is this context's.
            let r = unsafe { cuDeviceGetGraphMemAttribute(self.k.context().cu_device(), attr, (&mut v as *mut u64).cast()) };
            if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                v
            } else {
                0
            }
        };
        (read(CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), read(CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH))
    }

    /// Whether steps are recorded: asked for, on an instance that is
    /// no rank of a tensor-parallel group, on a device whose allocations
    /// are stream-ordered (a recording allocates and frees inside the
    /// graph; a synchronous free would end it).
    fn graphs_on(&self, g: &Graphs) -> bool {
        g.options.mode != CudaGraphMode::None && self.group.is_none() && self.k.context().has_async_alloc()
    }

    /// Drops every recorded graph and its inputs, and hands the memory the
    /// graphs held back to the device (`cuDeviceGraphMemTrim`), so that the
    /// free memory the KV cache is sized from does not count it.
    fn drop_graphs(&self) {
        lock(&self.graphs).clear();
        // The graphs were launched on this stream: none may still run when
        // their memory goes.
        if self.k.stream().synchronize().is_ok() {
            // SAFETY: the device handle is this context's; the call frees
            // only graph memory no live graph holds (all were dropped above).
            let r = unsafe { cudarc::driver::sys::cuDeviceGraphMemTrim(self.k.context().cu_device()) };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                tracing::debug!("cuDeviceGraphMemTrim: {r:?}");
            }
        }
    }

    /// [`StepBounds::check_below`], noting the limit while a step is
    /// recorded (a replay is then checked against it).
    fn check_bound(&self, bound: Bound, max: Option<u32>, limit: usize, what: &str, table: &str) -> OpResult<()> {
        if let Some(limits) = lock(&self.recording).as_mut() {
            limits.note(bound, limit);
        }
        StepBounds::check_below(max, limit, what, table)
    }

    /// Where `op` writes layer `layer`'s keys and values of `step`: the
    /// layer's pool slot and the step's group, after checking the block
    /// size, every slot against the pool (negative ones write nothing) and
    /// the layer.
    fn kv_write_target<'s>(
        &self,
        op: &str,
        cache: &CudaKvCache,
        layer: usize,
        step: &'s CudaStep,
    ) -> OpResult<(vellum_base::KvLayerSlot, &'s GroupStep)> {
        let spec = &cache.spec;
        check(step.block_size == spec.block_size, || format!("{op}: the step's block size differs from the cache's"))?;
        self.check_bound(
            Bound::Slot,
            step.bounds.max_slot,
            cache.num_blocks * spec.block_size,
            &format!("{op}: slot"),
            "the pool's slots",
        )?;
        check(layer < spec.groups.num_layers(), || format!("{op}: no layer {layer}"))?;
        let at = spec.groups.slot(layer);
        let g =
            step.inputs.groups.get(at.group).ok_or_else(|| Error::Backend(format!("{op}: the step has no KV-cache group {}", at.group)))?;
        Ok((at, g))
    }

    /// RoPE's arguments for `step` (table, positions, head size), after
    /// checking every position against the table.
    fn rotation<'s>(&self, rope: &'s CudaRope, step: &'s CudaStep) -> OpResult<(&'s CudaSlice<f32>, &'s CudaSlice<i64>, usize)> {
        self.check_bound(Bound::Position, step.bounds.max_position, rope.positions, "rope: position", "the table")?;
        Ok((&rope.table, &step.inputs.positions, rope.head_dim))
    }

    /// `out` with only its first `rows` rows (a padded step's real ones).
    fn first_rows(&self, out: CudaTensor, rows: usize) -> OpResult<CudaTensor> {
        if out.rows == rows {
            return Ok(out);
        }
        self.copy_rows(&out.buf, rows, out.cols)
    }

    /// A new `[rows, cols]` tensor holding the first rows of `src`.
    fn copy_rows(&self, src: &CudaSlice<f32>, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        let mut t = self.tensor(rows, cols)?;
        if rows * cols > 0 {
            self.k.stream().memcpy_dtod(&src.slice(..rows * cols), &mut t.buf).map_err(|e| backend(e.into()))?;
        }
        Ok(t)
    }

    /// A step of `key` padded into the key's persistent inputs; `None` when
    /// those are in use (an earlier step still holds them), so that the
    /// step runs on its own buffers.
    fn prepare_graph_step(&self, batch: &ForwardBatch, key: GraphKey, bounds: &StepBounds) -> OpResult<Option<CudaStep>> {
        let mut graphs = lock(&self.graphs);
        if graphs.cache.gave_up(&key) {
            // Eager for good: the step runs as it is, unpadded.
            return Ok(None);
        }
        let PaddedStep { inputs: host, bounds } = match PaddedStep::new(batch, &key, bounds) {
            Ok(padded) => padded,
            Err(why) => {
                tracing::debug!(?key, "a step not padded to its graph's shape runs eagerly: {why}");
                return Ok(None);
            }
        };
        let step = |inputs| CudaStep {
            inputs,
            tokens: key.rows,
            logits_rows: key.logits_rows,
            rows_out: batch.logits_indices.len(),
            block_size: key.block_size,
            bounds,
            graph: Some(key),
        };
        if graphs.cache.peek(&key) == Action::Eager && !graphs.inputs.contains_key(&key) {
            // A warm-up: the padded shape on buffers of its own; a key keeps
            // persistent inputs only once it is to be recorded.
            return Ok(Some(step(Arc::new(self.upload_inputs(
                &host,
                key.table_stride(),
                key.rows,
                key.context_bucket,
                key_query_lens(&key),
            )?))));
        }
        let inputs = match graphs.inputs.entry(key) {
            std::collections::hash_map::Entry::Vacant(slot) => slot
                .insert(Arc::new(self.upload_inputs(&host, key.table_stride(), key.rows, key.context_bucket, key_query_lens(&key))?))
                .clone(),
            std::collections::hash_map::Entry::Occupied(mut slot) => {
                let Some(inputs) = Arc::get_mut(slot.get_mut()) else {
                    return Ok(None);
                };
                let stream = self.k.stream();
                let driver = |e: cudarc::driver::DriverError| backend(e.into());
                stream.memcpy_htod(&host.ids, &mut inputs.ids).map_err(driver)?;
                stream.memcpy_htod(&host.positions, &mut inputs.positions).map_err(driver)?;
                if key.mixed {
                    // A decode key's logits rows, token sequences and query
                    // starts are the identity at every step; a mixed key's
                    // are the step's own.
                    stream.memcpy_htod(&host.logits, &mut inputs.logits).map_err(driver)?;
                }
                for ((group, slots), tables) in inputs.groups.iter_mut().zip(&host.slots).zip(&host.block_tables) {
                    stream.memcpy_htod(slots, &mut group.slots).map_err(driver)?;
                    stream.memcpy_htod(tables, &mut group.meta.block_tables).map_err(driver)?;
                    stream.memcpy_htod(&host.context_lens, &mut group.meta.context_lens).map_err(driver)?;
                    if key.mixed {
                        stream.memcpy_htod(&host.token_seq, &mut group.meta.token_seq).map_err(driver)?;
                        stream.memcpy_htod(&host.query_start_loc, &mut group.meta.query_start_loc).map_err(driver)?;
                    }
                }
                slot.get().clone()
            }
        };
        Ok(Some(step(inputs)))
    }

    /// `host` on the device: block tables of `stride` entries a sequence,
    /// `num_tokens` tokens, contexts up to `max_context` (which sizes the
    /// attention kernels' shared memory and partitions), sequences of
    /// `query_lens` (which picks them).
    fn upload_inputs(
        &self,
        host: &HostInputs,
        stride: usize,
        num_tokens: usize,
        max_context: usize,
        query_lens: QueryLens,
    ) -> OpResult<StepInputs> {
        let mut groups = Vec::with_capacity(host.slots.len());
        for (slots, tables) in host.slots.iter().zip(&host.block_tables) {
            groups.push(GroupStep {
                slots: self.htod(slots)?,
                meta: DeviceAttentionMetadata {
                    block_tables: self.htod(tables)?,
                    max_blocks_per_seq: stride.max(1),
                    token_seq: self.htod(&host.token_seq)?,
                    query_start_loc: self.htod(&host.query_start_loc)?,
                    context_lens: self.htod(&host.context_lens)?,
                    num_tokens,
                    max_context,
                    query_lens,
                },
            });
        }
        Ok(StepInputs { ids: self.htod(&host.ids)?, positions: self.htod(&host.positions)?, logits: self.htod(&host.logits)?, groups })
    }

    /// Records `forward` for `key` as a graph, uploads it (its memory is
    /// taken now, not at its first replay) and stores it. The capture is
    /// ended on every path, a panic in `forward` included
    /// ([`CaptureGuard`]).
    fn record(&self, graphs: &mut Graphs, key: GraphKey, forward: &mut dyn FnMut() -> OpResult<CudaTensor>) -> Result<(), RecordError> {
        let (rows, cols) = *graphs.shapes.get(&key).ok_or_else(|| RecordError::Capture("no warm-up step of this shape".into()))?;
        let started = std::time::Instant::now();
        // The smallest shared buffer that holds these logits, else a new one
        // (given back if the recording fails).
        let fits = graphs.outputs.iter().enumerate().filter(|(_, o)| o.len() >= rows * cols).min_by_key(|(_, o)| o.len()).map(|(i, _)| i);
        let output_at = match fits {
            Some(i) => i,
            None => {
                graphs.outputs.push(self.zeros::<f32>(rows * cols).map_err(|e| RecordError::Capture(e.to_string()))?);
                graphs.outputs.len() - 1
            }
        };
        let recorded = self.record_into(graphs, key, forward, (rows, cols), output_at, started);
        if recorded.is_err() && fits.is_none() {
            graphs.outputs.pop();
        }
        recorded
    }

    /// [`record`](Self::record)'s capture, its logits copied into the
    /// shared output buffer `output_at`.
    fn record_into(
        &self,
        graphs: &mut Graphs,
        key: GraphKey,
        forward: &mut dyn FnMut() -> OpResult<CudaTensor>,
        (rows, cols): (usize, usize),
        output_at: usize,
        started: std::time::Instant,
    ) -> Result<(), RecordError> {
        let capture = |e: cudarc::driver::DriverError| RecordError::Capture(e.to_string());
        let stream = self.k.stream().clone();
        stream.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(capture)?;
        let guard = CaptureGuard { stream: &stream };
        *lock(&self.recording) = Some(Limits::default());
        let copied = match forward() {
            Ok(out) if (out.rows, out.cols) == (rows, cols) => stream
                .memcpy_dtod(&out.buf, &mut graphs.outputs[output_at].slice_mut(..rows * cols))
                .map_err(|e| RecordError::Capture(e.to_string())),
            Ok(out) => Err(RecordError::Capture(format!("[{}, {}] logits recorded for [{rows}, {cols}]", out.rows, out.cols))),
            Err(e) => Err(RecordError::Step(e)),
        };
        // Every intermediate, the step's logits included, was freed inside
        // the capture: the graph allocates and frees its own memory. An
        // error cudarc stored meanwhile (a free on an invalidated capture)
        // would make end_capture return before ending it: take it first.
        let stored = self.k.context().check_err();
        let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        drop(guard);
        let limits = lock(&self.recording).take().unwrap_or_default();
        copied?;
        stored.map_err(capture)?;
        let graph = graph.map_err(capture)?.ok_or_else(|| RecordError::Capture("the capture recorded nothing".into()))?;
        graph.upload().map_err(capture)?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        graphs.record_ms += ms;
        let memory = self.graph_memory().0 + graphs.buffer_bytes();
        tracing::info!(
            rows = key.rows,
            logits_rows = key.logits_rows,
            mixed = key.mixed,
            context_bound = key.context_bucket,
            ms = format!("{ms:.1}"),
            graph_memory_mib = memory >> 20,
            "recorded a step as a CUDA graph"
        );
        graphs.cache.recorded(key, Recorded { graph: SendGraph(graph), output: output_at, cols, limits });
        Ok(())
    }

    /// The ranks of a tensor-parallel group of `size`, one per GPU (ordinals
    /// `0..size`), multiplying in `precision`, whose [`Ops::all_reduce`]
    /// sums over one NCCL communicator per GPU (`vellum-models`'
    /// `ModelRunner::load_tensor_parallel` runs a rank per thread). Typed
    /// errors for fewer GPUs than `size` and for a missing NCCL. A group of
    /// one is an NCCL single-rank communicator (the collective path, run
    /// on one GPU); without a group, [`CudaOps::with_precision`] needs no
    /// NCCL.
    pub fn tensor_parallel_group(size: usize, precision: CudaPrecision) -> Result<Vec<Self>, CudaError> {
        if !crate::device::driver_is_present() {
            return Err(CudaError::NoDriver);
        }
        let present = cudarc::driver::CudaContext::device_count()?.max(0) as usize;
        if present < size {
            return Err(CudaError::TooFewGpus { wanted: size, present });
        }
        let mut ranks = (0..size).map(|ordinal| Self::with_precision(ordinal, precision)).collect::<Result<Vec<_>, _>>()?;
        let group = Arc::new(NcclGroup::new(ranks.iter().map(|r| r.k.stream().clone()).collect())?);
        for (rank, ops) in ranks.iter_mut().enumerate() {
            ops.group = Some((group.clone(), rank));
        }
        Ok(ranks)
    }

    /// The kernels (for tests and benchmarks).
    pub fn kernels(&self) -> &Kernels {
        &self.k
    }

    /// A `[rows, cols]` tensor holding `data` (row-major).
    pub fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> OpResult<CudaTensor> {
        check(data.len() == rows * cols, || format!("upload: {} values for [{rows}, {cols}]", data.len()))?;
        let buf = if data.is_empty() { self.zeros(1)? } else { self.k.stream().clone_htod(data).map_err(|e| backend(e.into()))? };
        Ok(CudaTensor { rows, cols, buf })
    }

    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> OpResult<CudaSlice<T>> {
        // A zero-byte allocation is an error for the driver: keep one element.
        self.k.stream().alloc_zeros::<T>(n.max(1)).map_err(|e| backend(e.into()))
    }

    fn htod<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, data: &[T]) -> OpResult<CudaSlice<T>> {
        if data.is_empty() {
            return self.zeros(1);
        }
        self.k.stream().clone_htod(data).map_err(|e| backend(e.into()))
    }

    /// An op's output, left uninitialized (no memset launch): every caller
    /// hands it to a kernel that writes all `rows · cols` elements before
    /// anything reads them.
    fn tensor(&self, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        // SAFETY: the memory is uninitialized device memory of the right
        // length (one element when empty: the driver refuses zero bytes);
        // the callers (embedding, GEMV/GEMM, RMSNorm, gated activations,
        // logits-row gather, paged attention) each launch a kernel that
        // writes every element on this stream before any read.
        let buf = unsafe { self.k.stream().alloc::<f32>((rows * cols).max(1)) }.map_err(|e| backend(e.into()))?;
        Ok(CudaTensor { rows, cols, buf })
    }

    /// What it multiplies in.
    pub fn precision(&self) -> CudaPrecision {
        self.precision
    }

    /// A weight in the layout its products read:
    /// - Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K as their own values, repacked
    ///   into planes ([`crate::layout`]);
    /// - with bf16 products and cuBLAS: every other type as bf16 (bf16
    ///   files as stored, others rounded once), for cuBLAS;
    /// - otherwise dequantized to f32.
    ///
    /// Embeddings (`always_f32`) are an f32 table (the gather reads it; a
    /// tied LM head multiplies it as an F32 weight).
    fn weight(&self, w: &WeightView<'_>, always_f32: bool) -> vellum_ops::Result<CudaWeight> {
        let (n, k) = w.matrix_dims()?;
        let refused = |e: String| vellum_ops::Error::Backend(Error::Backend(format!("{}: {e}", w.name)));
        if !always_f32 {
            if QuantFormat::native(w.dtype).is_some() {
                let r = repack(w.dtype, &w.data, n, k).map_err(|e| refused(e.to_string()))?;
                let m = self.upload_layout(r, n, k)?;
                let bf16_copy = self.bf16_copy(&m)?;
                return Ok(CudaWeight { m: Stored::Blocks(m), bf16_copy });
            }
            if let Some(dtype) = self.tensor_core_dtype(w.dtype) {
                let words: Vec<u16> = if w.dtype == GgmlType::BF16 {
                    w.data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
                } else {
                    w.to_f32()?.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
                };
                check(words.len() == n * k, || format!("{}: {} values for [{n}, {k}]", w.name, words.len()))?;
                return Ok(CudaWeight { m: Stored::Half { data: self.htod(&words)?, dtype, n, k }, bf16_copy: None });
            }
        }
        check(k.is_multiple_of(32), || format!("{}: rows of {k} values; the CUDA kernels need a multiple of 32", w.name))?;
        let values = w.to_f32()?;
        check(values.len() == n * k, || format!("{}: {} values for [{n}, {k}]", w.name, values.len()))?;
        Ok(CudaWeight { m: Stored::Blocks(self.upload_layout(f32_layout(&values), n, k)?), bf16_copy: None })
    }

    /// `m` dequantized to bf16 once ([`WeightCopies`]), when products run in
    /// bf16 through cuBLAS and the copies' budget has room for it.
    fn bf16_copy(&self, m: &QuantMatrix) -> OpResult<Option<CudaSlice<u16>>> {
        use std::sync::atomic::Ordering;
        if self.precision != CudaPrecision::Bf16 || self.blas.is_none() {
            return Ok(None);
        }
        let bytes = (m.n * m.k * 2) as u64;
        if self.copies_keep_free > 0 {
            let free = self.k.context().mem_get_info().map_or(0, |(free, _)| free as u64);
            if free.saturating_sub(bytes) < self.copies_keep_free {
                return Ok(None);
            }
        }
        let taken = self.copies_bytes.fetch_add(bytes, Ordering::Relaxed);
        if taken.saturating_add(bytes) > self.copies_budget {
            self.copies_bytes.fetch_sub(bytes, Ordering::Relaxed);
            return Ok(None);
        }
        // SAFETY: uninitialized; dequantize_bf16 writes all n·k elements.
        let copy = unsafe { self.k.stream().alloc::<u16>(m.n * m.k) }.map_err(|e| backend(e.into()));
        let copy = copy.and_then(|mut c| self.k.dequantize_bf16(&mut c, m).map_err(backend).map(|()| c));
        match copy {
            Ok(c) => Ok(Some(c)),
            // Under Auto a copy that does not fit is none; asked for all, it is an error.
            Err(e) => {
                self.copies_bytes.fetch_sub(bytes, Ordering::Relaxed);
                if self.copies_keep_free > 0 {
                    tracing::debug!("a weight keeps no bf16 copy: {e}");
                    Ok(None)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Copies a repacked weight's planes to the device.
    fn upload_layout(&self, r: Repacked, n: usize, k: usize) -> OpResult<QuantMatrix> {
        let m = QuantMatrix { codes: self.htod(&r.codes)?, scales: self.htod(&r.scales)?, format: r.format, n, k };
        m.check().map_err(backend)?;
        Ok(m)
    }

    /// The 16-bit type a weight stored as `ty` keeps on the device for
    /// cuBLAS, when cuBLAS is there: with bf16 products every type without
    /// a native layout becomes bf16 (f16 too: its activations would be cast
    /// to f16, whose range ends at ±65504, which Gemma's activations are
    /// known to reach); with f32 products none.
    fn tensor_core_dtype(&self, ty: GgmlType) -> Option<Half> {
        self.blas.as_ref()?;
        match (self.precision, QuantFormat::native(ty)) {
            (CudaPrecision::Bf16, None) => Some(Half::Bf16),
            _ => None,
        }
    }

    /// `y = x · Wᵀ` for a weight in a layout of [`crate::layout`], by the
    /// batch's size. With bf16 products: up to [`GEMV_MAX_ROWS`] the f32
    /// GEMV; past it cuBLAS over the weight's kept bf16 copy where it has
    /// one ([`WeightCopies`]; from `VELLUM_COPIES_FROM_ROWS` rows when set),
    /// else the tensor-core GEMM on bf16
    /// activations and from [`CUBLAS_MIN_ROWS`] cuBLAS over a bf16 copy
    /// made for this product. With f32 products: the GEMV up to 8 rows, the
    /// CUDA-core GEMM beyond.
    fn linear_blocks(&self, y: &mut CudaSlice<f32>, m: &QuantMatrix, copy: Option<&CudaSlice<u16>>, x: &CudaTensor) -> OpResult<()> {
        let rows = x.rows;
        if rows <= GEMV_MAX_ROWS || self.precision == CudaPrecision::Float32 {
            return self.k.gemv_rows(y, m, &x.buf, rows).map_err(backend);
        }
        let x16 = self.cast_16(x, Half::Bf16)?;
        match (&self.blas, copy) {
            (Some(blas), Some(w16)) if rows >= self.copies_from_rows => {
                blas.linear_16(y, w16, &x16, Half::Bf16, rows, m.n, m.k).map_err(backend)
            }
            (Some(blas), None) if rows >= CUBLAS_MIN_ROWS => {
                // SAFETY: uninitialized; dequantize_bf16 writes all n·k elements.
                let mut w16 = unsafe { self.k.stream().alloc::<u16>(m.n * m.k) }.map_err(|e| backend(e.into()))?;
                self.k.dequantize_bf16(&mut w16, m).map_err(backend)?;
                blas.linear_16(y, &w16, &x16, Half::Bf16, rows, m.n, m.k).map_err(backend)
            }
            _ => self.k.gemm_mma(y, m, &x16, rows).map_err(backend),
        }
    }

    /// Whether a product of `rows` rows runs on the GEMV, which fuses a norm
    /// before it, a gated activation before it and a residual add after it
    /// (`VELLUM_FUSED_GEMV=0` turns the fusions off, for comparisons).
    fn gemv_fuses(&self, rows: usize) -> bool {
        let gemv_rows = if self.precision == CudaPrecision::Float32 { 8 } else { GEMV_MAX_ROWS };
        self.fused_gemv && (1..=gemv_rows).contains(&rows)
    }

    /// `x` rounded to `dtype` (nearest even), on the device.
    fn cast_16(&self, x: &CudaTensor, dtype: Half) -> OpResult<CudaSlice<u16>> {
        let n = x.rows * x.cols;
        // SAFETY: uninitialized device memory of n elements (one when
        // empty), which cast_to_16 writes in full before anything reads it.
        let mut x16 = unsafe { self.k.stream().alloc::<u16>(n.max(1)) }.map_err(|e| backend(e.into()))?;
        self.k.cast_to_16(&mut x16, &x.buf, n, dtype).map_err(backend)?;
        Ok(x16)
    }
}

impl HostIo for CudaOps {
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> OpResult<CudaTensor> {
        check(data.len() == rows * cols, || format!("upload: {} values for [{rows}, {cols}]", data.len()))?;
        Ok(CudaTensor { rows, cols, buf: self.htod(data)? })
    }

    fn read_kv(&self, cache: &CudaKvCache, layer: usize, value: bool) -> OpResult<Vec<f32>> {
        check(layer < cache.spec.groups.num_layers(), || format!("read_kv: no layer {layer}"))?;
        let pool = &cache.pools[cache.spec.groups.slot(layer).slot];
        let bytes = self.k.stream().clone_dtoh(if value { &pool.v } else { &pool.k }).map_err(|e| backend(e.into()))?;
        Ok(match cache.spec.dtype {
            KvCacheDtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            KvCacheDtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            KvCacheDtype::Bf16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            KvCacheDtype::Fp8E4m3 => {
                let s = cache.scale(layer);
                let s = if value { s.v } else { s.k };
                bytes.iter().map(|&c| vellum_base::fp8::to_f32(c) * s).collect()
            }
        })
    }
}

impl Ops for CudaOps {
    type Weight = CudaWeight;
    type Vector = CudaVector;
    type Rope = CudaRope;

    fn linear_weight(&self, w: WeightView<'_>) -> vellum_ops::Result<CudaWeight> {
        self.weight(&w, false)
    }

    fn embedding_weight(&self, w: WeightView<'_>) -> vellum_ops::Result<CudaWeight> {
        self.weight(&w, true)
    }

    fn stacked_weight(&self, name: &str, parts: &[WeightView<'_>]) -> vellum_ops::Result<Option<CudaWeight>> {
        // One product instead of two or three: a launch or two fewer a
        // layer, and wider GEMVs and GEMMs.
        match WeightView::concat_rows(name, parts) {
            Some(w) => Ok(Some(self.weight(&w, false)?)),
            None => Ok(None),
        }
    }

    fn split_qkv(
        &self,
        qkv: &CudaTensor,
        widths: [usize; 3],
        rope: Option<(&CudaRope, &CudaStep)>,
    ) -> OpResult<(CudaTensor, CudaTensor, CudaTensor)> {
        let [nq, nk, nv] = widths;
        check(qkv.cols == nq + nk + nv, || format!("split_qkv: rows of {} for {nq} + {nk} + {nv}", qkv.cols))?;
        let rows = qkv.rows;
        let (mut q, mut k, mut v) = (self.tensor(rows, nq)?, self.tensor(rows, nk)?, self.tensor(rows, nv)?);
        let rotation = match rope {
            Some((rope, step)) => {
                check(rows == step.tokens, || format!("split_qkv: {rows} rows for {} tokens", step.tokens))?;
                Some(self.rotation(rope, step)?)
            }
            None => None,
        };
        // SAFETY: with a rotation, every position of the step is below the
        // table's length (checked just above against the step's bounds).
        unsafe { self.k.split_qkv(&mut q.buf, &mut k.buf, &mut v.buf, &qkv.buf, rows, widths, rotation) }.map_err(backend)?;
        Ok((q, k, v))
    }

    fn attention_stacked(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        qkv: &CudaTensor,
        widths: [usize; 3],
        rope: Option<&CudaRope>,
        step: &CudaStep,
        shape: &AttentionShape,
    ) -> OpResult<CudaTensor> {
        let [nq, nk, nv] = widths;
        let row = cache.spec.num_kv_heads * cache.spec.head_dim;
        if self.calibrating.load(std::sync::atomic::Ordering::Relaxed) || nk != row || nv != row {
            // Calibration reads the keys and values on the host (write_kv);
            // a product whose k/v are not a pool row is refused there by name.
            let (q, k, v) = self.split_qkv(qkv, widths, rope.map(|r| (r, step)))?;
            return self.attention(cache, layer, &q, &k, &v, step, shape);
        }
        check(qkv.cols == nq + nk + nv && qkv.rows == step.tokens, || {
            format!("attention_stacked: [{}, {}] for {} tokens of {nq} + {nk} + {nv}", qkv.rows, qkv.cols, step.tokens)
        })?;
        let (at, g) = self.kv_write_target("attention_stacked", cache, layer, step)?;
        let rotation = rope.map(|rope| self.rotation(rope, step)).transpose()?;
        let scale = cache.scale(layer);
        let mut q = self.tensor(qkv.rows, nq)?;
        // SAFETY: every slot of the step is below num_blocks · block_size
        // (checked above against the step's bounds; negative slots write
        // nothing) and, with a rotation, every position below the table's
        // rows (checked above).
        unsafe {
            self.k.split_qkv_into_cache(&mut q.buf, &qkv.buf, qkv.rows, widths, rotation, &mut cache.pools[at.slot], &g.slots, scale)
        }
        .map_err(backend)?;
        self.split_kv_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.paged_attention(cache, layer, &q, step, shape)
    }

    fn gated_mul(&self, x: &CudaTensor, act: vellum_ops::GatedActivation) -> OpResult<CudaTensor> {
        check(x.cols.is_multiple_of(2), || format!("gated_mul: rows of {} are not gate and up halves", x.cols))?;
        let inter = x.cols / 2;
        let mut out = self.tensor(x.rows, inter)?;
        self.k.gated_and_mul(&mut out.buf, &x.buf, x.rows, inter, act == vellum_ops::GatedActivation::GeluTanh).map_err(backend)?;
        Ok(out)
    }

    /// Records each layer's largest |key| and |value| for FP8 caches (the
    /// runner calibrates for those only: the linears need no statistics).
    fn set_calibrating(&self, on: bool) {
        self.calibrating.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn linear_input_dtype(&self, weight: GgmlType) -> ActivationDtype {
        let _ = weight;
        match self.precision {
            CudaPrecision::Bf16 => ActivationDtype::Bf16,
            CudaPrecision::Float32 => ActivationDtype::F32,
        }
    }

    /// Flash prefill (`flash_attention.cu`, sequences of
    /// [`FLASH_MIN_QUERIES`] query tokens or more) multiplies in the cache's
    /// 16-bit type (f16 for FP8) at bf16 precision; the float32 path (its
    /// kernels opened without flash prefill), a float32 cache and the
    /// decode kernels keep f32 products.
    fn attention_operand_dtype(&self, kv: KvCacheDtype, query_tokens: usize) -> ActivationDtype {
        if !self.k.flash_enabled() || query_tokens < FLASH_MIN_QUERIES {
            return ActivationDtype::F32;
        }
        match kv {
            KvCacheDtype::Bf16 => ActivationDtype::Bf16,
            KvCacheDtype::F16 | KvCacheDtype::Fp8E4m3 => ActivationDtype::F16,
            KvCacheDtype::F32 => ActivationDtype::F32,
        }
    }

    fn vector(&self, _name: &str, data: &[f32]) -> vellum_ops::Result<CudaVector> {
        Ok(CudaVector { data: self.htod(data)? })
    }

    fn rope_table(&self, table: &RopeTable) -> vellum_ops::Result<CudaRope> {
        let half = table.inv_freq.len();
        let head_dim = table.head_dim();
        let positions = table.max_positions.max(1);
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        let mut data = Vec::with_capacity(positions * head_dim);
        for pos in 0..positions {
            table.cos_sin(pos as u32, &mut cos, &mut sin);
            data.extend_from_slice(&cos);
            data.extend_from_slice(&sin);
        }
        Ok(CudaRope { head_dim, positions, table: self.htod(&data)? })
    }

    fn embed(&self, table: &CudaWeight, step: &CudaStep) -> OpResult<CudaTensor> {
        self.check_bound(Bound::Id, step.bounds.max_id, table.n(), "token id", "the vocabulary")?;
        let Stored::Blocks(m) = &table.m else {
            return Err(Error::Backend("embed: the table is not stored as f32".into()));
        };
        check(m.format == QuantFormat::F32, || "embed: the table is not stored as f32".into())?;
        let mut out = self.tensor(step.tokens, m.k)?;
        self.k.embedding(&mut out.buf, &m.codes, &step.inputs.ids, 0, m.n, m.k).map_err(backend)?;
        Ok(out)
    }

    fn all_reduce(&self, x: &mut CudaTensor) -> OpResult<()> {
        match &self.group {
            Some((group, rank)) => group.all_reduce(*rank, &mut x.buf, x.rows * x.cols).map_err(backend),
            None => Ok(()),
        }
    }

    fn fail_group(&self) {
        if let Some((group, _)) = &self.group {
            group.fail();
        }
    }

    fn embed_vocab_shard(&self, table: &CudaWeight, step: &CudaStep, vocab_start: usize, vocab_size: usize) -> OpResult<CudaTensor> {
        self.check_bound(Bound::Id, step.bounds.max_id, vocab_size, "token id", "the vocabulary")?;
        let Stored::Blocks(m) = &table.m else {
            return Err(Error::Backend("embed: the table is not stored as f32".into()));
        };
        check(m.format == QuantFormat::F32, || "embed: the table is not stored as f32".into())?;
        let mut out = self.tensor(step.tokens, m.k)?;
        self.k.embedding(&mut out.buf, &m.codes, &step.inputs.ids, vocab_start, m.n, m.k).map_err(backend)?;
        Ok(out)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, bias: Option<&CudaVector>) -> OpResult<CudaTensor> {
        check(x.cols == w.k(), || format!("linear: input width {} but the weight takes {}", x.cols, w.k()))?;
        if let Some(b) = bias {
            check(b.data.len() == w.n(), || format!("linear: bias of {} for {} outputs", b.data.len(), w.n()))?;
        }
        let mut out = self.tensor(x.rows, w.n())?;
        if x.rows == 0 {
            return Ok(out);
        }
        match &w.m {
            Stored::Blocks(m) => self.linear_blocks(&mut out.buf, m, w.bf16_copy.as_ref(), x)?,
            Stored::Half { data, dtype, n, k } => {
                let blas = self.blas.as_ref().ok_or_else(|| backend(CudaError::NoCublas))?;
                let x16 = self.cast_16(x, *dtype)?;
                blas.linear_16(&mut out.buf, data, &x16, *dtype, x.rows, *n, *k).map_err(backend)?;
            }
        }
        if let Some(b) = bias {
            self.k.add_bias_rows(&mut out.buf, &b.data, x.rows).map_err(backend)?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaVector, eps: f32, group: usize) -> OpResult<CudaTensor> {
        check(group > 0 && x.cols.is_multiple_of(group) && w.data.len() == group, || {
            format!("rms_norm: width {} group {group} weight {}", x.cols, w.data.len())
        })?;
        let mut out = self.tensor(x.rows, x.cols)?;
        self.k.rms_norm_into(&mut out.buf, &x.buf, &w.data, x.rows * x.cols / group, eps).map_err(backend)?;
        Ok(out)
    }

    fn rope(&self, x: &mut CudaTensor, rope: &CudaRope, step: &CudaStep) -> OpResult<()> {
        check(x.rows == step.tokens && rope.head_dim > 0 && x.cols.is_multiple_of(rope.head_dim), || {
            format!("rope: {} rows of width {} for {} tokens, head_dim {}", x.rows, x.cols, step.tokens, rope.head_dim)
        })?;
        let (table, positions, d) = self.rotation(rope, step)?;
        // SAFETY: every position of the step is below the table's length
        // (checked just above against the step's bounds).
        unsafe { self.k.rope(&mut x.buf, table, positions, x.cols / d, d) }.map_err(backend)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> OpResult<CudaTensor> {
        check((gate.rows, gate.cols) == (up.rows, up.cols), || "silu_mul: shapes differ".into())?;
        let mut out = self.tensor(gate.rows, gate.cols)?;
        self.k.elementwise(Elementwise::SiluMul(&gate.buf, &up.buf), &mut out.buf, gate.rows * gate.cols).map_err(backend)?;
        Ok(out)
    }

    fn gelu_tanh_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> OpResult<CudaTensor> {
        check((gate.rows, gate.cols) == (up.rows, up.cols), || "gelu_tanh_mul: shapes differ".into())?;
        let mut out = self.tensor(gate.rows, gate.cols)?;
        self.k.elementwise(Elementwise::GeluTanhMul(&gate.buf, &up.buf), &mut out.buf, gate.rows * gate.cols).map_err(backend)?;
        Ok(out)
    }

    fn add_rms_norm(&self, residual: &mut CudaTensor, mut y: CudaTensor, w: &CudaVector, eps: f32, cols: usize) -> OpResult<CudaTensor> {
        check((residual.rows, residual.cols) == (y.rows, y.cols), || "add_rms_norm: shapes differ".into())?;
        check(cols == residual.cols && w.data.len() == cols, || {
            format!("add_rms_norm: rows of {} normed in groups of {cols} by {} weights", residual.cols, w.data.len())
        })?;
        // One pass: residual += y, then y = rms_norm(residual).
        self.k.rms_norm(&mut y.buf, Some(&mut residual.buf), &w.data, y.rows, eps, 0.0).map_err(backend)?;
        Ok(y)
    }

    fn rope_qk(&self, q: &mut CudaTensor, k: &mut CudaTensor, rope: &CudaRope, step: &CudaStep) -> OpResult<()> {
        let d = rope.head_dim;
        check(q.rows == step.tokens && k.rows == step.tokens && d > 0 && q.cols.is_multiple_of(d) && k.cols.is_multiple_of(d), || {
            format!("rope: q [{}, {}] and k [{}, {}] for {} tokens, head_dim {d}", q.rows, q.cols, k.rows, k.cols, step.tokens)
        })?;
        let (table, positions, _) = self.rotation(rope, step)?;
        // SAFETY: every position of the step is below the table's length
        // (checked just above against the step's bounds).
        unsafe { self.k.rope_qk(&mut q.buf, &mut k.buf, table, positions, q.cols / d, k.cols / d, d) }.map_err(backend)
    }

    fn scale(&self, x: &mut CudaTensor, factor: f32) -> OpResult<()> {
        let n = x.rows * x.cols;
        self.k.elementwise(Elementwise::Scale(factor), &mut x.buf, n).map_err(backend)
    }

    /// One GEMV launch where the rows are the GEMV's (a decode step's) and
    /// the weight is a layout of blocks: the norm as it reads (unless the
    /// residual add pending goes with the norm first, one launch), the
    /// gated activation as it writes. Otherwise the separate ops.
    fn norm_linear(
        &self,
        residual: &mut CudaTensor,
        pending: Option<CudaTensor>,
        norm: Norm<'_, CudaVector>,
        w: &CudaWeight,
        bias: Option<&CudaVector>,
        act: Option<vellum_ops::GatedActivation>,
    ) -> OpResult<CudaTensor> {
        let added = match pending {
            Some(y) => Some(self.add_rms_norm(residual, y, norm.w, norm.eps, norm.cols)?),
            None => None,
        };
        let x = added.as_ref().unwrap_or(residual);
        let output = match act {
            None => GemvOutput::Store,
            Some(vellum_ops::GatedActivation::Silu) => GemvOutput::Silu,
            Some(vellum_ops::GatedActivation::GeluTanh) => GemvOutput::GeluTanh,
        };
        let fused = match &w.m {
            Stored::Blocks(m)
                if self.gemv_fuses(x.rows)
                    && m.k == x.cols
                    && (added.is_some() || (norm.cols == x.cols && norm.w.data.len() == x.cols))
                    && (act.is_none() || (m.n.is_multiple_of(2) && bias.is_none())) =>
            {
                Some(m)
            }
            _ => None,
        };
        let Some(m) = fused else {
            let x = match added {
                Some(x) => x,
                None => self.rms_norm(residual, norm.w, norm.eps, norm.cols)?,
            };
            let y = self.linear(&x, w, bias)?;
            return match act {
                Some(act) => self.gated_mul(&y, act),
                None => Ok(y),
            };
        };
        if let Some(b) = bias {
            check(b.data.len() == m.n, || format!("norm_linear: bias of {} for {} outputs", b.data.len(), m.n))?;
        }
        let (input, norm_arg) = match added {
            Some(_) => (GemvInput::Plain, None),
            None => (GemvInput::RmsNorm, Some((&norm.w.data, norm.eps))),
        };
        let mut out = self.tensor(x.rows, if output.is_gated() { m.n / 2 } else { m.n })?;
        self.k.gemv_fused(&mut out.buf, m, &x.buf, x.rows, GemvFusion { input, output }, norm_arg).map_err(backend)?;
        if let Some(b) = bias {
            self.k.add_bias_rows(&mut out.buf, &b.data, x.rows).map_err(backend)?;
        }
        Ok(out)
    }

    /// One GEMV launch adding into `residual` as it writes, where the rows
    /// are the GEMV's and the weight is a layout of blocks; otherwise the
    /// product, for the next norm to add.
    fn linear_add(&self, x: &CudaTensor, w: &CudaWeight, residual: &mut CudaTensor) -> OpResult<Option<CudaTensor>> {
        match &w.m {
            Stored::Blocks(m) if self.gemv_fuses(x.rows) && x.cols == m.k && (residual.rows, residual.cols) == (x.rows, m.n) => {
                let fusion = GemvFusion { input: GemvInput::Plain, output: GemvOutput::Add };
                self.k.gemv_fused(&mut residual.buf, m, &x.buf, x.rows, fusion, None).map_err(backend)?;
                Ok(None)
            }
            _ => Ok(Some(self.linear(x, w, None)?)),
        }
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> OpResult<()> {
        check((x.rows, x.cols) == (y.rows, y.cols), || "add_assign: shapes differ".into())?;
        let n = x.rows * x.cols;
        self.k.elementwise(Elementwise::Add(&y.buf), &mut x.buf, n).map_err(backend)
    }

    fn logits_rows(&self, x: &CudaTensor, step: &CudaStep) -> OpResult<CudaTensor> {
        self.check_bound(Bound::LogitsRow, step.bounds.max_logits_row, x.rows, "logits row", "the batch")?;
        let mut out = self.tensor(step.logits_rows, x.cols)?;
        // SAFETY: every logits row of the step is below x's rows (checked
        // just above against the step's bounds).
        unsafe { self.k.gather_rows(&mut out.buf, &x.buf, &step.inputs.logits, step.logits_rows, x.cols) }.map_err(backend)?;
        Ok(out)
    }

    fn to_host(&self, x: &CudaTensor) -> OpResult<Vec<f32>> {
        let n = x.rows * x.cols;
        if n == 0 {
            return Ok(Vec::new());
        }
        let driver = |e: cudarc::driver::DriverError| backend(e.into());
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let pinned = match &mut *staging {
            Some(p) if p.len() >= n => p,
            slot => {
                // Plain page-locked memory (not write-combined: the host reads it).
                // SAFETY: uninitialized host memory of n floats; the copy
                // below writes the first n before anything reads them.
                slot.insert(unsafe { self.k.context().alloc_pinned_with_flags::<f32>(n, 0) }.map_err(driver)?)
            }
        };
        // The first n floats of the staging buffer: a copy moves as many
        // elements as its destination holds.
        let dst = &mut pinned.as_mut_slice().map_err(driver)?[..n];
        self.k.stream().memcpy_dtoh(&x.buf.slice(..n), dst).map_err(driver)?;
        self.k.stream().synchronize().map_err(driver)?;
        let src = &pinned.as_slice().map_err(driver)?[..n];
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut out = spare.filter(|v| v.capacity() >= n).unwrap_or_else(|| Vec::with_capacity(n));
        // Every element is overwritten below: a recycled buffer of the
        // step's size (the usual case) is not zeroed first.
        if out.len() >= n {
            out.truncate(n);
        } else {
            out.resize(n, 0.0);
        }
        copy_in_parallel(&mut out, src);
        Ok(out)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn sample_rows(&self, x: &CudaTensor, rows: &[RowSampling], penalties: &[PenaltyEntry]) -> OpResult<Option<Vec<DeviceSample>>> {
        let driver = |e: cudarc::driver::DriverError| backend(e.into());
        if rows.len() != x.rows {
            return Err(backend(CudaError::Shape(format!("{} sampling rows for {} rows of logits", rows.len(), x.rows))));
        }
        if rows.is_empty() {
            return Ok(Some(Vec::new()));
        }
        // What the kernel does not take (parameters outside its domain,
        // unordered penalties) the host samples, from the untouched logits.
        let Ok(p) = crate::sampling::pack(rows, penalties, x.cols) else { return Ok(None) };
        let s = self.k.stream();
        let inputs = SampleInputs {
            fparams: s.clone_htod(&p.fparams).map_err(driver)?,
            iparams: s.clone_htod(&p.iparams).map_err(driver)?,
            uniform: s.clone_htod(&p.uniform).map_err(driver)?,
            pen_tokens: s.clone_htod(&p.pen_tokens).map_err(driver)?,
            pen_values: s.clone_htod(&p.pen_values).map_err(driver)?,
            any_penalties: p.any_penalties,
        };
        let n = x.rows;
        // SAFETY: uninitialized; the kernel writes every row's token and
        // logprob, the top entries asked for, and the raw value of every
        // penalty entry it applies before reading it back; the other slots
        // are copied back but never read.
        let mut out = unsafe {
            SampleOutputs {
                tokens: s.alloc(n).map_err(driver)?,
                logprobs: s.alloc(n).map_err(driver)?,
                top_ids: s.alloc(n * p.top_stride).map_err(driver)?,
                top_logprobs: s.alloc(n * p.top_stride).map_err(driver)?,
                top_stride: p.top_stride,
                pen_raw: s.alloc(p.pen_tokens.len()).map_err(driver)?,
            }
        };
        // SAFETY: `inputs` is `pack`'s output for these rows and `x.cols`,
        // uploaded as is, and `pen_raw` has an element per entry.
        unsafe { self.k.sample_rows(&mut out, &x.buf, x.cols, &inputs) }.map_err(backend)?;
        let tokens = s.clone_dtoh(&out.tokens).map_err(driver)?;
        let logprobs = s.clone_dtoh(&out.logprobs).map_err(driver)?;
        let wants_top = rows.iter().any(|r| r.num_logprobs > 0);
        let (top_ids, top_lp) = if wants_top {
            (s.clone_dtoh(&out.top_ids).map_err(driver)?, s.clone_dtoh(&out.top_logprobs).map_err(driver)?)
        } else {
            (Vec::new(), Vec::new())
        };
        s.synchronize().map_err(driver)?;
        let samples = crate::sampling::unpack(rows, &tokens, &logprobs, &top_ids, &top_lp, p.top_stride, x.cols);
        if samples.is_none() {
            // A row had a NaN: the host samples the step, from the logits as
            // they came.
            // SAFETY: the inputs and outputs of the call above, which the
            // synchronize completed.
            unsafe { self.k.unpenalize_rows(&x.buf, x.cols, &inputs, &out) }.map_err(backend)?;
        }
        Ok(samples)
    }

    fn argmax_rows(&self, x: &CudaTensor) -> OpResult<Option<Vec<u32>>> {
        let driver = |e: cudarc::driver::DriverError| backend(e.into());
        if x.rows == 0 {
            return Ok(Some(Vec::new()));
        }
        // SAFETY: uninitialized; the kernel writes one id per row.
        let mut ids: CudaSlice<i32> = unsafe { self.k.stream().alloc(x.rows) }.map_err(driver)?;
        self.k.argmax_rows(&mut ids, &x.buf, x.rows, x.cols).map_err(backend)?;
        let ids = self.k.stream().clone_dtoh(&ids).map_err(driver)?;
        self.k.stream().synchronize().map_err(driver)?;
        // A row with no finite maximum (all NaN, say) keeps the kernel's
        // sentinel: then the host sampler sees the logits and decides.
        if ids.iter().any(|&i| i < 0 || i as usize >= x.cols) {
            return Ok(None);
        }
        Ok(Some(ids.into_iter().map(|i| i as u32).collect()))
    }

    fn run_graph(&self, step: &CudaStep, forward: &mut dyn FnMut() -> OpResult<CudaTensor>) -> OpResult<CudaTensor> {
        let Some(key) = step.graph else {
            return forward();
        };
        let mut graphs = lock(&self.graphs);
        if graphs.cache.peek(&key) != Action::Eager && !graphs.inputs.get(&key).is_some_and(|i| Arc::ptr_eq(i, &step.inputs)) {
            // Prepared as a warm-up on buffers of its own (the key became due
            // meanwhile: another step of it ran first): recording or
            // replaying would read those buffers at later steps. It runs
            // eagerly, uncounted; the key's next step records or replays.
            drop(graphs);
            let out = forward()?;
            return self.first_rows(out, step.rows_out);
        }
        match graphs.cache.next(key) {
            Action::Eager => {
                // A failed warm-up does not count: the shape is warmed up again.
                let out = forward().inspect_err(|_| graphs.cache.rewind(key))?;
                graphs.shapes.insert(key, (out.rows, out.cols));
                return self.first_rows(out, step.rows_out);
            }
            Action::Record => match self.record(&mut graphs, key, forward) {
                Ok(()) => {}
                Err(RecordError::Step(e)) => {
                    // The step's own ops failed inside the capture: run it
                    // eagerly to tell a bad step (the same error: returned,
                    // the shape left to record later) from one that fails
                    // only under capture (the shape then runs eagerly).
                    drop(graphs);
                    let out = forward()?;
                    tracing::warn!(?key, "steps of this shape run eagerly: {e}");
                    let mut graphs = lock(&self.graphs);
                    graphs.cache.failed(key);
                    graphs.inputs.remove(&key);
                    return self.first_rows(out, step.rows_out);
                }
                Err(RecordError::Capture(why)) => {
                    tracing::warn!(?key, "steps of this shape run eagerly: {why}");
                    graphs.cache.failed(key);
                    graphs.inputs.remove(&key);
                    // A stream that could not leave its capture takes no more.
                    if !matches!(
                        self.k.stream().capture_status(),
                        Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
                    ) {
                        tracing::error!("the stream is stuck in a capture; CUDA graphs are off for this instance");
                        graphs.options.mode = CudaGraphMode::None;
                    }
                    drop(graphs);
                    let out = forward()?;
                    return self.first_rows(out, step.rows_out);
                }
            },
            Action::Replay => {}
        }
        let recorded = graphs.cache.get(&key).ok_or_else(|| Error::Backend("graph: not recorded".into()))?;
        if let Err(why) = recorded.limits.admit(&step.bounds) {
            // The ops check the step and refuse it by name.
            tracing::debug!("a step outside its graph's limits runs eagerly: {why}");
            drop(graphs);
            let out = forward()?;
            return self.first_rows(out, step.rows_out);
        }
        if let Err(e) = recorded.graph.0.launch() {
            // The shape runs eagerly from now on (its graph is dropped).
            tracing::warn!(?key, "a recorded step failed to launch; eager from now on: {e}");
            graphs.cache.failed(key);
            graphs.inputs.remove(&key);
            drop(graphs);
            let out = forward()?;
            return self.first_rows(out, step.rows_out);
        }
        let output = graphs.outputs.get(recorded.output).ok_or_else(|| Error::Backend("graph: its output buffer is gone".into()))?;
        self.copy_rows(output, step.rows_out, recorded.cols)
    }

    fn graph_sizes(&self) -> Vec<usize> {
        let g = lock(&self.graphs);
        if self.graphs_on(&g) {
            g.options.capture_sizes.sizes().to_vec()
        } else {
            Vec::new()
        }
    }

    fn graphs_record_mixed_steps(&self) -> bool {
        let g = lock(&self.graphs);
        self.graphs_on(&g) && g.options.mode == CudaGraphMode::Full
    }

    fn graph_memory(&self) -> u64 {
        // The graphs' own allocations, and the inputs and outputs kept for them.
        CudaOps::graph_memory(self).0 + lock(&self.graphs).buffer_bytes()
    }

    fn release_graphs(&self) {
        self.drop_graphs();
    }

    fn reuse_host_buffer(&self, buffer: Vec<f32>) {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        // An argmax step hands back an empty buffer: nothing worth keeping.
        if buffer.capacity() > 0 && spare.len() < 2 {
            spare.push(buffer);
        }
    }
}

/// `dst.copy_from_slice(src)` over up to 8 threads when it is large (a
/// 50 MB step of logits takes one core ~5 ms).
fn copy_in_parallel(dst: &mut [f32], src: &[f32]) {
    const CHUNK: usize = 1 << 20;
    if src.len() <= 2 * CHUNK {
        dst.copy_from_slice(src);
        return;
    }
    let per = src.len().div_ceil(8).max(CHUNK);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(per).zip(src.chunks(per)) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
}

fn kv_dtype(d: KvCacheDtype) -> PoolDtype {
    match d {
        KvCacheDtype::F32 => PoolDtype::F32,
        KvCacheDtype::F16 => PoolDtype::F16,
        KvCacheDtype::Bf16 => PoolDtype::Bf16,
        KvCacheDtype::Fp8E4m3 => PoolDtype::Fp8E4m3,
    }
}

/// What the CUDA kernels support: the head sizes CI compiles and the GPU
/// suite runs (`kernels::ci_variants`; the kernel itself takes any multiple
/// of 64 up to 256, but an untested size is refused), the block sizes its
/// variants are built for, and every KV element type.
pub const CAPABILITIES: Capabilities = Capabilities {
    head_dims: Sizes::Only(&[64, 128, 256]),
    block_sizes: Sizes::Only(&[8, 16, 32]),
    kv_dtypes: &[KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3],
    kv_groups: true,
};

impl AttentionBackend for CudaOps {
    type Tensor = CudaTensor;
    type KvCache = CudaKvCache;
    type Step = CudaStep;

    fn describe(&self) -> String {
        let info = self.k.info();
        let copies = match self.weight_copies_bytes() >> 20 {
            0 => String::new(),
            mib => format!(", bf16 weight copies {mib} MiB"),
        };
        format!("cuda: {} ({}, {} GiB{copies})", info.name, info.arch(), info.total_memory >> 30)
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn kv_memory(&self, _spec: &KvCacheSpec) -> KvMemory {
        let total = self.k.info().total_memory as u64;
        let free = self.k.context().mem_get_info().map_or(0, |(free, _)| free as u64);
        let reserve = (total as f64 * ACTIVATION_RESERVE) as u64;
        KvMemory {
            available_bytes: free.saturating_sub(reserve),
            max_blocks: None,
            device: Some(DeviceMemory { total_bytes: total, free_bytes: free, activation_peak_bytes: 0, graph_reserve_bytes: 0 }),
        }
    }

    fn attention_workspace_bytes(&self, num_tokens: usize, num_heads: usize, head_dim: usize, max_context: usize) -> u64 {
        // v2's partial outputs and statistics for every partition of the
        // longest context (launch.rs); v1 needs none.
        let parts = max_context.div_ceil(crate::launch::PARTITION_SIZE) as u64;
        num_tokens as u64 * num_heads as u64 * parts * (head_dim as u64 + 2) * 4
    }

    fn begin_memory_profile(&self) -> Option<u64> {
        self.k.begin_memory_profile()
    }

    fn memory_profile_peak(&self) -> Option<u64> {
        self.k.memory_profile_peak()
    }

    fn allocate_kv_cache(&self, spec: &KvCacheSpec, num_blocks: usize, num_host_blocks: usize) -> vellum_base::Result<CudaKvCache> {
        CAPABILITIES.check("cuda", &AttentionRequirements::of(spec))?;
        let dtype = kv_dtype(spec.dtype);
        let mut pools = Vec::with_capacity(spec.num_slots());
        for _ in 0..spec.num_slots() {
            pools.push(
                KvPool::new(self.k.stream(), dtype, num_blocks.max(1), spec.block_size, spec.num_kv_heads, spec.head_dim)
                    .map_err(backend)?,
            );
        }
        let host_bytes = num_host_blocks * spec.pool_block_bytes() as usize;
        let host = (0..spec.num_slots()).map(|_| [vec![0u8; host_bytes], vec![0u8; host_bytes]]).collect();
        // The recorded graphs address the pools they were recorded with.
        self.drop_graphs();
        let layers = spec.groups.num_layers();
        let scales = if spec.dtype.is_scaled() { self.kv_absmax.scales(layers) } else { vec![KvScale::ONE; layers] };
        Ok(CudaKvCache { spec: spec.clone(), num_blocks, pools, host, num_host_blocks, scales })
    }

    fn prepare_step(&self, batch: &ForwardBatch, block_size: usize) -> vellum_base::Result<CudaStep> {
        // The step may run on a thread new to this device (a rank of a
        // tensor-parallel group): cuBLAS and raw launches need its context
        // current there.
        self.k.stream().context().bind_to_thread().map_err(|e| backend(e.into()))?;
        let bounds = batch.step_bounds(block_size)?;
        // A calibration pass runs as it is: its keys and values are measured,
        // and padding rows would be measured with them.
        let calibrating = self.calibrating.load(std::sync::atomic::Ordering::Relaxed);
        let key = {
            let g = lock(&self.graphs);
            (self.graphs_on(&g) && !calibrating)
                .then(|| GraphKey::of(batch, &g.options.capture_sizes, block_size, g.options.mode))
                .flatten()
        };
        if let Some(key) = key {
            if let Some(step) = self.prepare_graph_step(batch, key, &bounds)? {
                return Ok(step);
            }
        }
        let host = HostInputs::of(batch, &bounds).map_err(Error::Backend)?;
        // The longest context a query sees, unwindowed: an upper bound for
        // the layers with a window (v1 sizes its shared memory by it, v2 its
        // partitions; a partition past a token's window returns at once).
        let max_context = batch.context_lens.iter().copied().max().unwrap_or(0) as usize;
        let inputs =
            self.upload_inputs(&host, batch.block_table_stride, batch.num_tokens(), max_context, QueryLens::of(&host.query_start_loc))?;
        let logits_rows = host.logits.len();
        Ok(CudaStep {
            inputs: Arc::new(inputs),
            tokens: batch.num_tokens(),
            logits_rows,
            rows_out: logits_rows,
            block_size,
            bounds,
            graph: None,
        })
    }

    fn write_kv(&self, cache: &mut CudaKvCache, layer: usize, k: &CudaTensor, v: &CudaTensor, step: &CudaStep) -> vellum_base::Result<()> {
        let spec = &cache.spec;
        let row = spec.num_kv_heads * spec.head_dim;
        check(k.rows == step.tokens && v.rows == step.tokens && k.cols == row && v.cols == row, || {
            format!("write_kv: k/v are [{}, {}]/[{}, {}], {} tokens of {row} expected", k.rows, k.cols, v.rows, v.cols, step.tokens)
        })?;
        let (at, g) = self.kv_write_target("write_kv", cache, layer, step)?;
        if step.tokens == 0 {
            return Ok(());
        }
        if self.calibrating.load(std::sync::atomic::Ordering::Relaxed) {
            // Once at start: the rows come to the host.
            self.kv_absmax.observe(layer, &self.to_host(k)?, &self.to_host(v)?);
        }
        let scale = cache.scale(layer);
        // SAFETY: every slot of the step is below num_blocks · block_size
        // (checked above against the step's bounds; negative slots write
        // nothing).
        unsafe { self.k.reshape_and_cache(&k.buf, &v.buf, &mut cache.pools[at.slot], &g.slots, scale) }.map_err(backend)
    }

    fn paged_attention(
        &self,
        cache: &CudaKvCache,
        layer: usize,
        q: &CudaTensor,
        step: &CudaStep,
        shape: &AttentionShape,
    ) -> vellum_base::Result<CudaTensor> {
        let spec = &cache.spec;
        // This backend's kernels are causal; an encoder's attention is the CPU's.
        check(shape.causal, || "paged_attention: bidirectional (encoder) attention runs on --device cpu".into())?;
        check(shape.num_kv_heads == spec.num_kv_heads && shape.head_dim == spec.head_dim, || {
            format!(
                "paged_attention: {} kv heads of {} for a cache of {} of {}",
                shape.num_kv_heads, shape.head_dim, spec.num_kv_heads, spec.head_dim
            )
        })?;
        check(q.rows == step.tokens && q.cols == shape.num_heads * shape.head_dim, || {
            format!(
                "paged_attention: q is [{}, {}] for {} tokens of {} heads × {}",
                q.rows, q.cols, step.tokens, shape.num_heads, shape.head_dim
            )
        })?;
        self.check_bound(Bound::Block, step.bounds.max_block, cache.num_blocks, "paged_attention: block", "the pool")?;
        check(layer < spec.groups.num_layers(), || format!("paged_attention: no layer {layer}"))?;
        let at = spec.groups.slot(layer);
        let g = step
            .inputs
            .groups
            .get(at.group)
            .ok_or_else(|| Error::Backend(format!("paged_attention: the step has no KV-cache group {}", at.group)))?;
        let mut out = self.tensor(q.rows, q.cols)?;
        let params = AttentionParams {
            num_heads: shape.num_heads,
            scale: shape.scale,
            softcap: shape.logit_softcap.unwrap_or(0.0),
            window: shape.sliding_window.unwrap_or(0),
            kv_scale: cache.scale(layer),
        };
        // The launch picks flash prefill where it applies (never at Float32:
        // the instance's kernels were opened without it).
        // SAFETY: every block id of the step's tables is below the pool's
        // num_blocks (checked above against the step's bounds), and the
        // group's metadata was built by prepare_step from a batch whose
        // shape ForwardBatch::step_bounds checked — as it is, or padded to
        // its graph's shape by PaddedStep, whose padding reads block 0 only.
        unsafe { self.k.paged_attention(&mut out.buf, &q.buf, &cache.pools[at.slot], &g.meta, params, None) }.map_err(backend)?;
        Ok(out)
    }

    fn copy_blocks(&self, cache: &mut CudaKvCache, copies: &[BlockCopy]) -> vellum_base::Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        StepBounds::check_copies(copies, cache.num_blocks)?;
        let pairs: Vec<i64> = copies.iter().flat_map(|c| [i64::from(c.src.0), i64::from(c.dst.0)]).collect();
        let pairs = self.htod(&pairs)?;
        for pool in &mut cache.pools {
            // SAFETY: every id in pairs is below num_blocks (checked above).
            unsafe { self.k.copy_blocks(pool, &pairs) }.map_err(backend)?;
        }
        Ok(())
    }

    fn swap_blocks(&self, cache: &mut CudaKvCache, swaps: &[BlockSwap], to_host: bool) -> vellum_base::Result<()> {
        let bb = cache.spec.pool_block_bytes() as usize;
        StepBounds::check_swaps(swaps, cache.num_blocks, cache.num_host_blocks)?;
        let stream = self.k.stream().clone();
        for s in swaps {
            let (d, h) = (s.device.0 as usize * bb, s.host.0 as usize * bb);
            for (pool, host) in cache.pools.iter_mut().zip(&mut cache.host) {
                let [hk, hv] = host;
                for (dev, host) in [(&mut pool.k, hk), (&mut pool.v, hv)] {
                    let r = if to_host {
                        stream.memcpy_dtoh(&dev.slice(d..d + bb), &mut host[h..h + bb])
                    } else {
                        stream.memcpy_htod(&host[h..h + bb], &mut dev.slice_mut(d..d + bb))
                    };
                    r.map_err(|e| backend(e.into()))?;
                }
            }
        }
        stream.synchronize().map_err(|e| backend(e.into()))
    }
}

/// The query lengths a graph of `key` is recorded for: one token a sequence
/// for a decode key; any composition for a mixed key, so that its recorded
/// launches (flash prefill over as many tile slots as its tokens can give,
/// and the decode kernels for the short sequences) serve every step of the
/// shape.
fn key_query_lens(key: &GraphKey) -> QueryLens {
    if key.mixed {
        QueryLens::any(key.rows)
    } else {
        QueryLens::decode()
    }
}

#[cfg(test)]
mod tests {
    use super::CAPABILITIES;
    use vellum_base::{AttentionRequirements, Error, KvCacheDtype};

    /// What the kernels are compiled and tested for passes; a head size the
    /// kernel would take but no test covers (192) is refused by name,
    /// before any allocation (no GPU needed).
    #[test]
    fn capabilities_refuse_an_untested_head_size_by_name() {
        let wanted = |head_dim, block_size| AttentionRequirements { head_dim, block_size, kv_dtype: KvCacheDtype::Bf16 };
        for head_dim in [64, 128, 256] {
            assert!(CAPABILITIES.check("cuda", &wanted(head_dim, 16)).is_ok(), "head size {head_dim}");
        }
        let e = CAPABILITIES.check("cuda", &wanted(192, 16)).expect_err("192 is not tested");
        assert!(matches!(&e, Error::Unsupported(u) if u.value == "192"), "{e:?}");
        assert_eq!(e.to_string(), "the cuda backend does not support head size 192 (supported: 64, 128, 256)");
        let e = CAPABILITIES.check("cuda", &wanted(128, 12)).expect_err("block size 12");
        assert!(e.to_string().contains("block size (--block-size) 12 (supported: 8, 16, 32)"), "{e}");
    }
}
