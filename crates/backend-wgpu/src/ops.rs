//! [`WgpuOps`]: the model operations and the paged-attention contract on a
//! wgpu device.

use crate::context::GpuContext;
use crate::kernels::{Activation, Kernel};
use crate::memory::{BufferPool, DeviceBuffer, Pooled};
use crate::recorder::{Bound, KernelProfile, Recorder};
use crate::weights::{self, GpuWeight};
use std::sync::Arc;
use vellum_base::{
    AttentionBackend, AttentionRequirements, AttentionShape, BlockCopy, BlockSwap, Capabilities, Error, ForwardBatch, KvAbsmax,
    KvCacheDtype, KvCacheSpec, KvMemory, KvScale, Sizes, StepBounds,
};
use vellum_ops::rope::RopeTable;
use vellum_ops::WeightView;
use vellum_ops::{HostIo, OpResult, Ops};

/// Activations `[rows, cols]`, f32, in a pooled device buffer.
#[derive(Debug)]
pub struct GpuTensor {
    /// Rows (tokens).
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    buf: Pooled,
}

impl GpuTensor {
    fn bytes(&self) -> u64 {
        (self.rows * self.cols * 4) as u64
    }

    fn bound(&self) -> Bound {
        Bound { buf: self.buf.buf.clone(), offset: 0, size: self.bytes().max(4) }
    }

    fn rows_bound(&self, r0: usize, r1: usize) -> Bound {
        let row = (self.cols * 4) as u64;
        Bound { buf: self.buf.buf.clone(), offset: r0 as u64 * row, size: ((r1 - r0) as u64 * row).max(4) }
    }
}

/// A 1-D parameter on the device.
#[derive(Debug)]
pub struct GpuVector {
    len: usize,
    data: DeviceBuffer,
}

/// The RoPE table: `(cos, sin)` for every position and pair, computed on
/// the host in f64 as the CPU backend computes them.
#[derive(Debug)]
pub struct GpuRope {
    head_dim: usize,
    positions: usize,
    table: DeviceBuffer,
}

/// Offsets of the step's arrays inside its metadata buffer (in `u32`s).
#[derive(Clone, Copy, Debug, Default)]
struct Offsets {
    ids: u32,
    positions: u32,
    slots: u32,
    token_seq: u32,
    qsl: u32,
    ctx: u32,
    tables: u32,
    logits: u32,
}

/// One step's inputs, uploaded once as a single `u32` buffer:
/// `token_ids | positions | slot_mapping | token→sequence | query_start_loc
/// | context_lens | block_tables | logits_indices` (slot mapping and block
/// tables group after group for a model with several KV-cache groups).
#[derive(Debug)]
pub struct GpuStep {
    meta: Pooled,
    meta_bytes: u64,
    off: Offsets,
    tokens: usize,
    logits_rows: usize,
    block_size: usize,
    stride: usize,
    num_seqs: usize,
    num_kv_groups: usize,
    bounds: StepBounds,
}

impl GpuStep {
    fn meta(&self) -> Bound {
        Bound { buf: self.meta.buf.clone(), offset: 0, size: self.meta_bytes.max(4) }
    }

    /// Word offsets of KV-cache group `group`'s slot mapping and block tables.
    fn group_offsets(&self, group: usize) -> vellum_base::Result<(u32, u32)> {
        check(group < self.num_kv_groups, || format!("a layer of KV-cache group {group} in a batch of {} groups", self.num_kv_groups))?;
        let slots = self.off.slots as usize + group * self.tokens;
        let tables = self.off.tables as usize + group * self.num_seqs * self.stride;
        Ok((u32_of(slots, "slot offset")?, u32_of(tables, "block-table offset")?))
    }
}

/// The paged KV cache: one K and one V buffer per layer slot on the device
/// (per layer with one KV-cache group; the layers of each group share the
/// slots with several),
/// `[num_blocks, block_size, kv_heads, head_dim]` of the cache's dtype (f16
/// and bf16 two to a word), and the host swap pool with the same per-block
/// layout.
#[derive(Debug)]
pub struct GpuKvCache {
    spec: KvCacheSpec,
    num_blocks: usize,
    layers: Vec<[DeviceBuffer; 2]>,
    host: Vec<[Vec<u8>; 2]>,
    num_host_blocks: usize,
    /// Each layer's scales ([`KvScale::ONE`] unless the dtype is scaled).
    scales: Vec<KvScale>,
}

