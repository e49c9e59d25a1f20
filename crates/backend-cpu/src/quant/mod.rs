//! Block-quantized weights and the integer kernels of `CpuOps::linear`.
//!
//! Weights are stored per output column (a row of the `[out, in]` matrix) in
//! blocks of 32 input values with an asymmetric scale, `w = d·q + m`:
//!
//! * [`WeightFormat::Q4`]: `q ∈ 0..=15`, `d` and `m` as f16 — GGML's Q4_1,
//!   so a weight read from a Q4_1 GGUF is stored without any loss;
//! * [`WeightFormat::Q8`]: symmetric, `q ∈ -128..=127`, `m = 0`, `d` as
//!   f32 (GGML's Q8_0 with an f32 scale).
//!
//! Activations are quantized per row and block of 32 with an f32 scale
//! `dx` (`x ≈ dx·qx`), to int8 ([`ActBits::I8`], llama.cpp's choice and
//! the default: `vpmaddubsw` or VNNI `vpdpbusd`, four products per 32-bit
//! lane) or int16 ([`ActBits::I16`]: `vpmaddwd`, two products per lane).
//! Their block sum `sx` is kept, so one block contributes
//! `d·dx·Σ q·qx + m·sx` (the offset term uses the sum of the dequantized
//! activations, consistent with the integer part). Against the float64
//! golden references int16 costs 0.0018 nats and int8 about 0.04, both
//! under what llama.cpp itself shows on the same files (0.137 and 0.237
//! nats, `benchmarks/llama_cpp_logprobs.py`). A portable scalar kernel
//! computes the same integer sums as every SIMD one.
//!
//! Layout (see `KERNELS.md`): blocks are handled in pairs (64 values). Within
//! a pair, value `e` of block `b ∈ {0, 1}` sits at position
//! `p = 8·(e / 4) + 4·b + e % 4`: groups of four values of one block, the two
//! blocks alternating group by group, so every 32-bit lane of a `vpdpbusd`
//! (int8) result belongs to one block and the blocks alternate lane by lane;
//! the per-block scales then apply through a 64-bit broadcast (int16: two
//! lanes per group, a 128-bit pattern). `K` is zero-padded to a multiple of
//! 64 (a zero activation contributes nothing, whatever the padded weight).

use half::f16;
use vellum_models::gguf::GgmlType;

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

/// The precision activations are quantized to (ordered by width).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActBits {
    /// int8 codes (`|qx| ≤ 127`), llama.cpp's Q8 activations: the fast path.
    #[default]
    I8,
    /// int16 codes (`|qx| ≤ 32767`): 20× closer to float32, half the rate.
    I16,
}

impl ActBits {
    /// Bytes of one quantized activation pair: 64 codes, 2 f32 `dx`.
    pub const fn record(self) -> usize {
        self.scales() + 8
    }
    /// Offset of the two f32 `dx` in a pair record (after the 64 codes).
    pub const fn scales(self) -> usize {
        match self {
            ActBits::I8 => PAIR,
            ActBits::I16 => 2 * PAIR,
        }
    }
    /// Largest code magnitude.
    const fn max(self) -> f32 {
        match self {
            ActBits::I8 => 127.0,
            ActBits::I16 => 32767.0,
        }
    }
}

/// Per-block values (weight offsets `m`, activation sums `sx`) per row,
/// padded with zeros to whole 256-bit registers.
fn padded_blocks(pairs: usize) -> usize {
    (2 * pairs).next_multiple_of(8)
}
/// The byte position of value `e` of block `b` inside a pair.
#[inline]
fn pos(b: usize, e: usize) -> usize {
    8 * (e / 4) + 4 * b + e % 4
}

/// The (block, value) stored at byte position `p` of a pair.
fn unpos(p: usize) -> (usize, usize) {
    let group = p / 4;
    (group % 2, (group / 2) * 4 + p % 4)
}

