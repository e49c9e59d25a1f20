//! The tile's two inner loops on AVX-512, a query group at a time.
//!
//! * Scores ([`tile_scores`]): each 16-value chunk of a key row is loaded
//!   (and widened) once and meets up to four query heads' accumulators in
//!   registers (4 heads × 4 accumulators = 16 of the 32 `zmm` registers),
//!   where [`dot`](super::dot) loads it once per head. Every head's sums
//!   run in `dot`'s order — the same four 16-lane accumulators, chunk after
//!   chunk, the same pairwise reduction and scalar tail.
//! * Values ([`tile_values`]): 64 values of a row (four registers) meet up
//!   to four heads' accumulators, where the 256-bit loop takes 16 values
//!   (two registers) at a time; per output element the same fused
//!   multiply-adds in row order as [`accumulate_values`](super::accumulate_values).
//!
//! So the outputs are the same bits (checked by the tests below) and the
//! int8 golden gaps in docs/benchmarks.md do not move. Gemma 3 has four
//! query heads per kv head and 256-value heads.

use super::{accumulate_tail, for_each_row, prefetch, reduce_lanes_avx, ElemKind, KvElem, Rows, Shape, TileRuns, LANES, TILE, UNROLL};
use std::arch::x86_64::*;

/// Sixteen elements from `p` as `f32` in one register.
///
/// # Safety
/// AVX-512F (and BW for `bf16`; AVX2 for FP8); `p` points at 16 readable
/// elements.
#[inline(always)]
unsafe fn load16<T: KvElem>(p: *const T) -> __m512 {
    // SAFETY: the caller's contract (16 elements at p; AVX-512F/BW).
    unsafe {
        match T::KIND {
            ElemKind::F32 => _mm512_loadu_ps(p.cast()),
            ElemKind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            ElemKind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))),
            ElemKind::Fp8E4m3 => _mm512_cvtph_ps(super::fp8_to_f16_bits(_mm_loadu_si128(p.cast()))),
        }
    }
}

/// Step 1 of [`attend_tile`](super::attend_tile) on AVX-512: `scores[h, j]
/// = softcap(scale · q_h · k_{j, kv(h)})` for the tile's rows, prefetching
/// each row's values as the scalar step does.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW ([`Shape::wide_tile`] is set
/// only then); `q` holds the item's query heads, `scores` `[heads, TILE]`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn tile_scores<T: KvElem>(q: &[f32], rows: &Rows<'_, T>, runs: &TileRuns, shape: &Shape, scores: &mut [f32]) {
    let hd = shape.head_dim;
    let group_len = shape.group_len();
    let row_len = q.len() / shape.group;
    let mut dots = [0.0f32; 4];
    for_each_row!(runs, rows.row_stride, |j, base| {
        prefetch(&rows.v[base..base + row_len]);
        for (kv, q_kv) in q.chunks_exact(group_len).enumerate() {
            let k_row = &rows.k[base + kv * hd..base + (kv + 1) * hd];
            for h in (0..shape.group).step_by(4) {
                let n = (shape.group - h).min(4);
                let q_heads = &q_kv[h * hd..(h + n) * hd];
                // SAFETY (each arm): this function's target features; the
                // slices are bounds-checked above.
                unsafe {
                    match n {
                        1 => dots_n::<T, 1>(q_heads, k_row, &mut dots),
                        2 => dots_n::<T, 2>(q_heads, k_row, &mut dots),
                        3 => dots_n::<T, 3>(q_heads, k_row, &mut dots),
                        _ => dots_n::<T, 4>(q_heads, k_row, &mut dots),
                    }
                }
                for (i, &d) in dots[..n].iter().enumerate() {
                    scores[(kv * shape.group + h + i) * TILE + j] = shape.score(d);
                }
            }
        }
    });
}

