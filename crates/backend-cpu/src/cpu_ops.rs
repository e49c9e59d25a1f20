//! [`Ops`] on host memory: f32 activations, f32 weights, rayon threads.
//!
//! Linear layers run on the `gemm` crate (which picks AVX2/AVX-512 kernels at
//! run time) with weights transposed at load to `[in, out]`, so the GEMM reads
//! them without repacking; the output columns are split across the rayon
//! threads by hand, since the GEMM stays single-threaded for small shapes.

use crate::kv_cache::{KvCache, KvCacheLayout};
use crate::linear::HostWeight;
use crate::paged_attention::{paged_attention, write_kv};
use crate::quant::{self, ActBits, WeightFormat};
use crate::tensor_parallel::HostGroup;
use vellum_base::{
    AttentionBackend, AttentionMetadata, AttentionShape, BlockCopy, BlockSwap, Capabilities, Error, ForwardBatch, KvAbsmax, KvCacheDtype,
    KvCacheSpec, KvMemory, Sizes, StepBounds,
};
use vellum_ops::rope::RopeTable;
use vellum_ops::WeightView;
use vellum_ops::{HostIo, OpResult, Ops};

/// Row-major activations `[rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Rows (tokens).
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// `rows * cols` values.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// The values, taking them out of the tensor (a tensor's buffer goes
    /// back to the recycling pool when it drops, so `data` is not moved out).
    pub fn into_data(mut self) -> Vec<f32> {
        std::mem::take(&mut self.data)
    }

    fn zeros(rows: usize, cols: usize) -> Self {
        Self { rows, cols, data: vec![0.0; rows * cols] }
    }

    /// A `[rows, cols]` output every cell of which the caller overwrites: in
    /// a recycled buffer ([`RECYCLED`]: dropped tensors and the logits
    /// [`Ops::reuse_host_buffer`] hands back) when it is large and one fits, so the kernel writes to
    /// memory already mapped and not zeroed for nothing. Fresh allocations of
    /// this size come from `mmap`, and their first writes fault page after
    /// page (a tenth of a 64-sequence Gemma 3 step); zeroing a reused one
    /// cost 5% of a 64-sequence prefill.
    fn for_overwrite(rows: usize, cols: usize) -> Self {
        let len = rows * cols;
        if len >= RECYCLE_MIN_LEN {
            let data = RECYCLED.lock().ok().and_then(|mut pool| {
                // The smallest that fits keeps the larger ones for larger outputs.
                let best = pool.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity())?.0;
                Some(pool.swap_remove(best))
            });
            if let Some(mut data) = data {
                // Old values stay where the caller will overwrite them
                // (only a part past the buffer's old length is zeroed).
                data.resize(len, 0.0);
                return Self { rows, cols, data };
            }
        }
        Self::zeros(rows, cols)
    }
}

/// A large tensor's buffer goes back to [`RECYCLED`] for the next
/// [`HostTensor::for_overwrite`] (the activations of one layer are dropped
/// as the next layer allocates the same shapes).
impl Drop for HostTensor {
    fn drop(&mut self) {
        recycle(std::mem::take(&mut self.data));
    }
}

/// Keeps `buffer` in [`RECYCLED`] if it is large; when the pool is full it
/// replaces the smallest buffer there if it is larger.
fn recycle(buffer: Vec<f32>) {
    if buffer.capacity() < RECYCLE_MIN_LEN {
        return;
    }
    let Ok(mut pool) = RECYCLED.lock() else { return };
    if pool.len() < RECYCLED_MAX {
        pool.push(buffer);
    } else if let Some(smallest) = pool.iter_mut().min_by_key(|b| b.capacity()) {
        if smallest.capacity() < buffer.capacity() {
            *smallest = buffer;
        }
    }
}

/// Large buffers for [`HostTensor::for_overwrite`]: those of tensors the
/// forward pass dropped and the step's logits once sampled; at most
/// [`RECYCLED_MAX`] (the freed memory stays in the process anyway: see
/// `keep_freed_memory`).
static RECYCLED: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// Buffers [`RECYCLED`] keeps: more than one layer's live activations.
const RECYCLED_MAX: usize = 16;

/// Outputs at least this long (256 KiB) are worth keeping for reuse: a
/// 64-sequence decode step's activations are 0.2–0.5 MiB, and zeroing fresh
/// ones was 3% of a Gemma 3 decode step.
const RECYCLE_MIN_LEN: usize = 1 << 16;

/// The CPU implementation of the model operations.
#[derive(Clone, Debug, Default)]
pub struct CpuOps {
    weight_format: WeightFormat,
    activations: ActBits,
    /// Set during a calibration pass: int8 linears record their inputs'
    /// statistics ([`crate::outliers`]).
    calibrating: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The largest |key| and |value| each layer wrote during calibration
    /// passes (shared by the ranks of a tensor-parallel group, so that their
    /// shards get the scales of the whole layer): an FP8 cache's scales.
    kv_absmax: std::sync::Arc<KvAbsmax>,
    /// The tensor-parallel group this instance is a rank of, and its rank
    /// (`None`: a group of one).
    group: Option<(std::sync::Arc<HostGroup>, usize)>,
}

impl CpuOps {
    /// Operations that store linear weights as `format`, multiplying
    /// quantized weights by int8 activations ([`ActBits::I8`]).
    pub fn new(weight_format: WeightFormat) -> Self {
        keep_freed_memory();
        Self { weight_format, activations: ActBits::I8, calibrating: Default::default(), kv_absmax: Default::default(), group: None }
    }

