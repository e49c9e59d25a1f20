//! Decode-sized products on Q4_K and Q6_K super-blocks with AVX2: each
//! block's values are dequantized eight at a time in registers and
//! multiplied into every row of `x` at once, instead of being written to a
//! buffer and read back once per row.
//!
//! The arithmetic is the scalar path's, operation for operation: a value is
//! `d·sc·q − dmin·m` (Q4_K) or `(d·sc)·q` (Q6_K) as
//! `vellum_models::gguf::dequantize` computes it, and each super-block's dot
//! product keeps eight partial sums (lane `i` takes the values at index
//! `i mod 8`, in index order, product then sum, no fusing) reduced as
//! `linear::dot_generic` reduces them. So the results are bitwise those of
//! dequantize-then-dot, and a row's result does not depend on the others.

use std::arch::x86_64::*;

/// Bytes of a Q4_K super-block (256 values).
pub const Q4_K_BYTES: usize = 144;
/// Bytes of a Q6_K super-block (256 values).
pub const Q6_K_BYTES: usize = 210;

/// The partial sums reduced as `dot_generic` does:
/// `((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))`.
///
/// # Safety
/// The CPU must support AVX.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce(acc: __m256) -> f32 {
    let mut a = [0.0f32; 8];
    // SAFETY: `a` holds eight f32.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), acc) };
    // `+ 0.0`: dot_generic's empty tail (it turns a −0 sum into +0).
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + 0.0
}

/// Eight bytes as f32 (zero-extended).
///
/// # Safety
/// The CPU must support AVX2; `p` must be valid for reading 8 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u8x8(p: *const u8) -> __m256i {
    // SAFETY: p points at eight readable bytes.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
}

/// Adds, for every row `r < m`, the dot product of `values` (the 8 values
/// at index `at..at + 8` of the super-block) with `x[r·k + at ..]` to
/// `acc[r]`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `x` must be valid for reading
/// `x + r·k + at + 8` for every `r < m`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate<const M: usize>(acc: &mut [__m256; M], values: __m256, x: *const f32, k: usize, at: usize) {
    for (r, a) in acc.iter_mut().enumerate() {
        // SAFETY: row r's 8 values at `at` are in bounds (caller).
        let xv = unsafe { _mm256_loadu_ps(x.add(r * k + at)) };
        *a = _mm256_add_ps(*a, _mm256_mul_ps(xv, values));
    }
}

/// `out[r] = Σ` over one Q4_K super-block of its values times row `r` of
/// `x` (256 values from `x + r·k`), for `M` rows.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `block` must hold
/// [`Q4_K_BYTES`] bytes; `x` must be valid for reading 256 values at
/// `x + r·k` for every `r < M`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k_dots<const M: usize>(block: &[u8], x: *const f32, k: usize) -> [f32; M] {
    debug_assert!(block.len() >= Q4_K_BYTES);
    let half = |at: usize| half::f16::from_le_bytes([block[at], block[at + 1]]).to_f32();
    let (d, dmin, scales, qs) = (half(0), half(2), &block[4..16], &block[16..144]);
    let mut acc = [_mm256_setzero_ps(); M];
    for chunk in 0..4 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        for (sub, shift) in [(0usize, 0i32), (1, 4)] {
            let (sc, m) = vellum_models::gguf::scale_min_k4(2 * chunk + sub, scales);
            let (dl, ml) = (_mm256_set1_ps(d * f32::from(sc)), _mm256_set1_ps(dmin * f32::from(m)));
            for l in (0..32).step_by(8) {
                // SAFETY: q holds 32 bytes; x's bounds are the caller's.
                unsafe {
                    let bytes = u8x8(q.as_ptr().add(l));
                    let nib = _mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_set1_epi32(shift)), _mm256_set1_epi32(0x0f));
                    let values = _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(nib)), ml);
                    accumulate(&mut acc, values, x, k, chunk * 64 + sub * 32 + l);
                }
            }
        }
    }
    // SAFETY: register operations only.
    acc.map(|a| unsafe { reduce(a) })
}