/// `dots[i] = q_i · k` for the `N` heads of `q` (`[N, k.len()]`), each in
/// [`dot`](super::dot)'s order of operations.
///
/// # Safety
/// AVX-512F and BW, FMA and AVX (inlined into [`tile_scores`] only).
#[inline(always)]
unsafe fn dots_n<T: KvElem, const N: usize>(q: &[f32], k: &[T], dots: &mut [f32; 4]) {
    let hd = k.len();
    assert!(q.len() == N * hd && N <= 4);
    // SAFETY: every load below reads 16 elements at an offset c + 16 ≤ hd
    // of `k` or of one head's `hd` values of `q` (checked above).
    unsafe {
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); UNROLL]; N];
        let mut c = 0;
        while c + UNROLL * LANES <= hd {
            for u in 0..UNROLL {
                let y = load16(kp.add(c + u * LANES));
                for (h, acc) in acc.iter_mut().enumerate() {
                    acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(h * hd + c + u * LANES)), y, acc[u]);
                }
            }
            c += UNROLL * LANES;
        }
        while c + LANES <= hd {
            let y = load16(kp.add(c));
            for (h, acc) in acc.iter_mut().enumerate() {
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(h * hd + c)), y, acc[0]);
            }
            c += LANES;
        }
        for (h, [a0, a1, a2, a3]) in acc.iter().enumerate() {
            let mut tail = 0.0f32;
            for (x, &y) in q[h * hd + c..(h + 1) * hd].iter().zip(&k[c..]) {
                tail += x * T::to_f32(y);
            }
            let mut sum = [0.0f32; LANES];
            _mm512_storeu_ps(sum.as_mut_ptr(), _mm512_add_ps(_mm512_add_ps(*a0, *a1), _mm512_add_ps(*a2, *a3)));
            dots[h] = reduce_lanes_avx(&sum) + tail;
        }
    }
}

/// Step 3 of [`attend_tile`](super::attend_tile) on AVX-512: `out_h += Σ_j
/// p[h, j] · v_{j, kv(h)}` for every head of the item, `p` the tile's
/// exponentiated scores (`scores`, `[heads, TILE]`).
///
/// # Safety
/// As [`tile_scores`]; `out` and `scores` hold the item's heads.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn tile_values<T: KvElem>(out: &mut [f32], scores: &[f32], rows: &Rows<'_, T>, runs: &TileRuns, shape: &Shape) {
    let hd = shape.head_dim;
    for kv in 0..out.len() / shape.group_len() {
        for h in (0..shape.group).step_by(4) {
            let first = kv * shape.group + h;
            // SAFETY (each arm): this function's target features.
            unsafe {
                match (shape.group - h).min(4) {
                    1 => values_n::<T, 1>(out, scores, rows, runs, kv * hd, first, hd),
                    2 => values_n::<T, 2>(out, scores, rows, runs, kv * hd, first, hd),
                    3 => values_n::<T, 3>(out, scores, rows, runs, kv * hd, first, hd),
                    _ => values_n::<T, 4>(out, scores, rows, runs, kv * hd, first, hd),
                }
            }
        }
    }
}

