//! Linear layers on the CPU: how a weight is stored ([`HostWeight`], per
//! [`WeightFormat`]) and the kernels `CpuOps::linear` picks from — the
//! integer kernel on block-quantized weights (every batch size), a
//! dequantize-as-you-go kernel on GGUF blocks the integer kernel does not
//! hold (the K-quants), AXPY streams for a few rows of f32, and the `gemm`
//! crate for more — each splitting the output columns across the rayon
//! threads by hand.

use crate::outliers::{OutlierChannels, Outliers, CHANNELS_PER_OUTLIER_LM_HEAD};
use crate::quant::q5::Q5Lanes;
use crate::quant::{self, ActBits, QuantActs, QuantKind, QuantWeight, WeightFormat};
use vellum_ops::quant::{dequantize_into, GgmlType};
use vellum_ops::WeightView;

/// A weight matrix for `x · Wᵀ` (`[out, in]`, also an embedding table
/// `[vocab, hidden]` whose rows [`HostWeight::row`] looks up).
#[derive(Clone, Debug)]
pub struct HostWeight {
    pub(crate) out: usize,
    pub(crate) inp: usize,
    storage: Storage,
    /// The input channels multiplied in f32 beside the int8 kernel, once a
    /// calibration pass has chosen them ([`crate::outliers`]).
    outliers: OutlierChannels,
}

/// How a [`HostWeight`] keeps its values.
#[derive(Clone, Debug)]
enum Storage {
    /// f32, transposed to `[in, out]` (`[K, N]`) so the GEMM reads it
    /// without repacking.
    F32(Vec<f32>),
    /// Blocks for the integer kernel ([`QuantWeight`]), multiplying
    /// activations quantized to the given width; for a Q5_0 weight also
    /// a copy at the file's 5.5 bits, which one- and two-row products read
    /// instead ([`quant::q5`]: decode streams the weight, and these are
    /// 61% of the lane layout's bytes).
    Quant(QuantWeight, ActBits, Option<Q5Lanes>),
    /// A GGUF file's own blocks, rows of `[out, in]` in order, dequantized a
    /// tile at a time as `linear` runs: the K-quants keep their size in
    /// memory (Q4_K 4.5 bits per weight) and their exact values.
    Blocks { dtype: GgmlType, row_bytes: usize, data: Vec<u8> },
}

/// Whether the weight named `name` (its Hugging Face name) is the LM head:
/// `lm_head`, or the token embedding that a tied model multiplies as one.
fn is_lm_head(name: &str) -> bool {
    name.contains("lm_head") || name.contains("embed_tokens")
}

/// A zeroed buffer for a weight, backed by transparent huge pages where the
/// OS allows it (fewer TLB misses when the weights stream through memory:
/// +10–20% bandwidth measured on this project's machine). The advice is given
/// before the first write, while the zeroed pages are still untouched.
fn weight_buffer(len: usize) -> Vec<f32> {
    let v = vec![0.0f32; len];
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (v.as_ptr() as usize).next_multiple_of(PAGE);
        let end = (v.as_ptr() as usize + len * 4) / PAGE * PAGE;
        if end > start {
            // SAFETY: the range lies inside `v`'s allocation; MADV_HUGEPAGE
            // only advises the kernel and never changes the contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = weight_buffer(w.len());
    const B: usize = 32;
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    t[c * rows + r] = w[r * cols + c];
                }
            }
        }
    }
    t
}

/// A raw pointer that may cross to the worker threads of one `linear` call;
/// each thread writes a disjoint set of columns.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: threads write disjoint column ranges of the destination and the
// scope ends before the destination is read or dropped.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `SendPtr`,
    /// which is `Sync`, rather than its raw field, which is not).
    fn get(&self) -> *mut f32 {
        self.0
    }
}

