//! Block-quantized weights and the integer kernels of [`crate::CpuOps::linear`].
//!
//! Weights are stored per output column (a row of the `[out, in]` matrix) in
//! blocks of 32 input values with an asymmetric scale, `w = d·q + m`:
//!
//! * [`WeightFormat::Q4`]: `q ∈ 0..=15`, `d` and `m` as f16 — GGML's Q4_1,
//!   so a weight read from a Q4_1 GGUF is stored without any loss;
//! * [`WeightFormat::Q8`]: symmetric, `q ∈ -127..=127`, `m = 0`, `d` as
//!   f32 (GGML's Q8_0 with an f32 scale).
//!
//! Activations are quantized per row and block of 32 to int16 with an f32
//! scale `dx` (`x ≈ dx·qx`, |qx| ≤ 32767), and their block sum `sx` is
//! kept, so one block contributes `d·dx·Σ q·qx + m·sx` (the offset
//! term uses the sum of the dequantized activations, consistent with the
//! integer part). int8 activations (llama.cpp's choice) cost 0.036 nats
//! against the float64 golden reference, over its 0.02 tolerance; int16
//! costs 0.0018. The weights are widened to i16 in registers and the
//! integer dot products run on AVX2 `vpmaddwd`; a portable scalar kernel
//! computes the same sums.
//!
//! Layout (see `KERNELS.md`): blocks are handled in pairs (64 values, four
//! 256-bit registers of i16). Within a pair, value `e` of block `b ∈ {0, 1}`
//! sits at position `p = 4·(e / 2) + 2·b + e % 2`, so every 32-bit lane of a
//! `vpmaddwd` result belongs to one block and the two blocks alternate lane
//! by lane; the per-block scales then apply through a 64-bit broadcast. `K` is zero-padded to a multiple of 64 (a zero
//! activation contributes nothing, whatever the padded weight).

use half::f16;

/// How [`crate::CpuOps`] stores linear-layer weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// f32, transposed to `[in, out]`, multiplied in f32 (the reference).
    F32,
    /// 8-bit symmetric blocks of 32 (`w = d·q`, f32 `d`), int16 activations.
    Q8,
    /// 4-bit asymmetric blocks of 32 (GGML Q4_1: f16 `d`, `m`), int16
    /// activations. Lossy unless the weight came from a Q4_1 file.
    Q4,
    /// Lossless: [`WeightFormat::Q4`] for a weight that it stores exactly
    /// (every weight of a Q4_1 GGUF), else [`WeightFormat::Q8`] for one that
    /// it stores exactly (Q8_0), else [`WeightFormat::F32`] — also when the
    /// CPU has no fast integer kernel (AVX2).
    #[default]
    Auto,
}

impl WeightFormat {
    /// The format named by `VELLUM_CPU_WEIGHTS` (`f32`, `q8`, `q4`, `auto`),
    /// else [`WeightFormat::Auto`]: lets benchmarks compare formats on one
    /// build.
    pub fn from_env() -> Self {
        match std::env::var("VELLUM_CPU_WEIGHTS").as_deref().map(str::to_ascii_lowercase).as_deref() {
            Ok("f32") => WeightFormat::F32,
            Ok("q8") => WeightFormat::Q8,
            Ok("q4") => WeightFormat::Q4,
            _ => WeightFormat::Auto,
        }
    }
}

/// Values per quantization block.
pub const BLOCK: usize = 32;
/// Values per pair of blocks (one kernel step).
const PAIR: usize = 2 * BLOCK;
/// Offset of the scales in an activation pair record (after 64 i16 `qx`).
const XSCALES: usize = 2 * PAIR;
/// Bytes of one quantized activation pair: 64 i16 `qx`, 2 f32 `dx`.
const XREC: usize = XSCALES + 8;

/// Per-block values (weight offsets `m`, activation sums `sx`) per row,
/// padded with zeros to whole 256-bit registers.
fn padded_blocks(pairs: usize) -> usize {
    (2 * pairs).next_multiple_of(8)
}
/// Largest activation magnitude after quantization.
const XMAX: f32 = 32767.0;

/// The byte position of value `e` of block `b` inside a pair.
#[inline]
fn pos(b: usize, e: usize) -> usize {
    4 * (e / 2) + 2 * b + e % 2
}

/// The (block, value) stored at byte position `p` of a pair.
#[inline]
fn unpos(p: usize) -> (usize, usize) {
    let lane = p / 2;
    (lane % 2, (lane / 2) * 2 + p % 2)
}

