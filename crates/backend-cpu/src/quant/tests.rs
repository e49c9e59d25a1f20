//! The formats against GGUF's blocks and an f64 reference; the dispatching
//! kernel against the scalar one.

use super::*;

use vellum_base::SeededRng;

fn rng(r: &mut SeededRng) -> f32 {
    r.signed_f32()
}

#[test]
fn positions_are_a_permutation() {
    let mut seen = [false; PAIR];
    for b in 0..2 {
        for e in 0..BLOCK {
            let p = pos(b, e);
            assert!(!seen[p]);
            seen[p] = true;
            assert_eq!(unpos(p), (b, e));
        }
    }
}

/// GGML blocks of `ty` for `n` rows of `k` values, with extreme codes.
fn ggml_blocks(ty: GgmlType, n: usize, k: usize, s: &mut SeededRng) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in 0..n * k / BLOCK {
        let d = f16::from_f32(rng(s).abs() * 0.01 + 1e-4);
        out.extend_from_slice(&d.to_le_bytes());
        match ty {
            GgmlType::Q8_0 => {
                for e in 0..BLOCK {
                    let q: i8 = if e == 5 {
                        if blk % 2 == 0 {
                            127
                        } else {
                            -127
                        }
                    } else {
                        (rng(s) * 127.0) as i8
                    };
                    out.push(q as u8);
                }
            }
            GgmlType::Q5_0 => {
                // Random high bits and nibbles, with the extremes 0 and 31 present.
                let qh = (s.next_u64() as u32) | 1;
                out.extend_from_slice(&(qh & !2).to_le_bytes());
                for j in 0..16 {
                    let byte = if j == 1 { 0xf0 } else { s.below(256) as u8 };
                    out.push(if j == 0 { byte | 0x0f } else { byte });
                }
            }
            _ => {
                if ty == GgmlType::Q4_1 {
                    out.extend_from_slice(&f16::from_f32(rng(s) * 0.05).to_le_bytes());
                }
                for j in 0..16 {
                    let lo = if j == 3 { 0 } else { (((rng(s) + 1.0) * 7.9) as u8).min(15) };
                    let hi = if j == 9 { 15 } else { (((rng(s) + 1.0) * 7.9) as u8).min(15) };
                    out.push(lo | (hi << 4));
                }
            }
        }
    }
    out
}

/// GGML K-quant super-blocks of `ty` (Q4_K or Q6_K) for `n` rows of `k`
/// values: random bytes, with the f16 scales made small and finite.
fn kquant_blocks(ty: GgmlType, n: usize, k: usize, s: &mut SeededRng) -> Vec<u8> {
    let (bytes, halves): (usize, &[usize]) = if ty == GgmlType::Q4_K { (144, &[0, 2]) } else { (210, &[208]) };
    let mut out: Vec<u8> = (0..n * k / 256 * bytes).map(|_| s.below(256) as u8).collect();
    for b in out.chunks_exact_mut(bytes) {
        for &at in halves {
            b[at..at + 2].copy_from_slice(&f16::from_f32(rng(s) * 0.01).to_le_bytes());
        }
    }
    out
}

#[test]
fn k_quant_blocks_are_kept_exactly() {
    let mut s = SeededRng::new(12);
    for (ty, kind) in [(GgmlType::Q4_K, QuantKind::Q4K), (GgmlType::Q6_K, QuantKind::Q6K)] {
        let (n, k) = (3, 768);
        let bytes = kquant_blocks(ty, n, k, &mut s);
        let qw = QuantWeight::from_ggml(ty, &bytes, n, k).expect("whole super-blocks");
        assert_eq!(qw.kind, kind);
        let want = vellum_ops::quant::dequantize(ty, &bytes, n * k).expect("valid blocks");
        let mut row = vec![0.0; k];
        for c in 0..n {
            qw.dequantize_row(c, &mut row);
            assert_eq!(row, want[c * k..(c + 1) * k], "{ty:?} row {c}");
        }
        assert!(QuantWeight::from_ggml(ty, &bytes[1..], n, k).is_none(), "{ty:?}: short data");
        assert!(QuantWeight::from_ggml(ty, &bytes, n, k - 32).is_none(), "{ty:?}: k not whole super-blocks");
    }
}

#[test]
fn ggml_blocks_are_kept_bit_for_bit() {
    let mut s = SeededRng::new(11);
    for ty in [GgmlType::Q4_1, GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q5_0] {
        let (n, k) = (3, 320);
        let bytes = ggml_blocks(ty, n, k, &mut s);
        let qw = QuantWeight::from_ggml(ty, &bytes, n, k).expect("whole blocks");
        let q8 = matches!(ty, GgmlType::Q8_0 | GgmlType::Q5_0);
        assert_eq!(qw.kind, if q8 { QuantKind::Q8 } else { QuantKind::Q4 });
        let want = vellum_ops::quant::dequantize(ty, &bytes, n * k).expect("valid blocks");
        let mut row = vec![0.0; k];
        for c in 0..n {
            qw.dequantize_row(c, &mut row);
            assert_eq!(row, want[c * k..(c + 1) * k], "{ty:?} row {c}");
        }
        assert!(QuantWeight::from_ggml(ty, &bytes[1..], n, k).is_none(), "{ty:?}: short data");
    }
    assert!(QuantWeight::from_ggml(GgmlType::F32, &[0; 4 * 32], 1, 32).is_none());
}

