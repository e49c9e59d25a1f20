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
use vellum_ops::quant::GgmlType;

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
    /// int8 codes with a scale per 16 values (each half of a block; GGML's
    /// Q6_K weights have the same granularity): an outlier channel coarsens
    /// the codes of 15 neighbours instead of 31, at the int8 rate plus one
    /// more integer-to-float step per block. The lane layout's kernels run
    /// it; elsewhere the scalar kernel does.
    I8Halves,
}

impl ActBits {
    /// Bytes of one quantized activation pair: 64 codes, then 2 f32 `dx`
    /// (one per block) or, for [`ActBits::I8Halves`], 4.
    pub const fn record(self) -> usize {
        self.scales() + if self.halves() { 16 } else { 8 }
    }
    /// Offset of the f32 `dx` in a pair record (after the 64 codes).
    pub const fn scales(self) -> usize {
        match self {
            ActBits::I8 | ActBits::I8Halves => PAIR,
            ActBits::I16 => 2 * PAIR,
        }
    }
    /// Offset in a pair record of the `dx` that scales value `e` of block
    /// `b`: per block, or with halves `(b, 0..16)`, `(1 − b, 0..16)`, then
    /// `(b, 16..32)`, `(1 − b, 16..32)` — Q6_K's order of weight scales.
    pub const fn scale_at(self, b: usize, e: usize) -> usize {
        self.scales() + 4 * b + if self.halves() { 8 * (e / 16) } else { 0 }
    }
    /// Whether codes are bytes (the int8 kernels read them).
    pub const fn int8(self) -> bool {
        matches!(self, ActBits::I8 | ActBits::I8Halves)
    }
    /// Whether each half of a block (16 values) has its own scale.
    pub const fn halves(self) -> bool {
        matches!(self, ActBits::I8Halves)
    }
    /// Largest code magnitude.
    const fn max(self) -> f32 {
        match self {
            ActBits::I8 | ActBits::I8Halves => 127.0,
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
    /// (the offsets `m` live in their own array, as f16).
    Q4,
    /// 8-bit signed, f32 scales: a pair is 64 bytes + 2 f32.
    Q8,
    /// 4-bit, f32 scales and offsets: GGML's Q4_K, whose sub-block scale
    /// `d·sc` and offset `dmin·m` (products of an f16 and a 6-bit integer)
    /// are exact in f32 but not in f16. A pair is 32 bytes of nibbles + 2
    /// f32 `d`; the offsets live in their own array, as f32.
    Q4K,
    /// 8-bit signed codes with a scale per 16 values: GGML's Q6_K (codes
    /// −32..=31, sub-blocks of 16 whose scale `d·sc` is exact in f32). A
    /// pair is 64 bytes + 4 f32: `d` of (block 0, values 0..16), (block 1,
    /// 0..16), (block 0, 16..32), (block 1, 16..32) — the first 32 positions
    /// of a pair hold values 0..16 of both blocks, the last 32 values
    /// 16..32, so each half of the pair has its own scale pattern.
    Q6K,
}

/// [`QuantKind`] as a number, for the kernels' const generics.
pub(crate) const KQ4: u8 = 0;
/// See [`KQ4`].
pub(crate) const KQ8: u8 = 1;
/// See [`KQ4`].
pub(crate) const KQ4K: u8 = 2;
/// See [`KQ4`].
pub(crate) const KQ6K: u8 = 3;

impl QuantKind {
    /// Bytes of one weight pair record.
    pub const fn record(self) -> usize {
        match self {
            QuantKind::Q4 => 32 + 4,
            QuantKind::Q8 => 64 + 8,
            QuantKind::Q4K => 32 + 8,
            QuantKind::Q6K => 64 + 16,
        }
    }

    /// The kind's number ([`KQ4`] …).
    pub(crate) const fn code(self) -> u8 {
        match self {
            QuantKind::Q4 => KQ4,
            QuantKind::Q8 => KQ8,
            QuantKind::Q4K => KQ4K,
            QuantKind::Q6K => KQ6K,
        }
    }

    /// The kind numbered `code`.
    pub(crate) const fn from_code(code: u8) -> Self {
        match code {
            KQ4 => QuantKind::Q4,
            KQ8 => QuantKind::Q8,
            KQ4K => QuantKind::Q4K,
            _ => QuantKind::Q6K,
        }
    }

    /// Whether codes are unsigned nibbles (two per byte) rather than i8.
    pub(crate) const fn nibbles(self) -> bool {
        matches!(self, QuantKind::Q4 | QuantKind::Q4K)
    }

    /// Whether each half of a pair (values 0..16 and 16..32 of its
    /// blocks) has its own scales.
    pub(crate) const fn split_halves(self) -> bool {
        matches!(self, QuantKind::Q6K)
    }

    /// Offset of the `d` scales in a record.
    const fn scales_at(self) -> usize {
        if self.nibbles() {
            32
        } else {
            64
        }
    }
}

/// Per-block offsets `m` of the asymmetric kinds, `padded_blocks` per
/// output (zero-padded); none for the symmetric ones.
#[derive(Clone, Debug, Default)]
pub enum Mins {
    /// Symmetric blocks ([`QuantKind::Q8`], [`QuantKind::Q6K`]).
    #[default]
    None,
    /// f16 bits ([`QuantKind::Q4`]).
    F16(Vec<u16>),
    /// f32 ([`QuantKind::Q4K`]).
    F32(Vec<f32>),
}

impl Mins {
    /// Offset `i` as f32 (0 where there are none).
    fn at(&self, i: usize) -> f32 {
        match self {
            Mins::None => 0.0,
            Mins::F16(v) => f16::from_bits(v[i]).to_f32(),
            Mins::F32(v) => v[i],
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Mins::None => 0,
            Mins::F16(v) => v.len() * 2,
            Mins::F32(v) => v.len() * 4,
        }
    }

    /// Where offset `i` is stored; null where there are none (never read).
    fn ptr_at(&self, i: usize) -> *const u8 {
        match self {
            Mins::None => std::ptr::null(),
            Mins::F16(v) => v[i..].as_ptr() as *const u8,
            Mins::F32(v) => v[i..].as_ptr() as *const u8,
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
    /// Per-block offsets `m` (pair layout: Q4 as f16, Q4K as f32; the lane
    /// layout keeps them in its records).
    pub mins: Mins,
    /// Outputs per group of the lane layout ([`lanes`]: 8 or 16 outputs
    /// side by side, for the VNNI int8 kernels); 0 for the pair layout.
    pub lanes: usize,
    /// Whether every code of this Q8 weight lies in −16..=15 (it came from
    /// Q5_0): the AVX2 lane kernel then sums its products in i16 instead of
    /// taking the sign trick.
    pub small_codes: bool,
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
        assert!(matches!(kind, QuantKind::Q4 | QuantKind::Q8), "quantize: {kind:?} comes from GGUF blocks only");
        Self::assemble(n, k, kind, |c, blk, q| {
            let start = (blk * BLOCK).min(k);
            let vals = &w[c * k + start..c * k + (start + BLOCK).min(k)];
            match kind {
                QuantKind::Q4 => {
                    let (qb, d, m) = quant_block(vals, 15, true);
                    *q = qb;
                    ([d; 2], m)
                }
                _ => {
                    let amax = vals.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                    for (qe, &v) in q.iter_mut().zip(vals) {
                        *qe = ((v * id).round().clamp(-127.0, 127.0) as i8) as u8;
                    }
                    ([d; 2], 0.0)
                }
            }
        })
    }

    /// The `[n, k]` weight stored in GGML blocks of `ty`, kept bit for bit
    /// where this layout holds them: Q4_1 (and Q4_0, as `m = -8·d`, exact in
    /// f16) as [`QuantKind::Q4`], Q8_0 and Q5_0 (whose `q − 16` fits in
    /// eight bits) as [`QuantKind::Q8`], Q4_K as [`QuantKind::Q4K`] and Q6_K
    /// as [`QuantKind::Q6K`] (their sub-block scales multiplied out in f32,
    /// as GGML's dequantizer does). `None` for other types or a `k` that is
    /// not whole blocks.
    pub fn from_ggml(ty: GgmlType, bytes: &[u8], n: usize, k: usize) -> Option<Self> {
        let (kind, block_values, block_bytes) = match ty {
            GgmlType::Q4_1 => (QuantKind::Q4, BLOCK, 20),
            GgmlType::Q4_0 => (QuantKind::Q4, BLOCK, 18),
            GgmlType::Q8_0 => (QuantKind::Q8, BLOCK, 34),
            GgmlType::Q5_0 => (QuantKind::Q8, BLOCK, 22),
            GgmlType::Q4_K => (QuantKind::Q4K, SUPER, 144),
            GgmlType::Q6_K => (QuantKind::Q6K, SUPER, 210),
            _ => return None,
        };
        let row_blocks = k / block_values;
        if !k.is_multiple_of(block_values) || bytes.len() != n * row_blocks * block_bytes {
            return None;
        }
        let f16_at = |b: &[u8], o: usize| f16::from_le_bytes([b[o], b[o + 1]]);
        // Q4_0's offset -8·d must itself be an f16 (it is unless |d| > 8188).
        if ty == GgmlType::Q4_0 && bytes.chunks_exact(block_bytes).any(|b| (-8.0 * f16_at(b, 0).to_f32()).abs() > 65504.0) {
            return None;
        }
        let blocks = k / BLOCK;
        let weight = Self::assemble(n, k, kind, |c, blk, q| {
            if blk >= blocks {
                return ([0.0; 2], 0.0);
            }
            // The GGML block holding 32-value block `blk` of output `c`, and
            // which 32 of its values that is.
            let per = block_values / BLOCK;
            let at = (c * row_blocks + blk / per) * block_bytes;
            let (b, sub) = (&bytes[at..at + block_bytes], blk % per);
            let d = f16_at(b, 0);
            let (m, nibbles) = match ty {
                GgmlType::Q4_1 => (f16_at(b, 2).to_f32(), &b[4..]),
                GgmlType::Q4_0 => (-8.0 * d.to_f32(), &b[2..]),
                GgmlType::Q4_K => return q4_k_block(b, sub, q),
                GgmlType::Q6_K => return q6_k_block(b, sub, q),
                GgmlType::Q5_0 => {
                    // Five bits per value, bit 4 of value i in bit i of qh:
                    // q − 16 ∈ −16..=15 is an exact Q8 value.
                    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    for (j, &byte) in b[6..22].iter().enumerate() {
                        let (h0, h1) = (((qh >> j) & 1) as u8, ((qh >> (j + 16)) & 1) as u8);
                        q[j] = (((byte & 0x0f) | h0 << 4) as i8 - 16) as u8;
                        q[j + 16] = (((byte >> 4) | h1 << 4) as i8 - 16) as u8;
                    }
                    return ([d.to_f32(); 2], 0.0);
                }
                _ => {
                    q.copy_from_slice(&b[2..]);
                    return ([d.to_f32(); 2], 0.0);
                }
            };
            for (j, &byte) in nibbles.iter().enumerate() {
                q[j] = byte & 0x0f;
                q[j + 16] = byte >> 4;
            }
            ([d.to_f32(); 2], m)
        });
        Some(Self { small_codes: ty == GgmlType::Q5_0, ..weight })
    }

    /// Lays out an `[n, k]` weight whose block `blk` of output `c` is given
    /// by `block(c, blk, &mut q) -> ([d₀, d₁], m)` (`q` by value index:
    /// 0..=15 for Q4/Q4K, `i8` bits for Q8/Q6K; `d₀` scales values 0..16,
    /// `d₁` values 16..32, equal except for Q6K; `d`, `m` exact in f16 for
    /// Q4).
    fn assemble(n: usize, k: usize, kind: QuantKind, block: impl Fn(usize, usize, &mut [u8; BLOCK]) -> ([f32; 2], f32) + Sync) -> Self {
        let pairs = k.div_ceil(PAIR);
        let rec = kind.record();
        let nbp = padded_blocks(pairs);
        let mut data = vec![0u8; n * pairs * rec];
        // Offsets as f32 for every kind; stored as the kind keeps them below.
        let mut mins = vec![0f32; if kind.nibbles() { n * nbp } else { 0 }];
        let min_chunk = if kind.nibbles() { nbp } else { 1 };
        type Column<'a> = (usize, (&'a mut [u8], &'a mut [f32]));
        let columns = data.chunks_mut(pairs * rec);
        let chunks: Vec<Column<'_>> = if kind.nibbles() {
            columns.zip(mins.chunks_mut(min_chunk)).enumerate().collect()
        } else {
            columns.map(|c| (c, &mut [][..])).enumerate().collect()
        };
        let at = kind.scales_at();
        let work = |(c, (out, mout)): Column<'_>| {
            for j in 0..pairs {
                let r = &mut out[j * rec..(j + 1) * rec];
                for b in 0..2 {
                    let mut q = [0u8; BLOCK];
                    let (d, m) = block(c, 2 * j + b, &mut q);
                    for (e, &qe) in q.iter().enumerate() {
                        let p = pos(b, e);
                        match kind.nibbles() {
                            true if p < 32 => r[p] |= qe,
                            true => r[p - 32] |= qe << 4,
                            false => r[p] = qe,
                        }
                    }
                    match kind {
                        QuantKind::Q4 => r[at + 2 * b..at + 2 * b + 2].copy_from_slice(&f16::from_f32(d[0]).to_le_bytes()),
                        QuantKind::Q8 | QuantKind::Q4K => r[at + 4 * b..at + 4 * b + 4].copy_from_slice(&d[0].to_le_bytes()),
                        QuantKind::Q6K => {
                            for (h, dh) in d.iter().enumerate() {
                                let o = at + 8 * h + 4 * b;
                                r[o..o + 4].copy_from_slice(&dh.to_le_bytes());
                            }
                        }
                    }
                    if kind.nibbles() {
                        mout[2 * j + b] = m;
                    }
                }
            }
        };
        use rayon::prelude::*;
        chunks.into_par_iter().for_each(work);
        let mins = match kind {
            QuantKind::Q4 => Mins::F16(mins.iter().map(|&m| f16::from_f32(m).to_bits()).collect()),
            QuantKind::Q4K => Mins::F32(mins),
            QuantKind::Q8 | QuantKind::Q6K => Mins::None,
        };
        Self { n, k, pairs, kind, data, mins, lanes: 0, small_codes: false }
    }

    /// The record of pair `j` of output `c`.
    fn record(&self, c: usize, j: usize) -> &[u8] {
        let rec = self.kind.record();
        let o = (c * self.pairs + j) * rec;
        &self.data[o..o + rec]
    }

    /// Weight value `q` at byte position `p` of a record.
    #[inline]
    fn q_at(&self, r: &[u8], p: usize) -> i32 {
        if self.kind.nibbles() {
            i32::from(if p < 32 { r[p] & 0x0f } else { r[p - 32] >> 4 })
        } else {
            i32::from(r[p] as i8)
        }
    }

    /// (d, m) of half `h` (values `16·h..16·h + 16`) of block `b` of pair
    /// `j` of output `c`, whose record is `r`.
    #[inline]
    fn scales(&self, r: &[u8], c: usize, j: usize, b: usize, h: usize) -> (f32, f32) {
        let m = self.mins.at(c * padded_blocks(self.pairs) + 2 * j + b);
        let at = self.kind.scales_at();
        let d = match self.kind {
            QuantKind::Q4 => f16::from_le_bytes([r[at + 2 * b], r[at + 1 + 2 * b]]).to_f32(),
            QuantKind::Q8 | QuantKind::Q4K => f32_at(r, at + 4 * b),
            QuantKind::Q6K => f32_at(r, at + 8 * h + 4 * b),
        };
        (d, m)
    }

    /// Row `c` of the weight, dequantized to f32 (`out` holds `k` values;
    /// embedding lookups and tests). Exact for the blocks
    /// [`QuantWeight::from_ggml`] keeps: each value is `q·d + m` as ggml
    /// computes it (for Q4_0, `q·d − 8·d` equals `(q − 8)·d`: both
    /// products are exact in f32; for Q4_K, `d·q − dmin·m` is `q·d + m`
    /// with `m = −dmin·m`).
    pub fn dequantize_row(&self, c: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.k);
        if self.lanes > 0 {
            for (blk, vals) in out.chunks_mut(BLOCK).enumerate() {
                let halves = [0, 1].map(|h| self.lane_scales(c, blk, h));
                for (e, o) in vals.iter_mut().enumerate() {
                    let (d, m) = halves[e / 16];
                    *o = self.lane_code(c, blk, e) as f32 * d + m;
                }
            }
            return;
        }
        for j in 0..self.pairs {
            let r = self.record(c, j);
            for p in 0..PAIR {
                let (b, e) = unpos(p);
                let idx = j * PAIR + b * BLOCK + e;
                if idx < self.k {
                    let (d, m) = self.scales(r, c, j, b, e / 16);
                    out[idx] = self.q_at(r, p) as f32 * d + m;
                }
            }
        }
    }
}

