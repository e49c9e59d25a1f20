//! Decode-sized products on a Q5_0 weight read at 5.5 bits per value.
//!
//! The lane layout holds a Q5_0 weight as 8-bit codes (9 bits per weight
//! with the scales): the right shape for the int8 kernels, but a one-row
//! product (single-stream decode) only streams the weight through memory,
//! and there the bytes are the cost. [`Q5Lanes`] keeps a second copy at the
//! file's size, and [`gemv`] multiplies up to [`MAX_ROWS`] rows of
//! activations by it, rebuilding the 8-bit codes in registers.
//!
//! The layout is the lane layout's ([`super::lanes`]) for nibbles, eight
//! outputs side by side, plus a plane of fifth bits: a record per (group of
//! 8 outputs, block of 32) holds
//!
//! * four 32-byte vectors of nibbles, byte `4o + i` of vector `g` holding
//!   value `4g + i` of output `o` in its low nibble and `4(g + 4) + i` in its
//!   high one;
//! * 32 bytes of fifth bits, bit `g` of byte `4o + i` for value `4g + i`;
//! * the 8 outputs' `d` as f16 (exactly the file's),
//!
//! 176 bytes per 256 weights (5.5 bits). Vector `g` of codes is then
//! `nibbles | (bits shifted so that bit g lands on bit 4) & 16`: the code
//! plus 16 (0..=31), which the AVX2 lane kernel multiplies as it does Q5_0's
//! 8-bit codes moved to plus 16, with the same integer sums per block (or
//! half block with [`ActBits::I8Halves`]) and the same
//! fused multiply-adds in block order: the lane kernels' bits, so a row's
//! result does not depend on the rows it came with (`linear` picks this
//! kernel by batch size).

use super::{ActBits, QuantActs, PAIR};

/// Bytes of one GGML Q5_0 block: f16 `d`, 32 fifth bits, 16 bytes of nibbles.
const BLOCK_BYTES: usize = 22;
/// Outputs per record.
const LANES: usize = 8;
/// Bytes of one record: nibbles, fifth bits, `d`.
const RECORD: usize = 128 + 32 + 16;

/// Rows of activations up to which `linear` reads [`Q5Lanes`].
pub const MAX_ROWS: usize = 2;

/// A `[n, k]` Q5_0 weight at 5.5 bits, 8 outputs side by side.
#[derive(Clone, Debug)]
pub struct Q5Lanes {
    /// Outputs.
    pub n: usize,
    /// Inputs.
    pub k: usize,
    /// Blocks per output, `k` padded to whole pairs of blocks (64 values)
    /// as the activations are.
    blocks: usize,
    /// `⌈n / 8⌉ · blocks` records of [`RECORD`] bytes, `[groups][blocks]`.
    pub data: Vec<u8>,
}

impl Q5Lanes {
    /// The file's Q5_0 blocks of a `[n, k]` weight (rows in order), if they
    /// are whole rows.
    pub fn from_ggml(bytes: &[u8], n: usize, k: usize) -> Option<Self> {
        let row_blocks = k / 32;
        if !k.is_multiple_of(32) || bytes.len() != n * row_blocks * BLOCK_BYTES || n == 0 {
            return None;
        }
        let blocks = 2 * k.div_ceil(PAIR);
        let mut data = vec![0u8; n.div_ceil(LANES) * blocks * RECORD];
        let fill = |(g8, out): (usize, &mut [u8])| {
            for blk in 0..row_blocks {
                let r = &mut out[blk * RECORD..(blk + 1) * RECORD];
                for o in 0..LANES.min(n - g8 * LANES) {
                    let c = g8 * LANES + o;
                    let b = &bytes[(c * row_blocks + blk) * BLOCK_BYTES..(c * row_blocks + blk + 1) * BLOCK_BYTES];
                    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    for e in 0..32 {
                        let nibble = if e < 16 { b[6 + e] & 0x0f } else { b[6 + e - 16] >> 4 };
                        let (g, i) = (e / 4, e % 4);
                        r[(g % 4) * 32 + 4 * o + i] |= nibble << (4 * (g / 4));
                        r[128 + 4 * o + i] |= (((qh >> e) & 1) as u8) << g;
                    }
                    r[160 + 2 * o..162 + 2 * o].copy_from_slice(&b[0..2]);
                }
            }
        };
        use rayon::prelude::*;
        data.par_chunks_mut(blocks * RECORD).enumerate().for_each(fill);
        Some(Self { n, k, blocks, data })
    }

