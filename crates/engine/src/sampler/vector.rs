//! The passes over a whole row of logits that sampling needs, written so
//! that they vectorize: the row's maximum, and sums of `exp((x − max)/t)`
//! per chunk of [`CHUNK`] entries.
//!
//! With a 262,144-token vocabulary (Gemma 3) and 64 rows a step, these
//! passes were a quarter of a decode step with libm's scalar `expf` and a
//! sequential f64 sum. Here `exp` is a polynomial ([`vellum_base::exp_f32`]) and the sum
//! runs in 16 independent f64 lanes, so the compiler turns both into vector
//! code; on x86_64 the loops are compiled a second time for AVX2 and picked
//! at run time. No fused multiply-add is used, so both builds give the same
//! bits on every machine: a seeded draw does not depend on the CPU.

use vellum_base::TokenId;

/// Entries per chunk of the per-chunk sums.
pub(crate) const CHUNK: usize = 1024;

/// Independent accumulators per pass (a multiple of the widest vector).
const LANES: usize = 16;

/// The weight of logit `x` in a draw at `1/t = inv_t` from a row whose
/// maximum is `max`: `exp((x − max)/t)`, the same bits in every pass.
#[inline(always)]
pub(crate) fn weight(x: f32, max: f32, inv_t: f32) -> f32 {
    vellum_base::exp_f32((x - max) * inv_t)
}

#[inline(always)]
fn max_generic(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (mj, &v) in m.iter_mut().zip(c) {
            // `>` and a select, not `f32::max`: this form vectorizes; NaN never wins.
            *mj = if v > *mj { v } else { *mj };
        }
    }
    let mut best = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });
    for v in m {
        best = if v > best { v } else { best };
    }
    best
}

#[inline(always)]
fn exp_sums_generic(x: &[f32], max: f32, inv_t: f32, out: &mut Vec<f64>) {
    out.clear();
    for chunk in x.chunks(CHUNK) {
        let mut acc = [0f64; LANES];
        let mut lanes = chunk.chunks_exact(LANES);
        for c in &mut lanes {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += f64::from(weight(v, max, inv_t));
            }
        }
        let mut s = lanes.remainder().iter().map(|&v| f64::from(weight(v, max, inv_t))).sum::<f64>();
        for a in acc {
            s += a;
        }
        out.push(s);
    }
}

/// Entries per chunk that [`top_k_generic`] skips at once.
const SKIP: usize = 64;

#[inline(always)]
fn top_k_generic(values: &[f32], k: usize) -> Vec<(TokenId, f32)> {
    let mut best: Vec<(TokenId, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (ci, chunk) in values.chunks(SKIP).enumerate() {
        // Once k entries are held, a chunk whose maximum does not beat the
        // k-th changes nothing: one vector pass instead of 64 compares.
        if best.len() == k && max_generic(chunk) <= best[k - 1].1 {
            continue;
        }
        for (i, &v) in chunk.iter().enumerate() {
            if best.len() < k || v > best[best.len() - 1].1 {
                let pos = best.partition_point(|&(_, b)| b >= v);
                best.insert(pos, ((ci * SKIP + i) as TokenId, v));
                best.truncate(k);
            }
        }
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use vellum_base::TokenId;

    /// [`super::top_k_generic`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn top_k(values: &[f32], k: usize) -> Vec<(TokenId, f32)> {
        super::top_k_generic(values, k)
    }

    /// [`super::max_generic`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn max(x: &[f32]) -> f32 {
        super::max_generic(x)
    }

    /// [`super::exp_sums_generic`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sums(x: &[f32], max: f32, inv_t: f32, out: &mut Vec<f64>) {
        super::exp_sums_generic(x, max, inv_t, out)
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// The largest entry of `x` (NaN ignored; −∞ for an empty row).
pub(crate) fn max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { avx2::max(x) };
    }
    max_generic(x)
}

/// The `k` largest entries, largest first (ties: lower id first).
pub(crate) fn top_k(values: &[f32], k: usize) -> Vec<(TokenId, f32)> {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { avx2::top_k(values, k) };
    }
    top_k_generic(values, k)
}

/// `Σ exp((x − max)·inv_t)` over each chunk of [`CHUNK`] entries of `x`,
/// into `out` (cleared first), each summed in f64.
pub(crate) fn exp_sums(x: &[f32], max: f32, inv_t: f32, out: &mut Vec<f64>) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { avx2::exp_sums(x, max, inv_t, out) };
    }
    exp_sums_generic(x, max, inv_t, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_with_skipped_chunks_equals_the_plain_insertion() {
        let mut s = 3u64;
        for len in [1usize, 63, 64, 65, 300, 5000] {
            // Few distinct values, so ties are everywhere.
            let x: Vec<f32> = (0..len)
                .map(|_| {
                    s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    ((s >> 59) as f32) - 8.0
                })
                .collect();
            for k in [1usize, 2, 5, 20, 100] {
                let mut want: Vec<(TokenId, f32)> = x.iter().enumerate().map(|(i, &v)| (i as TokenId, v)).collect();
                want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                want.truncate(k);
                assert_eq!(top_k(&x, k), want, "{len} entries, k = {k}");
            }
        }
        assert!(top_k(&[1.0], 0).is_empty());
    }

    #[test]
    fn vector_passes_match_the_plain_loops_bit_for_bit() {
        let mut s = 7u64;
        let mut next = || {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 40.0 - 20.0
        };
        for len in [0usize, 1, 15, 16, 17, 1023, 1024, 1025, 5000] {
            let x: Vec<f32> = (0..len).map(|_| next()).collect();
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&x).to_bits(), m.to_bits(), "max, {len} entries");
            for inv_t in [1.0f32, 1.0 / 0.7] {
                let mut got = Vec::new();
                exp_sums(&x, m, inv_t, &mut got);
                let mut plain = Vec::new();
                exp_sums_generic(&x, m, inv_t, &mut plain);
                assert_eq!(got, plain, "dispatched and generic sums differ, {len} entries");
                let want: Vec<f64> = x.chunks(CHUNK).map(|c| c.iter().map(|&v| (((v - m) * inv_t) as f64).exp()).sum()).collect();
                assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-6 * w, "chunk sum {g} vs {w}");
                }
            }
        }
    }
}
