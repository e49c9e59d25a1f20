//! Times `CpuOps::linear` per weight format on the default model's shapes,
//! in process CPU time (robust to a loaded machine; run with
//! `RAYON_NUM_THREADS=1` for per-core numbers):
//! `cargo run --release -p vellum-backend-cpu --example linear_bench`
//! (`MS=1,64` picks the batch sizes, `VELLUM_CPU_KERNEL` the instruction
//! set). Columns: f32, then Q4 (the file's Q4_1 blocks) and Q8 blocks, each
//! with int16 and int8 activations (`QUANTIZE=1`: the activations'
//! quantization alone). `KQUANTS=1` times Gemma 3's Q4_K, Q6_K, Q5_0 and
//! Q8_0 (LM head) matrices instead (f32, then the integer kernel at int16,
//! int8 with a scale per 16 and int8).

use vellum_backend_cpu::{ActBits, CpuOps, HostTensor, WeightFormat};
use vellum_models::gguf::GgmlType;
use vellum_models::ops::Ops;
use vellum_models::WeightView;

fn cpu_time() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// A Q4_1 weight `[n, k]` as a GGUF stores it (20-byte blocks of 32).
fn q4_weight(n: usize, k: usize, rng: &mut vellum_base::SeededRng) -> WeightView<'static> {
    let mut next = || (rng.next_u64() >> 33) as u32;
    let mut bytes = Vec::with_capacity(n * k / 32 * 20);
    for _ in 0..n * k / 32 {
        bytes.extend_from_slice(&half::f16::from_f32((next() % 1000) as f32 * 1e-5 + 1e-3).to_le_bytes());
        bytes.extend_from_slice(&half::f16::from_f32((next() % 1000) as f32 * -1e-4).to_le_bytes());
        for j in 0..16u32 {
            // Every block spans the full 0..=15 range, as llama.cpp's quantizer makes it.
            let lo = if j == 0 { 0 } else { next() % 16 };
            let hi = if j == 1 { 15 } else { next() % 16 };
            bytes.push((lo | (hi << 4)) as u8);
        }
    }
    WeightView::new("w", vec![n, k], GgmlType::Q4_1, bytes.into()).expect("whole blocks")
}

/// A K-quant weight (`Q4_K` or `Q6_K`) or a `Q5_0` one `[n, k]`: random
/// blocks with small f16 scales.
fn kquant_weight(ty: GgmlType, n: usize, k: usize, rng: &mut vellum_base::SeededRng) -> WeightView<'static> {
    let (values, bytes_per, halves): (usize, usize, &[usize]) = match ty {
        GgmlType::Q4_K => (256, 144, &[0, 2]),
        GgmlType::Q6_K => (256, 210, &[208]),
        GgmlType::Q8_0 => (32, 34, &[0]),
        _ => (32, 22, &[0]),
    };
    let mut bytes: Vec<u8> = (0..n * k / values * bytes_per).map(|_| (rng.next_u64() >> 56) as u8).collect();
    for b in bytes.chunks_exact_mut(bytes_per) {
        for &at in halves {
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(1e-3).to_le_bytes());
        }
    }
    WeightView::new("w", vec![n, k], ty, bytes.into()).expect("whole super-blocks")
}