    /// `size` instances of these operations, rank 0 first, whose
    /// [`Ops::all_reduce`] sums over one in-process group
    /// ([`HostGroup`]): the ranks of a tensor-parallel model
    /// (`vellum-models`' `ModelRunner::load_tensor_parallel`), each run on
    /// a thread of its own. Their linears and attention share the
    /// process's threads.
    pub fn tensor_parallel_group(&self, size: usize) -> Vec<CpuOps> {
        let group = std::sync::Arc::new(HostGroup::new(size));
        (0..size.max(1)).map(|rank| CpuOps { group: Some((group.clone(), rank)), ..self.clone() }).collect()
    }

    /// The same operations with integer-kernel activations quantized to
    /// `bits` (int16: 20× closer to float32 at half the rate).
    pub fn with_activations(self, bits: ActBits) -> Self {
        Self { activations: bits, ..self }
    }

    /// The requested weight format.
    pub fn weight_format(&self) -> WeightFormat {
        self.weight_format
    }

    /// A linear weight, multiplying activations of the width its role
    /// takes (see [`CpuOps::activations_for`]).
    fn weight(&self, w: &WeightView<'_>) -> vellum_ops::Result<HostWeight> {
        HostWeight::from_view(w, self.weight_format, self.activations_for(&w.name))
    }

    /// The activation width of the linear named `name` (its Hugging Face
    /// name): [`CpuOps::activations`] for every linear, unless
    /// `VELLUM_CPU_ACT` names another for its role (to measure where the
    /// error comes from; `examples/accuracy.rs` in the engine). On the int8
    /// path the outlier channels a calibration chose go through f32 beside
    /// every int8 product ([`crate::outliers`]), which makes the scale per
    /// 16 values ([`ActBits::I8Halves`]) the query, key and value
    /// projections once took unnecessary: on SmolLM2 and Gemma 3 the KL
    /// divergence to the float32 path is the same with or without it
    /// (KERNELS.md).
    pub fn activations_for(&self, name: &str) -> ActBits {
        activation_override(name).unwrap_or(self.activations)
    }
}

/// Keeps freed large buffers in the process instead of handing them back
/// to the kernel (glibc; once per process, by the first [`CpuOps::new`]).
///
/// glibc serves every allocation above its mmap threshold (at most 32 MiB)
/// with a fresh `mmap` and unmaps it on free, so each large activation of a
/// prefill step (a 64-sequence Gemma 3 step's MLP output is 67 MB) faulted
/// in zeroed pages again at every layer: 16% of that step's profile, 2.5 M
/// minor faults in one `vellum bench latency --batch-size 64` run (0.77 M
/// after, most of them the KV cache's first touch), prefill +23–31%.
/// Large allocations now come from the heap (`M_MMAP_MAX = 0`), one arena
/// (`M_ARENA_MAX = 1`), which keeps up to 2 GiB of freed memory
/// (`M_TRIM_THRESHOLD`): the process's resident size stays at its peak, as
/// an inference engine's working set does anyway.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only sets allocator parameters; it has no
            // pointer arguments and glibc takes the arena lock around it,
            // so other threads may allocate meanwhile.
            unsafe {
                libc::mallopt(libc::M_MMAP_MAX, 0);
                libc::mallopt(libc::M_ARENA_MAX, 1);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            }
        });
    }
}

/// A rotary table and the rotations of the current step's positions.
///
/// Every layer rotates q and k at the same positions, so the step's `cos`
/// and `sin` (a `cos`/`sin` pair in f64 per value: 4% of a 64-sequence
/// Gemma 3 prefill when each call recomputed them) are computed by the
/// first call and reused while the positions stay the same.
pub struct CpuRope {
    table: RopeTable,
    step: std::sync::Mutex<RopeRows>,
}

/// The rotations of one list of positions: per position `head_dim / 2`
/// cosines, then as many sines.
#[derive(Default)]
struct RopeRows {
    positions: Vec<u32>,
    cos_sin: Vec<f32>,
}

impl RopeRows {
    /// Makes these the rotations of `positions` (a no-op when they are).
    fn fill(&mut self, table: &RopeTable, positions: &[u32]) {
        if self.positions == positions {
            return;
        }
        let (hd, half) = (table.head_dim(), table.head_dim() / 2);
        self.positions.clear();
        self.positions.extend_from_slice(positions);
        self.cos_sin.resize(positions.len() * hd, 0.0);
        for (row, &pos) in self.cos_sin.chunks_exact_mut(hd).zip(positions) {
            let (cos, sin) = row.split_at_mut(half);
            table.cos_sin(pos, cos, sin);
        }
    }
}

/// The activation width `VELLUM_CPU_ACT` gives the linear named `name`, for
/// measuring where quantization error comes from (`examples/accuracy.rs` in
/// the engine): comma-separated `role=bits` with roles `q k v o gate up down
/// head` and bits `int8`, `halves`, `int16`; `VELLUM_CPU_ACT_LAYERS=3,7-9`
/// limits the roles other than `head` to those layers.
fn activation_override(name: &str) -> Option<ActBits> {
    let spec = std::env::var("VELLUM_CPU_ACT").ok()?;
    let role = [
        ("self_attn.q_proj", "q"),
        ("self_attn.k_proj", "k"),
        ("self_attn.v_proj", "v"),
        ("self_attn.o_proj", "o"),
        ("mlp.gate_proj", "gate"),
        ("mlp.up_proj", "up"),
        ("mlp.down_proj", "down"),
        ("embed_tokens", "head"),
        ("lm_head", "head"),
    ]
    .iter()
    .find(|(p, _)| name.contains(p))?
    .1;
    if role != "head" {
        if let Ok(layers) = std::env::var("VELLUM_CPU_ACT_LAYERS") {
            let layer: usize = name.split("layers.").nth(1)?.split('.').next()?.parse().ok()?;
            let listed = layers.split(',').any(|r| match r.split_once('-') {
                Some((a, b)) => a.trim().parse::<usize>().is_ok_and(|a| a <= layer) && b.trim().parse::<usize>().is_ok_and(|b| layer <= b),
                None => r.trim().parse::<usize>() == Ok(layer),
            });
            if !listed {
                return None;
            }
        }
    }
    spec.split(',').find_map(|entry| {
        let (r, bits) = entry.split_once('=')?;
        (r.trim() == role).then_some(())?;
        match bits.trim() {
            "int8" => Some(ActBits::I8),
            "halves" => Some(ActBits::I8Halves),
            "int16" => Some(ActBits::I16),
            _ => None,
        }
    })
}

