//! The lane layout: eight outputs side by side, for the VNNI int8 kernels.
//!
//! In the pair layout ([`super`]) a register's lanes hold groups of one
//! output's values, so every 64 multiply-adds of a row end in a convert, a
//! scale multiply and an FMA: 5 vector operations per 2 `vpdpbusd`, the
//! bound of those kernels (~25 MAC per cycle). Here the eight 32-bit lanes
//! of a register are eight *outputs*, each holding four consecutive values
//! of one block, and a row's four matching activations are broadcast to all
//! lanes: eight `vpdpbusd` leave the whole block's integer dot product of
//! eight outputs in one register, which then takes one convert, one
//! multiply and one FMA (11 operations per 256 multiply-adds).
//!
//! With AVX-512 the groups are 16 outputs wide (`tile16`): a record's
//! vectors are 64 bytes, one 512-bit load each, so each broadcast
//! activation, `vpdpbusd`, convert and FMA serves 16 outputs. (Two 8-wide
//! records joined into one register cost a `vinserti64x4` per vector:
//! 20–30% of the 64-row rate on Zen 4.) A 16-wide group holds the same
//! operations lane for lane as two 8-wide ones, so the same sums.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones. Activations are
//! signed, so weights must be unsigned: nibbles (Q4, Q4K) are; signed codes
//! (Q8, Q6K) are stored plus 128, and a block's integer sum starts from
//! `−128 · Σ codes` of the row's activations ([`QuantActs::corr`]), which
//! takes the offset out exactly.
//!
//! A record per (group of `L` = 8 or 16 outputs, block of 32),
//! `[groups][blocks]`:
//!
//! * codes: 8-bit kinds, eight vectors of `4L` bytes, vector `g` holding
//!   values `4g..4g + 4` of each output (lane `o` = output `o` of the
//!   group); nibble kinds, four vectors, byte `i` of lane `o` of vector `g`
//!   holding value `4g + i` in its low nibble and `4(g + 4) + i` in its high
//!   one;
//! * the outputs' `d`: `L` f16 (Q4), `L` f32 (Q8, Q4K), 2 × `L` f32 (Q6K:
//!   values 0..16, then 16..32);
//! * the outputs' offsets `m`: `L` f16 (Q4), `L` f32 (Q4K).
//!
//! Bytes per weight are those of the pair layout. Weights use this layout
//! where the int8 kernel has VNNI, and on AVX2 alone
//! ([`QuantWeight::into_best_layout`]: there `vpmaddubsw` and `vpmaddwd`
//! stand in for `vpdpbusd`, the sums of a nibble block adding up in i16
//! first, 8-bit codes taking the sign trick); the scalar kernel reads both
//! layouts.

use super::{padded_blocks, pos, QuantActs, QuantKind, QuantWeight, BLOCK, KQ4, KQ4K, KQ6K, KQ8, PAIR};
use half::f16;

/// Outputs per lane group for the 256-bit kernels.
pub(crate) const LANES: usize = 8;
/// Outputs per lane group for the 512-bit kernel (AVX-512 VNNI).
pub(crate) const WIDE_LANES: usize = 16;

/// Bytes of the codes of one record of `lanes` outputs.
pub(crate) const fn codes_bytes(kind: QuantKind, lanes: usize) -> usize {
    if kind.nibbles() {
        4 * 4 * lanes
    } else {
        8 * 4 * lanes
    }
}

/// Bytes of one record of `lanes` outputs.
pub(crate) const fn record_bytes(kind: QuantKind, lanes: usize) -> usize {
    codes_bytes(kind, lanes)
        + lanes
            * match kind {
                QuantKind::Q4 => 2 + 2,
                QuantKind::Q4K => 4 + 4,
                QuantKind::Q8 => 4,
                QuantKind::Q6K => 8,
            }
}

impl QuantWeight {
    /// Blocks per output (both halves of every pair).
    fn blocks(&self) -> usize {
        2 * self.pairs
    }

    /// The record of output group `g`, block `blk` (lane layout).
    fn lane_record(&self, g: usize, blk: usize) -> &[u8] {
        let rec = record_bytes(self.kind, self.lanes);
        let o = (g * self.blocks() + blk) * rec;
        &self.data[o..o + rec]
    }

    /// The signed code of value `e` of block `blk` of output `c` (lane
    /// layout).
    pub(super) fn lane_code(&self, c: usize, blk: usize, e: usize) -> i32 {
        let l = self.lanes;
        let r = self.lane_record(c / l, blk);
        let (g, i, o) = (e / 4, e % 4, c % l);
        if self.kind.nibbles() {
            let byte = r[(g % 4) * 4 * l + 4 * o + i];
            i32::from(if g < 4 { byte & 0x0f } else { byte >> 4 })
        } else {
            i32::from(r[g * 4 * l + 4 * o + i]) - 128
        }
    }