/// Values per K-quant super-block.
const SUPER: usize = 256;

/// 32-value block `sub` (0..8) of a GGML Q4_K super-block `b`: nibbles into
/// `q`, and the block's `d·sc` and `−dmin·m` exactly as GGML's dequantizer
/// computes them (`y = d·sc·q − dmin·m`).
fn q4_k_block(b: &[u8], sub: usize, q: &mut [u8; BLOCK]) -> ([f32; 2], f32) {
    let half = |o: usize| f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
    let (d, dmin) = (half(0), half(2));
    let (sc, m) = vellum_ops::quant::scale_min_k4(sub, &b[4..16]);
    let qs = &b[16 + 32 * (sub / 2)..16 + 32 * (sub / 2) + 32];
    for (qe, &byte) in q.iter_mut().zip(qs) {
        *qe = if sub.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
    }
    let d1 = d * f32::from(sc);
    ([d1; 2], -(dmin * f32::from(m)))
}

/// 32-value block `sub` (0..8) of a GGML Q6_K super-block `b`: codes
/// `q − 32` into `q` (as i8 bits), and the scales `d·sc` of its two
/// 16-value halves (`y = d·sc·(q − 32)`).
fn q6_k_block(b: &[u8], sub: usize, q: &mut [u8; BLOCK]) -> ([f32; 2], f32) {
    // 128 values per half super-block: ql 64 bytes, qh 32, 8 scales.
    let (n, t) = (sub / 4, sub % 4);
    let (ql, qh, sc) = (&b[64 * n..64 * n + 64], &b[128 + 32 * n..160 + 32 * n], &b[192 + 8 * n..200 + 8 * n]);
    let d = f16::from_le_bytes([b[208], b[209]]).to_f32();
    for (l, qe) in q.iter_mut().enumerate() {
        let low = ql[l + 32 * (t % 2)];
        let nib = if t < 2 { low & 0x0f } else { low >> 4 };
        let high = (qh[l] >> (2 * t)) & 3;
        *qe = (((nib | high << 4) as i8) - 32) as u8;
    }
    ([0, 1].map(|h| d * f32::from(sc[h + 2 * t] as i8)), 0.0)
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
    /// int8 only: per row and block, `−128 ·` the sum of the codes of its
    /// values 0..16, of 16..32, and of all 32, then a zero (`4 · 2 · pairs`
    /// per row): the correction the lane kernels start from when the
    /// weights' codes carry an offset of 128 ([`lanes`]).
    pub corr: Vec<i32>,
    /// Whether these are the two-pass int8 form of int16 precision
    /// ([`QuantActs::quantize_split_cached`]): `rows / 2` input rows, then
    /// what each leaves.
    pub split: bool,
    /// The activations these records were made from (see
    /// [`QuantActs::quantize_cached`]).
    src: Vec<f32>,
    /// The channels quantized as zeros ([`QuantActs::quantize_cached_zeroing`]).
    zeroed: Vec<usize>,
    /// Their values, `zeroed.len()` per row (what the f32 products of
    /// [`crate::outliers`] multiply).
    pub zeroed_values: Vec<f32>,
}