impl HostWeight {
    /// Prepares a `[out, in]` weight in the resolved format:
    /// - `Auto` keeps GGML Q4_1/Q4_0/Q8_0/Q5_0 blocks bit for bit in the
    ///   integer kernel's layout (where the CPU has that kernel), keeps the
    ///   other quantized GGUF types (K-quants, Q5_1) as the file's blocks,
    ///   and turns f32/f16/bf16 into f32;
    /// - `Q4`/`Q8` quantize whatever they get (lossy unless the blocks
    ///   already were);
    /// - `F32` converts everything to f32 (the reference path).
    ///
    /// Integer-kernel weights multiply activations quantized to `acts`.
    pub(crate) fn from_view(w: &WeightView<'_>, format: WeightFormat, acts: ActBits) -> vellum_ops::Result<HostWeight> {
        let outliers =
            || if is_lm_head(&w.name) { OutlierChannels::one_in(CHANNELS_PER_OUTLIER_LM_HEAD) } else { OutlierChannels::default() };
        let (out, inp) = w.matrix_dims()?;
        let keep_blocks = match format {
            WeightFormat::Auto => quant::has_simd(),
            WeightFormat::Q4 | WeightFormat::Q8 => true,
            WeightFormat::F32 => false,
        };
        let kept = QuantWeight::from_ggml(w.dtype, &w.data, out, inp).filter(|q| {
            keep_blocks
                && match format {
                    WeightFormat::Q4 => q.kind == QuantKind::Q4,
                    WeightFormat::Q8 => q.kind == QuantKind::Q8,
                    _ => true,
                }
        });
        if let Some(q) = kept {
            let q5 = (w.dtype == GgmlType::Q5_0 && acts.int8() && quant::q5::available())
                .then(|| Q5Lanes::from_ggml(&w.data, out, inp))
                .flatten();
            return Ok(HostWeight { out, inp, storage: Storage::Quant(q.into_best_layout(acts), acts, q5), outliers: outliers() });
        }
        let plain = matches!(w.dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if format == WeightFormat::Auto && !plain && w.dtype.is_dequantizable() && out > 0 && inp > 0 {
            let data = w.data.to_vec();
            return Ok(HostWeight {
                out,
                inp,
                storage: Storage::Blocks { dtype: w.dtype, row_bytes: w.row_bytes(), data },
                outliers: outliers(),
            });
        }
        let data = w.to_f32()?;
        let kind = match format {
            WeightFormat::Q4 => Some(QuantKind::Q4),
            WeightFormat::Q8 => Some(QuantKind::Q8),
            WeightFormat::F32 | WeightFormat::Auto => None,
        };
        let storage = match kind {
            Some(kind) if out > 0 && inp > 0 => {
                Storage::Quant(QuantWeight::quantize(&data, out, inp, kind).into_best_layout(acts), acts, None)
            }
            _ => Storage::F32(transpose(&data, out, inp)),
        };
        Ok(HostWeight { out, inp, storage, outliers: outliers() })
    }

    /// Row `r` of the `[out, in]` matrix as f32 (an embedding lookup),
    /// exactly the stored values. `dst` holds `inp` values; `r < out`.
    pub(crate) fn row(&self, r: usize, dst: &mut [f32]) {
        match &self.storage {
            Storage::F32(kn) => {
                for (k, d) in dst.iter_mut().enumerate() {
                    *d = kn[k * self.out + r];
                }
            }
            Storage::Quant(q, ..) => q.dequantize_row(r, dst),
            Storage::Blocks { dtype, row_bytes, data } => {
                // The length was checked when the weight was made.
                let _ = dequantize_into(*dtype, &data[r * row_bytes..(r + 1) * row_bytes], dst);
            }
        }
    }

    /// Whether [`matmul`] stores every output cell (the integer kernels)
    /// rather than adding into zeros.
    pub(crate) fn overwrites_output(&self) -> bool {
        matches!(self.storage, Storage::Quant(..))
    }

    /// Bytes the weight occupies in memory.
    pub fn memory_bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(kn) => kn.len() * 4,
            Storage::Quant(q, _, q5) => q.data.len() + q.mins.bytes() + q5.as_ref().map_or(0, |r| r.data.len()),
            Storage::Blocks { data, .. } => data.len(),
        }
    }

    /// The storage of this weight: `Some(kind)` for the integer kernel's
    /// blocks, `None` otherwise (feature `reference`).
    #[cfg(any(test, feature = "reference"))]
    pub fn quant_kind(&self) -> Option<QuantKind> {
        match &self.storage {
            Storage::Quant(q, ..) => Some(q.kind),
            _ => None,
        }
    }

    /// The GGUF type of the blocks kept as the file stores them, if any
    /// (feature `reference`).
    #[cfg(any(test, feature = "reference"))]
    pub fn gguf_blocks(&self) -> Option<GgmlType> {
        match &self.storage {
            Storage::Blocks { dtype, .. } => Some(*dtype),
            _ => None,
        }
    }
}

