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

use super::avx2::{bcast2, dispatch_tile, drive, finish_tile, TileArgs, PREFETCH_BYTES};
use super::{ActBits, QuantActs, QuantKind, QuantWeight, KQ4K, KQ6K, KQ8};
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

            /// A weight pair of kind `K`: the two unsigned operand registers
            /// (Q4/Q4K: low and high nibbles, positions 0..32 and 32..64;
            /// Q8/Q6K: `|w|`), the two signed codes (Q8/Q6K; whose signs move
            /// onto the activations) and the `d` patterns `(d₀, d₁, d₀, d₁,
            /// …)` of positions 0..32 and 32..64 (equal except for Q6K).
            ///
            /// # Safety
            /// The CPU must support the module's features; `p` must be valid
            /// for reading one whole weight pair record of kind `K`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load_w<const K: u8>(p: *const u8) -> ([__m256i; 2], [__m256i; 2], [__m256; 2]) {
                // SAFETY (all loads): p points at a full record of the kind.
                unsafe {
                    if K == KQ8 || K == KQ6K {
                        let w = [_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i)];
                        let d = bcast2(p.add(64));
                        (w.map(|v| _mm256_abs_epi8(v)), w, [d, if K == KQ6K { bcast2(p.add(72)) } else { d }])
                    } else {
                        let v = _mm256_loadu_si256(p as *const __m256i);
                        let mask = _mm256_set1_epi8(0x0f);
                        let u = [_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask)];
                        let d = if K == KQ4K {
                            bcast2(p.add(32))
                        } else {
                            _mm256_cvtph_ps(_mm_set1_epi32((p.add(32) as *const i32).read_unaligned()))
                        };
                        (u, [_mm256_setzero_si256(); 2], [d, d])
                    }
                }
            }

            /// A tile of `R` rows × `C` outputs over every pair, weights of
            /// kind `K`.
            ///
            /// # Safety
            /// The CPU must support the module's features; `t.x`/`t.sums`
            /// must hold the int8 records and block sums of `R` rows,
            /// `t.w`/`t.mins` those of `C` outputs (`t.pairs` pairs each,
            /// kind `K`), and `y[r·ldy + c]` must be valid for writes and
            /// owned by the caller for every tile cell.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile<const R: usize, const C: usize, const K: u8>(t: TileArgs) {
                let TileArgs { x, w, pairs, .. } = t;
                let rec = QuantKind::from_code(K).record();
                let signed = K == KQ8 || K == KQ6K;
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                for j in 0..pairs {
                    for c in 0..C {
                        // SAFETY: record j of output c and of every row exists.
                        unsafe {
                            let (u, sw, d) = load_w::<K>(w.add((c * pairs + j) * rec));
                            if R < 4 {
                                // A prefetch never faults: the address may run past the weight.
                                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((c * pairs + j) * rec + PREFETCH_BYTES) as *const i8);
                            }
                            for (r, accr) in acc.iter_mut().enumerate() {
                                let xr = x.add((r * pairs + j) * XREC);
                                let mut s0 = _mm256_loadu_si256(xr as *const __m256i);
                                let mut s1 = _mm256_loadu_si256(xr.add(32) as *const __m256i);
                                if signed {
                                    s0 = _mm256_sign_epi8(s0, sw[0]);
                                    s1 = _mm256_sign_epi8(s1, sw[1]);
                                }
                                let dx = bcast2(xr.add(XSCALES));
                                if K == KQ6K {
                                    // Each half of the pair has its own scales.
                                    let i0 = dpbusd(_mm256_setzero_si256(), u[0], s0);
                                    let i1 = dpbusd(_mm256_setzero_si256(), u[1], s1);
                                    accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d[0], dx), accr[c]);
                                    accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d[1], dx), accr[c]);
                                } else {
                                    let isum = dpbusd(dpbusd(_mm256_setzero_si256(), u[0], s0), u[1], s1);
                                    accr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d[0], dx), accr[c]);
                                }
                            }
                        }
                    }
                }
                // SAFETY: as this function's contract (its features include AVX2, FMA, F16C).
                unsafe { finish_tile::<R, C, K>(acc, t) }
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
                    drive(y, ldy, x, w, rows, cols, |rr, cc, k, t| dispatch_tile!(tile, rr, cc, k, t))
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