/// `out_h += Σ_j p[h, j] · v_j` for the `N` heads from `first` (one kv
/// head's, whose values start at `v_off` in a row): 64 values at a time,
/// then 16, then the scalar tail, as the 256-bit loop orders each element's
/// operations.
///
/// # Safety
/// AVX-512F and BW, FMA and AVX (inlined into [`tile_values`] only).
#[inline(always)]
#[allow(clippy::too_many_arguments)] // Private helper of tile_values.
unsafe fn values_n<T: KvElem, const N: usize>(
    out: &mut [f32],
    scores: &[f32],
    rows: &Rows<'_, T>,
    runs: &TileRuns,
    v_off: usize,
    first: usize,
    hd: usize,
) {
    const W: usize = UNROLL * LANES;
    let o = &mut out[first * hd..(first + N) * hd];
    let p = &scores[first * TILE..(first + N) * TILE];
    let mut c = 0;
    // SAFETY: every load and store below covers 16 elements at offsets
    // checked by the slicing next to it.
    unsafe {
        while c + W <= hd {
            let mut acc = [[_mm512_setzero_ps(); UNROLL]; N];
            for (i, acc) in acc.iter_mut().enumerate() {
                let src = o[i * hd + c..i * hd + c + W].as_ptr();
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(src.add(u * LANES));
                }
            }
            for_each_row!(runs, rows.row_stride, |j, base| {
                let vp = rows.v[base + v_off + c..base + v_off + c + W].as_ptr();
                let v: [__m512; UNROLL] = std::array::from_fn(|u| load16(vp.add(u * LANES)));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let pj = _mm512_set1_ps(p[i * TILE + j]);
                    for (a, v) in acc.iter_mut().zip(v) {
                        *a = _mm512_fmadd_ps(pj, v, *a);
                    }
                }
            });
            for (i, acc) in acc.iter().enumerate() {
                let dst = o[i * hd + c..i * hd + c + W].as_mut_ptr();
                for (u, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(dst.add(u * LANES), *a);
                }
            }
            c += W;
        }
        while c + LANES <= hd {
            let mut acc = [_mm512_setzero_ps(); N];
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(o[i * hd + c..i * hd + c + LANES].as_ptr());
            }
            for_each_row!(runs, rows.row_stride, |j, base| {
                let v = load16(rows.v[base + v_off + c..base + v_off + c + LANES].as_ptr());
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(p[i * TILE + j]), v, *a);
                }
            });
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o[i * hd + c..i * hd + c + LANES].as_mut_ptr(), *a);
            }
            c += LANES;
        }
    }
    accumulate_tail(out, scores, rows, runs, v_off, first..first + N, hd, c);
}

#[cfg(test)]
mod tests {
    use super::super::{dot, test_values};
    use super::*;

    /// Whether this CPU runs the AVX-512 tile (and the 256-bit one beside
    /// it); says so by the test's name when it does not.
    fn wide_or_skip(test: &str) -> bool {
        let wide = std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") && crate::quant::has_simd();
        crate::runs_or_skips(wide, test, "AVX-512")
    }
    use crate::kv_cache::Fp8E4m3;
    use half::{bf16, f16};

    /// A value in [-1, 1] as an FP8 code of 64 times it (the normal range).
    fn fp8_code(x: f32) -> Fp8E4m3 {
        Fp8E4m3::from_f32(64.0 * x)
    }

    /// Every head's score equals `dot`'s, bit for bit, for head sizes with
    /// and without 64-value blocks, 16-value chunks and scalar tails, and
    /// groups of 1 to 9 heads (a partial last pass of four).
    #[test]
    fn wide_scores_are_the_bits_of_dot_or_skip() {
        if !wide_or_skip("wide_scores_are_the_bits_of_dot_or_skip") {
            return;
        }
        let mut rnd = test_values(0x9e37_79b9);
        fn check<T: KvElem>(rnd: &mut impl FnMut() -> f32, narrow: fn(f32) -> T, hd: usize, group: usize, softcap: Option<f32>) {
            let n_ctx = 5;
            let shape = Shape { softcap, wide_tile: true, ..Shape::new(group * 2, 2, hd, "test") };
            let q: Vec<f32> = (0..shape.num_heads * hd).map(|_| rnd()).collect();
            let k: Vec<T> = (0..n_ctx * shape.kv_row()).map(|_| narrow(rnd())).collect();
            let rows = Rows { k: &k, v: &k, row_stride: shape.kv_row(), head_off: 0 };
            let runs = TileRuns::new(&rows, 0, n_ctx, n_ctx, &|_| 0);
            let mut scores = vec![0.0f32; shape.num_heads * TILE];
            // SAFETY: AVX-512F/BW and AVX2/FMA/F16C checked above.
            unsafe { tile_scores(&q, &rows, &runs, &shape, &mut scores) };
            for j in 0..n_ctx {
                for h in 0..shape.num_heads {
                    let kv = h / group;
                    let k_row = &k[j * shape.kv_row() + kv * hd..][..hd];
                    // SAFETY: FMA, AVX2 and F16C checked above.
                    let s = shape.scale * unsafe { dot::<T, true>(&q[h * hd..(h + 1) * hd], k_row) };
                    let want = softcap.map_or(s, |cap| cap * (s / cap).tanh());
                    let got = scores[h * TILE + j];
                    assert_eq!(got.to_bits(), want.to_bits(), "hd {hd}, group {group}, row {j}, head {h}: {got} vs {want}");
                }
            }
        }
        for (hd, group) in [(256, 4), (64, 1), (128, 8), (80, 3), (72, 9), (8, 2), (96, 5)] {
            check::<f32>(&mut rnd, |a| a, hd, group, None);
            check::<f16>(&mut rnd, f16::from_f32, hd, group, Some(30.0));
            check::<bf16>(&mut rnd, bf16::from_f32, hd, group, None);
            check::<Fp8E4m3>(&mut rnd, fp8_code, hd, group, Some(30.0));
        }
    }