    /// (d, m) of half `h` of block `blk` of output `c` (lane layout).
    pub(super) fn lane_scales(&self, c: usize, blk: usize, h: usize) -> (f32, f32) {
        let l = self.lanes;
        let r = self.lane_record(c / l, blk);
        let (at, o) = (codes_bytes(self.kind, l), c % l);
        let f16_at = |p: usize| f16::from_le_bytes([r[p], r[p + 1]]).to_f32();
        match self.kind {
            QuantKind::Q4 => (f16_at(at + 2 * o), f16_at(at + 2 * l + 2 * o)),
            QuantKind::Q4K => (super::f32_at(r, at + 4 * o), super::f32_at(r, at + 4 * l + 4 * o)),
            QuantKind::Q8 => (super::f32_at(r, at + 4 * o), 0.0),
            QuantKind::Q6K => (super::f32_at(r, at + 4 * l * h + 4 * o), 0.0),
        }
    }

    /// The layout the fastest kernel for activations of `acts` reads: the
    /// lane layout on a CPU with VNNI (16 outputs wide with AVX-512, else
    /// 8); on AVX2 alone, for nibble kinds and
    /// for 8-bit kinds at int8 (int16 precision on an 8-bit kind runs
    /// faster through the pair layout's int16 kernel there than as two
    /// passes of [`kernels::avx2`]'s sign trick); else as it is. int16
    /// precision on the lane layout runs as two int8 passes
    /// ([`super::QuantActs::quantize_split_cached`]; KERNELS.md has the
    /// rates).
    pub fn into_best_layout(self, acts: super::ActBits) -> Self {
        let kernel = super::Kernel::detect();
        let avx2 = kernel == super::Kernel::Avx2 && (self.kind.nibbles() || acts.int8());
        if kernel == super::Kernel::Avx512Vnni {
            self.into_lanes_of(WIDE_LANES)
        } else if kernel >= super::Kernel::AvxVnni || avx2 {
            self.into_lanes_of(LANES)
        } else {
            self
        }
    }

    /// The same weight in the lane layout of 8 outputs per group.
    pub fn into_lanes(self) -> Self {
        self.into_lanes_of(LANES)
    }

    /// The same weight in the lane layout of `lanes` (8 or 16) outputs per
    /// group, from either layout (a no-op if it is already so).
    pub fn into_lanes_of(self, lanes: usize) -> Self {
        assert!(lanes == LANES || lanes == WIDE_LANES, "lane groups are 8 or 16 outputs wide, not {lanes}");
        if self.lanes == lanes {
            return self;
        }
        let kind = self.kind;
        let (rec, nb, groups) = (record_bytes(kind, lanes), self.blocks(), self.n.div_ceil(lanes));
        let mut data = vec![0u8; groups * nb * rec];
        let cb = codes_bytes(kind, lanes);
        // Code `e` and the scales of half `h` of block `blk` of output `c`,
        // from the layout the weight is in.
        let code = |c: usize, blk: usize, e: usize| {
            if self.lanes > 0 {
                self.lane_code(c, blk, e)
            } else {
                self.q_at(self.record(c, blk / 2), pos(blk % 2, e))
            }
        };
        let scales = |c: usize, blk: usize, h: usize| {
            if self.lanes > 0 {
                self.lane_scales(c, blk, h)
            } else {
                self.scales(self.record(c, blk / 2), c, blk / 2, blk % 2, h)
            }
        };
        let fill = |(g8, out): (usize, &mut [u8])| {
            for blk in 0..nb {
                let r = &mut out[blk * rec..(blk + 1) * rec];
                for o in 0..lanes.min(self.n - g8 * lanes) {
                    let c = g8 * lanes + o;
                    for e in 0..BLOCK {
                        let q = code(c, blk, e);
                        let (g, i) = (e / 4, e % 4);
                        if kind.nibbles() {
                            r[(g % 4) * 4 * lanes + 4 * o + i] |= (q as u8) << (4 * (g / 4));
                        } else {
                            r[g * 4 * lanes + 4 * o + i] = (q + 128) as u8;
                        }
                    }
                    let (d0, m) = scales(c, blk, 0);
                    let put = |r: &mut [u8], at: usize, bytes: &[u8]| r[at..at + bytes.len()].copy_from_slice(bytes);
                    match kind {
                        QuantKind::Q4 => {
                            put(r, cb + 2 * o, &f16::from_f32(d0).to_le_bytes());
                            put(r, cb + 2 * lanes + 2 * o, &f16::from_f32(m).to_le_bytes());
                        }
                        QuantKind::Q4K => {
                            put(r, cb + 4 * o, &d0.to_le_bytes());
                            put(r, cb + 4 * lanes + 4 * o, &m.to_le_bytes());
                        }
                        QuantKind::Q8 => put(r, cb + 4 * o, &d0.to_le_bytes()),
                        QuantKind::Q6K => {
                            let (d1, _) = scales(c, blk, 1);
                            put(r, cb + 4 * o, &d0.to_le_bytes());
                            put(r, cb + 4 * lanes + 4 * o, &d1.to_le_bytes());
                        }
                    }
                }
            }
        };
        use rayon::prelude::*;
        data.par_chunks_mut(nb * rec).enumerate().for_each(fill);
        Self { data, mins: super::Mins::None, lanes, ..self }
    }
}

/// The correction a block's integer sum starts from: none for nibbles,
/// `−128 · Σ codes` of the row's block (or of its half `h`, Q6K).
fn corr_index(blk: usize, which: usize) -> usize {
    4 * blk + which
}