/// One block of activations as codes of at most `max`: (q, dx, Σ dx·q).
/// The offset term uses the sum of the dequantized values, consistent with
/// the integer part (measured on the golden test with int16: 0.0018 nats,
/// against 0.005 with the exact f32 sum of `x`), summed in order in f32
/// ([`quantize_pair_avx2`] keeps that order: `dx · Σq` instead moved one
/// golden prompt's largest int8 gap from 0.143 to 0.262 nats, within the
/// rule but near its 0.2645 bound).
#[inline(always)]
/// Rows per part when a quantization runs on the spin team: a few parts per
/// thread, so that uneven rows still balance.
fn rows_per_part(rows: usize) -> usize {
    (rows / (4 * rayon::current_num_threads().max(1))).max(1)
}

fn quant_act_block(vals: &[f32], bits: ActBits) -> ([i16; BLOCK], [f32; 2], f32) {
    let max = bits.max();
    let amax = |v: &[f32]| v.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = if bits.halves() {
        let mid = vals.len().min(BLOCK / 2);
        [amax(&vals[..mid]) / max, amax(&vals[mid..]) / max]
    } else {
        [amax(vals) / max; 2]
    };
    let id = d.map(|d| if d > 0.0 { 1.0 / d } else { 0.0 });
    let mut q = [0i16; BLOCK];
    let mut sum = 0.0f32;
    for (e, (qe, &v)) in q.iter_mut().zip(vals).enumerate() {
        *qe = (v * id[e / 16]).round_ties_even().clamp(-max, max) as i16;
        sum += f32::from(*qe) * d[e / 16];
    }
    (q, d, sum)
}