impl GpuKvCache {
    /// Layer `layer`'s scales: it stores `x / scale`.
    pub fn scale(&self, layer: usize) -> KvScale {
        self.scales.get(layer).copied().unwrap_or(KvScale::ONE)
    }
}

/// The model operations on a wgpu device.
pub struct WgpuOps {
    ctx: Arc<GpuContext>,
    rec: Recorder,
    pool: Arc<BufferPool>,
    /// Largest range one binding may cover.
    binding_limit: u64,
    /// Bound where a kernel's optional input is absent.
    dummy: DeviceBuffer,
    /// Set during a calibration pass ([`Ops::set_calibrating`]): `write_kv`
    /// records each layer's largest |key| and |value| in `kv_absmax`, from
    /// which FP8 caches allocated afterwards take their scales.
    calibrating: std::sync::atomic::AtomicBool,
    kv_absmax: KvAbsmax,
}

impl std::fmt::Debug for WgpuOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuOps").field("adapter", &self.ctx.info.name).field("binding_limit", &self.binding_limit).finish()
    }
}

fn params(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn check(cond: bool, what: impl FnOnce() -> String) -> OpResult<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::Backend(what()))
    }
}

fn u32_of(n: usize, what: &str) -> OpResult<u32> {
    u32::try_from(n).map_err(|_| Error::Backend(format!("{what} {n} does not fit the kernels' 32-bit indices")))
}

impl WgpuOps {
    /// Operations on the best adapter (see [`GpuContext::new`]); a typed
    /// error, saying what to install, when there is none. Set
    /// `VELLUM_WGPU_PROFILE=1` to time every kernel with timestamp queries
    /// (summarized in the log when the ops are dropped).
    pub fn new() -> Result<Self, Error> {
        Self::with_context(GpuContext::new()?)
    }

    /// Operations on an opened device.
    pub fn with_context(ctx: Arc<GpuContext>) -> Result<Self, Error> {
        let binding_limit = ctx.limits.max_storage_buffer_binding_size.min(ctx.limits.max_buffer_size) & !3;
        let dummy = DeviceBuffer::new(&ctx, "dummy", 16)?;
        let rec = Recorder::new(ctx.clone());
        if std::env::var("VELLUM_WGPU_PROFILE").is_ok_and(|v| v != "0") && !rec.set_profiling(true) {
            tracing::warn!("VELLUM_WGPU_PROFILE: the adapter has no timestamp queries");
        }
        Ok(Self {
            pool: BufferPool::new(ctx.clone()),
            ctx,
            rec,
            binding_limit,
            dummy,
            calibrating: Default::default(),
            kv_absmax: Default::default(),
        })
    }

    /// Pretends one binding may cover at most `bytes` (rounded down to a
    /// multiple of 256), so that tests exercise the splitting of large
    /// weights and outputs on any adapter.
    pub fn with_binding_limit(mut self, bytes: u64) -> Self {
        self.binding_limit = self.binding_limit.min(bytes & !255).max(256);
        self
    }

    /// The device.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    /// Turns per-kernel timing on or off; false where the adapter has no
    /// timestamp queries.
    pub fn set_profiling(&self, on: bool) -> bool {
        self.rec.set_profiling(on)
    }

    /// Time per kernel since profiling was turned on.
    pub fn profile(&self) -> KernelProfile {
        self.rec.profile()
    }