/// Element-wise ops split across the rayon threads from this many values.
const PAR_ELEMENTS: usize = 1 << 16;

/// One step's inputs on the host: the batch's metadata, borrowed by the
/// kernels as an [`AttentionMetadata`].
#[derive(Clone, Debug)]
pub struct HostStep {
    batch: ForwardBatch,
    block_size: usize,
}

impl HostStep {
    /// The step's attention metadata for KV-cache group `group`.
    pub fn meta(&self, group: usize) -> AttentionMetadata<'_> {
        self.batch.attention_metadata(self.block_size, group)
    }
}

/// Host memory the OS reports available (`MemAvailable`), or 4 GiB where it
/// cannot tell.
pub fn available_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(4 << 30)
}

fn check(cond: bool, what: impl FnOnce() -> String) -> OpResult<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::Backend(what()))
    }
}

impl HostIo for CpuOps {
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> OpResult<HostTensor> {
        if data.len() != rows * cols {
            return Err(Error::Backend(format!("upload: {} values for [{rows}, {cols}]", data.len())));
        }
        Ok(HostTensor { rows, cols, data: data.to_vec() })
    }

    fn read_kv(&self, cache: &KvCache, layer: usize, value: bool) -> OpResult<Vec<f32>> {
        let at = cache.layer_slot(layer).ok_or_else(|| Error::Backend(format!("read_kv: no layer {layer}")))?;
        let (pools, scale) = (&cache.layers[at.slot], cache.scale(layer));
        let (mut x, s) = if value { (pools.v.to_f32_vec(), scale.v) } else { (pools.k.to_f32_vec(), scale.k) };
        if s != 1.0 {
            x.iter_mut().for_each(|x| *x *= s);
        }
        Ok(x)
    }
}

impl Ops for CpuOps {
    type Weight = HostWeight;
    type Vector = Vec<f32>;
    type Rope = CpuRope;

    fn linear_weight(&self, w: WeightView<'_>) -> vellum_ops::Result<HostWeight> {
        self.weight(&w)
    }

    fn embedding_weight(&self, w: WeightView<'_>) -> vellum_ops::Result<HostWeight> {
        // One copy serves both lookups (rows dequantized on demand) and the
        // tied LM head (int8 activations there cost 0.021 nats more than
        // int16 on SmolLM2's golden prompts and buy 29% of Gemma 3's
        // 64-sequence decode: its 262,144-row head is 63% of the weights).
        self.weight(&w)
    }

    /// int8 activations take their outlier channels from a calibration
    /// pass ([`crate::outliers`]); the exact paths need none.
    fn wants_calibration(&self) -> bool {
        self.weight_format != WeightFormat::F32 && self.activations.int8()
    }

