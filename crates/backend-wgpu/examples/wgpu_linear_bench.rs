//! Times `WgpuOps::linear` on the default model's shapes for each weight
//! format (device time, one command buffer per repetition):
//! `cargo run --release -p vellum-backend-wgpu --example wgpu_linear_bench`.
//! `MS=1,16` picks the batch sizes.

use std::time::Instant;
use vellum_backend_wgpu::WgpuOps;
use vellum_models::gguf::GgmlType;
use vellum_models::ops::Ops;
use vellum_models::WeightView;

fn weight(ty: GgmlType, n: usize, k: usize) -> WeightView<'static> {
    let mut rng = vellum_base::SeededRng::new(1);
    let mut next = || (rng.next_u64() >> 33) as u8;
    let block = match ty {
        GgmlType::Q4_1 => 20,
        GgmlType::Q8_0 => 34,
        _ => 0,
    };
    if block == 0 {
        let vals: Vec<f32> = (0..n * k).map(|_| f32::from(next()) / 255.0 - 0.5).collect();
        return WeightView::from_f32("w", vec![n, k], &vals);
    }
    let mut bytes = Vec::with_capacity(n * k / 32 * block);
    for _ in 0..n * k / 32 {
        bytes.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        bytes.extend((0..block - 2).map(|_| next() & 0x7f));
    }
    WeightView::new("w", vec![n, k], ty, bytes.into()).expect("whole blocks")
}

fn main() {
    let ops = WgpuOps::new().expect("a wgpu adapter");
    let ms: Vec<usize> =
        std::env::var("MS").ok().map(|s| s.split(',').filter_map(|v| v.parse().ok()).collect()).unwrap_or(vec![1, 16, 128]);
    let shapes = [(576, 576, "q/o"), (1536, 576, "gate/up"), (576, 1536, "down"), (49152, 576, "lm_head")];
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F32] {
        for &m in &ms {
            let mut line = format!("{ty:?} m={m:4}");
            for &(n, k, name) in &shapes {
                let w = ops.linear_weight(weight(ty, n, k)).expect("uploads");
                let x = ops.upload(m, k, &vec![0.5; m * k]).expect("uploads");
                let _ = ops.to_host(&ops.linear(&x, &w, None).expect("runs")).expect("reads");
                let reps = ((2e8 / (m * n * k) as f64).ceil() as usize).clamp(1, 50);
                let t0 = Instant::now();
                for _ in 0..reps {
                    let y = ops.linear(&x, &w, None).expect("runs");
                    drop(y);
                }
                ops.synchronize().expect("runs");
                let dt = t0.elapsed().as_secs_f64() / reps as f64;
                line += &format!("  {name}: {:7.2} ms {:5.2} GMAC/s", dt * 1e3, (m * n * k) as f64 / dt * 1e-9);
            }
            println!("{line}");
        }
    }
}