/// One output cell of the scalar kernel on the lane layout: the same
/// integer sums as the lane kernels.
pub(super) fn scalar_cell(x: &QuantActs, w: &QuantWeight, r: usize, c: usize) -> f32 {
    let mut acc = 0.0f32;
    for blk in 0..w.blocks() {
        let (j, b) = (blk / 2, blk % 2);
        let xr = x.record(r, j);
        let mut half = [0i32; 2];
        for e in 0..BLOCK {
            half[e / 16] += w.lane_code(c, blk, e) * x.code(xr, pos(b, e));
        }
        let dx = super::f32_at(xr, x.bits.scale_at(b, 0));
        if w.kind.split_halves() || x.bits.halves() {
            for (h, s) in half.iter().enumerate() {
                let (d, m) = w.lane_scales(c, blk, h);
                acc += *s as f32 * (d * super::f32_at(xr, x.bits.scale_at(b, 16 * h)));
                if h == 1 {
                    acc += m * x.sums[r * padded_blocks(x.pairs) + blk];
                }
            }
        } else {
            let (d, m) = w.lane_scales(c, blk, 0);
            acc += (half[0] + half[1]) as f32 * (d * dx) + m * x.sums[r * padded_blocks(x.pairs) + blk];
        }
    }
    acc
}

/// Checks the layout arithmetic the kernels rely on.
const _: () = assert!(PAIR == 2 * BLOCK && KQ4 != KQ8 && KQ4K != KQ6K);

#[cfg(target_arch = "x86_64")]
pub(super) mod kernels {
    //! The lane kernels, one module per VNNI instruction set.
    use super::super::{padded_blocks, ActBits, QuantActs, QuantKind, QuantWeight, KQ4, KQ4K, KQ6K, KQ8};
    use super::{codes_bytes, corr_index, record_bytes, LANES, WIDE_LANES};
    use crate::quant::avx2::PREFETCH_BYTES;
    use std::arch::x86_64::*;

    /// Weights above this size (bytes of the called column range) are
    /// walked in chunks of [`CHUNK_BYTES`] (see `gemm`).
    const BIG_WEIGHT: usize = 8 << 20;
    /// Bytes of weight records per chunk (Gemma 3's LM head at 64 rows,
    /// one core: 64–512 KiB alike, 32 KiB and 1 MiB slower).
    const CHUNK_BYTES: usize = 128 << 10;

    /// The activations the kernels read: [`ActBits::I8`], or with `H`
    /// [`ActBits::I8Halves`] (a scale per 16 values).
    const fn acts(h: bool) -> ActBits {
        if h {
            ActBits::I8Halves
        } else {
            ActBits::I8
        }
    }

    /// Bytes of one activation pair record (see [`acts`]).
    const fn xrec(h: bool) -> usize {
        acts(h).record()
    }

    /// The `dx` of half `h` of block `b` of the record at `xr` (the block's
    /// unless `H`), where [`ActBits::scale_at`] puts it.
    ///
    /// # Safety
    /// `xr` must point to a whole activation record of its kind.
    #[inline(always)]
    unsafe fn dx_at<const H: bool>(xr: *const u8, b: usize, h: usize) -> f32 {
        // SAFETY: the record holds its scales at `scale_at` (the caller's contract).
        unsafe { (xr.add(acts(H).scale_at(b, 16 * h)) as *const f32).read_unaligned() }
    }

    /// Where a tile reads: the first row's activation records, block sums
    /// and corrections, the output group's records, and where it writes.
    #[derive(Clone, Copy)]
    struct Tile {
        y: *mut f32,
        ldy: usize,
        x: *const u8,
        sums: *const f32,
        corr: *const i32,
        w: *const u8,
        blocks: usize,
        /// Which of the group's outputs to store (a bit per lane).
        store: u16,
        /// The weight's [`QuantWeight::small_codes`].
        small: bool,
    }

    /// Prefetches the `rec` bytes from `p` into L1, a request per cache
    /// line (a record of 8-bit codes spans five lines, one of nibbles three).
    #[inline(always)]
    fn prefetch_record(p: *const u8, rec: usize) {
        let mut line = 0;
        while line < rec {
            // SAFETY: a prefetch never faults, whatever the address (it may
            // run past the weight); SSE is part of x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line) as *const i8) };
            line += 64;
        }
    }

    /// Writes a tile's `R` rows of eight outputs (the lanes the store mask
    /// names).
    ///
    /// # Safety
    /// The CPU must support AVX; the cells of `t.y` the mask names, in `R`
    /// rows of stride `t.ldy`, must be valid for writes and the caller's.
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn store<const R: usize>(t: &Tile, f: &[__m256; R]) {
        for (r, fr) in f.iter().enumerate() {
            // SAFETY: as this function's contract.
            unsafe {
                let y = t.y.add(r * t.ldy);
                if t.store & 0xff == 0xff {
                    _mm256_storeu_ps(y, *fr);
                } else {
                    let mut v = [0f32; LANES];
                    _mm256_storeu_ps(v.as_mut_ptr(), *fr);
                    for (o, val) in v.iter().enumerate() {
                        if t.store & (1 << o) != 0 {
                            *y.add(o) = *val;
                        }
                    }
                }
            }
        }
    }

