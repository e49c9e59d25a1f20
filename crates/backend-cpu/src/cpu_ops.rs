//! [`Ops`] on host memory: f32 activations, f32 weights, rayon threads.
//!
//! Linear layers run on the `gemm` crate (which picks AVX2/AVX-512 kernels at
//! run time) with weights transposed at load to `[in, out]`, so the GEMM reads
//! them without repacking; the output columns are split across the rayon
//! threads by hand, since the GEMM stays single-threaded for small shapes.

use crate::kv_cache::KvCache;
use crate::quant::{self, QuantActs, QuantKind, QuantWeight, WeightFormat};
use crate::paged_attention::{paged_attention, write_kv};
use vellum_core::{AttentionBackend, AttentionMetadata, BlockCopy, BlockSwap};
use vellum_models::ops::{AttentionShape, Ops};
use vellum_models::rope::RopeTable;
use vellum_models::Tensor;

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
    fn zeros(rows: usize, cols: usize) -> Self {
        Self { rows, cols, data: vec![0.0; rows * cols] }
    }
}

/// A weight matrix for `x · Wᵀ`, stored transposed as `[in, out]` (`[K, N]`)
/// so the GEMM reads it without repacking; an embedding table also keeps its
/// `[vocab, hidden]` rows for lookups.
#[derive(Clone, Debug)]
pub struct HostWeight {
    out: usize,
    inp: usize,
    /// `[in, out]`, row-major (empty when the weight is quantized).
    kn: Vec<f32>,
    /// The block-quantized weight, when the format is not f32.
    q: Option<QuantWeight>,
    /// `[out, in]` rows, kept for embedding lookups only.
    rows: Option<Vec<f32>>,
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

/// The CPU implementation of the model operations.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuOps {
    weight_format: WeightFormat,
}

impl CpuOps {
    /// Operations that store linear weights as `format`.
    pub fn new(weight_format: WeightFormat) -> Self {
        Self { weight_format }
    }

    /// The requested weight format.
    pub fn weight_format(&self) -> WeightFormat {
        self.weight_format
    }

    /// The storage a `[n, k]` weight gets: `None` for f32.
    fn resolve(&self, w: &[f32], n: usize, k: usize) -> Option<QuantKind> {
        if n == 0 || k == 0 {
            return None;
        }
        match self.weight_format {
            WeightFormat::F32 => None,
            WeightFormat::Q8 => Some(QuantKind::Q8),
            WeightFormat::Q4 => Some(QuantKind::Q4),
            WeightFormat::Auto if !quant::has_simd() => None,
            WeightFormat::Auto if quant::is_q4_exact(w, n, k) => Some(QuantKind::Q4),
            WeightFormat::Auto if quant::is_q8_exact(w, n, k) => Some(QuantKind::Q8),
            WeightFormat::Auto => None,
        }
    }
}

impl CpuOps {
    /// Prepares a `[out, in]` weight in the resolved format.
    fn weight(&self, name: &str, w: Tensor) -> vellum_models::Result<HostWeight> {
        match w.shape[..] {
            [out, inp] => match self.resolve(&w.data, out, inp) {
                None => Ok(HostWeight { out, inp, kn: transpose(&w.data, out, inp), q: None, rows: None }),
                Some(kind) => Ok(HostWeight { out, inp, kn: Vec::new(), q: Some(QuantWeight::quantize(&w.data, out, inp, kind)), rows: None }),
            },
            _ => Err(vellum_models::Error::ShapeMismatch { tensor: name.to_string(), expected: vec![0, 0], actual: w.shape }),
        }
    }
}

/// Element-wise ops split across the rayon threads from this many values.
const PAR_ELEMENTS: usize = 1 << 16;


impl HostWeight {
    /// The storage of this weight (`None`: f32).
    pub fn quant_kind(&self) -> Option<QuantKind> {
        self.q.as_ref().map(|q| q.kind)
    }
}

