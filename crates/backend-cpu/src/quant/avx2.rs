//! The AVX2 kernels of the quantized linear for int16 activations: 4-row ×
//! 1-output (or 1–3 rows × up to 4 outputs) register tiles over the pair
//! layout of `super`.

use super::{padded_blocks, ActBits, QuantActs, QuantKind, QuantWeight, KQ4, KQ4K, KQ6K, KQ8};

const XREC: usize = ActBits::I16.record();
const XSCALES: usize = ActBits::I16.scales();
use std::arch::x86_64::*;

/// A weight pair widened to i16: positions 0..16, 16..32, 32..48, 48..64;
/// then its d patterns for positions 0..32 and 32..64 (equal except for
/// Q6K).
type Wide = ([__m256i; 4], [__m256; 2]);

/// Loads and widens the weight pair record at `p` of kind `K`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `p` must be valid for
/// reading one whole weight pair record of kind `K`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_w<const K: u8>(p: *const u8) -> Wide {
    // SAFETY (all loads): p points at a full record of the kind.
    unsafe {
        if K == KQ8 || K == KQ6K {
            let w = [0, 16, 32, 48].map(|o| _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(o) as *const __m128i)));
            let d = bcast2(p.add(64));
            (w, [d, if K == KQ6K { bcast2(p.add(72)) } else { d }])
        } else {
            // Bytes widened to i16: the low nibble is `& 15`, the high one `>> 4`.
            let z0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            let z1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(16) as *const __m128i));
            let mask = _mm256_set1_epi16(0x0f);
            let w = [_mm256_and_si256(z0, mask), _mm256_and_si256(z1, mask), _mm256_srli_epi16(z0, 4), _mm256_srli_epi16(z1, 4)];
            let d = if K == KQ4K { bcast2(p.add(32)) } else { _mm256_cvtph_ps(_mm_set1_epi32((p.add(32) as *const i32).read_unaligned())) };
            (w, [d, d])
        }
    }
}

/// The integer dot products of a widened weight pair with one activation
/// pair, positions 0..32 and 32..64 apart, each as 8 i32 lanes in the
/// pattern (0, 0, 1, 1, 0, 0, 1, 1) of blocks: each group of four values
/// fills two lanes (each lane sums 4 products per half: |sum| ≤
/// 8·128·32767 < 2³¹ even added).
///
/// # Safety
/// The CPU must support AVX2, and `x` must be valid for reading one
/// activation pair record (128 bytes of i16 codes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_halves(w: &[__m256i; 4], x: *const u8) -> [__m256i; 2] {
    // SAFETY: x points at a full activation record.
    unsafe {
        let p = |i: usize| _mm256_madd_epi16(w[i], _mm256_loadu_si256(x.add(32 * i) as *const __m256i));
        [_mm256_add_epi32(p(0), p(1)), _mm256_add_epi32(p(2), p(3))]
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
    /// The offsets of the first output (f16 for Q4, f32 for Q4K; null
    /// for the symmetric kinds).
    pub(super) mins: *const u8,
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

/// A tile of `R` rows × `C` outputs over every pair, weights of kind `K`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `t.x`/`t.sums` must hold the
/// records and block sums of `R` rows, `t.w`/`t.mins` those of `C`
/// outputs (`t.pairs` pairs each, kind `K`), and `y[r·ldy + c]` must be
/// valid for writes and owned by the caller for every tile cell.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const C: usize, const K: u8>(t: TileArgs) {
    let TileArgs { x, w, pairs, .. } = t;
    let rec = QuantKind::from_code(K).record();
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for j in 0..pairs {
        for c in 0..C {
            // SAFETY: record j of output c and of every row exists.
            unsafe {
                let (wv, d) = load_w::<K>(w.add((c * pairs + j) * rec));
                if R < 4 {
                    // A prefetch never faults: the address may run past the weight.
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((c * pairs + j) * rec + PREFETCH_BYTES) as *const i8);
                }
                for (r, accr) in acc.iter_mut().enumerate() {
                    let xr = x.add((r * pairs + j) * XREC);
                    let [i0, i1] = dot_halves(&wv, xr);
                    let dx = bcast2(xr.add(XSCALES));
                    // (s₀, s₁, s₀, s₁, …) → (s₀, s₀, s₁, s₁, …), the lanes' blocks.
                    let scale = |d: __m256| {
                        let s = _mm256_mul_ps(d, dx);
                        _mm256_unpacklo_ps(s, s)
                    };
                    if K == KQ6K {
                        accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), scale(d[0]), accr[c]);
                        accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), scale(d[1]), accr[c]);
                    } else {
                        let isum = _mm256_add_epi32(i0, i1);
                        accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale(d[0]), accr[c]);
                    }
                }
            }
        }
    }
    // SAFETY: as this function's contract.
    unsafe { finish_tile::<R, C, K>(acc, t) }
}