/// Quantizes one row of `k` activations into `pairs` records: whole pairs
/// with AVX2 where the CPU has it ([`quantize_pair_avx2`], the same codes,
/// scales and sums bit for bit), a partial last pair and other CPUs
/// through [`quantize_pair`].
fn quantize_row(x: &[f32], bits: ActBits, out: &mut [u8], sums: &mut [f32], corr: &mut [i32]) {
    let rec = bits.record();
    let pairs = out.len() / rec;
    let mut j = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if has_simd() {
            while (j + 1) * PAIR <= x.len() && j < pairs {
                let c = if bits.int8() { &mut corr[8 * j..8 * j + 8] } else { &mut [][..] };
                // SAFETY: the CPU supports AVX2, FMA and F16C; `x` holds the
                // pair's 64 values, `out` its record and `sums` its two sums.
                unsafe {
                    quantize_pair_avx2(&x[j * PAIR..(j + 1) * PAIR], bits, &mut out[j * rec..(j + 1) * rec], &mut sums[2 * j..2 * j + 2], c)
                };
                j += 1;
            }
        }
    }
    for j in j..pairs {
        quantize_pair(x, j, bits, &mut out[j * rec..(j + 1) * rec], sums, corr);
    }
}

/// [`quantize_row`] of `x` with the channels `zero` set to zero (in a
/// per-thread copy of the row), their values into `picked`.
fn quantize_row_zeroing(
    x: &[f32],
    bits: ActBits,
    (zero, picked): (&[usize], &mut [f32]),
    out: &mut [u8],
    sums: &mut [f32],
    corr: &mut [i32],
) {
    if zero.is_empty() {
        return quantize_row(x, bits, out, sums, corr);
    }
    for (p, &c) in picked.iter_mut().zip(zero) {
        *p = x[c];
    }
    thread_local! {
        static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut run = |row: &mut Vec<f32>| {
        row.clear();
        row.extend_from_slice(x);
        for &c in zero {
            row[c] = 0.0;
        }
        quantize_row(row, bits, out, sums, corr);
    };
    ROW.with(|cell| match cell.try_borrow_mut() {
        Ok(mut row) => run(&mut row),
        Err(_) => run(&mut Vec::new()),
    });
}

/// Pair `j` of row `x` (values `64j..64j + 64`, zeros past the end) into
/// its record `r`, its block sums and (int8) its corrections.
fn quantize_pair(x: &[f32], j: usize, bits: ActBits, r: &mut [u8], sums: &mut [f32], corr: &mut [i32]) {
    let k = x.len();
    for b in 0..2 {
        let start = (j * PAIR + b * BLOCK).min(k);
        let end = (start + BLOCK).min(k);
        let (q, d, sum) = quant_act_block(&x[start..end], bits);
        match bits {
            ActBits::I8 | ActBits::I8Halves => {
                for (e, &qe) in q.iter().enumerate() {
                    r[pos(b, e)] = qe as i8 as u8;
                }
                let half = |h: usize| -128 * q[16 * h..16 * h + 16].iter().map(|&v| i32::from(v)).sum::<i32>();
                let (h0, h1) = (half(0), half(1));
                corr[4 * (2 * j + b)..4 * (2 * j + b) + 4].copy_from_slice(&[h0, h1, h0 + h1, 0]);
            }
            ActBits::I16 => {
                for (e, qe) in q.iter().enumerate() {
                    let p = 2 * pos(b, e);
                    r[p..p + 2].copy_from_slice(&qe.to_le_bytes());
                }
            }
        }
        for (h, dh) in d.iter().enumerate().take(if bits.halves() { 2 } else { 1 }) {
            let at = bits.scale_at(b, 16 * h);
            r[at..at + 4].copy_from_slice(&dh.to_le_bytes());
        }
        sums[2 * j + b] = sum;
    }
}

/// [`quantize_pair`] for a whole pair with AVX2: each block's `amax` from
/// four registers, codes rounded to nearest-even (`vroundps`) and clamped,
/// then packed so that the pair's interleaved groups of four
/// ([`pos`]) come out in order: `packs_epi32` of the two blocks' registers
/// puts group `2r` of both blocks in the low lane and `2r + 1` in the high
/// one, which is the int16 record as it stands; for int8, `packs_epi16` of
/// two such results and a 64-bit permute.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x.len() == 64`, `r` is a whole
/// record of `bits`, `sums.len() == 2` and `corr.len()` is 8 for int8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_pair_avx2(x: &[f32], bits: ActBits, r: &mut [u8], sums: &mut [f32], corr: &mut [i32]) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == PAIR && r.len() == bits.record() && sums.len() == 2);
    let max = bits.max();
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let hmax = |v: __m256| {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    };
    let hsum = |v: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    };
    let mut q = [[_mm256_setzero_si256(); 4]; 2];
    // Per block, the scales of values 0..16 and 16..32 (equal unless halves).
    let mut d = [[0.0f32; 2]; 2];
    // Each block's dequantized values, for its sum.
    let mut prods = [[0.0f32; BLOCK]; 2];
    for b in 0..2 {
        // SAFETY (loads): `x` holds 64 values, block `b` is 32 of them.
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(b * BLOCK + 8 * i)));
        let a = v.map(|v| _mm256_and_ps(v, abs_mask));
        let (m0, m1) = (_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        d[b] = if bits.halves() { [hmax(m0) / max, hmax(m1) / max] } else { [hmax(_mm256_max_ps(m0, m1)) / max; 2] };
        let id = d[b].map(|d| _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 }));
        let (lo, hi) = (_mm256_set1_epi32(-(max as i32)), _mm256_set1_epi32(max as i32));
        for (i, qi) in q[b].iter_mut().enumerate() {
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[i], id[i / 2]));
            *qi = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(t), lo), hi);
        }
        for (i, &qi) in q[b].iter().enumerate() {
            let dv = _mm256_set1_ps(d[b][i / 2]);
            // SAFETY: 8 floats into `prods[b][8i..8i + 8]`.
            _mm256_storeu_ps(prods[b].as_mut_ptr().add(8 * i), _mm256_mul_ps(_mm256_cvtepi32_ps(qi), dv));
        }
        if bits.int8() {
            let h0 = hsum(_mm256_add_epi32(q[b][0], q[b][1]));
            let h1 = hsum(_mm256_add_epi32(q[b][2], q[b][3]));
            corr[4 * b..4 * b + 4].copy_from_slice(&[-128 * h0, -128 * h1, -128 * (h0 + h1), 0]);
        }
    }
    // The block sums of the dequantized values, added in order as the
    // scalar quantizer does (products rounded alike, then 32 adds); the two
    // blocks' chains interleaved.
    let (mut s0, mut s1) = (0.0f32, 0.0f32);
    for (p0, p1) in prods[0].iter().zip(&prods[1]) {
        s0 += p0;
        s1 += p1;
    }
    sums.copy_from_slice(&[s0, s1]);
    let w: [__m256i; 4] = std::array::from_fn(|i| _mm256_packs_epi32(q[0][i], q[1][i]));
    let out = r.as_mut_ptr() as *mut __m256i;
    // SAFETY (stores): the record holds 64 codes of `bits` before its scales.
    match bits {
        ActBits::I16 => (0..4).for_each(|i| _mm256_storeu_si256(out.add(i), w[i])),
        ActBits::I8 | ActBits::I8Halves => {
            for i in 0..2 {
                let p = _mm256_packs_epi16(w[2 * i], w[2 * i + 1]);
                _mm256_storeu_si256(out.add(i), _mm256_permute4x64_epi64::<0b11_01_10_00>(p));
            }
        }
    }
    for (b, db) in d.iter().enumerate() {
        for (h, dh) in db.iter().enumerate().take(if bits.halves() { 2 } else { 1 }) {
            let at = bits.scale_at(b, 16 * h);
            r[at..at + 4].copy_from_slice(&dh.to_le_bytes());
        }
    }
}