    fn set_calibrating(&self, on: bool) {
        self.calibrating.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn vector(&self, _name: &str, data: &[f32]) -> vellum_ops::Result<Vec<f32>> {
        Ok(data.to_vec())
    }

    fn rope_table(&self, table: &RopeTable) -> vellum_ops::Result<CpuRope> {
        Ok(CpuRope { table: table.clone(), step: std::sync::Mutex::new(RopeRows::default()) })
    }

    fn embed(&self, table: &HostWeight, step: &HostStep) -> OpResult<HostTensor> {
        gather_rows(table, &step.batch.token_ids, |id| format!("token id {id} outside the vocabulary of {}", table.out))
    }

    fn linear(&self, x: &HostTensor, w: &HostWeight, bias: Option<&Vec<f32>>) -> OpResult<HostTensor> {
        check(x.cols == w.inp, || format!("linear: input width {} but the weight takes {}", x.cols, w.inp))?;
        let (m, n) = (x.rows, w.out);
        // The integer kernels store every output cell; the others add into it.
        let mut out = if w.overwrites_output() { HostTensor::for_overwrite(m, n) } else { HostTensor::zeros(m, n) };
        if m == 0 {
            return Ok(out);
        }
        crate::linear::matmul(&mut out.data, &x.data, w, m, self.calibrating.load(std::sync::atomic::Ordering::Relaxed));
        if let Some(b) = bias {
            check(b.len() == n, || format!("linear: bias of {} for {n} outputs", b.len()))?;
            for row in out.data.chunks_exact_mut(n) {
                for (y, bi) in row.iter_mut().zip(b) {
                    *y += bi;
                }
            }
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &HostTensor, w: &Vec<f32>, eps: f32, group: usize) -> OpResult<HostTensor> {
        check(group > 0 && x.cols.is_multiple_of(group) && w.len() == group, || {
            format!("rms_norm: width {} group {group} weight {}", x.cols, w.len())
        })?;
        let mut out = HostTensor::for_overwrite(x.rows, x.cols);
        if out.data.len() >= PAR_ELEMENTS {
            let per_part = group * (PAR_ELEMENTS / group).max(1);
            crate::spin_team::for_chunks_mut(&mut out.data, per_part, &|i, part| {
                rms_norm_part(part, &x.data[i * per_part..i * per_part + part.len()], w, eps)
            });
        } else {
            rms_norm_part(&mut out.data, &x.data, w, eps);
        }
        Ok(out)
    }

    fn rope(&self, x: &mut HostTensor, rope: &CpuRope, step: &HostStep) -> OpResult<()> {
        let positions = &step.batch.positions;
        let head_dim = rope.table.head_dim();
        check(x.rows == positions.len() && head_dim > 0 && x.cols.is_multiple_of(head_dim), || {
            format!("rope: {} rows of width {} for {} positions, head_dim {head_dim}", x.rows, x.cols, positions.len())
        })?;
        let half = head_dim / 2;
        // A poisoned lock only means another call panicked mid-fill: the
        // positions check below refills it.
        let mut rows = rope.step.lock().unwrap_or_else(|e| e.into_inner());
        rows.fill(&rope.table, positions);
        let (cols, cos_sin) = (x.cols, &rows.cos_sin);
        let rotate = |first_row: usize, part: &mut [f32]| {
            for (r, row) in part.chunks_exact_mut(cols).enumerate() {
                let (cos, sin) = cos_sin[(first_row + r) * head_dim..(first_row + r + 1) * head_dim].split_at(half);
                for head in row.chunks_exact_mut(head_dim) {
                    let (a, b) = head.split_at_mut(half);
                    for i in 0..half {
                        let (x0, x1) = (a[i], b[i]);
                        a[i] = x0 * cos[i] - x1 * sin[i];
                        b[i] = x1 * cos[i] + x0 * sin[i];
                    }
                }
            }
        };
        if x.data.len() >= PAR_ELEMENTS {
            let rows_per_part = (PAR_ELEMENTS / cols).max(1);
            crate::spin_team::for_chunks_mut(&mut x.data, rows_per_part * cols, &|i, part| rotate(i * rows_per_part, part));
        } else {
            rotate(0, &mut x.data);
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &HostTensor, up: &HostTensor) -> OpResult<HostTensor> {
        gated(gate, up, "silu_mul", |g| g / (1.0 + (-g).exp()))
    }

    fn gelu_tanh_mul(&self, gate: &HostTensor, up: &HostTensor) -> OpResult<HostTensor> {
        gated(gate, up, "gelu_tanh_mul", gelu_tanh)
    }

    fn scale(&self, x: &mut HostTensor, factor: f32) -> OpResult<()> {
        x.data.iter_mut().for_each(|v| *v *= factor);
        Ok(())
    }

    fn embed_positions(&self, table: &HostWeight, step: &HostStep) -> OpResult<HostTensor> {
        gather_rows(table, &step.batch.positions, |p| format!("position {p} past the {} learned positions", table.out))
    }

    fn layer_norm(&self, x: &HostTensor, w: &Vec<f32>, b: &Vec<f32>, eps: f32) -> OpResult<HostTensor> {
        check(w.len() == x.cols && b.len() == x.cols, || format!("layer_norm: width {} weight {} bias {}", x.cols, w.len(), b.len()))?;
        let cols = x.cols.max(1);
        let mut out = HostTensor::for_overwrite(x.rows, x.cols);
        let rows = |at: usize, out: &mut [f32]| {
            for (o, r) in out.chunks_exact_mut(cols).zip(x.data[at..].chunks_exact(cols)) {
                // Two passes in f64: the mean, then the variance about it.
                let n = r.len() as f64;
                let mean = r.iter().map(|&v| v as f64).sum::<f64>() / n;
                let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
                let inv = 1.0 / (var + eps as f64).sqrt();
                for (((o, &v), &w), &b) in o.iter_mut().zip(r).zip(w).zip(b) {
                    *o = ((v as f64 - mean) * inv) as f32 * w + b;
                }
            }
        };
        if out.data.len() >= PAR_ELEMENTS {
            let per_part = cols * (PAR_ELEMENTS / cols).max(1);
            crate::spin_team::for_chunks_mut(&mut out.data, per_part, &|i, o| rows(i * per_part, o));
        } else {
            rows(0, &mut out.data);
        }
        Ok(out)
    }

    fn gelu(&self, x: &HostTensor) -> OpResult<HostTensor> {
        let mut out = HostTensor::for_overwrite(x.rows, x.cols);
        let part = |at: usize, o: &mut [f32]| o.iter_mut().zip(&x.data[at..]).for_each(|(o, &v)| *o = gelu_erf(v));
        if out.data.len() >= PAR_ELEMENTS {
            crate::spin_team::for_chunks_mut(&mut out.data, PAR_ELEMENTS, &|i, o| part(i * PAR_ELEMENTS, o));
        } else {
            part(0, &mut out.data);
        }
        Ok(out)
    }

    fn add_assign(&self, x: &mut HostTensor, y: &HostTensor) -> OpResult<()> {
        check((x.rows, x.cols) == (y.rows, y.cols) && x.data.len() == y.data.len(), || {
            format!("add_assign: [{}, {}] += [{}, {}]", x.rows, x.cols, y.rows, y.cols)
        })?;
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    fn logits_rows(&self, x: &HostTensor, step: &HostStep) -> OpResult<HostTensor> {
        let rows = &step.batch.logits_indices;
        let mut out = HostTensor::zeros(rows.len(), x.cols);
        for (dst, &r) in out.data.chunks_exact_mut(x.cols).zip(rows) {
            let r = r as usize;
            check(r < x.rows, || format!("logits row {r} outside the batch of {}", x.rows))?;
            dst.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        Ok(out)
    }

    fn to_host(&self, x: &HostTensor) -> OpResult<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn take_host(&self, x: HostTensor) -> OpResult<Vec<f32>> {
        Ok(x.into_data())
    }

    fn reuse_host_buffer(&self, buffer: Vec<f32>) {
        recycle(buffer);
    }

    fn all_reduce(&self, x: &mut HostTensor) -> OpResult<()> {
        match &self.group {
            Some((group, rank)) => group.all_reduce(*rank, &mut x.data),
            None => Ok(()),
        }
    }

    fn fail_group(&self) {
        if let Some((group, _)) = &self.group {
            group.fail();
        }
    }

    fn reset_group(&self) {
        if let Some((group, _)) = &self.group {
            group.reset();
        }
    }

    fn embed_vocab_shard(&self, table: &HostWeight, step: &HostStep, vocab_start: usize, vocab_size: usize) -> OpResult<HostTensor> {
        let ids = &step.batch.token_ids;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(Error::Backend(format!("token id {id} outside the vocabulary of {vocab_size}")));
        }
        let mut out = HostTensor::zeros(ids.len(), table.inp);
        for (row, &id) in out.data.chunks_exact_mut(table.inp).zip(ids) {
            // Rows of other ranks' shards stay zero.
            if let Some(local) = (id as usize).checked_sub(vocab_start).filter(|&i| i < table.out) {
                table.row(local, row);
            }
        }
        Ok(out)
    }

    fn run_forward<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // The pass runs on a rayon worker, so each op's parallel section
        // starts from the pool (one hand-off per step instead of one per op).
        rayon::scope(|_| f())
    }
}

/// Rows `indices` of `table` (an embedding lookup), each index checked
/// against the table's rows (`outside(index)` says what one past them is).
fn gather_rows(table: &HostWeight, indices: &[u32], outside: impl Fn(usize) -> String) -> OpResult<HostTensor> {
    let mut out = HostTensor::zeros(indices.len(), table.inp);
    for (row, &i) in out.data.chunks_exact_mut(table.inp).zip(indices) {
        let i = i as usize;
        check(i < table.out, || outside(i))?;
        table.row(i, row);
    }
    Ok(out)
}

/// The exact GELU, `0.5·x·(1 + erf(x/√2))` ([`erf`]).
fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

/// The error function to within 1.5e-7 (Abramowitz and Stegun 7.1.26: one
/// exponential and a polynomial in `1/(1 + p|x|)`), below the f32 rounding
/// of the GELU it feeds for all but tiny inputs, where GELU ≈ x/2 anyway.
fn erf(x: f64) -> f64 {
    const P: f64 = 0.327_591_1;
    const A: [f64; 5] = [0.254_829_592, -0.284_496_736, 1.421_413_741, -1.453_152_027, 1.061_405_429];
    let t = 1.0 / (1.0 + P * x.abs());
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    (1.0 - poly * (-x * x).exp()).copysign(x)
}

#[cfg(test)]
mod erf_tests {
    #[test]
    fn erf_and_gelu_match_tabulated_values() {
        // erf from the tables (to 16 digits).
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.5204998778130465),
            (1.0, 0.8427007929497149),
            (2.0, 0.9953222650189527),
            (3.0, 0.9999779095030014),
            (3.4999, 0.9999992566),
            (3.5, 0.9999992569016276),
            (5.0, 0.9999999999984626),
        ] {
            let got = super::erf(x);
            assert!((got - want).abs() < 1.5e-7, "erf({x}) = {got}, want {want}");
            assert_eq!(super::erf(-x), -got);
        }
        // GELU(1) = 0.5·(1 + erf(1/√2)) = 0.8413447460685429.
        assert!((super::gelu_erf(1.0) as f64 - 0.841_344_746_068_542_9).abs() < 1e-7);
        assert_eq!(super::gelu_erf(0.0), 0.0);
    }
}

/// The core attention contract on host memory.
impl AttentionBackend for CpuOps {
    type Tensor = HostTensor;
    type KvCache = KvCache;
    type Step = HostStep;