/// Gemma 3 270M's K-quant matrices (`attn_output` Q4_K, `ffn_down` Q4_K
/// or Q6_K) through the integer kernel, int16 and int8 activations.
fn kquants(ms: &[usize], seed: &mut vellum_base::SeededRng) {
    for &m in ms {
        for (ty, n, k, name) in [
            (GgmlType::Q4_K, 640, 1024, "o Q4_K"),
            (GgmlType::Q4_K, 640, 2048, "down Q4_K"),
            (GgmlType::Q6_K, 640, 2048, "down Q6_K"),
            (GgmlType::Q5_0, 2048, 640, "up Q5_0"),
            (GgmlType::Q5_0, 1024, 640, "q Q5_0"),
            (GgmlType::Q8_0, 2048, 640, "up Q8_0"),
            (GgmlType::Q5_0, 262144, 640, "head Q5_0"),
            (GgmlType::Q8_0, 262144, 640, "head Q8_0"),
        ] {
            let w = kquant_weight(ty, n, k, seed);
            let x = HostTensor { rows: m, cols: k, data: (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect() };
            let mut line = format!("m={m:4} {name:10} [{n}x{k}]");
            for (label, f, bits) in [
                ("f32", WeightFormat::F32, ActBits::I8),
                ("i16", WeightFormat::Auto, ActBits::I16),
                ("i8/16", WeightFormat::Auto, ActBits::I8Halves),
                ("i8", WeightFormat::Auto, ActBits::I8),
            ] {
                if n == 262144 && (f == WeightFormat::F32 || m > 64) {
                    continue;
                }
                let ops = CpuOps::new(f).with_activations(bits);
                let wt = ops.linear_weight(w.clone()).expect("weight");
                let _ = ops.linear(&x, &wt, None).expect("shapes match");
                let reps = ((2e8 / (m * n * k) as f64).ceil() as usize).clamp(1, 2000);
                let t0 = cpu_time();
                for _ in 0..reps {
                    let _ = std::hint::black_box(ops.linear(&x, &wt, None));
                }
                let dt = (cpu_time() - t0) / reps as f64;
                line += &format!("  {label}: {:7.1} us {:5.1} GMAC/s", dt * 1e6, (m * n * k) as f64 / dt * 1e-9);
            }
            println!("{line}");
        }
    }
}

/// `QUANTIZE=1`: activation quantization alone, per row width and width
/// of code, in ns per value (one core: the rows stay below the parallel
/// threshold only at m = 1; run with `RAYON_NUM_THREADS=1`).
fn quantize_bench() {
    use vellum_backend_cpu::quant::QuantActs;
    for (m, k) in [(1, 640), (64, 640), (64, 2048), (64, 576)] {
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut line = format!("quantize m={m:3} k={k:5}");
        for (label, bits) in [("i8", ActBits::I8), ("i16", ActBits::I16)] {
            let mut q = QuantActs::default();
            QuantActs::quantize(&x, m, k, bits, &mut q);
            let reps = (2e7 / (m * k) as f64).ceil() as usize;
            let t0 = cpu_time();
            for _ in 0..reps {
                QuantActs::quantize(std::hint::black_box(&x), m, k, bits, &mut q);
            }
            let dt = (cpu_time() - t0) / reps as f64;
            line += &format!("  {label}: {:6.2} ns/value", dt * 1e9 / (m * k) as f64);
        }
        println!("{line}");
    }
}

fn main() {
    let mut seed = vellum_base::SeededRng::new(1);
    if std::env::var("QUANTIZE").is_ok_and(|v| v == "1") {
        return quantize_bench();
    }
    if std::env::var("KQUANTS").is_ok_and(|v| v == "1") {
        let ms: Vec<usize> =
            std::env::var("MS").ok().map(|s| s.split(",").filter_map(|v| v.parse().ok()).collect()).unwrap_or(vec![1, 64, 512]);
        return kquants(&ms, &mut seed);
    }
    let shapes = [(576, 576, "q/o"), (192, 576, "k/v"), (1536, 576, "gate/up"), (576, 1536, "down"), (49152, 576, "lm_head")];
    let formats = [
        ("f32", WeightFormat::F32, ActBits::I8),
        ("q4·i16", WeightFormat::Auto, ActBits::I16),
        ("q4·i8", WeightFormat::Auto, ActBits::I8),
        ("q8·i16", WeightFormat::Q8, ActBits::I16),
        ("q8·i8", WeightFormat::Q8, ActBits::I8),
    ];
    let ms: Vec<usize> =
        std::env::var("MS").ok().map(|s| s.split(",").filter_map(|v| v.parse().ok()).collect()).unwrap_or(vec![1, 64, 512]);
    for &m in &ms {
        for &(n, k, name) in &shapes {
            if n == 49152 && m == 512 {
                continue;
            }
            let w = q4_weight(n, k, &mut seed);
            let x = HostTensor { rows: m, cols: k, data: (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect() };
            let mut line = format!("m={m:4} {name:8} [{n}x{k}]");
            for (label, f, bits) in formats {
                let ops = CpuOps::new(f).with_activations(bits);
                let wt = ops.linear_weight(w.clone()).expect("weight");
                assert_eq!(wt.quant_kind().is_some(), f != WeightFormat::F32, "{f:?} resolved to {:?}", wt.quant_kind());
                let _ = ops.linear(&x, &wt, None).expect("shapes match");
                let reps = ((2e8 / (m * n * k) as f64).ceil() as usize).clamp(1, 2000);
                let t0 = cpu_time();
                for _ in 0..reps {
                    let _ = std::hint::black_box(ops.linear(&x, &wt, None));
                }
                let dt = (cpu_time() - t0) / reps as f64;
                line += &format!("  {label}: {:7.1} us {:5.1} GMAC/s", dt * 1e6, (m * n * k) as f64 / dt * 1e-9);
            }
            println!("{line}");
        }
    }
}