impl QuantActs {
    /// Quantizes `rows × k` row-major activations to `bits` (rows in
    /// parallel when many).
    pub fn quantize(x: &[f32], rows: usize, k: usize, bits: ActBits, into: &mut QuantActs) {
        into.src.clear();
        into.zeroed.clear();
        Self::quantize_into(x, rows, k, bits, &[], into)
    }

    /// [`QuantActs::quantize`], skipped when `x` equals the activations of
    /// the previous call (the Q, K and V projections, or gate and up, read
    /// the same input). Comparing is ~10× cheaper than quantizing.
    pub fn quantize_cached(x: &[f32], rows: usize, k: usize, bits: ActBits, into: &mut QuantActs) {
        Self::quantize_cached_zeroing(x, rows, k, bits, &[], into)
    }

    /// [`QuantActs::quantize_cached`] with the input channels `zero`
    /// quantized as zeros (a weight's outlier channels, which it multiplies
    /// in f32: [`crate::outliers`]), so that they set no block's scale.
    /// Each row is copied and zeroed where it is quantized (in L1), not as
    /// a whole copy of `x`.
    pub fn quantize_cached_zeroing(x: &[f32], rows: usize, k: usize, bits: ActBits, zero: &[usize], into: &mut QuantActs) {
        if !into.split
            && into.rows == rows
            && into.pairs == k.div_ceil(PAIR)
            && into.bits == bits
            && into.zeroed == zero
            && into.src.len() == x.len()
            && into.src == x
        {
            return;
        }
        Self::quantize_into(x, rows, k, bits, zero, into);
        into.src.clear();
        into.src.extend_from_slice(x);
        into.zeroed.clear();
        into.zeroed.extend_from_slice(zero);
    }