    /// The signed code (−16..=15) of value `e` of block `blk` of output `c`.
    #[cfg(test)]
    pub(super) fn code(&self, c: usize, blk: usize, e: usize) -> i32 {
        let r = &self.data[((c / LANES) * self.blocks + blk) * RECORD..][..RECORD];
        let (g, i, o) = (e / 4, e % 4, c % LANES);
        let nibble = (r[(g % 4) * 32 + 4 * o + i] >> (4 * (g / 4))) & 0x0f;
        let bit = (r[128 + 4 * o + i] >> g) & 1;
        i32::from(nibble | bit << 4) - 16
    }
}

/// Whether [`gemv`] runs on this CPU (AVX2, FMA, F16C).
pub fn available() -> bool {
    super::has_simd()
}

/// `R` rows × one group of 8 outputs, every block, stored under `mask`.
///
/// # Safety
/// AVX2, FMA and F16C; `w` points to the group's `blocks` records; `x`,
/// `corr` to row `r0`'s activation records and corrections (rows `R` of
/// them, strides `xstride` bytes and `cstride` values); `y` to row `r0`,
/// output `8·g8`, valid for the cells `mask` names in `R` rows of stride
/// `ldy`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn group<const R: usize, const H: bool>(
    w: *const u8,
    blocks: usize,
    x: *const u8,
    xstride: usize,
    rec: usize,
    corr: *const i32,
    cstride: usize,
    y: *mut f32,
    ldy: usize,
    mask: u8,
) {
    use std::arch::x86_64::*;
    // SAFETY: the offsets stay inside the records, rows and cells of this
    // function's contract; the CPU runs its features.
    unsafe {
        let (low4, bit4, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x10), _mm256_set1_epi16(1));
        let mut f = [_mm256_setzero_ps(); R];
        for blk in 0..blocks {
            let wr = w.add(blk * RECORD);
            _mm_prefetch::<_MM_HINT_T0>(wr.wrapping_add(super::avx2::PREFETCH_BYTES) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(wr.wrapping_add(super::avx2::PREFETCH_BYTES + 64) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(wr.wrapping_add(super::avx2::PREFETCH_BYTES + 128) as *const i8);
            let plane = _mm256_loadu_si256(wr.add(128) as *const __m256i);
            // Codes plus 16 (0..=31), vector g: values 4g..4g + 4 of each output.
            let mut wv = [_mm256_setzero_si256(); 8];
            for q in 0..4 {
                let v = _mm256_loadu_si256(wr.add(32 * q) as *const __m256i);
                wv[q] = _mm256_and_si256(v, low4);
                wv[q + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
            }
            // Bit g of each byte onto bit 4 (16-bit shifts keep each byte's
            // bits in its byte at the positions read).
            wv[0] = _mm256_or_si256(wv[0], _mm256_and_si256(_mm256_slli_epi16::<4>(plane), bit4));
            wv[1] = _mm256_or_si256(wv[1], _mm256_and_si256(_mm256_slli_epi16::<3>(plane), bit4));
            wv[2] = _mm256_or_si256(wv[2], _mm256_and_si256(_mm256_slli_epi16::<2>(plane), bit4));
            wv[3] = _mm256_or_si256(wv[3], _mm256_and_si256(_mm256_slli_epi16::<1>(plane), bit4));
            wv[4] = _mm256_or_si256(wv[4], _mm256_and_si256(plane, bit4));
            wv[5] = _mm256_or_si256(wv[5], _mm256_and_si256(_mm256_srli_epi16::<1>(plane), bit4));
            wv[6] = _mm256_or_si256(wv[6], _mm256_and_si256(_mm256_srli_epi16::<2>(plane), bit4));
            wv[7] = _mm256_or_si256(wv[7], _mm256_and_si256(_mm256_srli_epi16::<3>(plane), bit4));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(wr.add(160) as *const __m128i));
            let (j, b) = (blk / 2, blk % 2);
            for (r, fr) in f.iter_mut().enumerate() {
                let xr = x.add(r * xstride + j * rec);
                let xg = |g: usize| _mm256_set1_epi32((xr.add(8 * g + 4 * b) as *const i32).read_unaligned());
                let mb = |g: usize| _mm256_maddubs_epi16(wv[g], xg(g));
                let corr = |which: usize| _mm256_set1_epi32(*corr.add(r * cstride + 4 * blk + which));
                // The scale of half h of block b (of the block unless H).
                let bits = if H { ActBits::I8Halves } else { ActBits::I8 };
                let dx = |h: usize| _mm256_set1_ps((xr.add(bits.scale_at(b, 16 * h)) as *const f32).read_unaligned());
                // A `vpmaddubsw` lane is at most 2 · 31 · 127 = 7874: four
                // add up in i16. The correction −16 · Σ qx is the lane
                // kernels' −128 · Σ qx shifted (exact).
                if H {
                    for h in 0..2 {
                        let g = 4 * h;
                        let p = _mm256_add_epi16(_mm256_add_epi16(mb(g), mb(g + 1)), _mm256_add_epi16(mb(g + 2), mb(g + 3)));
                        let isum = _mm256_add_epi32(_mm256_srai_epi32::<3>(corr(h)), _mm256_madd_epi16(p, ones));
                        *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx(h)), *fr);
                    }
                } else {
                    let p0 = _mm256_add_epi16(_mm256_add_epi16(mb(0), mb(2)), _mm256_add_epi16(mb(4), mb(6)));
                    let p1 = _mm256_add_epi16(_mm256_add_epi16(mb(1), mb(3)), _mm256_add_epi16(mb(5), mb(7)));
                    let isum = _mm256_add_epi32(
                        _mm256_srai_epi32::<3>(corr(2)),
                        _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)),
                    );
                    *fr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx(0)), *fr);
                }
            }
        }
        for (r, fr) in f.iter().enumerate() {
            let yr = y.add(r * ldy);
            if mask == 0xff {
                _mm256_storeu_ps(yr, *fr);
            } else {
                let mut v = [0f32; LANES];
                _mm256_storeu_ps(v.as_mut_ptr(), *fr);
                for (o, val) in v.iter().enumerate() {
                    if mask & (1 << o) != 0 {
                        *yr.add(o) = *val;
                    }
                }
            }
        }
    }
}