/// Quantized storage kind (the resolved format of one weight).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    /// 4-bit, f16 scales: a pair is 32 bytes of nibbles + 2 f16 `d`
    /// (the offsets `m` live in their own array).
    Q4,
    /// 8-bit signed, f32 scales: a pair is 64 bytes + 2 f32.
    Q8,
}

impl QuantKind {
    /// Bytes of one weight pair record.
    pub const fn record(self) -> usize {
        match self {
            QuantKind::Q4 => 32 + 4,
            QuantKind::Q8 => 64 + 8,
        }
    }
}

/// A quantized `[n, k]` weight (`y = x · Wᵀ`), one record stream per output.
#[derive(Clone, Debug)]
pub struct QuantWeight {
    /// Outputs.
    pub n: usize,
    /// Inputs.
    pub k: usize,
    /// Block pairs per output (`k` padded to 64).
    pub pairs: usize,
    /// Storage kind.
    pub kind: QuantKind,
    /// `n · pairs` records of `kind.record()` bytes.
    pub data: Vec<u8>,
    /// Per-block offsets `m` as f16 bits, [`padded_blocks`] per output
    /// (zero for Q8).
    pub mins: Vec<u16>,
}

/// Per-block quantization of one block of `vals` (≤ 32 real values).
/// Returns (q, d, m) with `q` indexed by value.
fn quant_block(vals: &[f32], levels: u32, f16_scales: bool) -> ([u8; BLOCK], f32, f32) {
    let mut q = [0u8; BLOCK];
    if vals.is_empty() {
        return (q, 0.0, 0.0);
    }
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in vals {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let round = |v: f32| if f16_scales { f16::from_f32(v).to_f32() } else { v };
    let m = round(lo);
    let mut d = round((hi - m) / levels as f32);
    if d.is_nan() || d <= 0.0 || !d.is_finite() {
        d = 0.0;
    }
    if d > 0.0 {
        let id = 1.0 / d;
        for (qi, &v) in q.iter_mut().zip(vals) {
            *qi = ((v - m) * id).round().clamp(0.0, levels as f32) as u8;
        }
        // Refine with an exact division where the reciprocal rounded badly.
        for (qi, &v) in q.iter_mut().zip(vals) {
            let alt = ((v - m) / d).round().clamp(0.0, levels as f32) as u8;
            if (f32::from(alt) * d + m - v).abs() < (f32::from(*qi) * d + m - v).abs() {
                *qi = alt;
            }
        }
    }
    (q, d, m)
}

/// Whether [`quant_block`] at 4 bits reproduces `vals` bit for bit (with the
/// f32 arithmetic of the GGUF dequantizer, `q·d + m`).
fn q4_exact(vals: &[f32]) -> bool {
    let (q, d, m) = quant_block(vals, 15, true);
    vals.iter().zip(&q).all(|(&v, &qi)| (f32::from(qi) * d + m).to_bits() == v.to_bits())
}

/// Whether symmetric 8-bit blocks reproduce `vals` bit for bit (true of
/// every block of a Q8_0 GGUF: its scale is `max |w| / 127` exactly).
fn q8_exact(vals: &[f32]) -> bool {
    let amax = vals.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    vals.iter().all(|&v| (((v * id).round().clamp(-127.0, 127.0)) * d).to_bits() == v.to_bits() || (v == 0.0 && d == 0.0))
}

/// Whether every block of the `[n, k]` weight `w` is exactly a Q8_0 block.
pub fn is_q8_exact(w: &[f32], n: usize, k: usize) -> bool {
    use rayon::prelude::*;
    (0..n).into_par_iter().all(|c| w[c * k..(c + 1) * k].chunks(BLOCK).all(q8_exact))
}

/// Whether every block of the `[n, k]` weight `w` is exactly a Q4_1 block.
pub fn is_q4_exact(w: &[f32], n: usize, k: usize) -> bool {
    use rayon::prelude::*;
    (0..n).into_par_iter().all(|c| w[c * k..(c + 1) * k].chunks(BLOCK).all(q4_exact))
}

impl QuantWeight {
    /// Quantizes the row-major `[n, k]` weight `w`.
    pub fn quantize(w: &[f32], n: usize, k: usize, kind: QuantKind) -> Self {
        assert_eq!(w.len(), n * k, "quantize: {} values for [{n}, {k}]", w.len());
        let pairs = k.div_ceil(PAIR);
        let rec = kind.record();
        let nbp = padded_blocks(pairs);
        let mut data = vec![0u8; n * pairs * rec];
        let mut mins = vec![0u16; n * nbp];
        type Column<'a> = (usize, (&'a mut [u8], &'a mut [u16]));
        let chunks: Vec<Column<'_>> = data.chunks_mut(pairs * rec).zip(mins.chunks_mut(nbp)).enumerate().collect();
        let work = |(c, (out, mout)): Column<'_>| {
            let row = &w[c * k..(c + 1) * k];
            for j in 0..pairs {
                let r = &mut out[j * rec..(j + 1) * rec];
                for b in 0..2 {
                    let start = (j * PAIR + b * BLOCK).min(k);
                    let end = (start + BLOCK).min(k);
                    let vals = &row[start..end];
                    match kind {
                        QuantKind::Q4 => {
                            let (q, d, m) = quant_block(vals, 15, true);
                            for (e, &qe) in q.iter().enumerate() {
                                let p = pos(b, e);
                                if p < 32 {
                                    r[p] |= qe;
                                } else {
                                    r[p - 32] |= qe << 4;
                                }
                            }
                            r[32 + 2 * b..34 + 2 * b].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                            mout[2 * j + b] = f16::from_f32(m).to_bits();
                        }
                        QuantKind::Q8 => {
                            let amax = vals.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                            let d = amax / 127.0;
                            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                            for (e, &v) in vals.iter().enumerate() {
                                r[pos(b, e)] = ((v * id).round().clamp(-127.0, 127.0) as i8) as u8;
                            }
                            r[64 + 4 * b..68 + 4 * b].copy_from_slice(&d.to_le_bytes());
                        }
                    }
                }
            }
        };
        use rayon::prelude::*;
        chunks.into_par_iter().for_each(work);
        Self { n, k, pairs, kind, data, mins }
    }

    /// (q, d, m) of value position `p` in pair `j` of output `c`.
    fn record(&self, c: usize, j: usize) -> &[u8] {
        let rec = self.kind.record();
        let o = (c * self.pairs + j) * rec;
        &self.data[o..o + rec]
    }

    /// Weight value `q` at byte position `p` of a record, and its block's (d, m).
    #[inline]
    fn q_at(&self, r: &[u8], p: usize) -> i32 {
        match self.kind {
            QuantKind::Q4 => i32::from(if p < 32 { r[p] & 0x0f } else { r[p - 32] >> 4 }),
            QuantKind::Q8 => i32::from(r[p] as i8),
        }
    }

    /// (d, m) of block `b` of pair `j` of output `c`, whose record is `r`.
    #[inline]
    fn scales(&self, r: &[u8], c: usize, j: usize, b: usize) -> (f32, f32) {
        let m = f16::from_bits(self.mins[c * padded_blocks(self.pairs) + 2 * j + b]).to_f32();
        match self.kind {
            QuantKind::Q4 => (f16::from_le_bytes([r[32 + 2 * b], r[33 + 2 * b]]).to_f32(), m),
            QuantKind::Q8 => (f32::from_le_bytes([r[64 + 4 * b], r[65 + 4 * b], r[66 + 4 * b], r[67 + 4 * b]]), 0.0),
        }
    }

    /// Row `c` of the weight, dequantized to f32 (`k` values).
    pub fn dequantize_row(&self, c: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.k);
        for j in 0..self.pairs {
            let r = self.record(c, j);
            for p in 0..PAIR {
                let (b, e) = unpos(p);
                let idx = j * PAIR + b * BLOCK + e;
                if idx < self.k {
                    let (d, m) = self.scales(r, c, j, b);
                    out[idx] = self.q_at(r, p) as f32 * d + m;
                }
            }
        }
    }

    /// Bytes of quantized storage.
    pub fn bytes(&self) -> usize {
        self.data.len() + 2 * self.mins.len()
    }
}