/// `y[m, n] = x[m, k] · Wᵀ` (`y` zeroed, `m > 0`) through the kernel that
/// suits the weight and the batch. While `calibrating`, an int8 weight
/// records its input's statistics ([`OutlierChannels::record`]); after,
/// its outlier channels (if a calibration chose them) go through f32.
pub(crate) fn matmul(y: &mut [f32], x: &[f32], w: &HostWeight, m: usize, calibrating: bool) {
    // A quantized weight runs the integer kernel at every batch size: a
    // row's result is then bitwise independent of the batch it came in
    // (chunked prefill, prefix-cache hits, batch composition).
    match &w.storage {
        Storage::Quant(q, acts, q5) if acts.int8() => {
            if calibrating {
                w.outliers.record(x, m, q.k);
            } else if let Some(o) = w.outliers.fixed(q) {
                return linear_quant_outliers(y, x, q, q5.as_ref(), *acts, m, Some(o));
            }
            linear_quant(y, x, q, q5.as_ref(), *acts, m)
        }
        Storage::Quant(q, acts, q5) => linear_quant(y, x, q, q5.as_ref(), *acts, m),
        Storage::Blocks { dtype, row_bytes, data } => linear_blocks(y, x, w, (*dtype, *row_bytes, data), m),
        Storage::F32(kn) if m <= SMALL_M => linear_small(y, x, kn, w, m),
        Storage::F32(kn) => linear_gemm(y, x, kn, w, m),
    }
}

/// `y[m, n] = x[m, k] · Wᵀ` on the quantized weight: activations quantized
/// once, output columns split across threads. One or two rows on a weight
/// with a 5.5-bit Q5_0 copy read that copy ([`quant::q5::gemv`]: the lane
/// kernels' bits from 61% of their bytes).
fn linear_quant(y: &mut [f32], x: &[f32], w: &QuantWeight, q5: Option<&Q5Lanes>, bits: ActBits, m: usize) {
    linear_quant_outliers(y, x, w, q5, bits, m, None)
}

/// Rows of `y` a thread computes at a time when outlier channels follow:
/// their f32 products then add into rows still in its cache (a 64-row
/// decode step in one pass over the weights: two passes of 32 cost Gemma 3's
/// 64-sequence decode 7%).
const OUTLIER_ROWS: usize = 64;

/// [`linear_quant`], with the outlier channels `outliers` (if any) quantized
/// as zeros and their products added in f32 ([`crate::outliers`]) by each
/// thread to its columns, [`OUTLIER_ROWS`] rows at a time.
fn linear_quant_outliers(
    y: &mut [f32],
    x: &[f32],
    w: &QuantWeight,
    q5: Option<&Q5Lanes>,
    bits: ActBits,
    m: usize,
    outliers: Option<&Outliers>,
) {
    let (n, k) = (w.n, w.k);
    thread_local! {
        static ACTS: std::cell::RefCell<QuantActs> = std::cell::RefCell::new(QuantActs::default());
    }
    if bits == ActBits::I16 && w.lanes > 0 {
        return linear_quant_split(y, x, w, m);
    }
    let q5 = q5.filter(|_| m <= quant::q5::MAX_ROWS);
    let zero = outliers.map_or(&[][..], |o| &o.channels[..]);
    let mut run = |acts: &mut QuantActs| {
        QuantActs::quantize_cached_zeroing(x, m, k, bits, zero, acts);
        let acts = &*acts;
        let dst = SendPtr(y.as_mut_ptr());
        // SAFETY (both calls): y is [m, n]; a call writes the rows and
        // columns it is given only; a Q5_0 copy exists only where
        // `q5::available()` (AVX2, FMA, F16C) and is read for m ≤ MAX_ROWS.
        let gemm = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>| unsafe {
            match q5 {
                #[cfg(target_arch = "x86_64")]
                Some(q5) => quant::q5::gemv(dst.get(), n, acts, q5, rows, cols),
                _ => quant::gemm(dst.get(), n, acts, w, rows, cols),
            }
        };
        let part = |cols: std::ops::Range<usize>| match outliers {
            None => gemm(0..m, cols),
            Some(o) => {
                // Tiles whose outputs are still in cache when the f32
                // products add into them: OUTLIER_ROWS rows of as many
                // columns as 256 KiB of int8 weights hold (an LM head's
                // thread range alone is 32 MB of outputs at 64 rows).
                // A few rows' outputs stay in cache anyway, and one call
                // keeps the kernel's weight stream (and its prefetch) whole.
                let width = if m <= 8 { cols.len().max(1) } else { ((256 << 10) / k.max(1)).next_multiple_of(16).max(16) };
                for c0 in cols.clone().step_by(width) {
                    let tile_cols = c0..(c0 + width).min(cols.end);
                    for r0 in (0..m).step_by(OUTLIER_ROWS) {
                        let rows = r0..(r0 + OUTLIER_ROWS).min(m);
                        gemm(rows.clone(), tile_cols.clone());
                        // SAFETY: as for `gemm`; the outlier values are
                        // `channels.len()` per row of x.
                        unsafe { o.add_products(dst.get(), n, &acts.zeroed_values, rows, tile_cols.clone()) };
                    }
                }
            }
        };
        let ranges = column_ranges(m, n, k);
        if ranges.len() == 1 {
            return part(0..n);
        }
        crate::spin_team::run(ranges.len(), &|i| part(ranges[i].clone()));
    };
    // The buffer is reused across calls; a re-entrant call (from a rayon
    // worker that stole work while waiting) gets a fresh one.
    ACTS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut acts) => run(&mut acts),
        Err(_) => run(&mut QuantActs::default()),
    });
}