/// `y[r·ldy + c]` for `rows × cols` from the 5.5-bit weight and int8
/// activations (`I8` or `I8Halves`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]); `y` must be
/// valid for writes at `r·ldy + c` for every row and output of the ranges,
/// cells the caller owns; `rows.len() ≤ MAX_ROWS`, `rows.end ≤ x.rows`,
/// `cols.end ≤ w.n`, and `x` quantized from rows of `w.k` values.
#[cfg(target_arch = "x86_64")]
pub unsafe fn gemv(y: *mut f32, ldy: usize, x: &QuantActs, w: &Q5Lanes, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
    assert!(x.bits.int8() && x.pairs == w.k.div_ceil(PAIR) && rows.end <= x.rows && cols.end <= w.n && rows.len() <= MAX_ROWS);
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    let rec = x.bits.record();
    let (xstride, cstride) = (x.pairs * rec, 8 * x.pairs);
    let (first, end) = (cols.start / LANES, cols.end.div_ceil(LANES));
    for g8 in first..end {
        let mut mask = 0u8;
        for o in 0..LANES {
            if cols.contains(&(g8 * LANES + o)) {
                mask |= 1 << o;
            }
        }
        // SAFETY: group g8 < ⌈n / 8⌉ has `blocks` records; rows `rows` of
        // `x` exist; the cells the mask names are the caller's (the pointer
        // to column 8·g8 may pass the row only where the mask stops short).
        unsafe {
            let wp = w.data.as_ptr().add(g8 * w.blocks * RECORD);
            let xp = x.data.as_ptr().add(rows.start * xstride);
            let cp = x.corr.as_ptr().add(rows.start * cstride);
            let yp = y.wrapping_add(rows.start * ldy + g8 * LANES);
            match (rows.len(), x.bits.halves()) {
                (1, false) => group::<1, false>(wp, w.blocks, xp, xstride, rec, cp, cstride, yp, ldy, mask),
                (1, true) => group::<1, true>(wp, w.blocks, xp, xstride, rec, cp, cstride, yp, ldy, mask),
                (_, false) => group::<2, false>(wp, w.blocks, xp, xstride, rec, cp, cstride, yp, ldy, mask),
                (_, true) => group::<2, true>(wp, w.blocks, xp, xstride, rec, cp, cstride, yp, ldy, mask),
            }
        }
    }
}