#[test]
fn q8_and_q4_quantization_round_trips_exact_blocks() {
    let mut s = SeededRng::new(13);
    for (ty, kind) in [(GgmlType::Q8_0, QuantKind::Q8), (GgmlType::Q4_1, QuantKind::Q4)] {
        let bytes = ggml_blocks(ty, 4, 320, &mut s);
        let w = vellum_ops::quant::dequantize(ty, &bytes, 4 * 320).expect("valid blocks");
        let qw = QuantWeight::quantize(&w, 4, 320, kind);
        let mut row = vec![0.0; 320];
        for c in 0..4 {
            qw.dequantize_row(c, &mut row);
            for (a, b) in row.iter().zip(&w[c * 320..(c + 1) * 320]) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{ty:?}: {a} vs {b}");
            }
        }
    }
}

/// y via the dispatching kernel and via the scalar one.
fn both(x: &[f32], m: usize, w: &QuantWeight, bits: ActBits) -> (Vec<f32>, Vec<f32>) {
    let mut acts = QuantActs::default();
    QuantActs::quantize(x, m, w.k, bits, &mut acts);
    let mut fast = vec![f32::NAN; m * w.n];
    // SAFETY: fast is [m, n] and owned here.
    unsafe { gemm(fast.as_mut_ptr(), w.n, &acts, w, 0..m, 0..w.n) };
    let mut slow = vec![f32::NAN; m * w.n];
    gemm_scalar(&mut slow, w.n, &acts, w, 0..m, 0..w.n);
    (fast, slow)
}

#[test]
fn kernels_match_f64_reference_on_odd_shapes() {
    let mut s = SeededRng::new(17);
    for &(m, n, k) in
        &[(1, 1, 1), (1, 3, 31), (2, 7, 33), (3, 5, 64), (5, 13, 100), (4, 6, 128), (9, 31, 576), (17, 4, 96), (6, 11, 1536), (50, 5, 1536)]
    {
        for (kind, bits) in
            [QuantKind::Q4, QuantKind::Q8].into_iter().flat_map(|k| [(k, ActBits::I8), (k, ActBits::I8Halves), (k, ActBits::I16)])
        {
            let w: Vec<f32> = (0..n * k).map(|_| rng(&mut s) * 0.1).collect();
            // Activations with an outlier per row, as hidden states have.
            let x: Vec<f32> = (0..m * k).map(|i| if i % 97 == 5 { 20.0 } else { rng(&mut s) }).collect();
            let qw = QuantWeight::quantize(&w, n, k, kind);
            let mut deq = vec![0.0f32; n * k];
            for c in 0..n {
                qw.dequantize_row(c, &mut deq[c * k..(c + 1) * k]);
                // The weight error is at most half a step.
                for i in 0..k {
                    let step = if kind == QuantKind::Q4 { 0.2 / 15.0 } else { 0.2 / 254.0 };
                    assert!((deq[c * k + i] - w[c * k + i]).abs() <= step * 0.51 + 1e-3, "{kind:?} weight error");
                }
            }
            let (fast, slow) = both(&x, m, &qw, bits);
            for r in 0..m {
                for c in 0..n {
                    let mut exact = 0.0f64;
                    let mut bound = 0.0f64;
                    for b0 in (0..k).step_by(BLOCK) {
                        let xs = &x[r * k + b0..r * k + (b0 + BLOCK).min(k)];
                        // Half a code step of the block's activations.
                        let half_step = xs.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64 / (2.0 * bits.max() as f64);
                        for (i, &xv) in xs.iter().enumerate() {
                            let wv = deq[c * k + b0 + i] as f64;
                            exact += xv as f64 * wv;
                            bound += wv.abs() * half_step;
                        }
                    }
                    let tol = bound * 1.01 + 1e-4 * (1.0 + exact.abs());
                    let (f, sl) = (fast[r * n + c] as f64, slow[r * n + c] as f64);
                    assert!((sl - exact).abs() <= tol, "{kind:?} {bits:?} ({m},{n},{k}) scalar {sl} vs {exact} (tol {tol})");
                    assert!((f - exact).abs() <= tol, "{kind:?} {bits:?} ({m},{n},{k}) fast {f} vs {exact} (tol {tol})");
                    assert!((f - sl).abs() <= 1e-4 * (1.0 + sl.abs()), "{kind:?} {bits:?} ({m},{n},{k}) fast {f} vs scalar {sl}");
                }
            }
        }
    }
}