/// Activations quantized per row and block: `rows · pairs` records of
/// [`XREC`] bytes.
#[derive(Clone, Debug, Default)]
pub struct QuantActs {
    /// Rows.
    pub rows: usize,
    /// Pairs per row.
    pub pairs: usize,
    /// The records.
    pub data: Vec<u8>,
    /// Sum of each block's dequantized values, [`padded_blocks`] per row.
    pub sums: Vec<f32>,
    /// The activations these records were made from (see
    /// [`QuantActs::quantize_cached`]).
    src: Vec<f32>,
}

/// One block of activations as int16: (q, dx, Σ dx·q). The offset term
/// uses the sum of the dequantized values, consistent with the integer part
/// (measured on the golden test: 0.0018 nats, against 0.005 with the exact
/// f32 sum of `x`).
#[inline(always)]
fn quant_act_block(vals: &[f32]) -> ([i16; BLOCK], f32, f32) {
    let amax = vals.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / XMAX;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i16; BLOCK];
    let mut sum = 0.0f32;
    for (qe, &v) in q.iter_mut().zip(vals) {
        *qe = (v * id).round_ties_even().clamp(-XMAX, XMAX) as i16;
        sum += f32::from(*qe) * d;
    }
    (q, d, sum)
}

/// Quantizes one row of `k` activations into `pairs` records (compiled
/// again with AVX2 enabled, where `round` is one instruction).
fn quantize_row(x: &[f32], out: &mut [u8], sums: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_simd() {
            // SAFETY: the CPU supports the features the function enables.
            return unsafe { quantize_row_avx2(x, out, sums) };
        }
    }
    quantize_row_generic(x, out, sums)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_avx2(x: &[f32], out: &mut [u8], sums: &mut [f32]) {
    quantize_row_generic(x, out, sums)
}