/// The block of position `p` (its group of four alternates).
#[inline]
fn block_of(p: usize) -> usize {
    (p / 4) % 2
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
    /// Per-block offsets `m` as f16 bits, `padded_blocks` per output
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

impl QuantWeight {
    /// Quantizes the row-major `[n, k]` weight `w`.
    pub fn quantize(w: &[f32], n: usize, k: usize, kind: QuantKind) -> Self {
        assert_eq!(w.len(), n * k, "quantize: {} values for [{n}, {k}]", w.len());
        Self::assemble(n, k, kind, |c, blk, q| {
            let start = (blk * BLOCK).min(k);
            let vals = &w[c * k + start..c * k + (start + BLOCK).min(k)];
            match kind {
                QuantKind::Q4 => {
                    let (qb, d, m) = quant_block(vals, 15, true);
                    *q = qb;
                    (d, m)
                }
                QuantKind::Q8 => {
                    let amax = vals.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                    for (qe, &v) in q.iter_mut().zip(vals) {
                        *qe = ((v * id).round().clamp(-127.0, 127.0) as i8) as u8;
                    }
                    (d, 0.0)
                }
            }
        })
    }

    /// The `[n, k]` weight stored in GGML blocks of `ty`, kept bit for bit
    /// where this layout holds them: Q4_1 (and Q4_0, as `m = -8·d`, exact in
    /// f16) as [`QuantKind::Q4`], Q8_0 and Q5_0 (whose `q − 16` fits in
    /// eight bits) as [`QuantKind::Q8`]. `None` for other types or a `k`
    /// that is not whole blocks.
    pub fn from_ggml(ty: GgmlType, bytes: &[u8], n: usize, k: usize) -> Option<Self> {
        let (kind, block_bytes) = match ty {
            GgmlType::Q4_1 => (QuantKind::Q4, 20),
            GgmlType::Q4_0 => (QuantKind::Q4, 18),
            GgmlType::Q8_0 => (QuantKind::Q8, 34),
            GgmlType::Q5_0 => (QuantKind::Q8, 22),
            _ => return None,
        };
        let blocks = k / BLOCK;
        if !k.is_multiple_of(BLOCK) || bytes.len() != n * blocks * block_bytes {
            return None;
        }
        let f16_at = |b: &[u8], o: usize| f16::from_le_bytes([b[o], b[o + 1]]);
        // Q4_0's offset -8·d must itself be an f16 (it is unless |d| > 8188).
        if ty == GgmlType::Q4_0 && bytes.chunks_exact(block_bytes).any(|b| (-8.0 * f16_at(b, 0).to_f32()).abs() > 65504.0) {
            return None;
        }
        Some(Self::assemble(n, k, kind, |c, blk, q| {
            if blk >= blocks {
                return (0.0, 0.0);
            }
            let b = &bytes[(c * blocks + blk) * block_bytes..(c * blocks + blk + 1) * block_bytes];
            let d = f16_at(b, 0);
            let (m, nibbles) = match ty {
                GgmlType::Q4_1 => (f16_at(b, 2).to_f32(), &b[4..]),
                GgmlType::Q4_0 => (-8.0 * d.to_f32(), &b[2..]),
                GgmlType::Q5_0 => {
                    // Five bits per value, bit 4 of value i in bit i of qh:
                    // q − 16 ∈ −16..=15 is an exact Q8 value.
                    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    for (j, &byte) in b[6..22].iter().enumerate() {
                        let (h0, h1) = (((qh >> j) & 1) as u8, ((qh >> (j + 16)) & 1) as u8);
                        q[j] = (((byte & 0x0f) | h0 << 4) as i8 - 16) as u8;
                        q[j + 16] = (((byte >> 4) | h1 << 4) as i8 - 16) as u8;
                    }
                    return (d.to_f32(), 0.0);
                }
                _ => {
                    q.copy_from_slice(&b[2..]);
                    return (d.to_f32(), 0.0);
                }
            };
            for (j, &byte) in nibbles.iter().enumerate() {
                q[j] = byte & 0x0f;
                q[j + 16] = byte >> 4;
            }
            (d.to_f32(), m)
        }))
    }

    /// Lays out an `[n, k]` weight whose block `blk` of output `c` is given
    /// by `block(c, blk, &mut q) -> (d, m)` (`q` by value index: 0..=15 for
    /// Q4, `i8` bits for Q8; `d`, `m` exact in f16 for Q4).
    fn assemble(n: usize, k: usize, kind: QuantKind, block: impl Fn(usize, usize, &mut [u8; BLOCK]) -> (f32, f32) + Sync) -> Self {
        let pairs = k.div_ceil(PAIR);
        let rec = kind.record();
        let nbp = padded_blocks(pairs);
        let mut data = vec![0u8; n * pairs * rec];
        let mut mins = vec![0u16; n * nbp];
        type Column<'a> = (usize, (&'a mut [u8], &'a mut [u16]));
        let chunks: Vec<Column<'_>> = data.chunks_mut(pairs * rec).zip(mins.chunks_mut(nbp)).enumerate().collect();
        let work = |(c, (out, mout)): Column<'_>| {
            for j in 0..pairs {
                let r = &mut out[j * rec..(j + 1) * rec];
                for b in 0..2 {
                    let mut q = [0u8; BLOCK];
                    let (d, m) = block(c, 2 * j + b, &mut q);
                    match kind {
                        QuantKind::Q4 => {
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
                            for (e, &qe) in q.iter().enumerate() {
                                r[pos(b, e)] = qe;
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

    /// Row `c` of the weight, dequantized to f32 (`out` holds `k` values;
    /// embedding lookups and tests). Exact for the blocks
    /// [`QuantWeight::from_ggml`] keeps: each value is `q·d + m` as ggml
    /// computes it (for Q4_0, `q·d − 8·d` equals `(q − 8)·d`: both
    /// products are exact in f32).
    pub fn dequantize_row(&self, c: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.k);
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
}

/// Activations quantized per row and block: `rows · pairs` records of
/// `bits.record()` bytes.
#[derive(Clone, Debug, Default)]
pub struct QuantActs {
    /// Rows.
    pub rows: usize,
    /// Pairs per row.
    pub pairs: usize,
    /// Code width.
    pub bits: ActBits,
    /// The records.
    pub data: Vec<u8>,
    /// Sum of each block's dequantized values, `padded_blocks` per row.
    pub sums: Vec<f32>,
    /// The activations these records were made from (see
    /// [`QuantActs::quantize_cached`]).
    src: Vec<f32>,
}

/// One block of activations as codes of at most `max`: (q, dx, Σ dx·q).
/// The offset term uses the sum of the dequantized values, consistent with
/// the integer part (measured on the golden test with int16: 0.0018 nats,
/// against 0.005 with the exact f32 sum of `x`).
#[inline(always)]
fn quant_act_block(vals: &[f32], max: f32) -> ([i16; BLOCK], f32, f32) {
    let amax = vals.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / max;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i16; BLOCK];
    let mut sum = 0.0f32;
    for (qe, &v) in q.iter_mut().zip(vals) {
        *qe = (v * id).round_ties_even().clamp(-max, max) as i16;
        sum += f32::from(*qe) * d;
    }
    (q, d, sum)
}

/// Quantizes one row of `k` activations into `pairs` records (compiled
/// again with AVX2 enabled, where `round` is one instruction).
fn quantize_row(x: &[f32], bits: ActBits, out: &mut [u8], sums: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_simd() {
            // SAFETY: the CPU supports the features the function enables.
            return unsafe { quantize_row_avx2(x, bits, out, sums) };
        }
    }
    quantize_row_generic(x, bits, out, sums)
}

/// [`quantize_row_generic`] compiled with AVX2, FMA and F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_avx2(x: &[f32], bits: ActBits, out: &mut [u8], sums: &mut [f32]) {
    quantize_row_generic(x, bits, out, sums)
}

#[inline(always)]
fn quantize_row_generic(x: &[f32], bits: ActBits, out: &mut [u8], sums: &mut [f32]) {
    let k = x.len();
    let (rec, xs) = (bits.record(), bits.scales());
    let pairs = out.len() / rec;
    for j in 0..pairs {
        let r = &mut out[j * rec..(j + 1) * rec];
        for b in 0..2 {
            let start = (j * PAIR + b * BLOCK).min(k);
            let end = (start + BLOCK).min(k);
            let (q, d, sum) = quant_act_block(&x[start..end], bits.max());
            match bits {
                ActBits::I8 => {
                    for (e, &qe) in q.iter().enumerate() {
                        r[pos(b, e)] = qe as i8 as u8;
                    }
                }
                ActBits::I16 => {
                    for (e, qe) in q.iter().enumerate() {
                        let p = 2 * pos(b, e);
                        r[p..p + 2].copy_from_slice(&qe.to_le_bytes());
                    }
                }
            }
            r[xs + 4 * b..xs + 4 * b + 4].copy_from_slice(&d.to_le_bytes());
            sums[2 * j + b] = sum;
        }
    }
}

impl QuantActs {
    /// Quantizes `rows × k` row-major activations to `bits` (rows in
    /// parallel when many).
    pub fn quantize(x: &[f32], rows: usize, k: usize, bits: ActBits, into: &mut QuantActs) {
        into.src.clear();
        Self::quantize_into(x, rows, k, bits, into)
    }

    /// [`QuantActs::quantize`], skipped when `x` equals the activations of
    /// the previous call (the Q, K and V projections, or gate and up, read
    /// the same input). Comparing is ~10× cheaper than quantizing.
    pub fn quantize_cached(x: &[f32], rows: usize, k: usize, bits: ActBits, into: &mut QuantActs) {
        if into.rows == rows && into.pairs == k.div_ceil(PAIR) && into.bits == bits && into.src.len() == x.len() && into.src == x {
            return;
        }
        Self::quantize_into(x, rows, k, bits, into);
        into.src.clear();
        into.src.extend_from_slice(x);
    }

    fn quantize_into(x: &[f32], rows: usize, k: usize, bits: ActBits, into: &mut QuantActs) {
        let pairs = k.div_ceil(PAIR);
        into.rows = rows;
        into.pairs = pairs;
        into.bits = bits;
        into.data.clear();
        into.data.resize(rows * pairs * bits.record(), 0);
        let nbp = padded_blocks(pairs);
        into.sums.clear();
        into.sums.resize(rows * nbp, 0.0);
        if k == 0 {
            return;
        }
        let per = pairs * bits.record();
        if rows * k >= 1 << 15 {
            use rayon::prelude::*;
            into.data
                .par_chunks_mut(per)
                .zip(into.sums.par_chunks_mut(nbp))
                .zip(x.par_chunks(k))
                .for_each(|((o, sm), xr)| quantize_row(xr, bits, o, sm));
        } else {
            for ((o, sm), xr) in into.data.chunks_mut(per).zip(into.sums.chunks_mut(nbp)).zip(x.chunks(k)) {
                quantize_row(xr, bits, o, sm);
            }
        }
    }

    fn record(&self, row: usize, j: usize) -> &[u8] {
        let rec = self.bits.record();
        let o = (row * self.pairs + j) * rec;
        &self.data[o..o + rec]
    }

    /// The code at position `p` of record `r`.
    #[inline]
    fn code(&self, r: &[u8], p: usize) -> i32 {
        match self.bits {
            ActBits::I8 => i32::from(r[p] as i8),
            ActBits::I16 => i32::from(i16::from_le_bytes([r[2 * p], r[2 * p + 1]])),
        }
    }
}

fn f32_at(r: &[u8], o: usize) -> f32 {
    f32::from_le_bytes([r[o], r[o + 1], r[o + 2], r[o + 3]])
}

/// One output cell of the scalar kernel: row `r` of `x` against output `c`
/// of `w`, the same integer sums as the SIMD kernels.
fn scalar_cell(x: &QuantActs, w: &QuantWeight, r: usize, c: usize) -> f32 {
    let mut acc = 0.0f32;
    let xs = x.bits.scales();
    for j in 0..w.pairs {
        let wr = w.record(c, j);
        let xr = x.record(r, j);
        let mut isum = [0i32; 2];
        for p in 0..PAIR {
            isum[block_of(p)] += w.q_at(wr, p) * x.code(xr, p);
        }
        for (b, &s) in isum.iter().enumerate() {
            let (d, m) = w.scales(wr, c, j, b);
            let dx = f32_at(xr, xs + 4 * b);
            let sx = x.sums[r * padded_blocks(x.pairs) + 2 * j + b];
            acc += s as f32 * (d * dx) + m * sx;
        }
    }
    acc
}

/// Portable kernel: `y[r·ldy + c] = Σ_blocks d·dx·Σ q·qx + m·sx` for rows
/// `rows` and outputs `cols` (the tests' reference for the dispatching one).
#[cfg(test)]
fn gemm_scalar(y: &mut [f32], ldy: usize, x: &QuantActs, w: &QuantWeight, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
    for r in rows {
        for c in cols.clone() {
            y[r * ldy + c] = scalar_cell(x, w, r, c);
        }
    }
}

/// The kernels of the quantized linear, by instruction set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kernel {
    /// Portable Rust, cell by cell (the reference the others are tested
    /// against).
    Scalar,
    /// AVX2 + FMA + F16C: int8 through `vpmaddubsw`/`vpmaddwd`, int16
    /// through `vpmaddwd`.
    Avx2,
    /// AVX-VNNI (VEX `vpdpbusd` on 256 bits) for int8; int16 as [`Kernel::Avx2`].
    AvxVnni,
    /// AVX-512 VNNI + VL (EVEX `vpdpbusd` on 256 bits, 32 registers) for
    /// int8; int16 as [`Kernel::Avx2`]. (The int16 tiles on 512-bit
    /// `vpdpwssd` measured 17–19 GMAC/s against 25–28 with AVX2 on a
    /// 2-vCPU Xeon, docs/benchmarks.md: not kept.)
    Avx512Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs; `VELLUM_CPU_KERNEL=scalar|avx2|
    /// avxvnni|avx512vnni` caps it (to compare kernels on one machine).
    pub fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            let available = Self::available();
            let best = available.last().copied().unwrap_or(Kernel::Scalar);
            let named = match std::env::var("VELLUM_CPU_KERNEL").as_deref() {
                Ok("scalar") => Some(Kernel::Scalar),
                Ok("avx2") => Some(Kernel::Avx2),
                Ok("avxvnni") => Some(Kernel::AvxVnni),
                Ok("avx512vnni") => Some(Kernel::Avx512Vnni),
                _ => None,
            };
            named.filter(|k| available.contains(k)).unwrap_or(best)
        })
    }

    /// Every kernel this CPU runs, slowest first.
    pub fn available() -> Vec<Self> {
        let mut v = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if has_simd() {
                v.push(Kernel::Avx2);
                if std::is_x86_feature_detected!("avxvnni") {
                    v.push(Kernel::AvxVnni);
                }
                if std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl") {
                    v.push(Kernel::Avx512Vnni);
                }
            }
        }
        v
    }
}