/// [`linear_quant`] at int16 precision on a lane-layout weight (a CPU with
/// VNNI): each row as int8 plus what int8 leaves, also as int8
/// ([`QuantActs::quantize_split_cached`]); the lane kernels multiply both
/// (`2m` rows) into a scratch buffer and each thread adds the two halves of
/// its columns.
fn linear_quant_split(y: &mut [f32], x: &[f32], w: &QuantWeight, m: usize) {
    let (n, k) = (w.n, w.k);
    thread_local! {
        static SPLIT: std::cell::RefCell<(QuantActs, Vec<f32>)> = std::cell::RefCell::new((QuantActs::default(), Vec::new()));
    }
    let mut run = |(acts, tmp): &mut (QuantActs, Vec<f32>)| {
        QuantActs::quantize_split_cached(x, m, k, acts);
        let acts = &*acts;
        tmp.resize(2 * m * n, 0.0);
        let (dst, both) = (SendPtr(y.as_mut_ptr()), SendPtr(tmp.as_mut_ptr()));
        let ranges = column_ranges(m, n, k);
        let chunk = |cols: std::ops::Range<usize>| {
            // SAFETY: tmp is [2m, n] and y [m, n]; this call writes and then
            // reads columns `cols` of both only, which no other thread touches.
            unsafe {
                quant::gemm(both.get(), n, acts, w, 0..2 * m, cols.clone());
                for r in 0..m {
                    for c in cols.clone() {
                        *dst.get().add(r * n + c) = *both.get().add(r * n + c) + *both.get().add((m + r) * n + c);
                    }
                }
            }
        };
        if ranges.len() == 1 {
            chunk(0..n);
        } else {
            crate::spin_team::run(ranges.len(), &|i| chunk(ranges[i].clone()));
        }
    };
    // As in `linear_quant`: a re-entrant call gets fresh buffers.
    SPLIT.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => run(&mut bufs),
        Err(_) => run(&mut (QuantActs::default(), Vec::new())),
    });
}

/// Output columns dequantized at a time by [`linear_blocks`].
const BLOCK_TILE: usize = 64;