/// The end of every tile (int8 and int16): for the asymmetric kinds (Q4,
/// Q4K) the offsets `Σ_b m_b · sx_b`, eight blocks per FMA, then each
/// accumulator's lane sum stored to its cell.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `t` as for the tile that
/// produced `acc` (`R` rows × `C` outputs of kind `K`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn finish_tile<const R: usize, const C: usize, const K: u8>(mut acc: [[__m256; C]; R], t: TileArgs) {
    let TileArgs { y, ldy, sums, mins, pairs, .. } = t;
    if K == KQ4 || K == KQ4K {
        let nbp = padded_blocks(pairs);
        for g in (0..nbp).step_by(8) {
            for c in 0..C {
                // SAFETY: nbp offsets per output and sums per row exist.
                unsafe {
                    let m = if K == KQ4 {
                        _mm256_cvtph_ps(_mm_loadu_si128((mins as *const u16).add(c * nbp + g) as *const __m128i))
                    } else {
                        _mm256_loadu_ps((mins as *const f32).add(c * nbp + g))
                    };
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

/// Calls `$tile::<R, C, K>($t)` for the run-time tile shape `($rr, $cc)`
/// and weight kind `$k` (`drive`'s shapes).
macro_rules! dispatch_tile {
    ($tile:ident, $rr:expr, $cc:expr, $k:expr, $t:expr) => {
        dispatch_tile!(@shapes $tile, $rr, $cc, $k, $t; 4, 1; 1, 1; 1, 2; 1, 3; 1, 4; 2, 1; 2, 2; 3, 1; 3, 2)
    };
    (@shapes $tile:ident, $rr:expr, $cc:expr, $k:expr, $t:expr; $($R:literal, $C:literal);*) => {
        match ($rr, $cc, $k) {
            $(
                ($R, $C, $crate::quant::KQ4) => $tile::<$R, $C, { $crate::quant::KQ4 }>($t),
                ($R, $C, $crate::quant::KQ8) => $tile::<$R, $C, { $crate::quant::KQ8 }>($t),
                ($R, $C, $crate::quant::KQ4K) => $tile::<$R, $C, { $crate::quant::KQ4K }>($t),
                ($R, $C, $crate::quant::KQ6K) => $tile::<$R, $C, { $crate::quant::KQ6K }>($t),
            )*
            _ => unreachable!("tiles take 4 rows × 1 output or 1–3 rows × at most 4 outputs"),
        }
    };
}
pub(super) use dispatch_tile;

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
    unsafe { drive(y, ldy, x, w, rows, cols, |rr, cc, k, t| dispatch_tile!(tile, rr, cc, k, t)) }
}

/// Walks `y[rows, cols]` (row stride `ldy`) in tiles, calling
/// `tile(rows, outputs, kind, args)` for each (`kind`: [`QuantKind::code`]): rows in blocks that stay in
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
    tile: impl Fn(usize, usize, u8, TileArgs),
) {
    let pairs = w.pairs;
    let rec = w.kind.record();
    let xrec = x.bits.record();
    let kind = w.kind.code();
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
            mins: w.mins.ptr_at(c * nbp),
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
                tile(4, 1, kind, args(r, c));
                r += 4;
            }
            if r < r1 {
                // 1–3 rows left: several outputs per tile.
                let rr = r1 - r;
                cc = if r == r0 { (cols.end - c).min(if rr == 1 { 4 } else { 2 }) } else { 1 };
                tile(rr, cc, kind, args(r, c));
            }
            c += cc;
        }
        r0 = r1;
    }
}