    /// Runs everything recorded and waits for it.
    pub fn synchronize(&self) -> OpResult<()> {
        self.rec.flush()?;
        self.ctx
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Backend(format!("wgpu: waiting for the device: {e}")))?;
        self.ctx.check()
    }

    /// A `[rows, cols]` tensor holding `data` (row-major).
    pub fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> OpResult<GpuTensor> {
        check(data.len() == rows * cols, || format!("upload: {} values for [{rows}, {cols}]", data.len()))?;
        let t = self.tensor(rows, cols)?;
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.rec.upload(&t.buf.buf, 0, &bytes)?;
        Ok(t)
    }

    /// Layer slot `layer`'s K (`value = false`) or V pool (layer `layer` with one
    /// KV-cache group), widened to f32 as stored (an FP8 code's value, not
    /// yet multiplied by its layer's scale),
    /// `[num_blocks, block_size, kv_heads, head_dim]` (for tests and
    /// debugging).
    pub fn read_kv_pool(&self, cache: &GpuKvCache, layer: usize, value: bool) -> OpResult<Vec<f32>> {
        let pools = cache.layers.get(layer).ok_or_else(|| Error::Backend(format!("read_kv_pool: no layer {layer}")))?;
        let pool = &pools[usize::from(value)];
        let bytes = self.rec.read(&pool.buf, 0, pool.buf.size())?;
        Ok(match cache.spec.dtype {
            KvCacheDtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            KvCacheDtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            KvCacheDtype::Bf16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            KvCacheDtype::Fp8E4m3 => bytes.iter().map(|&c| vellum_base::fp8::to_f32(c)).collect(),
        })
    }

    /// Layer `layer`'s host (swap) pools, K then V, widened to f32 as
    /// stored.
    pub fn read_host_pool(&self, cache: &GpuKvCache, layer: usize, value: bool) -> Vec<f32> {
        let bytes = cache.host.get(layer).map(|h| &h[usize::from(value)][..]).unwrap_or(&[]);
        match cache.spec.dtype {
            KvCacheDtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            KvCacheDtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            KvCacheDtype::Bf16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            KvCacheDtype::Fp8E4m3 => bytes.iter().map(|&c| vellum_base::fp8::to_f32(c)).collect(),
        }
    }

    fn tensor(&self, rows: usize, cols: usize) -> OpResult<GpuTensor> {
        let bytes = (rows * cols * 4) as u64;
        Ok(GpuTensor { rows, cols, buf: self.pool.take(bytes)? })
    }

    /// Checks that `t` fits one binding (ops that do not split their
    /// operands).
    fn bindable(&self, t: &GpuTensor, what: &str) -> OpResult<()> {
        check(t.bytes() <= self.binding_limit, || {
            format!("{what}: a [{}, {}] tensor exceeds the device's {}-byte storage binding", t.rows, t.cols, self.binding_limit)
        })
    }

    /// `act(gate) · up` into a new tensor.
    fn gated_mul(&self, act: Activation, gate: &GpuTensor, up: &GpuTensor) -> OpResult<GpuTensor> {
        let name = Kernel::GatedMul(act).name();
        check((gate.rows, gate.cols) == (up.rows, up.cols), || format!("{name}: shapes differ"))?;
        self.bindable(gate, name)?;
        let out = self.tensor(gate.rows, gate.cols)?;
        self.elementwise(Kernel::GatedMul(act), vec![gate.bound(), up.bound(), out.bound()], gate.rows * gate.cols)?;
        Ok(out)
    }

    fn elementwise(&self, kernel: Kernel, bound: Vec<Bound>, len: usize) -> OpResult<()> {
        let p = params(&[u32_of(len, "elements")?, 0, 0, 0]);
        self.rec.dispatch(kernel, bound, &p, self.rec.groups_1d(len.div_ceil(64) as u64))
    }

    /// Rows per dispatch of `linear` so that both the `[rows, k]` input and
    /// the `[rows, n]` output ranges fit a binding at aligned offsets.
    fn linear_rows_per_dispatch(&self, m: usize, k: usize, n: usize) -> OpResult<usize> {
        let widest = (k.max(n) * 4) as u64;
        if (m as u64) * widest <= self.binding_limit {
            return Ok(m);
        }
        let align = u64::from(self.ctx.limits.min_storage_buffer_offset_alignment).max(4);
        // Rows whose byte size is a multiple of the alignment for both widths.
        let unit = |w: u64| align / gcd(align, w);
        let (uk, un) = (unit((k * 4) as u64), unit((n * 4) as u64));
        let unit = uk / gcd(uk, un) * un;
        let rows = (self.binding_limit / widest) / unit * unit;
        check(rows > 0, || format!("linear: rows of {k}/{n} values cannot be bound within {} bytes", self.binding_limit))?;
        Ok(rows as usize)
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Drop for WgpuOps {
    fn drop(&mut self) {
        let profile = self.rec.profile();
        let total = profile.total_s();
        if total > 0.0 {
            for (kernel, n, s) in &profile.kernels {
                tracing::info!(
                    kernel,
                    dispatches = n,
                    ms = format!("{:.1}", s * 1e3),
                    share = format!("{:.1}%", 100.0 * s / total),
                    "wgpu kernel time"
                );
            }
        }
    }
}

impl HostIo for WgpuOps {
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> OpResult<GpuTensor> {
        WgpuOps::upload(self, rows, cols, data)
    }

    fn read_kv(&self, cache: &GpuKvCache, layer: usize, value: bool) -> OpResult<Vec<f32>> {
        // The pools are per slot; a hybrid cache's layers share slots.
        check(layer < cache.spec.groups.num_layers(), || format!("read_kv: no layer {layer}"))?;
        let mut x = self.read_kv_pool(cache, cache.spec.groups.slot(layer).slot, value)?;
        let scale = cache.scale(layer);
        let s = if value { scale.v } else { scale.k };
        if s != 1.0 {
            x.iter_mut().for_each(|x| *x *= s);
        }
        Ok(x)
    }
}

impl Ops for WgpuOps {
    type Weight = GpuWeight;
    type Vector = GpuVector;
    type Rope = GpuRope;

    fn linear_weight(&self, w: WeightView<'_>) -> vellum_ops::Result<GpuWeight> {
        weights::upload(&self.ctx, &w, self.binding_limit)
    }

    fn embedding_weight(&self, w: WeightView<'_>) -> vellum_ops::Result<GpuWeight> {
        weights::upload(&self.ctx, &w, self.binding_limit)
    }

    /// Records each layer's largest |key| and |value| for FP8 caches.
    fn set_calibrating(&self, on: bool) {
        self.calibrating.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn vector(&self, name: &str, data: &[f32]) -> vellum_ops::Result<GpuVector> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(GpuVector { len: data.len(), data: DeviceBuffer::with_data(&self.ctx, name, &bytes)? })
    }

    fn rope_table(&self, table: &RopeTable) -> vellum_ops::Result<GpuRope> {
        let half = table.inv_freq.len();
        let head_dim = table.head_dim();
        // Positions beyond what one binding holds are refused at run time.
        let positions = table.max_positions.min((self.binding_limit / (8 * half.max(1) as u64)) as usize);
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        let mut bytes = Vec::with_capacity(positions * half * 8);
        for pos in 0..positions {
            table.cos_sin(pos as u32, &mut cos, &mut sin);
            for i in 0..half {
                bytes.extend_from_slice(&cos[i].to_le_bytes());
                bytes.extend_from_slice(&sin[i].to_le_bytes());
            }
        }
        Ok(GpuRope { head_dim, positions, table: DeviceBuffer::with_data(&self.ctx, "rope table", &bytes)? })
    }

    fn embed(&self, table: &GpuWeight, step: &GpuStep) -> OpResult<GpuTensor> {
        StepBounds::check_below(step.bounds.max_id, table.out, "token id", "the vocabulary")?;
        let out = self.tensor(step.tokens, table.inp)?;
        self.bindable(&out, "embed")?;
        let len = step.tokens * table.inp;
        for c in &table.chunks {
            let p = params(&[
                u32_of(step.tokens, "tokens")?,
                table.inp as u32,
                step.off.ids,
                c.row0 as u32,
                c.rows as u32,
                table.inp as u32,
                0,
                0,
            ]);
            let bound = vec![step.meta(), out.bound(), c.data.bound()];
            self.rec.dispatch(Kernel::Embed(table.format), bound, &p, self.rec.groups_1d(len.div_ceil(64) as u64))?;
        }
        Ok(out)
    }

    fn linear(&self, x: &GpuTensor, w: &GpuWeight, bias: Option<&GpuVector>) -> OpResult<GpuTensor> {
        check(x.cols == w.inp, || format!("linear: input width {} but the weight takes {}", x.cols, w.inp))?;
        if let Some(b) = bias {
            check(b.len == w.out, || format!("linear: bias of {} for {} outputs", b.len, w.out))?;
        }
        let (m, n, k) = (x.rows, w.out, w.inp);
        let out = self.tensor(m, n)?;
        let rows = self.linear_rows_per_dispatch(m, k, n)?;
        let bias_bound = bias.map_or_else(|| self.dummy.bound(), |b| b.data.bound());
        let mut r0 = 0;
        while r0 < m {
            let r1 = (r0 + rows).min(m);
            let mr = r1 - r0;
            let tm = match mr {
                1 => 1,
                2..=4 => 4,
                5..=8 => 8,
                _ => 16,
            };
            for c in &w.chunks {
                let p = params(&[mr as u32, k as u32, c.rows as u32, k as u32, n as u32, c.row0 as u32, bias.is_some() as u32, 0]);
                let bound = vec![x.rows_bound(r0, r1), out.rows_bound(r0, r1), c.data.bound(), bias_bound.clone()];
                let groups = [c.rows.div_ceil(256) as u32, mr.div_ceil(tm as usize) as u32, 1];
                self.rec.dispatch(Kernel::Matmul { format: w.format, tm }, bound, &p, groups)?;
            }
            r0 = r1;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &GpuTensor, w: &GpuVector, eps: f32, group: usize) -> OpResult<GpuTensor> {
        check(group > 0 && x.cols.is_multiple_of(group) && w.len == group, || {
            format!("rms_norm: width {} group {group} weight {}", x.cols, w.len)
        })?;
        self.bindable(x, "rms_norm")?;
        let out = self.tensor(x.rows, x.cols)?;
        let groups = x.rows * x.cols / group;
        let p = params(&[u32_of(groups, "groups")?, group as u32, eps.to_bits(), 0]);
        self.rec.dispatch(Kernel::RmsNorm, vec![x.bound(), out.bound(), w.data.bound()], &p, self.rec.groups_1d(groups as u64))?;
        Ok(out)
    }

    fn rope(&self, x: &mut GpuTensor, rope: &GpuRope, step: &GpuStep) -> OpResult<()> {
        check(x.rows == step.tokens && rope.head_dim > 0 && x.cols.is_multiple_of(rope.head_dim), || {
            format!("rope: {} rows of width {} for {} tokens, head_dim {}", x.rows, x.cols, step.tokens, rope.head_dim)
        })?;
        StepBounds::check_below(step.bounds.max_position, rope.positions, "rope: position", "the table")?;
        self.bindable(x, "rope")?;
        let len = x.rows * x.cols / 2;
        let p = params(&[x.rows as u32, x.cols as u32, rope.head_dim as u32, step.off.positions]);
        self.rec.dispatch(Kernel::Rope, vec![x.bound(), step.meta(), rope.table.bound()], &p, self.rec.groups_1d(len.div_ceil(64) as u64))
    }

    fn silu_mul(&self, gate: &GpuTensor, up: &GpuTensor) -> OpResult<GpuTensor> {
        self.gated_mul(Activation::Silu, gate, up)
    }

    fn gelu_tanh_mul(&self, gate: &GpuTensor, up: &GpuTensor) -> OpResult<GpuTensor> {
        self.gated_mul(Activation::GeluTanh, gate, up)
    }

    fn scale(&self, x: &mut GpuTensor, factor: f32) -> OpResult<()> {
        self.bindable(x, "scale")?;
        let len = x.rows * x.cols;
        let p = params(&[u32_of(len, "elements")?, factor.to_bits(), 0, 0]);
        self.rec.dispatch(Kernel::Scale, vec![x.bound()], &p, self.rec.groups_1d(len.div_ceil(64) as u64))
    }

    fn add_assign(&self, x: &mut GpuTensor, y: &GpuTensor) -> OpResult<()> {
        check((x.rows, x.cols) == (y.rows, y.cols), || "add_assign: shapes differ".into())?;
        self.bindable(x, "add_assign")?;
        self.elementwise(Kernel::Add, vec![x.bound(), y.bound()], x.rows * x.cols)
    }

    fn logits_rows(&self, x: &GpuTensor, step: &GpuStep) -> OpResult<GpuTensor> {
        StepBounds::check_below(step.bounds.max_logits_row, x.rows, "logits row", "the batch")?;
        self.bindable(x, "logits_rows")?;
        let out = self.tensor(step.logits_rows, x.cols)?;
        let len = step.logits_rows * x.cols;
        let p = params(&[step.logits_rows as u32, x.cols as u32, step.off.logits, 0]);
        self.rec.dispatch(
            Kernel::GatherRows,
            vec![x.bound(), step.meta(), out.bound()],
            &p,
            self.rec.groups_1d(len.div_ceil(64) as u64),
        )?;
        Ok(out)
    }

    fn to_host(&self, x: &GpuTensor) -> OpResult<Vec<f32>> {
        let bytes = self.rec.read(&x.buf.buf, 0, x.bytes())?;
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

impl AttentionBackend for WgpuOps {
    type Tensor = GpuTensor;
    type KvCache = GpuKvCache;
    type Step = GpuStep;

    fn describe(&self) -> String {
        self.ctx.describe()
    }

    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // A workgroup holds a head in vec4 lanes.
            head_dims: Sizes::Multiples { multiple_of: 4, max: 256 },
            block_sizes: Sizes::ANY,
            kv_dtypes: &[KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3],
            kv_groups: true,
        }
    }

    fn kv_memory(&self, spec: &KvCacheSpec) -> KvMemory {
        KvMemory {
            available_bytes: self.ctx.available_bytes(),
            max_blocks: Some((self.binding_limit / spec.pool_block_bytes().max(1)) as usize),
            // wgpu reports no device totals: --kv-cache-memory sizes the cache.
            device: None,
        }
    }

    fn allocate_kv_cache(&self, spec: &KvCacheSpec, num_blocks: usize, num_host_blocks: usize) -> vellum_base::Result<GpuKvCache> {
        // The same check as the runner's before it loads a weight, for callers that skip it.
        self.capabilities().check(self.name(), &AttentionRequirements::of(spec))?;
        check(spec.head_dim.is_multiple_of(4) && spec.head_dim <= 256, || {
            format!("wgpu paged attention: head_dim {} must be a multiple of 4, at most 256", spec.head_dim)
        })?;
        let pool_bytes = num_blocks as u64 * spec.pool_block_bytes();
        check(pool_bytes <= self.binding_limit, || {
            format!("wgpu: a KV pool of {num_blocks} blocks ({pool_bytes} bytes) exceeds the {}-byte storage binding", self.binding_limit)
        })?;
        let mut layers = Vec::with_capacity(spec.num_slots());
        for l in 0..spec.num_slots() {
            layers.push([
                DeviceBuffer::new(&self.ctx, &format!("k pool {l}"), pool_bytes)?,
                DeviceBuffer::new(&self.ctx, &format!("v pool {l}"), pool_bytes)?,
            ]);
        }
        let host_bytes = num_host_blocks * spec.pool_block_bytes() as usize;
        let host = (0..spec.num_slots()).map(|_| [vec![0u8; host_bytes], vec![0u8; host_bytes]]).collect();
        let n = spec.groups.num_layers();
        let scales = if spec.dtype.is_scaled() { self.kv_absmax.scales(n) } else { vec![KvScale::ONE; n] };
        Ok(GpuKvCache { spec: spec.clone(), num_blocks, layers, host, num_host_blocks, scales })
    }

    fn prepare_step(&self, batch: &ForwardBatch, block_size: usize) -> vellum_base::Result<GpuStep> {
        let (t, s, groups) = (batch.num_tokens(), batch.num_seqs(), batch.kv_groups());
        let bounds = batch.step_bounds(block_size)?;
        let mut meta: Vec<u32> = Vec::new();
        let mut push = |xs: &[u32]| {
            let at = meta.len() as u32;
            meta.extend_from_slice(xs);
            at
        };
        let off = Offsets {
            ids: push(&batch.token_ids),
            positions: push(&batch.positions),
            slots: push(&batch.slot_mapping),
            token_seq: push(&bounds.token_seq),
            qsl: push(&batch.query_start_loc),
            ctx: push(&batch.context_lens),
            tables: push(&batch.block_tables),
            logits: push(&batch.logits_indices),
        };
        let bytes: Vec<u8> = meta.iter().flat_map(|w| w.to_le_bytes()).collect();
        let buf = self.pool.take(bytes.len() as u64)?;
        self.rec.upload(&buf.buf, 0, &bytes)?;
        Ok(GpuStep {
            meta: buf,
            meta_bytes: bytes.len() as u64,
            off,
            tokens: t,
            logits_rows: batch.logits_indices.len(),
            block_size,
            stride: batch.block_table_stride,
            num_seqs: s,
            num_kv_groups: groups,
            bounds,
        })
    }

    fn write_kv(&self, cache: &mut GpuKvCache, layer: usize, k: &GpuTensor, v: &GpuTensor, step: &GpuStep) -> vellum_base::Result<()> {
        let spec = &cache.spec;
        let row = spec.num_kv_heads * spec.head_dim;
        check(k.rows == step.tokens && v.rows == step.tokens && k.cols == row && v.cols == row, || {
            format!("write_kv: k/v are [{}, {}]/[{}, {}], {} tokens of {row} expected", k.rows, k.cols, v.rows, v.cols, step.tokens)
        })?;
        check(step.block_size == spec.block_size, || "write_kv: the step's block size differs from the cache's".into())?;
        StepBounds::check_below(step.bounds.max_slot, cache.num_blocks * spec.block_size, "write_kv: slot", "the pool's slots")?;
        check(layer < spec.groups.num_layers(), || format!("write_kv: no layer {layer}"))?;
        let at = spec.groups.slot(layer);
        let (slots, _) = step.group_offsets(at.group)?;
        let [kp, vp] = &cache.layers[at.slot];
        let per_word = 4 / spec.dtype.size_bytes();
        let words = step.tokens * row / per_word;
        if self.calibrating.load(std::sync::atomic::Ordering::Relaxed) {
            self.kv_absmax.observe(layer, &self.to_host(k)?, &self.to_host(v)?);
        }
        let scale = cache.scale(layer);
        let (k_inv, v_inv) = (1.0f32 / scale.k, 1.0f32 / scale.v);
        let p = params(&[step.tokens as u32, row as u32, slots, 0, k_inv.to_bits(), v_inv.to_bits(), 0, 0]);
        let bound = vec![k.bound(), v.bound(), kp.bound(), vp.bound(), step.meta()];
        self.rec.dispatch(Kernel::WriteKv(spec.dtype), bound, &p, self.rec.groups_1d(words.div_ceil(64) as u64))
    }

    fn paged_attention(
        &self,
        cache: &GpuKvCache,
        layer: usize,
        q: &GpuTensor,
        step: &GpuStep,
        shape: &AttentionShape,
    ) -> vellum_base::Result<GpuTensor> {
        let spec = &cache.spec;
        // This backend's kernels are causal; an encoder's attention is the CPU's.
        check(shape.causal, || "paged_attention: bidirectional (encoder) attention runs on --device cpu".into())?;
        check(shape.num_kv_heads == spec.num_kv_heads && shape.head_dim == spec.head_dim, || {
            format!(
                "paged_attention: {} kv heads of {} for a cache of {} of {}",
                shape.num_kv_heads, shape.head_dim, spec.num_kv_heads, spec.head_dim
            )
        })?;
        check(shape.num_kv_heads > 0 && shape.num_heads.is_multiple_of(shape.num_kv_heads), || {
            "paged_attention: heads are not a multiple of kv heads".into()
        })?;
        check(q.rows == step.tokens && q.cols == shape.num_heads * shape.head_dim, || {
            format!(
                "paged_attention: q is [{}, {}] for {} tokens of {} heads × {}",
                q.rows, q.cols, step.tokens, shape.num_heads, shape.head_dim
            )
        })?;
        StepBounds::check_below(step.bounds.max_block, cache.num_blocks, "paged_attention: block", "the pool")?;
        self.bindable(q, "paged_attention")?;
        check(layer < spec.groups.num_layers(), || format!("paged_attention: no layer {layer}"))?;
        let at = spec.groups.slot(layer);
        let (_, tables) = step.group_offsets(at.group)?;
        let [kp, vp] = &cache.layers[at.slot];
        let out = self.tensor(q.rows, q.cols)?;
        let o = step.off;
        let p = params(&[
            step.tokens as u32,
            shape.num_heads as u32,
            shape.num_kv_heads as u32,
            shape.head_dim as u32,
            step.block_size as u32,
            step.stride as u32,
            u32_of(shape.sliding_window.unwrap_or(0), "sliding window")?,
            o.token_seq,
            o.qsl,
            o.ctx,
            tables,
            0,
            // The layer's key scale joins the score scale (an FP8 code reads
            // as its value here), its value scale multiplies the outputs.
            (shape.scale * cache.scale(layer).k).to_bits(),
            shape.logit_softcap.unwrap_or(0.0).to_bits(),
            cache.scale(layer).v.to_bits(),
            0,
        ]);
        let bound = vec![q.bound(), out.bound(), kp.bound(), vp.bound(), step.meta()];
        let items = (step.tokens * shape.num_heads) as u64;
        self.rec.dispatch(Kernel::PagedAttention(spec.dtype), bound, &p, self.rec.groups_1d(items))?;
        Ok(out)
    }

    fn copy_blocks(&self, cache: &mut GpuKvCache, copies: &[BlockCopy]) -> vellum_base::Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        StepBounds::check_copies(copies, cache.num_blocks)?;
        let list: Vec<u8> = copies.iter().flat_map(|c| [c.src.0, c.dst.0]).flat_map(|w| w.to_le_bytes()).collect();
        let buf = self.pool.take(list.len() as u64)?;
        self.rec.upload(&buf.buf, 0, &list)?;
        let list_bound = Bound { buf: buf.buf.clone(), offset: 0, size: list.len() as u64 };
        let block_words = (cache.spec.pool_block_bytes() / 4) as usize;
        let p = params(&[copies.len() as u32, block_words as u32, 0, 0]);
        let groups = self.rec.groups_1d((copies.len() * block_words).div_ceil(64) as u64);
        for pools in &cache.layers {
            for pool in pools {
                self.rec.dispatch(Kernel::CopyBlocks, vec![pool.bound(), list_bound.clone()], &p, groups)?;
            }
        }
        Ok(())
    }

    fn swap_blocks(&self, cache: &mut GpuKvCache, swaps: &[BlockSwap], to_host: bool) -> vellum_base::Result<()> {
        if swaps.is_empty() {
            return Ok(());
        }
        let bb = cache.spec.pool_block_bytes();
        StepBounds::check_swaps(swaps, cache.num_blocks, cache.num_host_blocks)?;
        if to_host {
            // Gather every (swap, layer, K/V) block into one buffer, read it once.
            let n = swaps.len() * cache.layers.len() * 2;
            let gather = self.pool.take(n as u64 * bb)?;
            let mut at = 0;
            for s in swaps {
                for pools in &cache.layers {
                    for pool in pools {
                        self.rec.copy(&pool.buf, u64::from(s.device.0) * bb, &gather.buf, at, bb);
                        at += bb;
                    }
                }
            }
            let bytes = self.rec.read(&gather.buf, 0, at)?;
            let mut chunks = bytes.chunks_exact(bb as usize);
            for s in swaps {
                let h = s.host.0 as usize * bb as usize;
                for host in &mut cache.host {
                    for pool in host.iter_mut() {
                        let src = chunks.next().ok_or_else(|| Error::Backend("swap_blocks: short readback".into()))?;
                        pool[h..h + bb as usize].copy_from_slice(src);
                    }
                }
            }
        } else {
            for s in swaps {
                let h = s.host.0 as usize * bb as usize;
                for (pools, host) in cache.layers.iter().zip(&cache.host) {
                    for (pool, hp) in pools.iter().zip(host) {
                        self.rec.upload(&pool.buf, u64::from(s.device.0) * bb, &hp[h..h + bb as usize])?;
                    }
                }
            }
        }
        Ok(())
    }
}