    /// The whole SIMD tile with and without the AVX-512 loops: the same
    /// bits, over a paged context (blocks of 16 in shuffled order, a partial
    /// last tile), head sizes with and without 64-value blocks and tails,
    /// groups with a partial last pass of four, a soft-cap, every pool type.
    #[test]
    fn the_wide_tile_gives_the_narrow_tiles_bits_or_skip() {
        if !wide_or_skip("the_wide_tile_gives_the_narrow_tiles_bits_or_skip") {
            return;
        }
        let mut rnd = test_values(0x1234_5678);
        fn check<T: KvElem>(rnd: &mut impl FnMut() -> f32, narrow: fn(f32) -> T, hd: usize, group: usize, n_ctx: usize) {
            let bs = 16;
            let n_blocks = n_ctx.div_ceil(bs);
            let shape = Shape { softcap: (group % 2 == 1).then_some(20.0), ..Shape::new(group * 2, 2, hd, "test") };
            let q: Vec<f32> = (0..shape.num_heads * hd).map(|_| rnd()).collect();
            let pool = |rnd: &mut dyn FnMut() -> f32| (0..n_blocks * bs * shape.kv_row()).map(|_| narrow(rnd())).collect::<Vec<T>>();
            let (k, v) = (pool(rnd), pool(rnd));
            // Block b of the context lives in pool block (7 b + 3) mod n.
            let order: Vec<usize> = (0..n_blocks).map(|b| (7 * b + 3) % n_blocks).collect();
            let rows = Rows { k: &k, v: &v, row_stride: shape.kv_row(), head_off: 0 };
            let run = |wide_tile: bool| {
                let shape = Shape { wide_tile, ..shape };
                let mut out = vec![0.0f32; q.len()];
                // SAFETY: AVX2/FMA/F16C (and AVX-512 for wide_tile) checked above.
                unsafe { super::super::attend_group_simd(&mut out, &q, &rows, 0..n_ctx, bs, |b| order[b] * bs, &shape, &mut Vec::new()) };
                out
            };
            let (narrow_out, wide_out) = (run(false), run(true));
            for (i, (a, b)) in narrow_out.iter().zip(&wide_out).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "hd {hd}, group {group}, ctx {n_ctx}, element {i}: {a} vs {b}");
            }
        }
        for (hd, group, n_ctx) in [(256, 4, 150), (72, 9, 70), (128, 2, 64), (80, 3, 200), (8, 2, 33)] {
            check::<f32>(&mut rnd, |a| a, hd, group, n_ctx);
            check::<f16>(&mut rnd, f16::from_f32, hd, group, n_ctx);
            check::<bf16>(&mut rnd, bf16::from_f32, hd, group, n_ctx);
            check::<Fp8E4m3>(&mut rnd, fp8_code, hd, group, n_ctx);
        }
    }
}