/// `out[r] = Σ` over one Q6_K super-block of its values times row `r` of
/// `x`, for `M` rows.
///
/// # Safety
/// As [`q4_k_dots`], with a block of [`Q6_K_BYTES`] bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q6_k_dots<const M: usize>(block: &[u8], x: *const f32, k: usize) -> [f32; M] {
    debug_assert!(block.len() >= Q6_K_BYTES);
    let (ql, qh, sc) = (&block[0..128], &block[128..192], &block[192..208]);
    let d = half::f16::from_le_bytes([block[208], block[209]]).to_f32();
    let mut acc = [_mm256_setzero_ps(); M];
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
        // Value l + 32·t (l < 32, t < 4): low bits from nibble t / 2 of
        // ql[l + 32·(t % 2)], high bits from bits 2t, 2t + 1 of qh[l].
        for t in 0..4usize {
            let (lo_at, lo_shift, hi_shift) = (32 * (t % 2), 4 * (t as i32 / 2), 2 * t as i32);
            for l in (0..32).step_by(8) {
                let scale = _mm256_set1_ps(d * f32::from(sc[l / 16 + 2 * t] as i8));
                // SAFETY: ql and qh hold the bytes read; x's bounds are the caller's.
                unsafe {
                    let low = _mm256_and_si256(
                        _mm256_srlv_epi32(u8x8(ql.as_ptr().add(lo_at + l)), _mm256_set1_epi32(lo_shift)),
                        _mm256_set1_epi32(0x0f),
                    );
                    let high =
                        _mm256_and_si256(_mm256_srlv_epi32(u8x8(qh.as_ptr().add(l)), _mm256_set1_epi32(hi_shift)), _mm256_set1_epi32(3));
                    let q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
                    let values = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(q));
                    accumulate(&mut acc, values, x, k, n * 128 + 32 * t + l);
                }
            }
        }
    }
    // SAFETY: register operations only.
    acc.map(|a| unsafe { reduce(a) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vellum_core::SeededRng;
    use vellum_models::gguf::{dequantize_into, GgmlType};

    /// Random bytes with sane f16 scales where the format has them.
    fn random_block(rng: &mut SeededRng, len: usize, f16_at: &[usize]) -> Vec<u8> {
        let mut b: Vec<u8> = (0..len).map(|_| (rng.next_u64() & 0xff) as u8).collect();
        for &at in f16_at {
            let v = half::f16::from_f32((rng.uniform() as f32 - 0.5) * 0.02);
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// The scalar path: dequantize, then `dot_generic` per row.
    fn reference(ty: GgmlType, block: &[u8], x: &[f32], k: usize, m: usize) -> Vec<f32> {
        let mut values = vec![0.0f32; 256];
        dequantize_into(ty, block, &mut values).expect("one block");
        (0..m).map(|r| crate::linear::dot_generic_for_tests(&x[r * k..r * k + 256], &values)).collect()
    }

    #[test]
    fn fused_k_quant_dots_equal_dequantize_then_dot_bit_for_bit() {
        if !crate::quant::has_simd() {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let mut rng = SeededRng::new(7);
        for case in 0..64 {
            let k = 256 + 256 * (case % 3);
            let x: Vec<f32> = (0..4 * k).map(|_| (rng.uniform() as f32 - 0.5) * 4.0).collect();
            let q4 = random_block(&mut rng, Q4_K_BYTES, &[0, 2]);
            let q6 = random_block(&mut rng, Q6_K_BYTES, &[208]);
            // SAFETY: AVX2 checked above; x holds 4 rows of k ≥ 256 values.
            let (a4, a6) = unsafe { (q4_k_dots::<4>(&q4, x.as_ptr(), k), q6_k_dots::<4>(&q6, x.as_ptr(), k)) };
            let (r4, r6) = (reference(GgmlType::Q4_K, &q4, &x, k, 4), reference(GgmlType::Q6_K, &q6, &x, k, 4));
            for r in 0..4 {
                assert_eq!(a4[r].to_bits(), r4[r].to_bits(), "Q4_K case {case} row {r}: {} vs {}", a4[r], r4[r]);
                assert_eq!(a6[r].to_bits(), r6[r].to_bits(), "Q6_K case {case} row {r}: {} vs {}", a6[r], r6[r]);
            }
            // One row alone gives the same bits as within four.
            // SAFETY: as above.
            let alone = unsafe { q6_k_dots::<1>(&q6, x.as_ptr().add(2 * k), k) };
            assert_eq!(alone[0].to_bits(), a6[2].to_bits());
        }
    }
}
