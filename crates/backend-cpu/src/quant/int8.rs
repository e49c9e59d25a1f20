//! The kernels of the quantized linear for int8 activations, one module per
//! instruction set, from one template:
//!
//! * [`avx2`]: `vpmaddubsw` (u8 × i8 pairs → i16) then `vpmaddwd` by ones
//!   (→ i32), llama.cpp's AVX2 path;
//! * [`avxvnni`]: VEX `vpdpbusd` (four u8 × i8 products added into each i32
//!   lane in one instruction);
//! * [`avx512vnni`]: the EVEX form of the same on 256-bit registers (no
//!   512-bit frequency penalty; 32 registers).
//!
//! Both operands of `vpdpbusd`/`vpmaddubsw` are bytes, the first unsigned:
//! Q4 codes (0..=15) are unsigned already; a Q8 code is split into `|w|`
//! (unsigned, up to 128) and its sign moved onto the activation
//! (`vpsignb`), so `|w| · sign(w)·x = w · x`. No sum saturates: a
//! `vpmaddubsw` pair is at most `2 · 128 · 127 = 32512 < 2¹⁵`.
//!
//! The tiles and the walk over them are those of the int16 kernels
//! ([`super::avx2::drive`]); a lane holds one group of four values of one
//! block, the lanes alternate block 0 / block 1, so a block scale pair
//! `(d₀·dx₀, d₁·dx₁)` applies through a 64-bit broadcast.

use super::avx2::{bcast2, drive, finish_tile, TileArgs, PREFETCH_BYTES};
use super::{ActBits, QuantActs, QuantKind, QuantWeight};
use std::arch::x86_64::*;

/// Bytes of one int8 activation pair record.
const XREC: usize = ActBits::I8.record();
/// Offset of its two f32 scales.
const XSCALES: usize = ActBits::I8.scales();