/// `y[m, n] = x[m, k] · Wᵀ` on the quantized weight: activations quantized
/// once, output columns split across threads.
fn linear_quant(y: &mut [f32], x: &[f32], w: &QuantWeight, m: usize) {
    let (n, k) = (w.n, w.k);
    thread_local! {
        static ACTS: std::cell::RefCell<QuantActs> = std::cell::RefCell::new(QuantActs::default());
    }
    let mut run = |acts: &mut QuantActs| {
        QuantActs::quantize_cached(x, m, k, acts);
        let acts = &*acts;
        let dst = SendPtr(y.as_mut_ptr());
        let ranges = column_ranges(m, n, k);
        if ranges.len() == 1 {
            // SAFETY: y is [m, n] and borrowed mutably here.
            unsafe { quant::gemm(dst.0, n, acts, w, 0..m, 0..n) };
            return;
        }
        rayon::scope(|s| {
            for cols in ranges {
                s.spawn(move |_| {
                    let dst = dst;
                    // SAFETY: y is [m, n]; this task writes columns `cols` only.
                    unsafe { quant::gemm(dst.0, n, acts, w, 0..m, cols) };
                });
            }
        });
    };
    // The buffer is reused across calls; a re-entrant call (from a rayon
    // worker that stole work while waiting) gets a fresh one.
    ACTS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut acts) => run(&mut acts),
        Err(_) => run(&mut QuantActs::default()),
    });
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
fn linear_small(y: &mut [f32], x: &[f32], w: &HostWeight, m: usize) {
    let (n, k) = (w.out, w.inp);
    let dst = SendPtr(y.as_mut_ptr());
    rayon::scope(|s| {
        for cols in column_ranges(m, n, k) {
            s.spawn(move |_| {
                let dst = dst;
                let len = cols.len();
                let mut acc = vec![0.0f32; m * len];
                small_kernel(&mut acc, x, &w.kn, n, k, m, cols.start, len);
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
fn linear_gemm(y: &mut [f32], x: &[f32], w: &HostWeight, m: usize) {
    let (n, k) = (w.out, w.inp);
    let dst = SendPtr(y.as_mut_ptr());
    let (lhs, rhs) = (x.as_ptr() as usize, w.kn.as_ptr() as usize);
    rayon::scope(|s| {
        for cols in column_ranges(m, n, k) {
            s.spawn(move |_| {
                let dst = dst;
                // SAFETY: dst is [m, n], lhs [m, k], rhs [k, n], all row-major
                // and alive for the scope; this task writes `cols` only.
                unsafe {
                    gemm::gemm(
                        m, cols.len(), k,
                        dst.0.add(cols.start), 1, n as isize, false,
                        lhs as *const f32, 1, k as isize,
                        (rhs as *const f32).add(cols.start), 1, n as isize,
                        0.0, 1.0, false, false, false,
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

impl Ops for CpuOps {
    type Tensor = HostTensor;
    type Weight = HostWeight;
    type Vector = Vec<f32>;
    type KvCache = KvCache;

    fn linear_weight(&self, name: &str, w: Tensor) -> vellum_models::Result<HostWeight> {
        self.weight(name, w)
    }

    fn embedding_weight(&self, name: &str, w: Tensor) -> vellum_models::Result<HostWeight> {
        let rows = w.data.clone();
        let mut weight = self.weight(name, w)?;
        weight.rows = Some(rows);
        Ok(weight)
    }

    fn vector(&self, data: Vec<f32>) -> Vec<f32> {
        data
    }

    fn embed(&self, table: &HostWeight, ids: &[u32]) -> HostTensor {
        let mut out = HostTensor::zeros(ids.len(), table.inp);
        for (row, &id) in out.data.chunks_exact_mut(table.inp).zip(ids) {
            let id = id as usize;
            assert!(id < table.out, "token id {id} outside the vocabulary of {}", table.out);
            let rows = table.rows.as_ref().expect("embedding tables keep their rows");
            row.copy_from_slice(&rows[id * table.inp..(id + 1) * table.inp]);
        }
        out
    }

    fn linear(&self, x: &HostTensor, w: &HostWeight, bias: Option<&Vec<f32>>) -> HostTensor {
        assert_eq!(x.cols, w.inp, "linear: input width {} but weight takes {}", x.cols, w.inp);
        let (m, n) = (x.rows, w.out);
        let mut out = HostTensor::zeros(m, n);
        if m == 0 {
            return out;
        }
        // A quantized weight runs the integer kernel at every batch size: a
        // row's result is then bitwise independent of the batch it came in
        // (chunked prefill, prefix-cache hits, batch composition).
        match &w.q {
            Some(q) => linear_quant(&mut out.data, &x.data, q, m),
            None if m <= SMALL_M => linear_small(&mut out.data, &x.data, w, m),
            None => linear_gemm(&mut out.data, &x.data, w, m),
        }
        if let Some(b) = bias {
            for row in out.data.chunks_exact_mut(n) {
                for (y, bi) in row.iter_mut().zip(b) {
                    *y += bi;
                }
            }
        }
        out
    }

    fn rms_norm(&self, x: &HostTensor, w: &Vec<f32>, eps: f32, group: usize) -> HostTensor {
        assert!(group > 0 && x.cols % group == 0 && w.len() == group, "rms_norm: width {} group {group} weight {}", x.cols, w.len());
        let mut out = x.clone();
        let norm = |g: &mut [f32]| {
            let ms = g.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, wi) in g.iter_mut().zip(w) {
                *v = *v * inv * wi;
            }
        };
        if out.data.len() >= PAR_ELEMENTS {
            use rayon::prelude::*;
            out.data.par_chunks_exact_mut(group).for_each(norm);
        } else {
            out.data.chunks_exact_mut(group).for_each(norm);
        }
        out
    }

    fn rope(&self, x: &mut HostTensor, head_dim: usize, positions: &[u32], table: &RopeTable) {
        assert_eq!(x.rows, positions.len(), "rope: one position per row");
        let half = head_dim / 2;
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        let cols = x.cols;
        for (row, &pos) in x.data.chunks_exact_mut(cols).zip(positions) {
            table.cos_sin(pos, &mut cos, &mut sin);
            for head in row.chunks_exact_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * cos[i] - x1 * sin[i];
                    b[i] = x1 * cos[i] + x0 * sin[i];
                }
            }
        }
    }

    fn silu_mul(&self, gate: &HostTensor, up: &HostTensor) -> HostTensor {
        assert_eq!((gate.rows, gate.cols), (up.rows, up.cols), "silu_mul: shapes differ");
        let silu = |(g, u): (&f32, &f32)| g / (1.0 + (-g).exp()) * u;
        let data = if gate.data.len() >= PAR_ELEMENTS {
            use rayon::prelude::*;
            gate.data.par_iter().zip(&up.data).map(silu).collect()
        } else {
            gate.data.iter().zip(&up.data).map(silu).collect()
        };
        HostTensor { rows: gate.rows, cols: gate.cols, data }
    }

    fn add_assign(&self, x: &mut HostTensor, y: &HostTensor) {
        assert_eq!(x.data.len(), y.data.len(), "add_assign: shapes differ");
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
    }

    fn attention(
        &self,
        cache: &mut KvCache,
        layer: usize,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        meta: &AttentionMetadata<'_>,
        shape: AttentionShape,
    ) -> HostTensor {
        let mut out = HostTensor::zeros(q.rows, shape.num_heads * shape.head_dim);
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        AttentionBackend::write_kv(self, cache, layer, k, v, meta).expect("host K/V write cannot fail");
        AttentionBackend::paged_attention(self, cache, layer, q, meta, scale, &mut out).expect("host attention cannot fail");
        out
    }

    fn gather_rows(&self, x: &HostTensor, rows: &[u32]) -> HostTensor {
        let mut out = HostTensor::zeros(rows.len(), x.cols);
        for (dst, &r) in out.data.chunks_exact_mut(x.cols).zip(rows) {
            let r = r as usize;
            dst.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        out
    }

    fn to_host(&self, x: &HostTensor) -> Vec<f32> {
        x.data.clone()
    }
}

/// The core attention contract on host memory; [`Ops::attention`] goes
/// through it, as a GPU backend's would.
impl AttentionBackend for CpuOps {
    type Tensor = HostTensor;
    type KvCache = KvCache;

    fn kv_block_bytes(&self, cache: &KvCache) -> u64 {
        KvCache::block_bytes(&cache.layout, cache.layers.len(), cache.dtype)
    }

    fn write_kv(
        &self,
        cache: &mut KvCache,
        layer: usize,
        k: &HostTensor,
        v: &HostTensor,
        meta: &AttentionMetadata<'_>,
    ) -> vellum_core::Result<()> {
        let layout = cache.layout;
        write_kv(&mut cache.layers[layer], &layout, &k.data, &v.data, meta.slot_mapping);
        Ok(())
    }

    fn paged_attention(
        &self,
        cache: &KvCache,
        layer: usize,
        q: &HostTensor,
        meta: &AttentionMetadata<'_>,
        scale: f32,
        out: &mut HostTensor,
    ) -> vellum_core::Result<()> {
        let num_heads = q.cols / cache.layout.head_dim;
        paged_attention(&mut out.data, &q.data, &cache.layers[layer], &cache.layout, meta, num_heads, scale);
        Ok(())
    }

    fn copy_blocks(&self, cache: &mut KvCache, copies: &[BlockCopy]) -> vellum_core::Result<()> {
        cache.copy_blocks(copies);
        Ok(())
    }

    fn swap_blocks(&self, cache: &mut KvCache, swaps: &[BlockSwap], to_host: bool) -> vellum_core::Result<()> {
        cache.swap_blocks(swaps, to_host);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    /// A `[n, k]` weight whose blocks are exact Q4_1 blocks (as a Q4_1 GGUF
    /// dequantizes), `k` a multiple of 32.
    fn q4_weight(n: usize, k: usize, seed: &mut u64) -> Vec<f32> {
        let mut w = Vec::with_capacity(n * k);
        for _ in 0..n * k / 32 {
            let d = half::f16::from_f32((lcg(seed) % 1000) as f32 * 1e-5 + 1e-3).to_f32();
            let m = half::f16::from_f32((lcg(seed) % 1000) as f32 * -1e-5).to_f32();
            for e in 0..32u32 {
                let q = match e {
                    0 => 0,
                    1 => 15,
                    _ => lcg(seed) % 16,
                };
                w.push(q as f32 * d + m);
            }
        }
        w
    }

    fn acts(m: usize, k: usize, seed: &mut u64) -> HostTensor {
        let data = (0..m * k).map(|i| if i % 211 == 7 { 30.0 } else { (lcg(seed) % 2001) as f32 / 1000.0 - 1.0 }).collect();
        HostTensor { rows: m, cols: k, data }
    }

    #[test]
    fn every_format_matches_f64_and_auto_picks_lossless_storage() {
        let mut seed = 5u64;
        for &(m, n, k) in &[(1, 37, 96), (3, 64, 576), (20, 33, 160), (40, 48, 64)] {
            let w = q4_weight(n, k, &mut seed);
            let x = acts(m, k, &mut seed);
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            for (format, kind, tol) in [
                (WeightFormat::F32, None, 1e-5),
                (WeightFormat::Q4, Some(QuantKind::Q4), 1e-3),
                (WeightFormat::Q8, Some(QuantKind::Q8), 2e-2),
                (WeightFormat::Auto, Some(QuantKind::Q4).filter(|_| quant::has_simd()), 1e-3),
            ] {
                let ops = CpuOps::new(format);
                let wt = ops.linear_weight("w", Tensor { shape: vec![n, k], data: w.clone() }).expect("2-D weight");
                assert_eq!(wt.quant_kind(), kind, "{format:?}");
                let y = ops.linear(&x, &wt, Some(&bias));
                let (mut err, mut norm) = (0.0f64, 0.0f64);
                for r in 0..m {
                    for c in 0..n {
                        let exact: f64 = (0..k).map(|i| x.data[r * k + i] as f64 * w[c * k + i] as f64).sum::<f64>() + bias[c] as f64;
                        err += (y.data[r * n + c] as f64 - exact).powi(2);
                        norm += exact * exact;
                    }
                }
                let rel = (err / norm).sqrt();
                assert!(rel <= tol, "{format:?} ({m},{n},{k}): relative error {rel}");
            }
        }
    }

    #[test]
    fn a_row_computes_the_same_alone_or_in_a_large_batch() {
        // Auto switches kernels with the batch size; a row's result must not.
        let mut seed = 9u64;
        let (m, n, k) = (40, 50, 192);
        let w = q4_weight(n, k, &mut seed);
        let x = acts(m, k, &mut seed);
        for format in [WeightFormat::Auto, WeightFormat::Q4, WeightFormat::F32] {
            let ops = CpuOps::new(format);
            let wt = ops.linear_weight("w", Tensor { shape: vec![n, k], data: w.clone() }).expect("2-D weight");
            let all = ops.linear(&x, &wt, None);
            for r in [0, 7, 39] {
                let one = HostTensor { rows: 1, cols: k, data: x.data[r * k..(r + 1) * k].to_vec() };
                let y = ops.linear(&one, &wt, None);
                for c in 0..n {
                    let (a, b) = (all.data[r * n + c], y.data[c]);
                    assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{format:?} row {r} col {c}: {a} in the batch, {b} alone");
                }
            }
        }
    }

    #[test]
    fn non_matrix_weights_are_typed_errors() {
        let ops = CpuOps::default();
        let err = ops.linear_weight("w", Tensor { shape: vec![4], data: vec![0.0; 4] });
        assert!(matches!(err, Err(vellum_models::Error::ShapeMismatch { .. })));
    }
}