#[inline(always)]
fn quantize_row_generic(x: &[f32], out: &mut [u8], sums: &mut [f32]) {
    let k = x.len();
    let pairs = out.len() / XREC;
    for j in 0..pairs {
        let r = &mut out[j * XREC..(j + 1) * XREC];
        for b in 0..2 {
            let start = (j * PAIR + b * BLOCK).min(k);
            let end = (start + BLOCK).min(k);
            let (q, d, sum) = quant_act_block(&x[start..end]);
            for (e, qe) in q.iter().enumerate() {
                let p = 2 * pos(b, e);
                r[p..p + 2].copy_from_slice(&qe.to_le_bytes());
            }
            r[XSCALES + 4 * b..XSCALES + 4 * b + 4].copy_from_slice(&d.to_le_bytes());
            sums[2 * j + b] = sum;
        }
    }
}

impl QuantActs {
    /// Quantizes `rows × k` row-major activations (rows in parallel when many).
    pub fn quantize(x: &[f32], rows: usize, k: usize, into: &mut QuantActs) {
        into.src.clear();
        Self::quantize_into(x, rows, k, into)
    }

    /// [`QuantActs::quantize`], skipped when `x` equals the activations of
    /// the previous call (the Q, K and V projections, or gate and up, read
    /// the same input). Comparing is ~10× cheaper than quantizing.
    pub fn quantize_cached(x: &[f32], rows: usize, k: usize, into: &mut QuantActs) {
        if into.rows == rows && into.pairs == k.div_ceil(PAIR) && into.src.len() == x.len() && into.src == x {
            return;
        }
        Self::quantize_into(x, rows, k, into);
        into.src.clear();
        into.src.extend_from_slice(x);
    }

    fn quantize_into(x: &[f32], rows: usize, k: usize, into: &mut QuantActs) {
        let pairs = k.div_ceil(PAIR);
        into.rows = rows;
        into.pairs = pairs;
        into.data.clear();
        into.data.resize(rows * pairs * XREC, 0);
        let nbp = padded_blocks(pairs);
        into.sums.clear();
        into.sums.resize(rows * nbp, 0.0);
        if k == 0 {
            return;
        }
        let per = pairs * XREC;
        if rows * k >= 1 << 15 {
            use rayon::prelude::*;
            into.data.par_chunks_mut(per).zip(into.sums.par_chunks_mut(nbp)).zip(x.par_chunks(k)).for_each(|((o, sm), xr)| quantize_row(xr, o, sm));
        } else {
            for ((o, sm), xr) in into.data.chunks_mut(per).zip(into.sums.chunks_mut(nbp)).zip(x.chunks(k)) {
                quantize_row(xr, o, sm);
            }
        }
    }

    fn record(&self, row: usize, j: usize) -> &[u8] {
        let o = (row * self.pairs + j) * XREC;
        &self.data[o..o + XREC]
    }
}

fn f32_at(r: &[u8], o: usize) -> f32 {
    f32::from_le_bytes([r[o], r[o + 1], r[o + 2], r[o + 3]])
}

