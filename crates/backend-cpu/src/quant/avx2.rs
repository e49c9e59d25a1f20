//! The AVX2 kernels of the quantized linear for int16 activations: 4-row ×
//! 1-output (or 1–3 rows × up to 4 outputs) register tiles over the pair
//! layout of `super`.

use super::{padded_blocks, ActBits, QuantActs, QuantKind, QuantWeight};

const XREC: usize = ActBits::I16.record();
const XSCALES: usize = ActBits::I16.scales();
use std::arch::x86_64::*;

/// A weight pair widened to i16: positions 0..16, 16..32, 32..48, 48..64;
/// then its d pattern.
type Wide = ([__m256i; 4], __m256);

///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `p` must be valid for
/// reading one whole weight pair record of the kind (`Q8`: 72 bytes,
/// else 36).
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
/// pair, as 8 i32 lanes in the pattern (0, 0, 1, 1, 0, 0, 1, 1) of blocks:
/// each group of four values fills two lanes (each lane sums 8 products:
/// |sum| ≤ 8·128·32767 < 2³¹).
///
/// # Safety
/// The CPU must support AVX2, and `x` must be valid for reading one
/// activation pair record (128 bytes of i16 codes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot(w: &[__m256i; 4], x: *const u8) -> __m256i {
    // SAFETY: x points at a full activation record.
    unsafe {
        let p = |i: usize| _mm256_madd_epi16(w[i], _mm256_loadu_si256(x.add(32 * i) as *const __m256i));
        _mm256_add_epi32(_mm256_add_epi32(p(0), p(1)), _mm256_add_epi32(p(2), p(3)))
    }
}

/// The two f32 at `p`, repeated across a register.
///
/// # Safety
/// The CPU must support AVX, and `p` must be valid for reading 8 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bcast2(p: *const u8) -> __m256 {
    // SAFETY: p points at two f32 inside a record.
    unsafe { _mm256_castpd_ps(_mm256_set1_pd((p as *const f64).read_unaligned())) }
}

/// The sum of the eight lanes.
///
/// # Safety
/// The CPU must support AVX (register operations only).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Where a tile reads: records and per-block arrays at its first
/// output / row.
#[derive(Clone, Copy)]
pub(super) struct TileArgs {
    pub(super) y: *mut f32,
    pub(super) ldy: usize,
    pub(super) x: *const u8,
    pub(super) sums: *const f32,
    pub(super) w: *const u8,
    pub(super) mins: *const u16,
    pub(super) pairs: usize,
}

/// How far ahead of its loads a tile of 1–3 rows prefetches weights.
/// Such a tile does little arithmetic per weight byte, so it waits on
/// memory: the hardware prefetcher alone kept Gemma 3's 189 MB LM head at
/// ~18 GB/s of the machine's 28; 4 KiB ahead (0.5–12 KiB tried with
/// `examples/gemv_bandwidth.rs`) reaches 24–27 GB/s. Single-stream decode
/// went from 98 to 135 tok/s (SmolLM2) and 40 to 52 (Gemma 3), two and
/// three sequences +18–24%; 4-row tiles (batches of 4 and more) gained
/// nothing (8 sequences: −4%), so they do not prefetch.
pub(super) const PREFETCH_BYTES: usize = 4096;

/// A tile of `R` rows × `C` outputs over every pair.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `t.x`/`t.sums` must hold the
/// records and block sums of `R` rows, `t.w`/`t.mins` those of `C`
/// outputs (`t.pairs` pairs each), and `y[r·ldy + c]` must be valid for
/// writes and owned by the caller for every tile cell.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const C: usize, const Q8: bool>(t: TileArgs) {
    let TileArgs { x, w, pairs, .. } = t;
    let rec = if Q8 { QuantKind::Q8.record() } else { QuantKind::Q4.record() };
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for j in 0..pairs {
        for c in 0..C {
            // SAFETY: record j of output c and of every row exists.
            unsafe {
                let (wv, d) = load_w::<Q8>(w.add((c * pairs + j) * rec));
                if R < 4 {
                    // A prefetch never faults: the address may run past the weight.
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((c * pairs + j) * rec + PREFETCH_BYTES) as *const i8);
                }
                for (r, accr) in acc.iter_mut().enumerate() {
                    let xr = x.add((r * pairs + j) * XREC);
                    let isum = dot(&wv, xr);
                    // (s₀, s₁, s₀, s₁, …) → (s₀, s₀, s₁, s₁, …), the lanes' blocks.
                    let s = _mm256_mul_ps(d, bcast2(xr.add(XSCALES)));
                    let s = _mm256_unpacklo_ps(s, s);
                    accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, accr[c]);
                }
            }
        }
    }
    // SAFETY: as this function's contract.
    unsafe { finish_tile::<R, C>(acc, t, Q8) }
}

