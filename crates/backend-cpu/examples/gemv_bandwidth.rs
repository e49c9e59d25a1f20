//! Wall-clock read bandwidth of one-row linears on the shapes where decode
//! is bandwidth-bound (Gemma 3's 262,144 × 640 tied LM head, SmolLM2's
//! 49,152 × 576, which a large L3 may hold), to compare with
//! `benchmarks/membw.c`:
//! `cargo run --release -p vellum-backend-cpu --example gemv_bandwidth`.

use std::time::Instant;
use vellum_backend_cpu::{ActBits, CpuOps, HostTensor, WeightFormat};
use vellum_models::gguf::GgmlType;
use vellum_models::ops::Ops;
use vellum_models::WeightView;

/// A Q8_0 weight `[n, k]` as a GGUF stores it (34-byte blocks of 32).
fn q8_weight(n: usize, k: usize) -> WeightView<'static> {
    let mut bytes = Vec::with_capacity(n * k / 32 * 34);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..n * k / 32 {
        bytes.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        for _ in 0..32 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            bytes.push(state as u8);
        }
    }
    WeightView::new("w", vec![n, k], GgmlType::Q8_0, bytes.into()).expect("whole blocks")
}

fn main() {
    for (n, k, name) in [(262_144, 640, "gemma lm_head"), (49_152, 576, "smollm2 lm_head")] {
        let ops = CpuOps::new(WeightFormat::Auto).with_activations(ActBits::I8);
        let w = ops.linear_weight(q8_weight(n, k)).expect("weight");
        let x = HostTensor { rows: 1, cols: k, data: (0..k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect() };
        let _ = ops.linear(&x, &w, None).expect("shapes match");
        let reps = 40;
        let t0 = Instant::now();
        for _ in 0..reps {
            let _ = std::hint::black_box(ops.linear(&x, &w, None));
        }
        let dt = t0.elapsed().as_secs_f64() / reps as f64;
        let bytes = w.memory_bytes() as f64;
        println!("{name} [{n}x{k}] q8·i8: {:.2} ms, {:.1} MB read, {:.1} GB/s", dt * 1e3, bytes / 1e6, bytes / dt / 1e9);
    }
}