/// One kernel module: `$features` are the target features its functions
/// are compiled for, `dpbusd(acc, u, s)` adds the four products
/// `u8 × i8` of each 32-bit lane of `u` and `s` into `acc`.
macro_rules! int8_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, |$acc:ident, $u:ident, $s:ident| $dpbusd:expr) => {
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

            /// A weight pair: the two unsigned operand registers (Q4: low and
            /// high nibbles, positions 0..32 and 32..64; Q8: `|w|`), the two
            /// signed codes (Q8; whose signs move onto the activations) and
            /// the `d` pattern `(d₀, d₁, d₀, d₁, …)`.
            ///
            /// # Safety
            /// The CPU must support the module's features; `p` must be valid
            /// for reading one whole weight pair record of the kind.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load_w<const Q8: bool>(p: *const u8) -> ([__m256i; 2], [__m256i; 2], __m256) {
                // SAFETY (all loads): p points at a full record of the kind.
                unsafe {
                    if Q8 {
                        let w = [_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i)];
                        (w.map(|v| _mm256_abs_epi8(v)), w, bcast2(p.add(64)))
                    } else {
                        let v = _mm256_loadu_si256(p as *const __m256i);
                        let mask = _mm256_set1_epi8(0x0f);
                        let u = [_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask)];
                        let d = _mm256_cvtph_ps(_mm_set1_epi32((p.add(32) as *const i32).read_unaligned()));
                        (u, [_mm256_setzero_si256(); 2], d)
                    }
                }
            }

            /// A tile of `R` rows × `C` outputs over every pair.
            ///
            /// # Safety
            /// The CPU must support the module's features; `t.x`/`t.sums`
            /// must hold the int8 records and block sums of `R` rows,
            /// `t.w`/`t.mins` those of `C` outputs (`t.pairs` pairs each),
            /// and `y[r·ldy + c]` must be valid for writes and owned by the
            /// caller for every tile cell.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile<const R: usize, const C: usize, const Q8: bool>(t: TileArgs) {
                let TileArgs { x, w, pairs, .. } = t;
                let rec = if Q8 { QuantKind::Q8.record() } else { QuantKind::Q4.record() };
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                for j in 0..pairs {
                    for c in 0..C {
                        // SAFETY: record j of output c and of every row exists.
                        unsafe {
                            let (u, sw, d) = load_w::<Q8>(w.add((c * pairs + j) * rec));
                            if R < 4 {
                                // A prefetch never faults: the address may run past the weight.
                                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((c * pairs + j) * rec + PREFETCH_BYTES) as *const i8);
                            }
                            for (r, accr) in acc.iter_mut().enumerate() {
                                let xr = x.add((r * pairs + j) * XREC);
                                let mut s0 = _mm256_loadu_si256(xr as *const __m256i);
                                let mut s1 = _mm256_loadu_si256(xr.add(32) as *const __m256i);
                                if Q8 {
                                    s0 = _mm256_sign_epi8(s0, sw[0]);
                                    s1 = _mm256_sign_epi8(s1, sw[1]);
                                }
                                let isum = dpbusd(dpbusd(_mm256_setzero_si256(), u[0], s0), u[1], s1);
                                let s = _mm256_mul_ps(d, bcast2(xr.add(XSCALES)));
                                accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, accr[c]);
                            }
                        }
                    }
                }
                // SAFETY: as this function's contract (its features include AVX2, FMA, F16C).
                unsafe { finish_tile::<R, C>(acc, t, Q8) }
            }

            /// `y[rows, cols]`, row stride `ldy`, int8 activations, in the
            /// tiles of [`drive`].
            ///
            /// # Safety
            /// The CPU must support the module's features; `y` must be valid
            /// for writes at every (row, col) of the ranges; the caller owns
            /// those cells; `x` holds int8 codes.
            pub unsafe fn gemm(
                y: *mut f32,
                ldy: usize,
                x: &QuantActs,
                w: &QuantWeight,
                rows: std::ops::Range<usize>,
                cols: std::ops::Range<usize>,
            ) {
                debug_assert_eq!(x.bits, ActBits::I8);
                // SAFETY: forwarded; every tile runs on the features the caller checked.
                unsafe {
                    drive(y, ldy, x, w, rows, cols, |rr, cc, q8, t| {
                        match (rr, cc, q8) {
                            (4, 1, false) => tile::<4, 1, false>(t),
                            (4, 1, true) => tile::<4, 1, true>(t),
                            (1, 1, false) => tile::<1, 1, false>(t),
                            (1, 1, true) => tile::<1, 1, true>(t),
                            (1, 2, false) => tile::<1, 2, false>(t),
                            (1, 2, true) => tile::<1, 2, true>(t),
                            (1, 3, false) => tile::<1, 3, false>(t),
                            (1, 3, true) => tile::<1, 3, true>(t),
                            (1, 4, false) => tile::<1, 4, false>(t),
                            (1, 4, true) => tile::<1, 4, true>(t),
                            (2, 1, false) => tile::<2, 1, false>(t),
                            (2, 1, true) => tile::<2, 1, true>(t),
                            (2, 2, false) => tile::<2, 2, false>(t),
                            (2, 2, true) => tile::<2, 2, true>(t),
                            (3, 1, false) => tile::<3, 1, false>(t),
                            (3, 1, true) => tile::<3, 1, true>(t),
                            (3, 2, false) => tile::<3, 2, false>(t),
                            (3, 2, true) => tile::<3, 2, true>(t),
                            _ => unreachable!("tiles take 4 rows × 1 output or 1–3 rows × at most 4 outputs"),
                        }
                    })
                }
            }
        }
    };
}

int8_kernel!(
    /// AVX2: `vpmaddubsw` then `vpmaddwd` by ones.
    avx2,
    "avx2,fma,f16c",
    |acc, u, s| _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
);

int8_kernel!(
    /// AVX-VNNI: VEX `vpdpbusd`.
    avxvnni,
    "avx2,fma,f16c,avxvnni",
    |acc, u, s| _mm256_dpbusd_avx_epi32(acc, u, s)
);

int8_kernel!(
    /// AVX-512 VNNI with VL: EVEX `vpdpbusd` on 256 bits.
    avx512vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    |acc, u, s| _mm256_dpbusd_epi32(acc, u, s)
);