/// Every kernel this CPU runs against the scalar one, on shapes that hit
/// every tile (1–3 leftover rows, 1–4 outputs, odd `k`); a CPU without
/// AVX2 tests the scalar kernel alone (the list is printed).
#[test]
fn every_kernel_this_cpu_runs_matches_the_scalar_one() {
    let mut s = SeededRng::new(23);
    let kernels = Kernel::available();
    eprintln!("kernels on this CPU: {kernels:?}");
    for &(m, n, k) in &[(1, 9, 33), (2, 7, 96), (3, 5, 640), (4, 6, 128), (5, 13, 100), (7, 3, 2048), (13, 17, 576)] {
        for (kind, bits) in
            [QuantKind::Q4, QuantKind::Q8].into_iter().flat_map(|k| [(k, ActBits::I8), (k, ActBits::I8Halves), (k, ActBits::I16)])
        {
            let w: Vec<f32> = (0..n * k).map(|_| rng(&mut s) * 0.1).collect();
            let x: Vec<f32> = (0..m * k).map(|i| if i % 89 == 3 { -30.0 } else { rng(&mut s) }).collect();
            let mut qw = QuantWeight::quantize(&w, n, k, kind);
            if kind == QuantKind::Q8 {
                // GGML's Q8_0 may hold −128, whose magnitude only fits unsigned.
                qw.data[(n / 2) * qw.pairs * kind.record() + 3] = 0x80;
            }
            let mut acts = QuantActs::default();
            QuantActs::quantize(&x, m, k, bits, &mut acts);
            let mut slow = vec![f32::NAN; m * n];
            gemm_scalar(&mut slow, n, &acts, &qw, 0..m, 0..n);
            for &kernel in &kernels {
                let mut y = vec![f32::NAN; m * n];
                // SAFETY: y is [m, n] and owned here; the kernel is available.
                unsafe { gemm_with(kernel, y.as_mut_ptr(), n, &acts, &qw, 0..m, 0..n) };
                for (a, b) in y.iter().zip(&slow) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{kernel:?} {kind:?} {bits:?} ({m},{n},{k}): {a} vs scalar {b}");
                }
            }
        }
    }
}