/// Whether the CPU runs the SIMD kernels (AVX2 with FMA and F16C).
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
mod avx2;
#[cfg(target_arch = "x86_64")]
mod int8;

/// `y[r·ldy + c]` for `rows × cols` through the best kernel the CPU runs.
///
/// # Safety
/// `y` must be valid for writes at `r·ldy + c` for every row and output of
/// the ranges, and nothing else may access those cells meanwhile.
pub unsafe fn gemm(y: *mut f32, ldy: usize, x: &QuantActs, w: &QuantWeight, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
    // SAFETY: forwarded; `detect` only returns kernels the CPU runs.
    unsafe { gemm_with(Kernel::detect(), y, ldy, x, w, rows, cols) }
}

/// [`gemm`] through a given kernel.
///
/// # Safety
/// As [`gemm`]; and `kernel` must be one of [`Kernel::available`].
pub unsafe fn gemm_with(
    kernel: Kernel,
    y: *mut f32,
    ldy: usize,
    x: &QuantActs,
    w: &QuantWeight,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) {
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    debug_assert!(x.pairs == w.pairs && rows.end <= x.rows && cols.end <= w.n);
    #[cfg(target_arch = "x86_64")]
    {
        type Gemm = unsafe fn(*mut f32, usize, &QuantActs, &QuantWeight, std::ops::Range<usize>, std::ops::Range<usize>);
        let simd: Option<Gemm> = match (kernel, x.bits) {
            (Kernel::Scalar, _) => None,
            (_, ActBits::I16) => Some(avx2::gemm),
            (Kernel::Avx2, ActBits::I8) => Some(int8::avx2::gemm),
            (Kernel::AvxVnni, ActBits::I8) => Some(int8::avxvnni::gemm),
            (Kernel::Avx512Vnni, ActBits::I8) => Some(int8::avx512vnni::gemm),
        };
        if let Some(gemm) = simd {
            // SAFETY: the caller checked that the CPU runs `kernel`, whose
            // features every SIMD kernel picked above needs (int16 always
            // runs on AVX2, which every SIMD kernel implies); the cells are
            // the caller's.
            return unsafe { gemm(y, ldy, x, w, rows, cols) };
        }
    }
    // Cell by cell through the pointer: other threads own the other columns
    // of the same rows, so no slice over whole rows may be formed here.
    for r in rows {
        for c in cols.clone() {
            // SAFETY: (r, c) lies in the ranges whose cells the caller lets
            // this call write, and no reference to them exists meanwhile.
            unsafe { *y.add(r * ldy + c) = scalar_cell(x, w, r, c) };
        }
    }
}

#[cfg(test)]
mod tests;
