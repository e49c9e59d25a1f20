//! Sampling on the device, on a GPU: `sample_rows` (`kernels/cuda/sampling.cu`
//! through `CudaOps::sample_rows`) against the host's reference of the same
//! contract (`vellum_engine::sampler::sample_row`). It lives here, beside
//! both crates, because the reference is the engine's and the engine builds
//! on the CUDA backend. Staged for a GPU machine by
//! `kernels/cuda/gpu_suite.sh stage` (the `sampling` step of `.gpu/run.sh`).
//!
//! Without a GPU the test says SKIPPED by name and passes, unless
//! `VELLUM_REQUIRE_GPU` is set; without the `cuda` feature it is not built.

#![cfg(feature = "cuda")]

/// Sampling on the device (`sampling.cu` through `CudaOps::sample_rows`)
/// against the host's reference of the same contract
/// (`vellum::engine::sampler::sample_row`, the host sampler's draw for the
/// same uniform number): greedy, plain draws, top-k, top-p, min-p, their
/// mix, penalties with logit bias, logprobs, on peaked and flat rows of a
/// small vocabulary and of Gemma 3's (262,144). Sums run in another order
/// on the device, so a draw within ~1e-15 of a boundary could differ: the
/// test allows one such row in the 262,144-wide batch and prints the time
/// 256 rows of that width take (the sampled decode step's extra cost).
#[test]
fn sampling_on_the_device_draws_the_host_samplers_tokens() {
    use vellum::core::{DeviceSample, PenaltyEntry, RowSampling};
    use vellum::ops::Ops;
    let test = "sampling_on_the_device_draws_the_host_samplers_tokens";
    let ops = match vellum::backend_cuda::CudaOps::new(0) {
        Ok(ops) => ops,
        Err(e) => {
            assert!(std::env::var_os("VELLUM_REQUIRE_GPU").is_none(), "VELLUM_REQUIRE_GPU is set but: {e}");
            eprintln!("SKIPPED {test}: {e}");
            return;
        }
    };
    let base = RowSampling {
        temperature: 0.8,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        uniform: 0.0,
        num_logprobs: 0,
        logprob: false,
        penalties: (0, 0),
    };
    let kinds = [
        RowSampling { temperature: 0.0, ..base },
        base,
        RowSampling { top_k: 5, ..base },
        RowSampling { top_k: 50, temperature: 1.3, ..base },
        RowSampling { top_p: 0.9, ..base },
        RowSampling { top_p: 0.95, logprob: true, num_logprobs: 5, ..base },
        RowSampling { min_p: 0.05, temperature: 1.0, ..base },
        RowSampling { top_k: 40, top_p: 0.9, min_p: 0.02, ..base },
        RowSampling { penalties: (0, 3), top_p: 0.9, ..base },
        RowSampling { penalties: (0, 3), temperature: 0.0, logprob: true, ..base },
    ];
    let pens = [
        PenaltyEntry { token: 3, repetition: 1.3, subtract: 0.7, bias: 0.0 },
        PenaltyEntry { token: 5, repetition: 1.0, subtract: 0.0, bias: 2.5 },
        PenaltyEntry { token: 8, repetition: 1.3, subtract: 0.0, bias: -100.0 },
    ];
    let mut rng = vellum::core::SeededRng::new(42);
    // Rows of `vocab` logits, peaked (even rows) and flat (odd), each row's
    // parameters from `kind(r)` with a uniform number of its own.
    let mut batch = |rows: usize, vocab: usize, kind: &dyn Fn(usize) -> RowSampling| {
        let mut logits = Vec::with_capacity(rows * vocab);
        let mut sampling = Vec::with_capacity(rows);
        for r in 0..rows {
            let flat = r % 2 == 1;
            for i in 0..vocab {
                let x = rng.signed_f32();
                logits.push(if flat { x * 0.5 } else { x * 4.0 + if i % 97 == 3 { 6.0 } else { 0.0 } });
            }
            sampling.push(RowSampling { uniform: rng.uniform(), ..kind(r) });
        }
        (logits, sampling)
    };
    for (vocab, rows) in [(1000usize, 200usize), (262_144, 256)] {
        let (logits, sampling) = batch(rows, vocab, &|r| kinds[r % kinds.len()]);
        // Rows with penalties are overwritten with their scores: each call
        // gets the logits afresh.
        let x = ops.upload(rows, vocab, &logits).expect("upload");
        let got = ops.sample_rows(&x, &sampling, &pens).expect("sample").expect("sampled on the device");
        let x = ops.upload(rows, vocab, &logits).expect("upload");
        let started = std::time::Instant::now();
        let again = ops.sample_rows(&x, &sampling, &pens).expect("sample").expect("sampled on the device");
        let ms = started.elapsed().as_secs_f64() * 1e3;
        // Bit for bit (a logprob nobody asked for is NaN, which `==` never
        // matches).
        let bits = |v: &[DeviceSample]| -> Vec<String> {
            v.iter()
                .map(|d| {
                    format!(
                        "{} {:08x} {:?}",
                        d.token,
                        d.logprob.to_bits(),
                        d.top_logprobs.iter().map(|&(t, l)| (t, l.to_bits())).collect::<Vec<_>>()
                    )
                })
                .collect()
        };
        assert_eq!(bits(&got), bits(&again), "the same draws give the same tokens");
        // A NaN in one row: the step goes back to the host, with every
        // row's logits as they came (the penalized ones put back).
        let mut with_nan = logits.clone();
        with_nan[3 * vocab + 7] = f32::NAN;
        let x = ops.upload(rows, vocab, &with_nan).expect("upload");
        assert!(ops.sample_rows(&x, &sampling, &pens).expect("sample").is_none(), "a NaN leaves the step to the host");
        let back = ops.to_host(&x).expect("download");
        assert!(back.iter().zip(&with_nan).all(|(a, b)| a.to_bits() == b.to_bits()), "the logits come back untouched");
        let mut differ = 0;
        for (r, (g, s)) in got.iter().zip(&sampling).enumerate() {
            let entries = &pens[s.penalties.0 as usize..s.penalties.1 as usize];
            let want = vellum::engine::sampler::sample_row(&logits[r * vocab..(r + 1) * vocab], s, entries);
            if g.token != want.token {
                eprintln!("row {r} ({s:?}): device {} host {}", g.token, want.token);
                differ += 1;
                continue;
            }
            assert_eq!(g.logprob.is_nan(), want.logprob.is_nan());
            if s.logprob {
                assert!((g.logprob - want.logprob).abs() < 1e-4, "row {r}: logprob {} against {}", g.logprob, want.logprob);
            }
            assert_eq!(g.top_logprobs.len(), want.top_logprobs.len());
            for (a, b) in g.top_logprobs.iter().zip(&want.top_logprobs) {
                assert!(a.0 == b.0 && (a.1 - b.1).abs() < 1e-4, "row {r}: top {a:?} against {b:?}");
            }
        }
        eprintln!("{rows} rows of {vocab}: {differ} draws differ; sampling took {ms:.3} ms");
        assert!(differ <= usize::from(vocab > 1000), "{differ} of {rows} draws differ from the host's");
    }

    // The step-overhead issue's sampled row: 256 rows of Gemma 3's
    // vocabulary at temperature 0.8 and top-p 0.95, drawn from the score
    // bins (two passes over a row after the first) and by the radix
    // descents alone (a pass a digit), against greedy (the first pass
    // alone): the same tokens both ways, and the time of each (the best of
    // three calls; 268 MB of logits a call).
    let (vocab, rows) = (262_144usize, 256usize);
    let (logits, top_p) = batch(rows, vocab, &|_| RowSampling { top_p: 0.95, ..base });
    let greedy: Vec<RowSampling> = top_p.iter().map(|s| RowSampling { temperature: 0.0, ..*s }).collect();
    // Greedy with 20 top logprobs (what an evaluation asks): listed from the
    // bins (two passes, one shared with the log-sum) and a pass each.
    let listing: Vec<RowSampling> = greedy.iter().map(|s| RowSampling { num_logprobs: 20, logprob: true, ..*s }).collect();
    let x = ops.upload(rows, vocab, &logits).expect("upload");
    let kernels = ops.kernels();
    let was = kernels.sample_binned();
    // The best of three calls (ms) with the bins on or off, and the draws.
    let time = |rows: &[RowSampling], binned: bool| {
        kernels.set_sample_binned(binned);
        let mut best = f64::INFINITY;
        let mut got = Vec::new();
        for _ in 0..3 {
            let started = std::time::Instant::now();
            got = ops.sample_rows(&x, rows, &[]).expect("sample").expect("sampled on the device");
            best = best.min(started.elapsed().as_secs_f64() * 1e3);
        }
        (best, got)
    };
    let tokens = |got: &[DeviceSample]| got.iter().map(|d| d.token).collect::<Vec<_>>();
    let tops = |got: &[DeviceSample]| {
        got.iter().map(|d| d.top_logprobs.iter().map(|&(t, l)| (t, l.to_bits())).collect::<Vec<_>>()).collect::<Vec<_>>()
    };
    let (greedy_ms, _) = time(&greedy, true);
    let (binned_ms, binned) = time(&top_p, true);
    let (descents_ms, descents) = time(&top_p, false);
    let (listed_ms, listed) = time(&listing, true);
    let (passes_ms, passes) = time(&listing, false);
    kernels.set_sample_binned(was);
    let (binned, descents, listed, passes) = (tokens(&binned), tokens(&descents), tops(&listed), tops(&passes));
    assert_eq!(listed, passes, "the bins and the passes list the same top logprobs, bit for bit");
    assert!(listed.iter().all(|t| t.len() == 20), "20 top logprobs a row");
    assert_eq!(binned, descents, "the bins and the descents draw the same tokens");
    let differ = (0..rows)
        .filter(|&r| binned[r] != vellum::engine::sampler::sample_row(&logits[r * vocab..(r + 1) * vocab], &top_p[r], &[]).token)
        .count();
    assert!(differ <= 1, "{differ} of {rows} top-p draws differ from the host's");
    let gb = (rows * vocab * 4) as f64 / 1e9;
    eprintln!(
        "{rows} rows of {vocab}, temperature 0.8, top-p 0.95: binned {binned_ms:.3} ms, descents {descents_ms:.3} ms, greedy {greedy_ms:.3} ms \
         ({:.0} / {:.0} / {:.0} GB/s of logits a call); greedy with 20 top logprobs: binned {listed_ms:.3} ms, a pass each {passes_ms:.3} ms",
        gb / binned_ms * 1e3,
        gb / descents_ms * 1e3,
        gb / greedy_ms * 1e3
    );
}