    /// The AVX2 tile for 8-bit kinds (Q8, Q6K), whose codes are stored plus
    /// 128: `vpmaddubsw` needs an unsigned operand no larger than 128 to
    /// stay clear of saturation, so each code goes back to signed
    /// (`u ⊕ 0x80`), its magnitude is the unsigned operand and its sign
    /// moves onto the broadcast activations (`vpsignb`): `|w| · sign(w)·x =
    /// w·x`, a pair at most `2 · 128 · 127 < 2¹⁵` (a −128 code included).
    /// A block runs in two halves of four vectors (values 0..16 and 16..32,
    /// Q6K's two scales), so that the half's magnitudes and signs (eight
    /// registers) serve every row of the tile; no correction term is needed.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `t` as for the lane kernels'
    /// tiles, the weight of kind `K` (8-bit).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn signed_tile_avx2<const R: usize, const K: u8, const H: bool>(t: Tile) {
        let kind = QuantKind::from_code(K);
        let (rec, cb) = (record_bytes(kind, LANES), codes_bytes(kind, LANES));
        let pairs = t.blocks / 2;
        let (offset, ones) = (_mm256_set1_epi8(-128), _mm256_set1_epi16(1));
        let mut f = [_mm256_setzero_ps(); R];
        for blk in 0..t.blocks {
            let (j, b) = (blk / 2, blk % 2);
            // SAFETY (loads): record `blk` of the group and pair `blk / 2`
            // of every row exist; offsets stay inside them.
            unsafe {
                let wr = t.w.add(blk * rec);
                if R < 4 {
                    // A prefetch never faults: the address may run past the weight.
                    prefetch_record(t.w.wrapping_add(blk * rec + PREFETCH_BYTES), rec);
                }
                for h in 0..2 {
                    let mut sw = [_mm256_setzero_si256(); 4];
                    let mut aw = [_mm256_setzero_si256(); 4];
                    for q in 0..4 {
                        sw[q] = _mm256_xor_si256(_mm256_loadu_si256(wr.add(32 * (4 * h + q)) as *const __m256i), offset);
                        aw[q] = _mm256_abs_epi8(sw[q]);
                    }
                    let d = _mm256_loadu_ps(wr.add(cb + if K == KQ6K { 32 * h } else { 0 }) as *const f32);
                    for (r, fr) in f.iter_mut().enumerate() {
                        let xr = t.x.add((r * pairs + j) * xrec(H));
                        // Group g of block b sits at 8g + 4b in the pair.
                        let xg = |g: usize| _mm256_set1_epi32((xr.add(8 * g + 4 * b) as *const i32).read_unaligned());
                        let dx = _mm256_set1_ps(dx_at::<H>(xr, b, h));
                        let p = |q: usize| _mm256_madd_epi16(_mm256_maddubs_epi16(aw[q], _mm256_sign_epi8(xg(4 * h + q), sw[q])), ones);
                        let isum = _mm256_add_epi32(_mm256_add_epi32(p(0), p(1)), _mm256_add_epi32(p(2), p(3)));
                        *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx), *fr);
                    }
                }
            }
        }
        // SAFETY: the caller owns the cells the store mask names.
        unsafe { store(&t, &f) }
    }

    /// A group of 16 outputs in 512-bit registers (AVX-512 VNNI): each
    /// broadcast activation and each `vpdpbusd` serves 16 outputs. Every
    /// kind; the operations are those of the 256-bit tile's VNNI path lane
    /// for lane, so the results are the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL/VNNI; `t` as
    /// for the lane kernels' tiles, its group 16 outputs wide, of kind `K`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tile16<const R: usize, const K: u8, const H: bool>(t: Tile) {
        let kind = QuantKind::from_code(K);
        let (rec, cb) = (record_bytes(kind, WIDE_LANES), codes_bytes(kind, WIDE_LANES));
        let pairs = t.blocks / 2;
        let nbp = padded_blocks(pairs);
        let mut f = [_mm512_setzero_ps(); R];
        for blk in 0..t.blocks {
            // SAFETY (loads): record `blk` of the group and pair `blk / 2`
            // of every row exist; offsets stay inside them.
            unsafe {
                let wr = t.w.add(blk * rec);
                if R < 4 {
                    // A prefetch never faults: the address may run past the weight.
                    prefetch_record(t.w.wrapping_add(blk * rec + 2 * PREFETCH_BYTES), rec);
                }
                let load = |o: usize| _mm512_loadu_si512(wr.add(o) as *const _);
                let mut wv = [_mm512_setzero_si512(); 8];
                if K == KQ4 || K == KQ4K {
                    let mask = _mm512_set1_epi8(0x0f);
                    for g in 0..4 {
                        let v = load(64 * g);
                        wv[g] = _mm512_and_si512(v, mask);
                        wv[g + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
                    }
                } else {
                    for (g, v) in wv.iter_mut().enumerate() {
                        *v = load(64 * g);
                    }
                }
                let f32x16 = |o: usize| _mm512_loadu_ps(wr.add(o) as *const f32);
                let f16x16 = |o: usize| _mm512_cvtph_ps(_mm256_loadu_si256(wr.add(o) as *const __m256i));
                let d0 = if K == KQ4 { f16x16(cb) } else { f32x16(cb) };
                // Q6K's second scale (values 16..32), or the offsets `m`.
                let (d1, m) = match K {
                    KQ6K => (f32x16(cb + 64), _mm512_setzero_ps()),
                    KQ4 => (_mm512_setzero_ps(), f16x16(cb + 32)),
                    KQ4K => (_mm512_setzero_ps(), f32x16(cb + 64)),
                    _ => (_mm512_setzero_ps(), _mm512_setzero_ps()),
                };
                let (j, b) = (blk / 2, blk % 2);
                for (r, fr) in f.iter_mut().enumerate() {
                    let xr = t.x.add((r * pairs + j) * xrec(H));
                    // Group g of block b sits at 8g + 4b in the pair.
                    let xg = |g: usize| _mm512_set1_epi32((xr.add(8 * g + 4 * b) as *const i32).read_unaligned());
                    let dx = _mm512_set1_ps(dx_at::<H>(xr, b, 0));
                    let corr = |which: usize| _mm512_set1_epi32(*t.corr.add(r * 4 * t.blocks + corr_index(blk, which)));
                    if K == KQ6K || H {
                        // A chain per half, each with its own scales (the
                        // weight's for Q6K, the activations' for H).
                        let (mut i0, mut i1) =
                            if K == KQ4 || K == KQ4K { (_mm512_setzero_si512(), _mm512_setzero_si512()) } else { (corr(0), corr(1)) };
                        for g in 0..4 {
                            i0 = _mm512_dpbusd_epi32(i0, wv[g], xg(g));
                            i1 = _mm512_dpbusd_epi32(i1, wv[g + 4], xg(g + 4));
                        }
                        let (d1, dx1) = (if K == KQ6K { d1 } else { d0 }, if H { _mm512_set1_ps(dx_at::<H>(xr, b, 1)) } else { dx });
                        *fr = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(d0, dx), *fr);
                        *fr = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(d1, dx1), *fr);
                        if K == KQ4 || K == KQ4K {
                            *fr = _mm512_fmadd_ps(m, _mm512_set1_ps(*t.sums.add(r * nbp + blk)), *fr);
                        }
                        continue;
                    }
                    // Two chains, for the latency of vpdpbusd (one chain
                    // per row measured no faster).
                    let (mut i0, mut i1) =
                        if K == KQ8 { (corr(2), _mm512_setzero_si512()) } else { (_mm512_setzero_si512(), _mm512_setzero_si512()) };
                    for g in 0..4 {
                        i0 = _mm512_dpbusd_epi32(i0, wv[2 * g], xg(2 * g));
                        i1 = _mm512_dpbusd_epi32(i1, wv[2 * g + 1], xg(2 * g + 1));
                    }
                    let isum = _mm512_add_epi32(i0, i1);
                    *fr = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d0, dx), *fr);
                    if K == KQ4 || K == KQ4K {
                        *fr = _mm512_fmadd_ps(m, _mm512_set1_ps(*t.sums.add(r * nbp + blk)), *fr);
                    }
                }
            }
        }
        for (r, fr) in f.iter().enumerate() {
            // SAFETY: the caller owns the cells the store mask names, in
            // `R` rows of stride `t.ldy`.
            unsafe { _mm512_mask_storeu_ps(t.y.add(r * t.ldy), t.store, *fr) };
        }
    }

    /// `$tile::<R, K>($args)` for the tile's rows `R` (1–4) and the
    /// weight's kind code `K`.
    macro_rules! by_rows_and_kind {
        ($tile:ident, $rows:expr, $kind:expr, $h:ident, ($($arg:expr),*)) => {
            match ($rows, $kind) {
                (4, KQ4) => $tile::<4, KQ4, $h>($($arg),*),
                (3, KQ4) => $tile::<3, KQ4, $h>($($arg),*),
                (2, KQ4) => $tile::<2, KQ4, $h>($($arg),*),
                (1, KQ4) => $tile::<1, KQ4, $h>($($arg),*),
                (4, KQ8) => $tile::<4, KQ8, $h>($($arg),*),
                (3, KQ8) => $tile::<3, KQ8, $h>($($arg),*),
                (2, KQ8) => $tile::<2, KQ8, $h>($($arg),*),
                (1, KQ8) => $tile::<1, KQ8, $h>($($arg),*),
                (4, KQ4K) => $tile::<4, KQ4K, $h>($($arg),*),
                (3, KQ4K) => $tile::<3, KQ4K, $h>($($arg),*),
                (2, KQ4K) => $tile::<2, KQ4K, $h>($($arg),*),
                (1, KQ4K) => $tile::<1, KQ4K, $h>($($arg),*),
                (4, KQ6K) => $tile::<4, KQ6K, $h>($($arg),*),
                (3, KQ6K) => $tile::<3, KQ6K, $h>($($arg),*),
                (2, KQ6K) => $tile::<2, KQ6K, $h>($($arg),*),
                (1, KQ6K) => $tile::<1, KQ6K, $h>($($arg),*),
                _ => unreachable!("tiles take 1–4 rows"),
            }
        };
    }

    macro_rules! lane_kernel {
        ($(#[$doc:meta])* $name:ident, $features:literal, maddubs: $maddubs:literal, wide: $wide:literal, |$acc:ident, $u:ident, $s:ident| $dpbusd:expr) => {
            $(#[$doc])*
            pub mod $name {
                use super::*;

                /// `acc + Σ₄ u·s` per 32-bit lane.
                ///
                /// # Safety
                /// The CPU must support the module's features.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn dpbusd($acc: __m256i, $u: __m256i, $s: __m256i) -> __m256i {
                    $dpbusd
                }

                /// `R` rows × one group of 8 outputs of kind `K`, every block.
                ///
                /// # Safety
                /// The CPU must support the module's features; `t.x`, `t.sums`
                /// and `t.corr` must hold `R` rows' int8 records, block sums
                /// and corrections, `t.w` the group's `t.blocks` records of
                /// kind `K`; the cells of `y` the store mask names must be
                /// valid for writes and the caller's.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn tile<const R: usize, const K: u8, const H: bool>(t: Tile) {
                    if $maddubs && K == KQ8 && !t.small {
                        // SAFETY: as this function's contract; the module's
                        // features include AVX2, FMA and F16C.
                        return unsafe { signed_tile_avx2::<R, K, H>(t) };
                    }
                    let kind = QuantKind::from_code(K);
                    let (rec, cb) = (record_bytes(kind, LANES), codes_bytes(kind, LANES));
                    let pairs = t.blocks / 2;
                    let nbp = padded_blocks(pairs);
                    let mut f = [_mm256_setzero_ps(); R];
                    for blk in 0..t.blocks {
                        // SAFETY (loads): record `blk` of the group and pair
                        // `blk / 2` of every row exist; offsets stay inside them.
                        unsafe {
                            let wr = t.w.add(blk * rec);
                            if R < 4 {
                                // A prefetch never faults: the address may run past the weight.
                                prefetch_record(t.w.wrapping_add(blk * rec + PREFETCH_BYTES), rec);
                            }
                            let mut wv = [_mm256_setzero_si256(); 8];
                            if K == KQ4 || K == KQ4K {
                                let mask = _mm256_set1_epi8(0x0f);
                                for g in 0..4 {
                                    let v = _mm256_loadu_si256(wr.add(32 * g) as *const __m256i);
                                    wv[g] = _mm256_and_si256(v, mask);
                                    wv[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                                }
                            } else {
                                // AVX2: small codes (Q5_0's −16..=15, Q6K's
                                // −32..=31) move from offset 128 to 16 or 32.
                                let back = _mm256_set1_epi8(if K == KQ6K { 96 } else { 112 });
                                for (g, v) in wv.iter_mut().enumerate() {
                                    *v = _mm256_loadu_si256(wr.add(32 * g) as *const __m256i);
                                    if $maddubs {
                                        *v = _mm256_sub_epi8(*v, back);
                                    }
                                }
                            }
                            let d0 = if K == KQ4 {
                                _mm256_cvtph_ps(_mm_loadu_si128(wr.add(cb) as *const __m128i))
                            } else {
                                _mm256_loadu_ps(wr.add(cb) as *const f32)
                            };
                            let (j, b) = (blk / 2, blk % 2);
                            for (r, fr) in f.iter_mut().enumerate() {
                                let xr = t.x.add((r * pairs + j) * xrec(H));
                                // Group g of block b sits at 8g + 4b in the pair.
                                let xg = |g: usize| _mm256_set1_epi32((xr.add(8 * g + 4 * b) as *const i32).read_unaligned());
                                let dx = _mm256_set1_ps(dx_at::<H>(xr, b, 0));
                                // The scale of values 16..32 (`dx` unless H).
                                let dx1 = if H { _mm256_set1_ps(dx_at::<H>(xr, b, 1)) } else { dx };
                                // The weights' offsets, for nibble kinds.
                                let mins = || if K == KQ4 {
                                    _mm256_cvtph_ps(_mm_loadu_si128(wr.add(cb + 16) as *const __m128i))
                                } else {
                                    _mm256_loadu_ps(wr.add(cb + 32) as *const f32)
                                };
                                let corr = |which: usize| _mm256_set1_epi32(*t.corr.add(r * 4 * t.blocks + corr_index(blk, which)));
                                let madd = |p: __m256i| _mm256_madd_epi16(p, _mm256_set1_epi16(1));
                                let mb = |g: usize| _mm256_maddubs_epi16(wv[g], xg(g));
                                if $maddubs && K == KQ6K {
                                    // Codes plus 32 (0..=63): a `vpmaddubsw`
                                    // lane is at most 2 · 63 · 127 = 16002, two
                                    // add up in i16; the correction is
                                    // −32 · Σ qx, a quarter of −128 · Σ qx
                                    // (exact: a shift).
                                    let d1 = _mm256_loadu_ps(wr.add(cb + 32) as *const f32);
                                    let half = |h: usize| {
                                        let g = 4 * h;
                                        let a = madd(_mm256_add_epi16(mb(g), mb(g + 2)));
                                        let c = madd(_mm256_add_epi16(mb(g + 1), mb(g + 3)));
                                        _mm256_add_epi32(_mm256_srai_epi32::<2>(corr(h)), _mm256_add_epi32(a, c))
                                    };
                                    let (i0, i1) = (half(0), half(1));
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, dx), *fr);
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d1, dx1), *fr);
                                } else if $maddubs && K == KQ8 && H {
                                    // Q5_0's codes plus 16, a sum per half:
                                    // four lanes of at most 7874 add up in
                                    // i16; the correction is −16 · Σ qx.
                                    let half = |h: usize| {
                                        let g = 4 * h;
                                        let p = _mm256_add_epi16(_mm256_add_epi16(mb(g), mb(g + 1)), _mm256_add_epi16(mb(g + 2), mb(g + 3)));
                                        _mm256_add_epi32(_mm256_srai_epi32::<3>(corr(h)), madd(p))
                                    };
                                    let (i0, i1) = (half(0), half(1));
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, dx), *fr);
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d0, dx1), *fr);
                                } else if $maddubs && K == KQ8 {
                                    // Q5_0's codes plus 16 (0..=31): a lane is
                                    // at most 2 · 31 · 127 = 7874, four add up
                                    // in i16; the correction is −16 · Σ qx.
                                    let p0 = _mm256_add_epi16(_mm256_add_epi16(mb(0), mb(2)), _mm256_add_epi16(mb(4), mb(6)));
                                    let p1 = _mm256_add_epi16(_mm256_add_epi16(mb(1), mb(3)), _mm256_add_epi16(mb(5), mb(7)));
                                    let isum = _mm256_add_epi32(_mm256_srai_epi32::<3>(corr(2)), _mm256_add_epi32(madd(p0), madd(p1)));
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d0, dx), *fr);
                                } else if $maddubs && H {
                                    // Nibbles, a sum per half: four
                                    // `vpmaddubsw` (lanes of at most
                                    // 2 · 15 · 128) add up in i16.
                                    let half = |h: usize| {
                                        let g = 4 * h;
                                        madd(_mm256_add_epi16(_mm256_add_epi16(mb(g), mb(g + 1)), _mm256_add_epi16(mb(g + 2), mb(g + 3))))
                                    };
                                    let (i0, i1) = (half(0), half(1));
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, dx), *fr);
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d0, dx1), *fr);
                                    *fr = _mm256_fmadd_ps(mins(), _mm256_set1_ps(*t.sums.add(r * nbp + blk)), *fr);
                                } else if K == KQ6K || H {
                                    // A chain per half, each with its own
                                    // scales (the weight's for Q6K, the
                                    // activations' for H).
                                    let d1 = if K == KQ6K { _mm256_loadu_ps(wr.add(cb + 32) as *const f32) } else { d0 };
                                    let (mut i0, mut i1) = if K == KQ4 || K == KQ4K {
                                        (_mm256_setzero_si256(), _mm256_setzero_si256())
                                    } else {
                                        (corr(0), corr(1))
                                    };
                                    for g in 0..4 {
                                        i0 = dpbusd(i0, wv[g], xg(g));
                                        i1 = dpbusd(i1, wv[g + 4], xg(g + 4));
                                    }
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, dx), *fr);
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d1, dx1), *fr);
                                    if K == KQ4 || K == KQ4K {
                                        *fr = _mm256_fmadd_ps(mins(), _mm256_set1_ps(*t.sums.add(r * nbp + blk)), *fr);
                                    }
                                } else if $maddubs {
                                    // Nibbles: eight
                                    // `vpmaddubsw` add up in i16 without
                                    // saturating (16 products of at most
                                    // 15 · 128 per lane, < 2¹⁵), then one
                                    // `vpmaddwd` by ones widens the sums.
                                    let mut p0 = _mm256_maddubs_epi16(wv[0], xg(0));
                                    let mut p1 = _mm256_maddubs_epi16(wv[1], xg(1));
                                    for g in 1..4 {
                                        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(wv[2 * g], xg(2 * g)));
                                        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(wv[2 * g + 1], xg(2 * g + 1)));
                                    }
                                    let isum = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d0, dx), *fr);
                                    let sx = _mm256_set1_ps(*t.sums.add(r * nbp + blk));
                                    *fr = _mm256_fmadd_ps(mins(), sx, *fr);
                                } else {
                                    // Two chains, for the latency of vpdpbusd.
                                    let (mut i0, mut i1) = if K == KQ8 { (corr(2), _mm256_setzero_si256()) } else { (_mm256_setzero_si256(), _mm256_setzero_si256()) };
                                    for g in 0..4 {
                                        i0 = dpbusd(i0, wv[2 * g], xg(2 * g));
                                        i1 = dpbusd(i1, wv[2 * g + 1], xg(2 * g + 1));
                                    }
                                    let isum = _mm256_add_epi32(i0, i1);
                                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d0, dx), *fr);
                                    if K == KQ4 || K == KQ4K {
                                        let sx = _mm256_set1_ps(*t.sums.add(r * nbp + blk));
                                        *fr = _mm256_fmadd_ps(mins(), sx, *fr);
                                    }
                                }
                            }
                        }
                    }
                    // SAFETY: the caller owns the cells the store mask names.
                    unsafe { store(&t, &f) }
                }

                /// `y[rows, cols]` (row stride `ldy`) on a lane-layout weight
                /// and int8 activations: per group of 8 outputs (16 with
                /// `$wide`), tiles of 4 rows, then 1–3.
                ///
                /// # Safety
                /// The CPU must support the module's features; `y` must be
                /// valid for writes at every (row, col) of the ranges, cells
                /// the caller owns; `x` holds int8 codes; `w` is in the lane
                /// layout, its groups 8 outputs wide (or 16 where `$wide`).
                pub unsafe fn gemm<const H: bool>(
                    y: *mut f32,
                    ldy: usize,
                    x: &QuantActs,
                    w: &QuantWeight,
                    rows: std::ops::Range<usize>,
                    cols: std::ops::Range<usize>,
                ) {
                    let lanes = w.lanes;
                    debug_assert!(x.bits == if H { ActBits::I8Halves } else { ActBits::I8 });
                    debug_assert!(lanes == LANES || ($wide && lanes == WIDE_LANES));
                    let blocks = 2 * w.pairs;
                    let rec = record_bytes(w.kind, lanes);
                    let nbp = padded_blocks(w.pairs);
                    // Rows in blocks whose activations stay in L2 while the
                    // group's weights (in L1) meet each row.
                    let row_block = (96 * 1024 / (w.pairs * xrec(H))).max(4) / 4 * 4;
                    let (first_group, end_group) = (cols.start / lanes, cols.end.div_ceil(lanes));
                    // Which of group `g`'s outputs the column range holds.
                    let mask = |g: usize| {
                        let mut store = 0u16;
                        for o in 0..lanes {
                            if cols.contains(&(g * lanes + o)) {
                                store |= 1 << o;
                            }
                        }
                        store
                    };
                    // Tile `rr` rows from `r` by group `g`.
                    let run_tile = |r: usize, rr: usize, g: usize| {
                        // SAFETY: r + rr ≤ x.rows and g is below the
                        // weight's groups, so every offset stays inside its
                        // allocation; the pointer to column `g · lanes` may
                        // pass the row only when the mask stops short of it
                        // (it is then not written).
                        let t = unsafe {
                            Tile {
                                y: y.wrapping_add(r * ldy + g * lanes),
                                ldy,
                                x: x.data.as_ptr().add(r * w.pairs * xrec(H)),
                                sums: x.sums.as_ptr().add(r * nbp),
                                corr: x.corr.as_ptr().add(r * 4 * blocks),
                                w: w.data.as_ptr().add(g * blocks * rec),
                                blocks,
                                store: mask(g),
                                small: w.small_codes,
                            }
                        };
                        // SAFETY: the tile's reads and writes are those just
                        // checked; the CPU runs this module's features, which
                        // include AVX-512 BW and VNNI where `$wide` holds.
                        unsafe {
                            if $wide && lanes == WIDE_LANES {
                                by_rows_and_kind!(tile16, rr, w.kind.code(), H, (t))
                            } else {
                                by_rows_and_kind!(tile, rr, w.kind.code(), H, (t))
                            }
                        }
                    };
                    // A weight larger than the caches (an LM head) goes in
                    // chunks of groups that fit in L2, each row tile
                    // sweeping a chunk: every tile then writes a run of
                    // consecutive outputs per row. Group by group, a tile's
                    // rows of 16 outputs lie a whole output row apart (1 MiB
                    // for a 262,144-entry vocabulary), so the writes of all
                    // rows fall in one cache set and evict each other: 25%
                    // of the head's rate at 64 rows.
                    let group_bytes = blocks * rec;
                    let big = (end_group - first_group) * group_bytes > BIG_WEIGHT;
                    let chunk = if big { (CHUNK_BYTES / group_bytes).max(1) } else { end_group - first_group };
                    let mut r0 = rows.start;
                    while r0 < rows.end {
                        let r1 = (r0 + row_block).min(rows.end);
                        let mut c0 = first_group;
                        while c0 < end_group {
                            let c1 = (c0 + chunk).min(end_group);
                            if big {
                                let mut r = r0;
                                while r < r1 {
                                    let rr = (r1 - r).min(4);
                                    for g in c0..c1 {
                                        run_tile(r, rr, g);
                                    }
                                    r += rr;
                                }
                            } else {
                                for g in c0..c1 {
                                    let mut r = r0;
                                    while r < r1 {
                                        let rr = (r1 - r).min(4);
                                        run_tile(r, rr, g);
                                        r += rr;
                                    }
                                }
                            }
                            c0 = c1;
                        }
                        r0 = r1;
                    }
                }
            }
        };
    }

    lane_kernel!(
        /// AVX2 without VNNI: `vpmaddubsw` and `vpmaddwd`; 8-bit kinds
        /// through [`signed_tile_avx2`].
        avx2,
        "avx2,fma,f16c",
        maddubs: true,
        wide: false,
        |acc, u, s| _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
    );

    lane_kernel!(
        /// AVX-VNNI: VEX `vpdpbusd` (16 registers).
        avxvnni,
        "avx2,fma,f16c,avxvnni",
        maddubs: false,
        wide: false,
        |acc, u, s| _mm256_dpbusd_avx_epi32(acc, u, s)
    );

    lane_kernel!(
        /// AVX-512 VNNI with VL: EVEX `vpdpbusd` on 512 bits for groups of
        /// 16 ([`tile16`]), on 256 bits for groups of 8.
        avx512vnni,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        maddubs: false,
        wide: true,
        |acc, u, s| _mm256_dpbusd_epi32(acc, u, s)
    );
}