/// The end of every tile (int8 and int16): for Q4 weights the offsets
/// `Σ_b m_b · sx_b`, eight blocks per FMA, then each accumulator's lane sum
/// stored to its cell.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `t` as for the tile that
/// produced `acc` (`R` rows × `C` outputs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn finish_tile<const R: usize, const C: usize>(mut acc: [[__m256; C]; R], t: TileArgs, q8: bool) {
    let TileArgs { y, ldy, sums, mins, pairs, .. } = t;
    if !q8 {
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

/// `y[rows, cols]`, row stride `ldy`, int16 activations: see [`drive`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `y` must be valid for writes at
/// every (row, col) of the ranges; the caller owns those cells; `x` holds
/// int16 codes.
pub unsafe fn gemm(y: *mut f32, ldy: usize, x: &QuantActs, w: &QuantWeight, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
    debug_assert_eq!(x.bits, ActBits::I16);
    // SAFETY: forwarded; every tile below runs on the features the caller checked.
    unsafe {
        drive(y, ldy, x, w, rows, cols, |rr, cc, q8, t| {
            macro_rules! go {
                ($($R:literal, $C:literal);*) => {
                    match (rr, cc, q8) {
                        $(
                            ($R, $C, false) => tile::<$R, $C, false>(t),
                            ($R, $C, true) => tile::<$R, $C, true>(t),
                        )*
                        _ => unreachable!("tiles take 4 rows × 1 output or 1–3 rows × at most 4 outputs"),
                    }
                };
            }
            go!(4, 1; 1, 1; 1, 2; 1, 3; 1, 4; 2, 1; 2, 2; 3, 1; 3, 2)
        })
    }
}

/// Walks `y[rows, cols]` (row stride `ldy`) in tiles, calling
/// `tile(rows, outputs, q8, args)` for each: rows in blocks that stay in
/// cache; within a block, 4 rows × 1 output per register tile (the weight
/// pair is reused by 4 rows), or for 1–3 rows, up to 4 outputs at once
/// (independent accumulator chains).
///
/// # Safety
/// `y` must be valid for writes at every (row, col) of the ranges and the
/// caller owns those cells; `tile` must be safe to call on the tiles given
/// (its CPU features present).
pub(super) unsafe fn drive(
    y: *mut f32,
    ldy: usize,
    x: &QuantActs,
    w: &QuantWeight,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    tile: impl Fn(usize, usize, bool, TileArgs),
) {
    let pairs = w.pairs;
    let rec = w.kind.record();
    let xrec = x.bits.record();
    let q8 = w.kind == QuantKind::Q8;
    let block = (ROW_BLOCK_BYTES / (pairs * xrec)).max(4) / 4 * 4;
    let nbp = padded_blocks(pairs);
    // SAFETY (the pointer offsets): r < x.rows and c < w.n everywhere
    // below, so every offset stays inside its allocation.
    let args = |r: usize, c: usize| unsafe {
        TileArgs {
            y: y.add(r * ldy + c),
            ldy,
            x: x.data.as_ptr().add(r * pairs * xrec),
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
                tile(4, 1, q8, args(r, c));
                r += 4;
            }
            if r < r1 {
                // 1–3 rows left: several outputs per tile.
                let rr = r1 - r;
                cc = if r == r0 { (cols.end - c).min(if rr == 1 { 4 } else { 2 }) } else { 1 };
                tile(rr, cc, q8, args(r, c));
            }
            c += cc;
        }
        r0 = r1;
    }
}