/// Portable kernel: `y[r·ldy + c] = Σ_blocks d·dx·Σ q·qx + m·sx` for rows
/// `rows` and outputs `cols`.
pub fn gemm_scalar(y: &mut [f32], ldy: usize, x: &QuantActs, w: &QuantWeight, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
    for r in rows {
        for c in cols.clone() {
            let mut acc = 0.0f32;
            for j in 0..w.pairs {
                let wr = w.record(c, j);
                let xr = x.record(r, j);
                let mut isum = [0i32; 2];
                for p in 0..PAIR {
                    isum[(p / 2) % 2] += w.q_at(wr, p) * i32::from(i16::from_le_bytes([xr[2 * p], xr[2 * p + 1]]));
                }
                for (b, &s) in isum.iter().enumerate() {
                    let (d, m) = w.scales(wr, c, j, b);
                    let dx = f32_at(xr, XSCALES + 4 * b);
                    let sx = x.sums[r * padded_blocks(x.pairs) + 2 * j + b];
                    acc += s as f32 * (d * dx) + m * sx;
                }
            }
            y[r * ldy + c] = acc;
        }
    }
}

/// Whether the CPU runs the SIMD kernel (AVX2 with FMA and F16C).
pub fn has_simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{padded_blocks, QuantActs, QuantKind, QuantWeight, XREC, XSCALES};
    use std::arch::x86_64::*;

    /// A weight pair widened to i16: positions 0..16, 16..32, 32..48, 48..64;
    /// then its d pattern.
    type Wide = ([__m256i; 4], __m256);

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_w<const Q8: bool>(p: *const u8) -> Wide {
        // SAFETY (all loads): p points at a full record of the kind.
        unsafe {
            if Q8 {
                let w = [0, 16, 32, 48].map(|o| _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(o) as *const __m128i)));
                let d = _mm256_castpd_ps(_mm256_set1_pd((p.add(64) as *const f64).read_unaligned()));
                (w, d)
            } else {
                // Bytes widened to i16: the low nibble is `& 15`, the high one `>> 4`.
                let z0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
                let z1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(16) as *const __m128i));
                let mask = _mm256_set1_epi16(0x0f);
                let w = [_mm256_and_si256(z0, mask), _mm256_and_si256(z1, mask), _mm256_srli_epi16(z0, 4), _mm256_srli_epi16(z1, 4)];
                let d = _mm256_cvtph_ps(_mm_set1_epi32((p.add(32) as *const i32).read_unaligned()));
                (w, d)
            }
        }
    }

    /// The integer dot product of a widened weight pair with one activation
    /// pair, as 8 i32 lanes alternating block 0 / block 1 (each lane sums 8
    /// products: |sum| ≤ 8·127·32767 < 2³¹).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(w: &[__m256i; 4], x: *const u8) -> __m256i {
        // SAFETY: x points at a full activation record.
        unsafe {
            let p = |i: usize| _mm256_madd_epi16(w[i], _mm256_loadu_si256(x.add(32 * i) as *const __m256i));
            _mm256_add_epi32(_mm256_add_epi32(p(0), p(1)), _mm256_add_epi32(p(2), p(3)))
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bcast2(p: *const u8) -> __m256 {
        // SAFETY: p points at two f32 inside a record.
        unsafe { _mm256_castpd_ps(_mm256_set1_pd((p as *const f64).read_unaligned())) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// Where a tile reads: records and per-block arrays at its first
    /// output / row.
    #[derive(Clone, Copy)]
    struct TileArgs {
        y: *mut f32,
        ldy: usize,
        x: *const u8,
        sums: *const f32,
        w: *const u8,
        mins: *const u16,
        pairs: usize,
    }

    /// A tile of `R` rows × `C` outputs over every pair.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const C: usize, const Q8: bool>(t: TileArgs) {
        let TileArgs { y, ldy, x, sums, w, mins, pairs } = t;
        let rec = if Q8 { QuantKind::Q8.record() } else { QuantKind::Q4.record() };
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for j in 0..pairs {
            for c in 0..C {
                // SAFETY: record j of output c and of every row exists.
                unsafe {
                    let (wv, d) = load_w::<Q8>(w.add((c * pairs + j) * rec));
                    for (r, accr) in acc.iter_mut().enumerate() {
                        let xr = x.add((r * pairs + j) * XREC);
                        let isum = dot(&wv, xr);
                        let s = _mm256_mul_ps(d, bcast2(xr.add(XSCALES)));
                        accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, accr[c]);
                    }
                }
            }
        }
        if !Q8 {
            // The offsets: Σ_b m_b · sx_b, eight blocks per step.
            let nbp = padded_blocks(pairs);
            for g in (0..nbp).step_by(8) {
                for c in 0..C {
                    // SAFETY: nbp offsets per output and sums per row exist.
                    unsafe {
                        let m = _mm256_cvtph_ps(_mm_loadu_si128(mins.add(c * nbp + g) as *const __m128i));
                        for (r, accr) in acc.iter_mut().enumerate() {
                            accr[c] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums.add(r * nbp + g)), accr[c]);
                        }
                    }
                }
            }
        }
        for (r, accr) in acc.iter().enumerate() {
            for (c, a) in accr.iter().enumerate() {
                // SAFETY: the caller owns y[r·ldy + c].
                unsafe { *y.add(r * ldy + c) = hsum(*a) };
            }
        }
    }

    /// Activation bytes a row block may take (stays in L2 while every
    /// output of the thread's range streams past it).
    const ROW_BLOCK_BYTES: usize = 96 * 1024;

    /// `y[rows, cols]`, row stride `ldy`: rows in blocks that stay in cache;
    /// within a block, 4 rows × 1 output per register tile (the widened
    /// weight pair is reused by 4 rows), or for 1–3 rows, up to 4 outputs at
    /// once (independent accumulator chains).
    ///
    /// # Safety
    /// The CPU must support the enabled features; `y` must be valid for
    /// writes at every (row, col) of the ranges; the caller owns those cells.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gemm(y: *mut f32, ldy: usize, x: &QuantActs, w: &QuantWeight, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
        let pairs = w.pairs;
        let rec = w.kind.record();
        let q8 = w.kind == QuantKind::Q8;
        let block = (ROW_BLOCK_BYTES / (pairs * XREC)).max(4) / 4 * 4;
        let nbp = padded_blocks(pairs);
        // SAFETY (the pointer offsets): r < x.rows and c < w.n everywhere below.
        let args = |r: usize, c: usize| unsafe {
            TileArgs {
                y: y.add(r * ldy + c),
                ldy,
                x: x.data.as_ptr().add(r * pairs * XREC),
                sums: x.sums.as_ptr().add(r * nbp),
                w: w.data.as_ptr().add(c * pairs * rec),
                mins: w.mins.as_ptr().add(c * nbp),
                pairs,
            }
        };
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = (r0 + block).min(rows.end);
            let mut c = cols.start;
            while c < cols.end {
                let mut r = r0;
                // Full 4-row tiles, one output at a time.
                let mut cc = 1;
                while r1 - r >= 4 {
                    // SAFETY: records of output c and rows r..r+4 exist; the caller owns y's cells.
                    unsafe {
                        let t = args(r, c);
                        if q8 { tile::<4, 1, true>(t) } else { tile::<4, 1, false>(t) }
                    }
                    r += 4;
                }
                if r < r1 {
                    // 1–3 rows left: several outputs per tile.
                    let rr = r1 - r;
                    cc = if r == r0 { (cols.end - c).min(if rr == 1 { 4 } else { 2 }) } else { 1 };
                    // SAFETY: as above, for outputs c..c+cc.
                    unsafe {
                        let t = args(r, c);
                        macro_rules! go {
                            ($($R:literal, $C:literal);*) => {
                                match (rr, cc, q8) {
                                    $(
                                        ($R, $C, false) => tile::<$R, $C, false>(t),
                                        ($R, $C, true) => tile::<$R, $C, true>(t),
                                    )*
                                    _ => unreachable!("tiles of 1–3 rows take at most 4 outputs"),
                                }
                            };
                        }
                        go!(1, 1; 1, 2; 1, 3; 1, 4; 2, 1; 2, 2; 3, 1; 3, 2);
                    }
                }
                c += cc;
            }
            r0 = r1;
        }
    }
}