/// The K-quant kinds (made from GGUF blocks) through every kernel this
/// CPU runs against the scalar one, at both activation widths.
#[test]
fn every_kernel_matches_the_scalar_one_on_k_quants() {
    let mut s = SeededRng::new(29);
    let kernels = Kernel::available();
    for &(m, n, k) in &[(1, 9, 256), (2, 7, 512), (3, 5, 768), (4, 6, 256), (5, 13, 1024), (13, 17, 512)] {
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
            let qw = QuantWeight::from_ggml(ty, &kquant_blocks(ty, n, k, &mut s), n, k).expect("whole super-blocks");
            let mut deq = vec![0.0f32; n * k];
            for c in 0..n {
                qw.dequantize_row(c, &mut deq[c * k..(c + 1) * k]);
            }
            for bits in [ActBits::I8, ActBits::I8Halves, ActBits::I16] {
                let x: Vec<f32> = (0..m * k).map(|i| if i % 89 == 3 { -30.0 } else { rng(&mut s) }).collect();
                let mut acts = QuantActs::default();
                QuantActs::quantize(&x, m, k, bits, &mut acts);
                let mut slow = vec![f32::NAN; m * n];
                gemm_scalar(&mut slow, n, &acts, &qw, 0..m, 0..n);
                let mut fast: Vec<(Kernel, Vec<f32>)> = Vec::new();
                for &kernel in &kernels {
                    let mut y = vec![f32::NAN; m * n];
                    // SAFETY: y is [m, n] and owned here; the kernel is available.
                    unsafe { gemm_with(kernel, y.as_mut_ptr(), n, &acts, &qw, 0..m, 0..n) };
                    fast.push((kernel, y));
                }
                for r in 0..m {
                    // Row r's activations as the kernels see them (codes × scales).
                    let mut xq = vec![0.0f32; k];
                    for (j, chunk) in xq.chunks_mut(PAIR).enumerate() {
                        let rec = acts.record(r, j);
                        for (i, v) in chunk.iter_mut().enumerate() {
                            let (b, e) = (i / BLOCK, i % BLOCK);
                            *v = acts.code(rec, pos(b, e)) as f32 * f32_at(rec, bits.scale_at(b, e));
                        }
                    }
                    for c in 0..n {
                        // Against the f64 product of the exact weights and
                        // those activations, relative to the terms' size
                        // (f32 sums in a different order per kernel).
                        let exact: f64 = (0..k).map(|i| xq[i] as f64 * deq[c * k + i] as f64).sum();
                        let scale: f64 = (0..k).map(|i| (xq[i] as f64 * deq[c * k + i] as f64).abs()).sum();
                        let tol = 1e-5 * scale + 1e-6;
                        let got = slow[r * n + c] as f64;
                        assert!((got - exact).abs() <= tol, "{ty:?} {bits:?} ({m},{n},{k}) scalar {got} vs {exact}");
                        for (kernel, y) in &fast {
                            let got = y[r * n + c] as f64;
                            assert!((got - exact).abs() <= tol, "{kernel:?} {ty:?} {bits:?} ({m},{n},{k}): {got} vs {exact}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn cached_quantization_follows_its_input() {
    let mut s = SeededRng::new(21);
    let x: Vec<f32> = (0..3 * 100).map(|_| rng(&mut s)).collect();
    let mut fresh = QuantActs::default();
    let mut cached = QuantActs::default();
    QuantActs::quantize_cached(&x, 3, 100, ActBits::I8, &mut cached);
    QuantActs::quantize_cached(&x, 3, 100, ActBits::I8, &mut cached);
    QuantActs::quantize(&x, 3, 100, ActBits::I8, &mut fresh);
    assert_eq!((&cached.data, &cached.sums), (&fresh.data, &fresh.sums));
    let mut y = x.clone();
    y[150] += 0.5;
    QuantActs::quantize_cached(&y, 3, 100, ActBits::I8, &mut cached);
    QuantActs::quantize(&y, 3, 100, ActBits::I8, &mut fresh);
    assert_eq!((&cached.data, &cached.sums), (&fresh.data, &fresh.sums));
    // Same values, another shape.
    QuantActs::quantize_cached(&y, 2, 150, ActBits::I8, &mut cached);
    QuantActs::quantize_cached(&y, 2, 150, ActBits::I16, &mut cached);
    QuantActs::quantize(&y, 2, 150, ActBits::I16, &mut fresh);
    assert_eq!((&cached.data, &cached.sums, cached.rows), (&fresh.data, &fresh.sums, 2));
}

#[test]
fn subranges_write_only_their_cells() {
    let mut s = SeededRng::new(3);
    let (m, n, k) = (7, 10, 200);
    let w: Vec<f32> = (0..n * k).map(|_| rng(&mut s)).collect();
    let x: Vec<f32> = (0..m * k).map(|_| rng(&mut s)).collect();
    let qw = QuantWeight::quantize(&w, n, k, QuantKind::Q8);
    let mut acts = QuantActs::default();
    QuantActs::quantize(&x, m, k, ActBits::I8, &mut acts);
    let mut full = vec![0.0f32; m * n];
    gemm_scalar(&mut full, n, &acts, &qw, 0..m, 0..n);
    let mut part = vec![f32::NAN; m * n];
    // SAFETY: part is [m, n]; the ranges are disjoint.
    unsafe {
        gemm(part.as_mut_ptr(), n, &acts, &qw, 0..m, 0..4);
        gemm(part.as_mut_ptr(), n, &acts, &qw, 0..3, 4..n);
        gemm(part.as_mut_ptr(), n, &acts, &qw, 3..m, 4..n);
    }
    for (a, b) in part.iter().zip(&full) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
    }
}

/// Two threads write disjoint column ranges of the same rows through the
/// dispatching kernel, as `linear` does (small enough for Miri, where the
/// scalar fallback runs: `cargo +nightly miri test -p vellum-backend-cpu
/// --lib threads_write_disjoint_columns`).
#[test]
fn threads_write_disjoint_columns_of_shared_rows() {
    let mut s = SeededRng::new(23);
    let (m, n, k) = (3, 8, 64);
    let w: Vec<f32> = (0..n * k).map(|_| rng(&mut s)).collect();
    let x: Vec<f32> = (0..m * k).map(|_| rng(&mut s)).collect();
    for kind in [QuantKind::Q4, QuantKind::Q8] {
        let qw = QuantWeight::quantize(&w, n, k, kind);
        let mut acts = QuantActs::default();
        QuantActs::quantize(&x, m, k, ActBits::I8, &mut acts);
        let mut y = vec![f32::NAN; m * n];
        let mut want = vec![0.0; m * n];
        gemm_scalar(&mut want, n, &acts, &qw, 0..m, 0..n);
        /// The destination, shared by both threads (each writes its own columns).
        #[derive(Clone, Copy)]
        struct Dst(*mut f32);
        // SAFETY: the threads write disjoint columns and the scope joins
        // them before `y` is read.
        unsafe impl Send for Dst {}
        let dst = Dst(y.as_mut_ptr());
        let (acts, qw) = (&acts, &qw);
        std::thread::scope(|sc| {
            for cols in [0..n / 2, n / 2..n] {
                sc.spawn(move || {
                    let d = dst;
                    // SAFETY: y is [m, n]; this thread writes columns `cols` only.
                    unsafe { gemm(d.0, n, acts, qw, 0..m, cols) };
                });
            }
        });
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{kind:?}: {a} vs {b}");
        }
    }
}

/// The lane layout keeps every value, and every kernel on it (VNNI lane
/// kernels where the CPU has them, the scalar one elsewhere) computes the
/// pair layout's products: all four kinds, outputs not a multiple of 8,
/// column ranges that split a lane group, 1–4-row tiles and row blocks.
#[test]
fn the_lane_layout_computes_what_the_pair_layout_does() {
    let mut s = SeededRng::new(31);
    let kernels = Kernel::available();
    for &(m, n, k) in &[(1, 9, 256), (2, 8, 512), (3, 21, 768), (4, 16, 256), (7, 13, 1024), (13, 40, 512), (70, 11, 2048)] {
        let weights = [
            (QuantKind::Q4, QuantWeight::quantize(&(0..n * k).map(|_| rng(&mut s) * 0.1).collect::<Vec<_>>(), n, k, QuantKind::Q4)),
            (QuantKind::Q8, {
                let mut w = QuantWeight::quantize(&(0..n * k).map(|_| rng(&mut s) * 0.1).collect::<Vec<_>>(), n, k, QuantKind::Q8);
                // GGML's Q8_0 may hold −128: it must survive the offset of 128.
                w.data[(n / 2) * w.pairs * QuantKind::Q8.record() + 3] = 0x80;
                w
            }),
            // Q5_0: a Q8 weight with small codes (the AVX2 lane kernel's i16 sums).
            (QuantKind::Q8, QuantWeight::from_ggml(GgmlType::Q5_0, &ggml_blocks(GgmlType::Q5_0, n, k, &mut s), n, k).expect("blocks")),
            (QuantKind::Q4K, QuantWeight::from_ggml(GgmlType::Q4_K, &kquant_blocks(GgmlType::Q4_K, n, k, &mut s), n, k).expect("blocks")),
            (QuantKind::Q6K, QuantWeight::from_ggml(GgmlType::Q6_K, &kquant_blocks(GgmlType::Q6_K, n, k, &mut s), n, k).expect("blocks")),
        ];
        for ((kind, pair), width) in weights.into_iter().flat_map(|w| [(w.clone(), 8), (w, 16)]) {
            assert_eq!(pair.kind, kind);
            // Groups of 16 made from groups of 8, which covers both conversions.
            let lanes = if width == 8 { pair.clone().into_lanes() } else { pair.clone().into_lanes().into_lanes_of(16) };
            assert!(lanes.lanes == width && pair.lanes == 0);
            let (mut a, mut b) = (vec![0.0; k], vec![0.0; k]);
            for c in 0..n {
                pair.dequantize_row(c, &mut a);
                lanes.dequantize_row(c, &mut b);
                assert_eq!(a, b, "{kind:?} ({n},{k}) row {c}: values ({width} lanes)");
            }
            let x: Vec<f32> = (0..m * k).map(|i| if i % 89 == 3 { -30.0 } else { rng(&mut s) }).collect();
            for bits in [ActBits::I8, ActBits::I8Halves] {
                let mut acts = QuantActs::default();
                QuantActs::quantize(&x, m, k, bits, &mut acts);
                let mut want = vec![f32::NAN; m * n];
                gemm_scalar(&mut want, n, &acts, &pair, 0..m, 0..n);
                let mut scale = vec![0.0f64; m * n];
                for r in 0..m {
                    for c in 0..n {
                        pair.dequantize_row(c, &mut a);
                        scale[r * n + c] = (0..k).map(|i| (x[r * k + i] as f64 * a[i] as f64).abs()).sum::<f64>();
                    }
                }
                for &kernel in &kernels {
                    let mut y = vec![f32::NAN; m * n];
                    let split = (n / 3).max(1);
                    // SAFETY: y is [m, n] and owned here; the ranges are disjoint
                    // and the kernel is available.
                    unsafe {
                        gemm_with(kernel, y.as_mut_ptr(), n, &acts, &lanes, 0..m, 0..split);
                        gemm_with(kernel, y.as_mut_ptr(), n, &acts, &lanes, 0..m, split..n);
                    }
                    for (i, (got, w)) in y.iter().zip(&want).enumerate() {
                        let tol = 2e-6 * scale[i] + 1e-6;
                        assert!(
                            ((got - w) as f64).abs() <= tol,
                            "{kernel:?} {kind:?} {bits:?} ({m},{n},{k}) cell {i}: {width} lanes {got} vs pairs {w} (tol {tol})"
                        );
                    }
                }
            }
        }
    }
}

/// The largest sums the AVX2 lane kernels add up in i16 do not saturate
/// (every nibble 15, 16 products per lane; every Q5_0 code −16 or 15, eight
/// per lane; every Q6_K code −32 or 31, four per lane; every Q8_0 code −128
/// or 127, two per lane; activation codes ±127): every kernel on the lane
/// layout gives the exact product.
#[test]
fn lane_kernels_hold_the_extreme_sums() {
    let (n, k, m) = (16, 512, 4);
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let q4_1 = [&f16(1.0)[..], &f16(0.0), &[0xff; 16]].concat();
    let q8_0 = |code: u8| [&f16(1.0)[..], &[code; 32]].concat();
    // Q5_0: d, the fifth bits of the 32 values, their nibbles.
    let q5_0 = |bits: u32, nibbles: u8| [&f16(1.0)[..], &bits.to_le_bytes(), &[nibbles; 16]].concat();
    // Q6_K: 256 values from low nibbles, high bit pairs, 16 scales and d.
    let q6_k = |fill: u8| [&[fill; 128][..], &[fill; 64], &[1; 16], &f16(1.0)].concat();
    let cases = [
        (GgmlType::Q4_1, q4_1, BLOCK, 15.0f32),
        (GgmlType::Q8_0, q8_0(0x80), BLOCK, -128.0),
        (GgmlType::Q8_0, q8_0(127), BLOCK, 127.0),
        (GgmlType::Q5_0, q5_0(0, 0), BLOCK, -16.0),
        (GgmlType::Q5_0, q5_0(u32::MAX, 0xff), BLOCK, 15.0),
        (GgmlType::Q6_K, q6_k(0), SUPER, -32.0),
        (GgmlType::Q6_K, q6_k(0xff), SUPER, 31.0),
    ];
    for (ty, block, values, value) in cases {
        let bytes: Vec<u8> = block.iter().copied().cycle().take(block.len() * n * k / values).collect();
        let narrow = QuantWeight::from_ggml(ty, &bytes, n, k).expect("blocks").into_lanes();
        for (w, (sign, bits)) in [narrow.clone(), narrow.into_lanes_of(16)].into_iter().flat_map(|w| {
            [1.0f32, -1.0].into_iter().flat_map(move |s| [(w.clone(), (s, ActBits::I8)), (w.clone(), (s, ActBits::I8Halves))])
        }) {
            let x = vec![sign; m * k];
            let mut acts = QuantActs::default();
            QuantActs::quantize(&x, m, k, bits, &mut acts);
            let want = value * sign * k as f32;
            for &kernel in &Kernel::available() {
                let mut y = vec![f32::NAN; m * n];
                // SAFETY: y is [m, n] and owned here; the kernel is available.
                unsafe { gemm_with(kernel, y.as_mut_ptr(), n, &acts, &w, 0..m, 0..n) };
                for got in &y {
                    assert!((got - want).abs() <= 1e-3 * want.abs(), "{kernel:?} {ty:?} {bits:?} {} lanes: {got} vs {want}", w.lanes);
                }
            }
        }
    }
}

/// The two-pass int8 form of int16 precision: what the rows hold adds up
/// to the input within half a code step of the remainder, and the lane
/// kernels' product of both rows lies within the int16 bound of the f64
/// product (every kind, rows with outliers).
#[test]
fn two_int8_passes_reach_int16_precision() {
    let mut s = SeededRng::new(37);
    let (m, n, k) = (5, 21, 512);
    let x: Vec<f32> = (0..m * k).map(|i| if i % 97 == 5 { 40.0 } else { rng(&mut s) }).collect();
    let mut acts = QuantActs::default();
    QuantActs::quantize_split_cached(&x, m, k, &mut acts);
    assert!(acts.split && acts.rows == 2 * m && acts.bits == ActBits::I8);
    let value = |row: usize, i: usize| {
        let rec = acts.record(row, i / PAIR);
        let (b, e) = (i % PAIR / BLOCK, i % BLOCK);
        acts.code(rec, pos(b, e)) as f32 * f32_at(rec, ActBits::I8.scales() + 4 * b)
    };
    for r in 0..m {
        for blk in 0..k / BLOCK {
            let xs = &x[r * k + blk * BLOCK..r * k + (blk + 1) * BLOCK];
            let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            for (e, &xv) in xs.iter().enumerate() {
                let i = blk * BLOCK + e;
                let err = (value(r, i) + value(m + r, i) - xv).abs();
                assert!(err <= amax / (4.0 * 127.0 * 127.0) * 1.01 + 1e-7, "row {r} value {i}: error {err} (amax {amax})");
            }
        }
    }
    // A cached call with the same input keeps the records; a plain int8
    // quantization of the same input is not taken for them.
    let before = acts.data.clone();
    QuantActs::quantize_split_cached(&x, m, k, &mut acts);
    assert_eq!(acts.data, before);
    QuantActs::quantize_cached(&x, m, k, ActBits::I8, &mut acts);
    assert!(!acts.split && acts.rows == m);
    QuantActs::quantize_split_cached(&x, m, k, &mut acts);
    assert_eq!(acts.data, before);

    let weights = [
        QuantWeight::quantize(&(0..n * k).map(|_| rng(&mut s) * 0.1).collect::<Vec<_>>(), n, k, QuantKind::Q4),
        QuantWeight::quantize(&(0..n * k).map(|_| rng(&mut s) * 0.1).collect::<Vec<_>>(), n, k, QuantKind::Q8),
        QuantWeight::from_ggml(GgmlType::Q4_K, &kquant_blocks(GgmlType::Q4_K, n, k, &mut s), n, k).expect("blocks"),
        QuantWeight::from_ggml(GgmlType::Q6_K, &kquant_blocks(GgmlType::Q6_K, n, k, &mut s), n, k).expect("blocks"),
    ];
    for w in weights.into_iter().flat_map(|pair| [pair.clone().into_lanes(), pair.into_lanes_of(16)]) {
        let mut both = vec![f32::NAN; 2 * m * n];
        // SAFETY: both is [2m, n] and owned here.
        unsafe { gemm(both.as_mut_ptr(), n, &acts, &w, 0..2 * m, 0..n) };
        let mut row = vec![0.0f32; k];
        for c in 0..n {
            w.dequantize_row(c, &mut row);
            for r in 0..m {
                let (mut exact, mut bound) = (0.0f64, 0.0f64);
                for blk in 0..k / BLOCK {
                    let xs = &x[r * k + blk * BLOCK..r * k + (blk + 1) * BLOCK];
                    let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                    for (e, &xv) in xs.iter().enumerate() {
                        let wv = row[blk * BLOCK + e] as f64;
                        exact += xv as f64 * wv;
                        bound += wv.abs() * amax / (2.0 * 32767.0);
                    }
                }
                let got = (both[r * n + c] + both[(m + r) * n + c]) as f64;
                let tol = bound * 1.05 + 1e-5 * (1.0 + exact.abs());
                assert!((got - exact).abs() <= tol, "{:?} {} lanes ({r},{c}): {got} vs {exact} (tol {tol})", w.kind, w.lanes);
            }
        }
    }
}

/// The AVX2 quantizer writes the same records, block sums and corrections
/// as the scalar one, bit for bit: rows with whole and partial pairs,
/// values at the code range's edges (±amax, halfway between codes), zero
/// blocks and a huge outlier, at both widths.
#[test]
fn simd_quantizer_matches_the_scalar_one_bit_for_bit_or_skip() {
    if !crate::runs_or_skips(has_simd(), "simd_quantizer_matches_the_scalar_one_bit_for_bit_or_skip", "AVX2") {
        return;
    }
    let mut s = SeededRng::new(5);
    for k in [64usize, 640, 576 + 20, 32, 7] {
        let mut x: Vec<f32> = (0..k).map(|_| rng(&mut s) * 3.0).collect();
        if k >= 64 {
            // Ties: 1.0 and halves of the code step of a block whose amax is 127.
            x[0] = 127.0;
            x[1] = 2.5;
            x[2] = -3.5;
            x[3] = 0.5;
            x[32..64].iter_mut().for_each(|v| *v = 0.0); // a zero block
        }
        if k >= 640 {
            x[200] = 1e30;
            x[201] = -1e-30;
        }
        for bits in [ActBits::I8, ActBits::I8Halves, ActBits::I16] {
            let pairs = k.div_ceil(PAIR);
            let (rec, nbp) = (bits.record(), padded_blocks(pairs));
            let ncorr = if bits.int8() { 8 * pairs } else { 0 };
            let (mut d1, mut s1, mut c1) = (vec![0u8; pairs * rec], vec![0f32; nbp], vec![0i32; ncorr]);
            let (mut d2, mut s2, mut c2) = (d1.clone(), s1.clone(), c1.clone());
            quantize_row(&x, bits, &mut d1, &mut s1, &mut c1);
            for j in 0..pairs {
                quantize_pair(&x, j, bits, &mut d2[j * rec..(j + 1) * rec], &mut s2, &mut c2);
            }
            assert_eq!(d1, d2, "codes and scales, k = {k}, {bits:?}");
            assert_eq!(
                s1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                s2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "sums, k = {k}"
            );
            assert_eq!(c1, c2, "corrections, k = {k}");
        }
    }
}

/// Groups of 16 outputs (the 512-bit tiles) give the bits of groups of 8
/// (the 256-bit tiles of AVX-512 VNNI, and of AVX-VNNI where the CPU has
/// it), for every kind (Q4, Q8, Q5_0, Q4_K, Q6_K): the same operations lane
/// for lane. Where the CPU lacks AVX-512 VNNI the test says it skipped.
#[test]
fn wide_groups_give_the_narrow_groups_bits_or_skip() {
    let kernels = Kernel::available();
    if !crate::runs_or_skips(kernels.contains(&Kernel::Avx512Vnni), "wide_groups_give_the_narrow_groups_bits_or_skip", "AVX-512 VNNI") {
        return;
    }
    let mut s = SeededRng::new(37);
    for &(m, n, k) in &[(1, 16, 256), (4, 24, 768), (7, 40, 512), (64, 33, 1024)] {
        let weights = [
            QuantWeight::quantize(&(0..n * k).map(|_| rng(&mut s) * 0.1).collect::<Vec<_>>(), n, k, QuantKind::Q4),
            QuantWeight::quantize(&(0..n * k).map(|_| rng(&mut s) * 0.1).collect::<Vec<_>>(), n, k, QuantKind::Q8),
            QuantWeight::from_ggml(GgmlType::Q5_0, &ggml_blocks(GgmlType::Q5_0, n, k, &mut s), n, k).expect("blocks"),
            QuantWeight::from_ggml(GgmlType::Q4_K, &kquant_blocks(GgmlType::Q4_K, n, k, &mut s), n, k).expect("blocks"),
            QuantWeight::from_ggml(GgmlType::Q6_K, &kquant_blocks(GgmlType::Q6_K, n, k, &mut s), n, k).expect("blocks"),
        ];
        for w in weights {
            let (kind, narrow, wide) = (w.kind, w.clone().into_lanes(), w.into_lanes_of(16));
            let x: Vec<f32> = (0..m * k).map(|_| rng(&mut s)).collect();
            for bits in [ActBits::I8, ActBits::I8Halves] {
                let mut acts = QuantActs::default();
                QuantActs::quantize(&x, m, k, bits, &mut acts);
                let run = |kernel, w: &QuantWeight| {
                    let mut y = vec![f32::NAN; m * n];
                    // SAFETY: y is [m, n] and owned here; the kernel is available.
                    unsafe {
                        gemm_with(kernel, y.as_mut_ptr(), n, &acts, w, 0..m, 0..5);
                        gemm_with(kernel, y.as_mut_ptr(), n, &acts, w, 0..m, 5..n);
                    }
                    y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                };
                let want = run(Kernel::Avx512Vnni, &narrow);
                assert_eq!(run(Kernel::Avx512Vnni, &wide), want, "{kind:?} {bits:?} ({m},{n},{k})");
                if kernels.contains(&Kernel::AvxVnni) {
                    assert_eq!(run(Kernel::AvxVnni, &narrow), want, "AVX-VNNI {kind:?} {bits:?} ({m},{n},{k})");
                }
            }
        }
    }
}

/// A weight larger than the caches (an LM head: the lane kernels walk it in
/// chunks of groups, each row tile sweeping a chunk) gives the products of
/// the pair layout's kernel: rows in tiles of 4 and 2, a last group cut
/// short at output 36,005, groups of 8 and 16, both int8 widths.
#[test]
fn lane_kernels_walk_a_large_weight_in_chunks() {
    let (m, n, k) = (6, 36_005, 256);
    let mut s = SeededRng::new(41);
    let pair = QuantWeight::quantize(&(0..n * k).map(|_| rng(&mut s) * 0.1).collect::<Vec<_>>(), n, k, QuantKind::Q8);
    let narrow = pair.clone().into_lanes();
    assert!(narrow.data.len() > 8 << 20, "the weight must pass the kernels' large-weight threshold");
    let x: Vec<f32> = (0..m * k).map(|i| if i % 89 == 3 { -30.0 } else { rng(&mut s) }).collect();
    let wide = narrow.clone().into_lanes_of(16);
    for bits in [ActBits::I8, ActBits::I8Halves] {
        let mut acts = QuantActs::default();
        QuantActs::quantize(&x, m, k, bits, &mut acts);
        // The reference on a sample of columns (the scalar kernel, pair layout).
        let cols: Vec<usize> = (0..n).step_by(997).chain([n - 1, n - 2, 8 * 16 - 1]).collect();
        for (kernel, lanes) in Kernel::available().into_iter().flat_map(|k| [(k, &narrow), (k, &wide)]) {
            if kernel == Kernel::Scalar && lanes.lanes == 16 {
                continue; // the scalar kernel reads both layouts alike; once is enough here
            }
            let mut y = vec![f32::NAN; m * n];
            // SAFETY: y is [m, n] and owned here; the kernel is available.
            unsafe { gemm_with(kernel, y.as_mut_ptr(), n, &acts, lanes, 0..m, 0..n) };
            assert!(y.iter().all(|v| v.is_finite()), "{kernel:?} {bits:?} {} lanes: a cell was not written", lanes.lanes);
            for r in 0..m {
                for &c in &cols {
                    let want = scalar_cell(&acts, &pair, r, c);
                    let got = y[r * n + c];
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{kernel:?} {bits:?} {} lanes ({r}, {c}): {got} vs {want}",
                        lanes.lanes
                    );
                }
            }
        }
    }
}

/// One- and two-row products on a Q5_0 weight's 5.5-bit copy
/// ([`super::q5::gemv`]) give the lane kernels' bits, at both int8 widths:
/// whole pairs, a partial last pair, a single block, outputs not a multiple
/// of 8 and column ranges that split a group; the copy holds every code.
#[test]
fn q5_lanes_give_the_lane_kernels_bits_or_skip() {
    if !crate::runs_or_skips(super::q5::available(), "q5_lanes_give_the_lane_kernels_bits_or_skip", "AVX2") {
        return;
    }
    let mut s = SeededRng::new(43);
    let simd: Vec<Kernel> = Kernel::available().into_iter().filter(|k| *k != Kernel::Scalar).collect();
    assert!(!simd.is_empty());
    for &(n, k) in &[(37, 640), (16, 96), (9, 32), (24, 2048)] {
        let bytes = ggml_blocks(GgmlType::Q5_0, n, k, &mut s);
        let lanes = QuantWeight::from_ggml(GgmlType::Q5_0, &bytes, n, k).expect("blocks").into_lanes();
        let q5 = super::q5::Q5Lanes::from_ggml(&bytes, n, k).expect("whole Q5_0 rows");
        for c in 0..n {
            for blk in 0..k / BLOCK {
                for e in 0..BLOCK {
                    assert_eq!(q5.code(c, blk, e), lanes.lane_code(c, blk, e), "code ({c}, {blk}, {e})");
                }
            }
        }
        for (m, bits) in [1, 2].into_iter().flat_map(|m| [(m, ActBits::I8), (m, ActBits::I8Halves)]) {
            let x: Vec<f32> = (0..m * k).map(|i| if i % 89 == 3 { -30.0 } else { rng(&mut s) }).collect();
            let mut acts = QuantActs::default();
            QuantActs::quantize(&x, m, k, bits, &mut acts);
            let mut got = vec![f32::NAN; m * n];
            let split = (n / 3).max(1);
            // SAFETY: got is [m, n] and owned here; the CPU runs AVX2, FMA, F16C.
            unsafe {
                super::q5::gemv(got.as_mut_ptr(), n, &acts, &q5, 0..m, 0..split);
                super::q5::gemv(got.as_mut_ptr(), n, &acts, &q5, 0..m, split..n);
            }
            for &kernel in &simd {
                let mut want = vec![f32::NAN; m * n];
                // SAFETY: want is [m, n] and owned here; the kernel is available.
                unsafe { gemm_with(kernel, want.as_mut_ptr(), n, &acts, &lanes, 0..m, 0..n) };
                let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits_of(&got), bits_of(&want), "{kernel:?} {bits:?} m={m} ({n},{k})");
            }
        }
    }
}