    /// int16 precision from two int8 passes, for the VNNI lane kernels:
    /// rows `0..rows` hold each input row quantized to int8 (`x̂`), rows
    /// `rows..2·rows` what it leaves, `x − x̂`, quantized to int8 again with
    /// its own block scales. `W·x̂ + W·(x − x̂)^` then errs by at most half a
    /// code step of the remainder, `amax / (4 · 127²) ≈ amax / 64516` per
    /// value against int16's `amax / 65534`, at the int8 kernels' rate
    /// (each weight block meets both rows while in registers). Skipped,
    /// like [`QuantActs::quantize_cached`], when `x` is the previous input.
    pub fn quantize_split_cached(x: &[f32], rows: usize, k: usize, into: &mut QuantActs) {
        let pairs = k.div_ceil(PAIR);
        if into.split && into.rows == 2 * rows && into.pairs == pairs && into.src.len() == x.len() && into.src == x {
            return;
        }
        let bits = ActBits::I8;
        let (per, nbp, ncorr) = (pairs * bits.record(), padded_blocks(pairs), 8 * pairs);
        into.rows = 2 * rows;
        into.pairs = pairs;
        into.bits = bits;
        into.split = true;
        into.zeroed.clear();
        into.data.clear();
        into.data.resize(2 * rows * per, 0);
        into.sums.clear();
        into.sums.resize(2 * rows * nbp, 0.0);
        into.corr.clear();
        into.corr.resize(2 * rows * ncorr, 0);
        into.src.clear();
        into.src.extend_from_slice(x);
        if k == 0 || rows == 0 {
            return;
        }
        let (hi_d, lo_d) = into.data.split_at_mut(rows * per);
        let (hi_s, lo_s) = into.sums.split_at_mut(rows * nbp);
        let (hi_c, lo_c) = into.corr.split_at_mut(rows * ncorr);
        /// A row's two records, block sums and corrections (int8 of `x`,
        /// then of what it leaves), and the row, as the zips below nest them.
        type SplitRow<'a> = ((((((&'a mut [u8], &'a mut [u8]), &'a mut [f32]), &'a mut [f32]), &'a mut [i32]), &'a mut [i32]), &'a [f32]);
        let row = |((((((hd, ld), hs), ls), hc), lc), xr): SplitRow<'_>| {
            quantize_row(xr, bits, hd, hs, hc);
            let mut rest = xr.to_vec();
            for (pair, rec) in rest.chunks_mut(PAIR).zip(hd.chunks(bits.record())) {
                for (b, block) in pair.chunks_mut(BLOCK).enumerate() {
                    let d = f32_at(rec, bits.scales() + 4 * b);
                    for (e, v) in block.iter_mut().enumerate() {
                        *v -= f32::from(rec[pos(b, e)] as i8) * d;
                    }
                }
            }
            quantize_row(&rest, bits, ld, ls, lc);
        };
        if rows * k >= 1 << 15 {
            let mut items: Vec<SplitRow<'_>> = hi_d
                .chunks_mut(per)
                .zip(lo_d.chunks_mut(per))
                .zip(hi_s.chunks_mut(nbp))
                .zip(lo_s.chunks_mut(nbp))
                .zip(hi_c.chunks_mut(ncorr))
                .zip(lo_c.chunks_mut(ncorr))
                .zip(x.chunks(k))
                .collect();
            crate::spin_team::for_chunks_mut(&mut items, rows_per_part(rows), &|_, part| {
                for ((((((hd, ld), hs), ls), hc), lc), xr) in part.iter_mut() {
                    row(((((((&mut **hd, &mut **ld), &mut **hs), &mut **ls), &mut **hc), &mut **lc), xr));
                }
            });
        } else {
            hi_d.chunks_mut(per)
                .zip(lo_d.chunks_mut(per))
                .zip(hi_s.chunks_mut(nbp))
                .zip(lo_s.chunks_mut(nbp))
                .zip(hi_c.chunks_mut(ncorr))
                .zip(lo_c.chunks_mut(ncorr))
                .zip(x.chunks(k))
                .for_each(row);
        }
    }

    fn quantize_into(x: &[f32], rows: usize, k: usize, bits: ActBits, zero: &[usize], into: &mut QuantActs) {
        into.split = false;
        let pairs = k.div_ceil(PAIR);
        into.rows = rows;
        into.pairs = pairs;
        into.bits = bits;
        into.data.clear();
        into.data.resize(rows * pairs * bits.record(), 0);
        let nbp = padded_blocks(pairs);
        into.sums.clear();
        into.sums.resize(rows * nbp, 0.0);
        let ncorr = if bits.int8() { 8 * pairs } else { 0 };
        into.corr.clear();
        into.corr.resize(rows * ncorr, 0);
        into.zeroed_values.clear();
        into.zeroed_values.resize(rows * zero.len(), 0.0);
        if k == 0 {
            return;
        }
        let per = pairs * bits.record();
        // One (empty) slice per row when there are no corrections or no
        // zeroed channels.
        let empty_rows = |n: usize| -> Vec<&mut [i32]> { (0..n).map(|_| &mut [][..]).collect() };
        let mut corr: Vec<&mut [i32]> = if ncorr == 0 { empty_rows(rows) } else { into.corr.chunks_mut(ncorr).collect() };
        let mut picked: Vec<&mut [f32]> =
            if zero.is_empty() { (0..rows).map(|_| &mut [][..]).collect() } else { into.zeroed_values.chunks_mut(zero.len()).collect() };
        let rows_of = into.data.chunks_mut(per).zip(into.sums.chunks_mut(nbp)).zip(corr.iter_mut()).zip(picked.iter_mut()).zip(x.chunks(k));
        if rows * k >= 1 << 15 {
            let mut items: Vec<_> = rows_of.collect();
            crate::spin_team::for_chunks_mut(&mut items, rows_per_part(rows), &|_, part| {
                for ((((o, sm), cr), pk), xr) in part.iter_mut() {
                    quantize_row_zeroing(xr, bits, (zero, pk), o, sm, cr);
                }
            });
        } else {
            for ((((o, sm), cr), pk), xr) in rows_of {
                quantize_row_zeroing(xr, bits, (zero, pk), o, sm, cr);
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
            ActBits::I8 | ActBits::I8Halves => i32::from(r[p] as i8),
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
    if w.lanes > 0 {
        return lanes::scalar_cell(x, w, r, c);
    }
    let mut acc = 0.0f32;
    for j in 0..w.pairs {
        let wr = w.record(c, j);
        let xr = x.record(r, j);
        // By half of the pair (values 0..16 / 16..32 of each block) and block.
        let mut isum = [[0i32; 2]; 2];
        for p in 0..PAIR {
            isum[p / 32][block_of(p)] += w.q_at(wr, p) * x.code(xr, p);
        }
        for b in 0..2 {
            let dx = f32_at(xr, x.bits.scale_at(b, 0));
            let sx = x.sums[r * padded_blocks(x.pairs) + 2 * j + b];
            if w.kind.split_halves() || x.bits.halves() {
                for (h, half) in isum.iter().enumerate() {
                    let (d, m) = w.scales(wr, c, j, b, h);
                    acc += half[b] as f32 * (d * f32_at(xr, x.bits.scale_at(b, 16 * h)));
                    if h == 1 {
                        acc += m * sx;
                    }
                }
            } else {
                let (d, m) = w.scales(wr, c, j, b, 0);
                acc += (isum[0][b] + isum[1][b]) as f32 * (d * dx) + m * sx;
            }
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
                if std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512vnni")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512bw")
                {
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
mod lanes;
pub mod q5;

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
            // The lane layout: int8 kernels only (else the scalar one);
            // groups of 16 on AVX-512 only.
            (Kernel::Avx2, ActBits::I8) if w.lanes == lanes::LANES => Some(lanes::kernels::avx2::gemm::<false>),
            (Kernel::AvxVnni, ActBits::I8) if w.lanes == lanes::LANES => Some(lanes::kernels::avxvnni::gemm::<false>),
            (Kernel::Avx512Vnni, ActBits::I8) if w.lanes > 0 => Some(lanes::kernels::avx512vnni::gemm::<false>),
            (Kernel::Avx2, ActBits::I8Halves) if w.lanes == lanes::LANES => Some(lanes::kernels::avx2::gemm::<true>),
            (Kernel::AvxVnni, ActBits::I8Halves) if w.lanes == lanes::LANES => Some(lanes::kernels::avxvnni::gemm::<true>),
            (Kernel::Avx512Vnni, ActBits::I8Halves) if w.lanes > 0 => Some(lanes::kernels::avx512vnni::gemm::<true>),
            // The pair layout has no kernel for scales per 16 activations.
            (_, ActBits::I8Halves) => None,
            _ if w.lanes > 0 => None,
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