/// `y[r·ldy + c]` for `rows × cols` through the best kernel the CPU runs.
///
/// # Safety
/// `y` must be valid for writes at `r·ldy + c` for every row and output of
/// the ranges, and nothing else may access those cells meanwhile.
pub unsafe fn gemm(y: *mut f32, ldy: usize, x: &QuantActs, w: &QuantWeight, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    debug_assert!(x.pairs == w.pairs && rows.end <= x.rows && cols.end <= w.n);
    #[cfg(target_arch = "x86_64")]
    {
        if has_simd() {
            // SAFETY: features checked; the caller guarantees the cells.
            return unsafe { avx2::gemm(y, ldy, x, w, rows, cols) };
        }
    }
    let ysl = unsafe { std::slice::from_raw_parts_mut(y, rows.end * ldy) };
    gemm_scalar(ysl, ldy, x, w, rows, cols)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    #[test]
    fn positions_are_a_permutation() {
        let mut seen = [false; PAIR];
        for b in 0..2 {
            for e in 0..BLOCK {
                let p = pos(b, e);
                assert!(!seen[p]);
                seen[p] = true;
                assert_eq!(unpos(p), (b, e));
            }
        }
    }

    #[test]
    fn q8_round_trips_q8_0_blocks() {
        let mut s = 11u64;
        let mut w = Vec::new();
        for blk in 0..30 {
            let d = f16::from_f32(rng(&mut s).abs() * 0.01 + 1e-4).to_f32();
            for e in 0..BLOCK {
                let q: i32 = if e == 5 { if blk % 2 == 0 { 127 } else { -127 } } else { (rng(&mut s) * 127.0) as i32 };
                w.push(q as f32 * d);
            }
        }
        w[64..96].fill(0.0);
        assert!(is_q8_exact(&w, 3, 320));
        let qw = QuantWeight::quantize(&w, 3, 320, QuantKind::Q8);
        let mut row = vec![0.0; 320];
        for c in 0..3 {
            qw.dequantize_row(c, &mut row);
            assert_eq!(row, w[c * 320..(c + 1) * 320]);
        }
        let smooth: Vec<f32> = (0..320).map(|i| (i as f32 * 0.37).sin()).collect();
        assert!(!is_q8_exact(&smooth, 1, 320));
        assert!(!is_q4_exact(&smooth, 1, 320));
    }

    #[test]
    fn q4_round_trips_q4_1_blocks() {
        // Values built as GGUF's dequantizer builds them.
        let mut s = 7u64;
        let mut w = Vec::new();
        for _ in 0..40 {
            let d = f16::from_f32(rng(&mut s).abs() * 0.01).to_f32();
            let m = f16::from_f32(rng(&mut s) * 0.05).to_f32();
            for e in 0..BLOCK {
                let q = if e == 3 { 0 } else if e == 9 { 15 } else { ((rng(&mut s) + 1.0) * 7.9) as u8 };
                w.push(f32::from(q) * d + m);
            }
        }
        assert!(is_q4_exact(&w, 4, 320));
        let qw = QuantWeight::quantize(&w, 4, 320, QuantKind::Q4);
        let mut row = vec![0.0; 320];
        for c in 0..4 {
            qw.dequantize_row(c, &mut row);
            assert_eq!(row, w[c * 320..(c + 1) * 320]);
        }
        let noisy: Vec<f32> = w.iter().map(|v| v + 1e-4).collect();
        assert!(!is_q4_exact(&noisy, 4, 320));
    }

    /// y via the dispatching kernel and via the scalar one.
    fn both(x: &[f32], m: usize, w: &QuantWeight) -> (Vec<f32>, Vec<f32>) {
        let mut acts = QuantActs::default();
        QuantActs::quantize(x, m, w.k, &mut acts);
        let mut fast = vec![f32::NAN; m * w.n];
        // SAFETY: fast is [m, n] and owned here.
        unsafe { gemm(fast.as_mut_ptr(), w.n, &acts, w, 0..m, 0..w.n) };
        let mut slow = vec![f32::NAN; m * w.n];
        gemm_scalar(&mut slow, w.n, &acts, w, 0..m, 0..w.n);
        (fast, slow)
    }

    #[test]
    fn kernels_match_f64_reference_on_odd_shapes() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for &(m, n, k) in &[(1, 1, 1), (1, 3, 31), (2, 7, 33), (3, 5, 64), (5, 13, 100), (4, 6, 128), (9, 31, 576), (17, 4, 96), (6, 11, 1536), (50, 5, 1536)] {
            for kind in [QuantKind::Q4, QuantKind::Q8] {
                let w: Vec<f32> = (0..n * k).map(|_| rng(&mut s) * 0.1).collect();
                // Activations with an outlier per row, as hidden states have.
                let x: Vec<f32> = (0..m * k).map(|i| if i % 97 == 5 { 20.0 } else { rng(&mut s) }).collect();
                let qw = QuantWeight::quantize(&w, n, k, kind);
                let mut deq = vec![0.0f32; n * k];
                for c in 0..n {
                    qw.dequantize_row(c, &mut deq[c * k..(c + 1) * k]);
                    // The weight error is at most half a step.
                    for i in 0..k {
                        let step = if kind == QuantKind::Q4 { 0.2 / 15.0 } else { 0.2 / 254.0 };
                        assert!((deq[c * k + i] - w[c * k + i]).abs() <= step * 0.51 + 1e-3, "{kind:?} weight error");
                    }
                }
                let (fast, slow) = both(&x, m, &qw);
                for r in 0..m {
                    for c in 0..n {
                        let mut exact = 0.0f64;
                        let mut bound = 0.0f64;
                        for b0 in (0..k).step_by(BLOCK) {
                            let xs = &x[r * k + b0..r * k + (b0 + BLOCK).min(k)];
                            let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64 * 127.0 / XMAX as f64;
                            for (i, &xv) in xs.iter().enumerate() {
                                let wv = deq[c * k + b0 + i] as f64;
                                exact += xv as f64 * wv;
                                bound += wv.abs() * amax / 254.0;
                            }
                        }
                        let tol = bound * 1.01 + 1e-4 * (1.0 + exact.abs());
                        let (f, sl) = (fast[r * n + c] as f64, slow[r * n + c] as f64);
                        assert!((sl - exact).abs() <= tol, "{kind:?} ({m},{n},{k}) scalar {sl} vs {exact} (tol {tol})");
                        assert!((f - exact).abs() <= tol, "{kind:?} ({m},{n},{k}) fast {f} vs {exact} (tol {tol})");
                        assert!((f - sl).abs() <= 1e-4 * (1.0 + sl.abs()), "{kind:?} ({m},{n},{k}) fast {f} vs scalar {sl}");
                    }
                }
            }
        }
    }

    #[test]
    fn cached_quantization_follows_its_input() {
        let mut s = 21u64;
        let x: Vec<f32> = (0..3 * 100).map(|_| rng(&mut s)).collect();
        let mut fresh = QuantActs::default();
        let mut cached = QuantActs::default();
        QuantActs::quantize_cached(&x, 3, 100, &mut cached);
        QuantActs::quantize_cached(&x, 3, 100, &mut cached);
        QuantActs::quantize(&x, 3, 100, &mut fresh);
        assert_eq!((&cached.data, &cached.sums), (&fresh.data, &fresh.sums));
        let mut y = x.clone();
        y[150] += 0.5;
        QuantActs::quantize_cached(&y, 3, 100, &mut cached);
        QuantActs::quantize(&y, 3, 100, &mut fresh);
        assert_eq!((&cached.data, &cached.sums), (&fresh.data, &fresh.sums));
        // Same values, another shape.
        QuantActs::quantize_cached(&y, 2, 150, &mut cached);
        QuantActs::quantize(&y, 2, 150, &mut fresh);
        assert_eq!((&cached.data, &cached.sums, cached.rows), (&fresh.data, &fresh.sums, 2));
    }

    #[test]
    fn subranges_write_only_their_cells() {
        let mut s = 3u64;
        let (m, n, k) = (7, 10, 200);
        let w: Vec<f32> = (0..n * k).map(|_| rng(&mut s)).collect();
        let x: Vec<f32> = (0..m * k).map(|_| rng(&mut s)).collect();
        let qw = QuantWeight::quantize(&w, n, k, QuantKind::Q8);
        let mut acts = QuantActs::default();
        QuantActs::quantize(&x, m, k, &mut acts);
        let mut full = vec![0.0f32; m * n];
        gemm_scalar(&mut full, n, &acts, &qw, 0..m, 0..n);
        let mut part = vec![f32::NAN; m * n];
        // SAFETY: part is [m, n]; the ranges are disjoint.
        unsafe {
            gemm(part.as_mut_ptr(), n, &acts, &qw, 0..m, 0..4);
            gemm(part.as_mut_ptr(), n, &acts, &qw, 0..3, 4..n);
            gemm(part.as_mut_ptr(), n, &acts, &qw, 3..m, 4..n);
        }
        for (a, b) in part.iter().zip(&full) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