/// `y[m, n] = x[m, k] · Wᵀ` on GGUF blocks, in f32 with exactly the file's
/// values. For a few rows of `x` (decode) each thread walks its rows of `W`
/// once, dequantizing [`CHUNK`] values at a time into a buffer that stays in
/// L1 and dotting them with every row of `x` (so a row's result does not
/// depend on the others); for more rows it dequantizes [`BLOCK_TILE`] rows of
/// `W` (output columns) at a time and multiplies them by the GEMM.
fn linear_blocks(y: &mut [f32], x: &[f32], w: &HostWeight, (dtype, row_bytes, data): (GgmlType, usize, &[u8]), m: usize) {
    let (n, k) = (w.out, w.inp);
    let dst = SendPtr(y.as_mut_ptr());
    let ranges = column_ranges(m, n, k);
    crate::spin_team::run(ranges.len(), &|i| {
        let cols = ranges[i].clone();
        if m <= SMALL_M {
            // Decode: each row of W once, a few blocks at a time into
            // an L1-resident buffer, dotted with every row of x.
            let (block, block_bytes) = dtype.block_layout();
            let per_chunk = (CHUNK / block).max(1);
            let (chunk_values, chunk_bytes) = (per_chunk * block, per_chunk * block_bytes);
            let mut buf = vec![0.0f32; chunk_values];
            for c in cols {
                let mut acc = [0.0f32; SMALL_M];
                for (i, bytes) in data[c * row_bytes..(c + 1) * row_bytes].chunks(chunk_bytes).enumerate() {
                    let values = &mut buf[..bytes.len() / block_bytes * block];
                    // The length was checked when the weight was made.
                    let _ = dequantize(dtype, bytes, values);
                    let at = i * chunk_values;
                    for (r, a) in acc.iter_mut().enumerate().take(m) {
                        *a += dot(&x[r * k + at..r * k + at + values.len()], values);
                    }
                }
                for (r, a) in acc.iter().enumerate().take(m) {
                    // SAFETY: row r, column c of y belongs to this chunk alone.
                    unsafe { *dst.get().add(r * n + c) = *a };
                }
            }
            return;
        }
        let mut tile = vec![0.0f32; BLOCK_TILE * k];
        for c0 in cols.clone().step_by(BLOCK_TILE) {
            let t = BLOCK_TILE.min(cols.end - c0);
            for (j, row) in tile.chunks_exact_mut(k).take(t).enumerate() {
                let c = c0 + j;
                // The length was checked when the weight was made.
                let _ = dequantize(dtype, &data[c * row_bytes..(c + 1) * row_bytes], row);
            }
            // SAFETY: dst is [m, n], x [m, k], the tile t rows of k
            // (read as a [k, t] matrix with column stride k), all
            // alive for the scope; this task writes columns c0..c0+t.
            unsafe {
                gemm::gemm(
                    m,
                    t,
                    k,
                    dst.get().add(c0),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    tile.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        }
    });
}

/// [`dequantize_into`] compiled with AVX2, FMA and F16C: the GGUF kernels
/// inline here and their loops may vectorize (same arithmetic, same bits).
/// Prefill tiles and the decode chunks use it.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2(dtype: GgmlType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    dequantize_into(dtype, bytes, out)
}

/// Dispatches [`dequantize_into`] to the best variant the CPU runs.
fn dequantize(dtype: GgmlType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::quant::has_simd() {
            // SAFETY: the CPU supports the features the function enables.
            return unsafe { dequantize_avx2(dtype, bytes, out) };
        }
    }
    dequantize_into(dtype, bytes, out)
}

/// Values a decode-sized product dequantizes at a time (one K-quant
/// super-block; eight blocks of 32).
const CHUNK: usize = 256;

/// `Σ a·b` with eight partial sums (vectorizes; the order is fixed and no
/// product is fused, so every variant gives the same bits and a result
/// never depends on the batch).
#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// [`dot_generic`] compiled with AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

/// Dispatches [`dot_generic`] to the best variant the CPU runs.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features the function enables.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_generic(a, b)
}

/// Up to this many rows, `linear` streams the weight once with AXPYs
/// instead of calling the GEMM (whose packing dominates at decode sizes).
const SMALL_M: usize = 8;

/// Splits `n` output columns into one contiguous range per thread (a
/// multiple of 16 wide) when the work is worth it.
fn column_ranges(m: usize, n: usize, k: usize) -> Vec<std::ops::Range<usize>> {
    let parts = if m * n * k >= 1 << 16 { rayon::current_num_threads().max(1) } else { 1 };
    let width = n.div_ceil(parts).next_multiple_of(16).min(n).max(1);
    (0..n).step_by(width).map(|n0| n0..(n0 + width).min(n)).collect()
}