    fn describe(&self) -> String {
        let kernel = format!("{:?}", quant::Kernel::detect()).to_ascii_lowercase();
        let acts = match (self.weight_format, self.activations) {
            (WeightFormat::F32, _) => "float32",
            (_, ActBits::I16) => "int16 activations",
            (_, ActBits::I8Halves) => "int8 activations, a scale per 16, outlier channels in f32",
            (_, ActBits::I8) => "int8 activations, outlier channels in f32",
        };
        format!("cpu ({kernel}, {} threads, weights {:?}, {acts})", rayon::current_num_threads(), self.weight_format)
    }

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            head_dims: Sizes::ANY,
            block_sizes: Sizes::ANY,
            kv_dtypes: &[KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3],
            kv_groups: true,
        }
    }

    fn kv_memory(&self, _spec: &KvCacheSpec) -> KvMemory {
        KvMemory { available_bytes: available_memory_bytes(), max_blocks: None, device: None }
    }

    fn allocate_kv_cache(&self, spec: &KvCacheSpec, num_blocks: usize, num_host_blocks: usize) -> vellum_base::Result<KvCache> {
        let layout = KvCacheLayout { num_blocks, block_size: spec.block_size, num_kv_heads: spec.num_kv_heads, head_dim: spec.head_dim };
        let cache = KvCache::try_grouped(layout, spec.groups.clone(), num_host_blocks, spec.dtype).map_err(|e| {
            Error::Backend(format!("the KV cache ({num_blocks} blocks, {num_host_blocks} host blocks, {:?}): {e}", spec.dtype))
        })?;
        Ok(if spec.dtype.is_scaled() { cache.with_scales(&self.kv_absmax.scales(spec.groups.num_layers())) } else { cache })
    }

    fn prepare_step(&self, batch: &ForwardBatch, block_size: usize) -> vellum_base::Result<HostStep> {
        let (t, rows) = (batch.num_tokens(), batch.num_seqs() * batch.block_table_stride);
        let groups = batch.kv_groups();
        if batch.slot_mapping.len() != groups * t || batch.block_tables.len() < groups * rows {
            return Err(Error::Backend(format!(
                "prepare_step: {groups} KV groups of {t} tokens and {rows} block-table entries need {} slots and {} entries, the batch has {} and {}",
                groups * t,
                groups * rows,
                batch.slot_mapping.len(),
                batch.block_tables.len()
            )));
        }
        Ok(HostStep { batch: batch.clone(), block_size })
    }

    fn write_kv(&self, cache: &mut KvCache, layer: usize, k: &HostTensor, v: &HostTensor, step: &HostStep) -> vellum_base::Result<()> {
        let layout = cache.layout;
        let at = cache.layer_slot(layer).ok_or_else(|| Error::Backend(format!("write_kv: no layer {layer}")))?;
        check_group(at.group, step)?;
        if self.calibrating.load(std::sync::atomic::Ordering::Relaxed) {
            self.kv_absmax.observe(layer, &k.data, &v.data);
        }
        let scale = cache.scale(layer);
        write_kv(&mut cache.layers[at.slot], &layout, &k.data, &v.data, step.meta(at.group).slot_mapping, scale);
        Ok(())
    }

    fn paged_attention(
        &self,
        cache: &KvCache,
        layer: usize,
        q: &HostTensor,
        step: &HostStep,
        shape: &AttentionShape,
    ) -> vellum_base::Result<HostTensor> {
        let at = cache.layer_slot(layer).ok_or_else(|| Error::Backend(format!("paged_attention: no layer {layer}")))?;
        check_group(at.group, step)?;
        if !shape.causal {
            // Bidirectional attention is defined over a whole prompt computed
            // at once: a chunk, a cached prefix or a decode would see part of it.
            let meta = &step.batch;
            let whole = (0..meta.context_lens.len()).all(|s| meta.query_start_loc[s + 1] - meta.query_start_loc[s] == meta.context_lens[s]);
            check(whole, || "paged_attention: bidirectional attention needs each prompt whole in one step".into())?;
        }
        // Every row is written: each work item zeroes its run first.
        let mut out = HostTensor::for_overwrite(q.rows, shape.num_heads * shape.head_dim);
        paged_attention(&mut out.data, &q.data, &cache.layers[at.slot], &cache.layout, &step.meta(at.group), shape, cache.scale(layer));
        Ok(out)
    }

    fn copy_blocks(&self, cache: &mut KvCache, copies: &[BlockCopy]) -> vellum_base::Result<()> {
        StepBounds::check_copies(copies, cache.layout.num_blocks)?;
        cache.copy_blocks(copies);
        Ok(())
    }

    fn swap_blocks(&self, cache: &mut KvCache, swaps: &[BlockSwap], to_host: bool) -> vellum_base::Result<()> {
        StepBounds::check_swaps(swaps, cache.layout.num_blocks, cache.num_host_blocks)?;
        cache.swap_blocks(swaps, to_host);
        Ok(())
    }
}

