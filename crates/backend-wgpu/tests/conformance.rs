//! Every WGSL kernel against the CPU backend (the reference): the shared
//! suite (`vellum-conformance`: every op, paged attention at every head
//! size, block size and KV type the backend declares, copies and swaps),
//! then what is particular to wgpu: weights and outputs split past the
//! storage-binding limit, embedding tables in chunks.
//!
//! These run on a real Vulkan device: in CI that is lavapipe, Mesa's CPU
//! driver (`apt-get install mesa-vulkan-drivers libvulkan1`). Without any
//! adapter they fail with that hint rather than skip. Tolerances: `linear`
//! 1e-4 relative (both sides compute in f32 on the same dequantized values),
//! `embed` exact; the suite's own are in its crate docs.

use std::sync::{Arc, OnceLock};
use vellum_backend_cpu::{CpuOps, HostTensor, WeightFormat};
use vellum_backend_wgpu::{GpuContext, WgpuOps};
use vellum_base::SeededRng as Rng;
use vellum_base::{AttentionBackend, ForwardBatch};
use vellum_conformance::{one_sequence_batch, random_weight};
use vellum_ops::quant::GgmlType;
use vellum_ops::Ops;

/// One device for the whole test binary (opening lavapipe costs ~0.1 s).
fn device() -> Arc<GpuContext> {
    static CTX: OnceLock<Arc<GpuContext>> = OnceLock::new();
    CTX.get_or_init(|| GpuContext::new().unwrap_or_else(|e| panic!("these tests need a wgpu adapter: {e}"))).clone()
}

fn gpu() -> WgpuOps {
    WgpuOps::with_context(device()).expect("ops on the device")
}

fn cpu() -> CpuOps {
    CpuOps::new(WeightFormat::F32)
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}: element {i}: wgpu {g}, cpu {w} (tolerance {tol})");
    }
}

fn host(rows: usize, cols: usize, data: Vec<f32>) -> HostTensor {
    HostTensor { rows, cols, data }
}

/// `linear` on both backends, for a weight format, a shape and a binding
/// limit (small limits split the weight and the rows).
fn check_linear(ty: GgmlType, m: usize, n: usize, k: usize, seed: u64, limit: Option<u64>) {
    let mut rng = Rng::new(seed);
    let w = random_weight(ty, n, k, &mut rng);
    let x = rng.signed_vec(m * k);
    let bias = rng.signed_vec(n);
    let (c, mut g) = (cpu(), gpu());
    if let Some(l) = limit {
        g = g.with_binding_limit(l);
    }
    let want = c.linear(&host(m, k, x.clone()), &c.linear_weight(w.clone()).unwrap(), Some(&bias)).unwrap().into_data();
    let gw = g.linear_weight(w).unwrap();
    let gb = g.vector("bias", &bias).unwrap();
    let gx = g.upload(m, k, &x).unwrap();
    let got = g.to_host(&g.linear(&gx, &gw, Some(&gb)).unwrap()).unwrap();
    assert_close(&got, &want, 1e-4, &format!("linear {ty:?} [{m}x{k}]·[{n}x{k}]ᵀ limit {limit:?}"));
}

#[test]
fn linear_splits_weights_and_rows_past_the_binding_limit() {
    // 4 KiB bindings: a [300, 64] Q8_0 weight (21.6 KB) becomes 6 chunks,
    // and 40 output rows of 300 floats (48 KB) run in row ranges.
    check_linear(GgmlType::Q8_0, 40, 300, 64, 7, Some(4096));
    check_linear(GgmlType::F32, 17, 130, 96, 8, Some(4096));
}

#[test]
fn embed_gathers_rows_of_every_format_and_chunk() {
    let mut rng = Rng::new(3);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q4_1, GgmlType::Q8_0] {
        for limit in [None, Some(8192)] {
            let (vocab, hidden) = (300, 64);
            let w = random_weight(ty, vocab, hidden, &mut rng);
            let ids: Vec<u32> = (0..20).map(|_| rng.below(vocab) as u32).chain([0, vocab as u32 - 1]).collect();
            let batch = ForwardBatch { token_ids: ids.clone(), ..one_sequence_batch(ids.len()) };
            let c = cpu();
            let want = c.embed(&c.embedding_weight(w.clone()).unwrap(), &c.prepare_step(&batch, 4).unwrap()).unwrap().into_data();
            let mut g = gpu();
            if let Some(l) = limit {
                g = g.with_binding_limit(l);
            }
            let table = g.embedding_weight(w).unwrap();
            if limit.is_some() {
                assert!(table.chunks.len() > 1, "{ty:?}: the table was not split");
            }
            let got = g.to_host(&g.embed(&table, &g.prepare_step(&batch, 4).unwrap()).unwrap()).unwrap();
            assert_close(&got, &want, 0.0, &format!("embed {ty:?} limit {limit:?}"));
            let bad = ForwardBatch { token_ids: vec![vocab as u32; ids.len()], ..batch };
            assert!(g.embed(&table, &g.prepare_step(&bad, 4).unwrap()).is_err(), "a token id past the vocabulary is an error");
        }
    }
}

/// The shared suite, on this device.
#[test]
fn the_conformance_suite_passes() {
    vellum_conformance::Suite::new("wgpu").run(&gpu());
}