/// `y[m, n] = x[m, k] · W[k, n]` for a few rows: every row of `W` is read
/// once and added, scaled, into each output row (AXPY), so the weight streams
/// through memory once per call.
fn linear_small(y: &mut [f32], x: &[f32], kn: &[f32], w: &HostWeight, m: usize) {
    let (n, k) = (w.out, w.inp);
    let dst = SendPtr(y.as_mut_ptr());
    rayon::scope(|s| {
        for cols in column_ranges(m, n, k) {
            s.spawn(move |_| {
                let dst = dst;
                let len = cols.len();
                let mut acc = vec![0.0f32; m * len];
                small_kernel(&mut acc, x, kn, n, k, m, cols.start, len);
                for r in 0..m {
                    // SAFETY: row r, columns `cols` of y belong to this task alone.
                    let out = unsafe { std::slice::from_raw_parts_mut(dst.0.add(r * n + cols.start), len) };
                    out.copy_from_slice(&acc[r * len..(r + 1) * len]);
                }
            });
        }
    });
}

/// `y[m, n] = x[m, k] · W[k, n]` through the `gemm` crate, output columns
/// split across threads by hand.
fn linear_gemm(y: &mut [f32], x: &[f32], kn: &[f32], w: &HostWeight, m: usize) {
    let (n, k) = (w.out, w.inp);
    let dst = SendPtr(y.as_mut_ptr());
    let (lhs, rhs) = (x.as_ptr() as usize, kn.as_ptr() as usize);
    rayon::scope(|s| {
        for cols in column_ranges(m, n, k) {
            s.spawn(move |_| {
                let dst = dst;
                // SAFETY: dst is [m, n], lhs [m, k], rhs [k, n], all row-major
                // and alive for the scope; this task writes `cols` only.
                unsafe {
                    gemm::gemm(
                        m,
                        cols.len(),
                        k,
                        dst.0.add(cols.start),
                        1,
                        n as isize,
                        false,
                        lhs as *const f32,
                        1,
                        k as isize,
                        (rhs as *const f32).add(cols.start),
                        1,
                        n as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            });
        }
    });
}

/// The inner loop of [`linear_small`]: four weight rows per pass, so each
/// accumulator is loaded and stored a quarter as often.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn small_kernel_generic(acc: &mut [f32], x: &[f32], wkn: &[f32], n: usize, k: usize, m: usize, c0: usize, len: usize) {
    let mut kk = 0;
    while kk + 4 <= k {
        let w0 = &wkn[kk * n + c0..kk * n + c0 + len];
        let w1 = &wkn[(kk + 1) * n + c0..(kk + 1) * n + c0 + len];
        let w2 = &wkn[(kk + 2) * n + c0..(kk + 2) * n + c0 + len];
        let w3 = &wkn[(kk + 3) * n + c0..(kk + 3) * n + c0 + len];
        for r in 0..m {
            let (a0, a1, a2, a3) = (x[r * k + kk], x[r * k + kk + 1], x[r * k + kk + 2], x[r * k + kk + 3]);
            let out = &mut acc[r * len..(r + 1) * len];
            for j in 0..len {
                out[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
            }
        }
        kk += 4;
    }
    while kk < k {
        let w0 = &wkn[kk * n + c0..kk * n + c0 + len];
        for r in 0..m {
            let a0 = x[r * k + kk];
            for (o, wv) in acc[r * len..(r + 1) * len].iter_mut().zip(w0) {
                *o += a0 * wv;
            }
        }
        kk += 1;
    }
}

/// [`small_kernel_generic`] compiled with AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn small_kernel_avx2(acc: &mut [f32], x: &[f32], wkn: &[f32], n: usize, k: usize, m: usize, c0: usize, len: usize) {
    small_kernel_generic(acc, x, wkn, n, k, m, c0, len)
}

/// Dispatches [`small_kernel_generic`] to the best variant the CPU runs.
#[allow(clippy::too_many_arguments)]
fn small_kernel(acc: &mut [f32], x: &[f32], wkn: &[f32], n: usize, k: usize, m: usize, c0: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features the function enables.
            return unsafe { small_kernel_avx2(acc, x, wkn, n, k, m, c0, len) };
        }
    }
    small_kernel_generic(acc, x, wkn, n, k, m, c0, len)
}