/// A layer of KV-cache group `group` needs the step to carry that group.
fn check_group(group: usize, step: &HostStep) -> vellum_base::Result<()> {
    let groups = step.batch.kv_groups();
    if group < groups {
        Ok(())
    } else {
        Err(Error::Backend(format!("a layer of KV-cache group {group} in a batch of {groups} groups")))
    }
}

/// `act(gate) · up`, element-wise, in parallel for large tensors.
fn gated(gate: &HostTensor, up: &HostTensor, what: &str, act: impl Fn(f32) -> f32 + Sync) -> OpResult<HostTensor> {
    check((gate.rows, gate.cols) == (up.rows, up.cols), || format!("{what}: shapes differ"))?;
    let mut out = HostTensor::for_overwrite(gate.rows, gate.cols);
    if gate.data.len() >= PAR_ELEMENTS {
        crate::spin_team::for_chunks_mut(&mut out.data, PAR_ELEMENTS, &|i, part| {
            let at = i * PAR_ELEMENTS..i * PAR_ELEMENTS + part.len();
            gated_part(part, &gate.data[at.clone()], &up.data[at], &act);
        });
    } else {
        gated_part(&mut out.data, &gate.data, &up.data, &act);
    }
    Ok(out)
}

/// `out[i] = act(gate[i]) · up[i]`, compiled for AVX2 and FMA where the CPU
/// has them (eight lanes instead of SSE2's four; `act` must inline).
fn gated_part(out: &mut [f32], gate: &[f32], up: &[f32], act: &impl Fn(f32) -> f32) {
    #[inline(always)]
    fn rows(out: &mut [f32], gate: &[f32], up: &[f32], act: &impl Fn(f32) -> f32) {
        for (o, (g, u)) in out.iter_mut().zip(gate.iter().zip(up)) {
            *o = act(*g) * u;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if crate::quant::has_simd() {
        /// `rows` compiled for AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must have AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn simd(out: &mut [f32], gate: &[f32], up: &[f32], act: &impl Fn(f32) -> f32) {
            rows(out, gate, up, act)
        }
        // SAFETY: has_simd() found AVX2 and FMA.
        return unsafe { simd(out, gate, up, act) };
    }
    rows(out, gate, up, act)
}

/// RMSNorm of the rows of `x` (each `w.len()` wide) into `out`: the mean
/// square summed in sixteen lanes (a single running sum would be a chain of
/// dependent additions), compiled for AVX2 and FMA where the CPU has them.
fn rms_norm_part(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    #[inline(always)]
    fn rows(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
        const LANES: usize = 16;
        let group = w.len();
        for (o, xr) in out.chunks_exact_mut(group).zip(x.chunks_exact(group)) {
            let chunks = xr.chunks_exact(LANES);
            let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
            let mut acc = [0.0f32; LANES];
            for c in chunks {
                for (a, v) in acc.iter_mut().zip(c) {
                    *a += v * v;
                }
            }
            let ms = (acc.iter().sum::<f32>() + tail) / group as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, v), wi) in o.iter_mut().zip(xr).zip(w) {
                *o = v * inv * wi;
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if crate::quant::has_simd() {
        /// `rows` compiled for AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU must have AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn simd(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
            rows(out, x, w, eps)
        }
        // SAFETY: has_simd() found AVX2 and FMA.
        return unsafe { simd(out, x, w, eps) };
    }
    rows(out, x, w, eps)
}

/// GELU, tanh approximation: `0.5·x·(1 + tanh(u))` with
/// `u = √(2/π)·(x + 0.044715·x³)`, computed as `x·σ(2u) = x / (1 + e^(−2u))`
/// (the same function: `(1 + tanh u) / 2 = σ(2u)`), one `exp` instead of
/// `tanh`'s two-sided evaluation. Large negative `u` gives `x / ∞ = −0`.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    x / (1.0 + vellum_base::exp_f32(-2.0 * SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_equals_its_tanh_definition() {
        for i in -2000..=2000 {
            let x = i as f64 / 100.0;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            let want = 0.5 * x * (1.0 + u.tanh());
            let got = f64::from(gelu_tanh(x as f32));
            assert!((got - want).abs() <= 2e-6 * want.abs().max(1e-3), "gelu_tanh({x}) = {got}, want {want}");
        }
        assert_eq!(gelu_tanh(-1e4), 0.0);
        assert_eq!(gelu_tanh(1e4), 1e4);
    }
    use crate::quant::QuantKind;

    use vellum_base::SeededRng;

    fn lcg(rng: &mut SeededRng) -> u32 {
        (rng.next_u64() >> 33) as u32
    }

    /// A Q4_1 `[n, k]` weight as a GGUF stores it (`k` a multiple of 32),
    /// and its values.
    fn q4_weight(n: usize, k: usize, seed: &mut SeededRng) -> (WeightView<'static>, Vec<f32>) {
        let mut bytes = Vec::with_capacity(n * k / 32 * 20);
        for _ in 0..n * k / 32 {
            bytes.extend_from_slice(&half::f16::from_f32((lcg(seed) % 1000) as f32 * 1e-5 + 1e-3).to_le_bytes());
            bytes.extend_from_slice(&half::f16::from_f32((lcg(seed) % 1000) as f32 * -1e-5).to_le_bytes());
            for j in 0..16u32 {
                let lo = if j == 0 { 0 } else { lcg(seed) % 16 };
                let hi = if j == 1 { 15 } else { lcg(seed) % 16 };
                bytes.push((lo | (hi << 4)) as u8);
            }
        }
        let view = WeightView::new("w", vec![n, k], vellum_ops::quant::GgmlType::Q4_1, bytes.into()).expect("whole blocks");
        let values = view.to_f32().expect("Q4_1 dequantizes");
        (view, values)
    }

    fn acts(m: usize, k: usize, seed: &mut SeededRng) -> HostTensor {
        let data = (0..m * k).map(|i| if i % 211 == 7 { 30.0 } else { (lcg(seed) % 2001) as f32 / 1000.0 - 1.0 }).collect();
        HostTensor { rows: m, cols: k, data }
    }

    #[test]
    fn every_format_matches_f64_and_auto_picks_lossless_storage() {
        let mut seed = SeededRng::new(5);
        for &(m, n, k) in &[(1, 37, 96), (3, 64, 576), (20, 33, 160), (40, 48, 64)] {
            let (view, w) = q4_weight(n, k, &mut seed);
            let x = acts(m, k, &mut seed);
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            // (format, storage, tolerance with int16 / int8 activations; these
            // activations hold an outlier of 30 every 211 values, so int8
            // codes of those blocks step by 0.24).
            let cases = [
                (WeightFormat::F32, None, 1e-5, 1e-5),
                (WeightFormat::Q4, Some(QuantKind::Q4), 1e-3, 1.5e-2),
                (WeightFormat::Q8, Some(QuantKind::Q8), 2e-2, 3e-2),
                (WeightFormat::Auto, Some(QuantKind::Q4).filter(|_| quant::has_simd()), 1e-3, 1.5e-2),
            ];
            for ((format, kind, tol16, tol8), bits) in cases.into_iter().flat_map(|c| [(c, ActBits::I16), (c, ActBits::I8)]) {
                let tol = if bits == ActBits::I16 { tol16 } else { tol8 };
                let ops = CpuOps::new(format).with_activations(bits);
                let wt = ops.linear_weight(view.clone()).expect("2-D weight");
                assert_eq!(wt.quant_kind(), kind, "{format:?}");
                let y = ops.linear(&x, &wt, Some(&bias)).expect("shapes match");
                let (mut err, mut norm) = (0.0f64, 0.0f64);
                for r in 0..m {
                    for c in 0..n {
                        let exact: f64 = (0..k).map(|i| x.data[r * k + i] as f64 * w[c * k + i] as f64).sum::<f64>() + bias[c] as f64;
                        err += (y.data[r * n + c] as f64 - exact).powi(2);
                        norm += exact * exact;
                    }
                }
                let rel = (err / norm).sqrt();
                assert!(rel <= tol, "{format:?} {bits:?} ({m},{n},{k}): relative error {rel}");
            }
        }
    }

    #[test]
    fn a_row_computes_the_same_alone_or_in_a_large_batch() {
        // Auto switches kernels with the batch size; a row's result must not.
        let mut seed = SeededRng::new(9);
        let (m, n, k) = (40, 50, 192);
        let (view, _) = q4_weight(n, k, &mut seed);
        let x = acts(m, k, &mut seed);
        for format in [WeightFormat::Auto, WeightFormat::Q4, WeightFormat::F32] {
            let ops = CpuOps::new(format);
            let wt = ops.linear_weight(view.clone()).expect("2-D weight");
            let all = ops.linear(&x, &wt, None).expect("shapes match");
            for r in [0, 7, 39] {
                let one = HostTensor { rows: 1, cols: k, data: x.data[r * k..(r + 1) * k].to_vec() };
                let y = ops.linear(&one, &wt, None).expect("shapes match");
                for c in 0..n {
                    let (a, b) = (all.data[r * n + c], y.data[c]);
                    assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{format:?} row {r} col {c}: {a} in the batch, {b} alone");
                }
            }
        }
    }

    /// Random GGUF blocks of `ty` for an `[n, k]` weight, f16 fields small.
    fn random_blocks(ty: vellum_ops::quant::GgmlType, n: usize, k: usize, seed: &mut SeededRng) -> WeightView<'static> {
        use vellum_ops::quant::GgmlType;
        let (block, nb) = ty.block_layout();
        let mut bytes: Vec<u8> = (0..n * k / block * nb).map(|_| seed.below(256) as u8).collect();
        let halves: &[usize] = match ty {
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q5_1 => &[0, 2],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            _ => &[0],
        };
        for b in bytes.chunks_exact_mut(nb) {
            for &at in halves {
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(seed.signed_f32() * 0.01).to_le_bytes());
            }
        }
        WeightView::new("w", vec![n, k], ty, bytes.into()).expect("whole blocks")
    }

    #[test]
    fn gguf_blocks_multiply_and_look_up_their_exact_values() {
        use vellum_ops::quant::GgmlType;
        let mut seed = SeededRng::new(21);
        let types = [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_1, GgmlType::Q5_0];
        let int8 = [GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K].map(|t| (t, ActBits::I8));
        for (ty, bits) in types.into_iter().map(|t| (t, ActBits::I16)).chain(int8) {
            let (n, k) = (70, 512);
            let view = random_blocks(ty, n, k, &mut seed);
            let w = view.to_f32().expect("dequantizable");
            let ops = CpuOps::new(WeightFormat::Auto).with_activations(bits);
            let wt = ops.embedding_weight(view.clone()).expect("2-D weight");
            let integer = match ty {
                GgmlType::Q5_0 => Some(QuantKind::Q8),
                GgmlType::Q4_K => Some(QuantKind::Q4K),
                GgmlType::Q6_K => Some(QuantKind::Q6K),
                _ => None,
            }
            .filter(|_| quant::has_simd());
            if let Some(kind) = integer {
                assert_eq!(wt.quant_kind(), Some(kind), "{ty} runs the integer kernel");
            } else {
                assert_eq!(wt.gguf_blocks(), Some(ty), "{ty}: the file's blocks are kept");
                assert_eq!(wt.memory_bytes(), view.data.len(), "{ty}: no larger than the file");
            }
            // Lookups return the exact values, whatever the storage.
            let mut row = vec![0.0; k];
            for r in [0, 33, n - 1] {
                wt.row(r, &mut row);
                assert_eq!(row, w[r * k..(r + 1) * k], "{ty} row {r}");
            }
            for m in [1, 5, 12, 40] {
                let x = acts(m, k, &mut seed);
                let y = ops.linear(&x, &wt, None).expect("shapes match");
                for r in 0..m {
                    for c in 0..n {
                        let exact: f64 = (0..k).map(|i| x.data[r * k + i] as f64 * w[c * k + i] as f64).sum();
                        let scale: f64 = (0..k).map(|i| (x.data[r * k + i] as f64 * w[c * k + i] as f64).abs()).sum();
                        let got = y.data[r * n + c] as f64;
                        // f32 sums (int16 or int8 activations for Q5_0): relative
                        // to the terms' magnitude.
                        let tol = match (integer, bits) {
                            (Some(_), ActBits::I16) => 1e-4,
                            (Some(_), ActBits::I8 | ActBits::I8Halves) => 2e-2,
                            (None, _) => 1e-6,
                        };
                        assert!((got - exact).abs() <= tol * scale + 1e-9, "{ty} m={m} ({r},{c}): {got} vs {exact}");
                    }
                }
            }
        }
    }

    #[test]
    fn non_matrix_weights_are_typed_errors() {
        let ops = CpuOps::default();
        let err = ops.linear_weight(WeightView::from_f32("w", vec![4], &[0.0; 4]));
        assert!(matches!(err, Err(vellum_ops::Error::ShapeMismatch { .. })));
        let x = HostTensor { rows: 1, cols: 3, data: vec![0.0; 3] };
        let w = ops.linear_weight(WeightView::from_f32("w", vec![2, 4], &[0.0; 8])).expect("2-D weight");
        assert!(matches!(ops.linear(&x, &w, None), Err(Error::Backend(_))), "a width mismatch is an error, not a panic");
    }
}
