//! The linear layer's paths on a GPU, by batch rows, at the shapes of
//! Llama 3 8B (the tensor-core issue's benchmark model): which path is
//! fastest where, and how far each is from the device's limits.
//!
//! For a weight `[n, k]` in Q8_0 (and one in Q4_1), `rows` activation rows:
//! - `gemv`: the f32 GEMV of `gemv_q.cu` (1..8 rows);
//! - `mma`: `cast_to_16` of the rows to bf16, then the tensor-core GEMM of
//!   `gemm_mma.cu`, which dequantizes as it stages;
//! - `dequant+cublas`: the cast, `dequantize_bf16` of the whole weight into
//!   a scratch, then cuBLAS's bf16 GEMM;
//! - `cublas-bf16`: cuBLAS on weights already in bf16 (a bf16 model's path,
//!   and the ceiling for a GEMM library);
//! - `cores`: the f32 CUDA-core GEMM (the float32 path).
//!
//! Weights rotate among copies that together exceed the L2 cache, so each
//! call reads its weight from device memory. Each row of stdout is JSON;
//! the table (stderr, and again at the end of stdout) gives milliseconds,
//! TFLOP/s and the weight's GB/s.
//!
//! ```text
//! cargo build --release -p vellum-backend-cuda --example gemm_bench
//! gemm_bench [--quick] > gemm.jsonl
//! gemm_bench --gemv-plans 1:1:0,2:2:1 > gemv.jsonl
//! gemm_bench --staged > staged.jsonl
//! ```
//!
//! `--gemv-plans` measures only the GEMV, at 1, 2, 4 and 8 rows, once per
//! plan (`columns_per_warp:k_split:magic`, `gemv_q.cu`'s knobs), and the
//! tensor-core GEMM beside it from 2 rows (the default path's choice past
//! `GEMV_MAX_ROWS`), adding
//! the shapes where it matters most: the 1024-column k/v projections and
//! the 128,256-column LM head.
//!
//! `--staged` measures the tensor-core GEMM at decode batches (3 to 128
//! rows): `gemm_mma_staged_*` with three and four stages (`staged-3`,
//! `staged-4`; the default is four below tile height 128, three at it) and
//! `gemm_mma_*` (`mma-registers`, one step in flight), beside
//! cuBLAS on a bf16 copy of the weight (`cublas-bf16`, the path of a
//! weight with a kept copy); its table gives each path's milliseconds and
//! the weight's GB/s as the file stores it.
//!
//! Without a GPU it says so and exits with status 2.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use vellum_backend_cuda::blas::{Blas, Half};
use vellum_backend_cuda::launch::{GemvPlan, Kernels, QuantMatrix};
use vellum_backend_cuda::layout::{repack, QuantFormat};
use vellum_ops::quant::GgmlType;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// xorshift64*.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Random GGUF blocks of `dtype` for `[n, k]`, the first f16 of a block
/// (Q8_0's and Q4_1's scale, Q4_K's d) small; Q4_1's min set too. The
/// K-quants' other fields stay random bytes: a benchmark's values need not
/// be finite.
fn blocks(rng: &mut Rng, dtype: GgmlType, n: usize, k: usize) -> Vec<u8> {
    let (bk, bb) = dtype.block_layout();
    let mut out = vec![0u8; n * k / bk * bb];
    for chunk in out.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    for (i, b) in out.chunks_exact_mut(bb).enumerate() {
        b[..2].copy_from_slice(&half::f16::from_f32(0.001 + (i % 89) as f32 * 1e-5).to_le_bytes());
        if dtype == GgmlType::Q4_1 {
            b[2..4].copy_from_slice(&half::f16::from_f32(-0.008).to_le_bytes());
        }
    }
    out
}

/// Milliseconds per call of `f` over `iters` calls after one warm-up,
/// with `iters` picked so that a measurement takes about 40 ms.
fn time_ms(k: &Kernels, mut f: impl FnMut(usize) -> Res<()>) -> Res<f64> {
    f(0)?;
    let once = {
        let s = k.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f(1)?;
        let e = k.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        s.elapsed_ms(&e)? as f64
    };
    let iters = ((40.0 / once.max(1e-3)) as usize).clamp(3, 200);
    let start = k.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for i in 0..iters {
        f(i + 2)?;
    }
    let end = k.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok(start.elapsed_ms(&end)? as f64 / iters as f64)
}

struct Row {
    path: String,
    weight: String,
    rows: usize,
    ms: f64,
    tflops: f64,
    gbs: f64,
}

fn main() {
    match run() {
        Ok(()) => {}
        Err(e) => {
            eprintln!("gemm_bench: {e}");
            std::process::exit(2);
        }
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let plans: Option<Vec<(String, GemvPlan)>> = match args.iter().position(|a| a == "--gemv-plans") {
        Some(i) => {
            let list = args.get(i + 1).ok_or("--gemv-plans takes a list, as 1:1:0,2:2:1")?;
            Some(list.split(',').map(|p| Ok((format!("gemv {p}"), GemvPlan::parse(p)?))).collect::<Res<_>>()?)
        }
        None => None,
    };
    let staged = args.iter().any(|a| a == "--staged");
    let k = Kernels::open(0)?;
    let blas = Blas::new(k.stream().clone())?;
    eprintln!("{} ({} SMs)", k.info().name, k.info().num_sms);
    let shapes: &[(GgmlType, usize, usize)] = if staged {
        &[
            (GgmlType::Q8_0, 6144, 4096),
            (GgmlType::Q8_0, 4096, 4096),
            (GgmlType::Q8_0, 28672, 4096),
            (GgmlType::Q8_0, 4096, 14336),
            (GgmlType::Q4_1, 14336, 4096),
            (GgmlType::Q4_K, 14336, 4096),
            (GgmlType::Q6_K, 4096, 14336),
        ]
    } else if plans.is_some() {
        &[
            (GgmlType::Q8_0, 1024, 4096),
            (GgmlType::Q8_0, 4096, 4096),
            (GgmlType::Q8_0, 14336, 4096),
            (GgmlType::Q8_0, 4096, 14336),
            (GgmlType::Q8_0, 128256, 4096),
            (GgmlType::Q4_1, 14336, 4096),
        ]
    } else if quick {
        &[(GgmlType::Q8_0, 4096, 4096)]
    } else {
        &[(GgmlType::Q8_0, 4096, 4096), (GgmlType::Q8_0, 14336, 4096), (GgmlType::Q8_0, 4096, 14336), (GgmlType::Q4_1, 14336, 4096)]
    };
    let all_rows: &[usize] = if staged {
        &[3, 8, 16, 32, 64, 96, 128]
    } else if plans.is_some() {
        &[1, 2, 4, 8]
    } else if quick {
        &[1, 8, 64, 256, 1024]
    } else {
        &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    };
    let mut rng = Rng(0x5eed);
    let mut table = Vec::new();
    for &(dtype, n, kk) in shapes {
        let bytes_per_weight = dtype.block_layout().1 as f64 / dtype.block_layout().0 as f64;
        let weight_bytes = n as f64 * kk as f64 * bytes_per_weight;
        // Enough copies to exceed the L2 cache (50-60 MB) together.
        let copies = ((200e6 / weight_bytes).ceil() as usize).clamp(1, 64);
        let mut ws = Vec::new();
        let mut w16s = Vec::new();
        for _ in 0..copies {
            let r = repack(dtype, &blocks(&mut rng, dtype, n, kk), n, kk)?;
            let m = QuantMatrix {
                codes: k.stream().clone_htod(&r.codes)?,
                scales: k.stream().clone_htod(&r.scales)?,
                format: r.format,
                n,
                k: kk,
            };
            // SAFETY: uninitialized; dequantize_bf16 writes all n·k elements.
            let mut w16: CudaSlice<u16> = unsafe { k.stream().alloc(n * kk) }?;
            k.dequantize_bf16(&mut w16, &m)?;
            ws.push(m);
            w16s.push(w16);
        }
        assert!(ws[0].format != QuantFormat::F32);
        let max_rows = *all_rows.iter().max().unwrap_or(&1);
        let x_host: Vec<f32> = (0..max_rows * kk).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0).collect();
        let x = k.stream().clone_htod(&x_host)?;
        // SAFETY: uninitialized; cast_to_16 writes every element before use.
        let mut x16: CudaSlice<u16> = unsafe { k.stream().alloc(max_rows * kk) }?;
        // SAFETY: uninitialized; each path writes rows·n outputs before any read (none here).
        let mut y: CudaSlice<f32> = unsafe { k.stream().alloc(max_rows * n) }?;
        // SAFETY: as for w16.
        let mut scratch: CudaSlice<u16> = unsafe { k.stream().alloc(n * kk) }?;
        let name = format!("{dtype} [{n}x{kk}]");
        for &rows in all_rows {
            let flops = 2.0 * rows as f64 * n as f64 * kk as f64;
            let mut record = |path: &str, ms: f64, bytes: f64| {
                let row = Row { path: path.to_string(), weight: name.clone(), rows, ms, tflops: flops / ms / 1e9, gbs: bytes / ms / 1e6 };
                println!(
                    "{{\"path\":\"{}\",\"weight\":\"{}\",\"rows\":{},\"ms\":{:.4},\"tflops\":{:.2},\"weight_gbs\":{:.1}}}",
                    row.path, row.weight, row.rows, row.ms, row.tflops, row.gbs
                );
                eprintln!("{:<16} {:<24} rows {:>5}: {:>8.4} ms {:>7.1} TFLOP/s {:>7.0} GB/s", path, name, rows, ms, row.tflops, row.gbs);
                table.push(row);
            };
            if staged {
                for (label, on, stages) in [("mma-registers", false, None), ("staged-3", true, Some(3)), ("staged-4", true, Some(4))] {
                    k.set_gemm_staged(on);
                    k.set_gemm_stages(stages);
                    let ms = time_ms(&k, |i| {
                        k.cast_to_16(&mut x16, &x, rows * kk, Half::Bf16)?;
                        Ok(k.gemm_mma(&mut y, &ws[i % copies], &x16, rows)?)
                    })?;
                    record(label, ms, weight_bytes);
                }
                k.set_gemm_staged(true);
                k.set_gemm_stages(None);
                let ms = time_ms(&k, |i| {
                    k.cast_to_16(&mut x16, &x, rows * kk, Half::Bf16)?;
                    Ok(blas.linear_16(&mut y, &w16s[i % copies], &x16, Half::Bf16, rows, n, kk)?)
                })?;
                record("cublas-bf16", ms, weight_bytes);
                continue;
            }
            if let Some(plans) = &plans {
                for (label, plan) in plans {
                    let ms = time_ms(&k, |i| Ok(k.gemv_q_planned(&mut y, &ws[i % copies], &x, rows, *plan)?))?;
                    record(label, ms, weight_bytes);
                }
                // The default path's alternative past GEMV_MAX_ROWS rows.
                if rows >= 2 {
                    let ms = time_ms(&k, |i| {
                        k.cast_to_16(&mut x16, &x, rows * kk, Half::Bf16)?;
                        Ok(k.gemm_mma(&mut y, &ws[i % copies], &x16, rows)?)
                    })?;
                    record("mma", ms, weight_bytes);
                }
                continue;
            }
            if rows <= 8 {
                let ms = time_ms(&k, |i| Ok(k.gemv_q(&mut y, &ws[i % copies], &x, rows)?))?;
                record("gemv", ms, weight_bytes);
            }
            let ms = time_ms(&k, |i| {
                k.cast_to_16(&mut x16, &x, rows * kk, Half::Bf16)?;
                Ok(k.gemm_mma(&mut y, &ws[i % copies], &x16, rows)?)
            })?;
            record("mma", ms, weight_bytes);
            if rows >= 16 {
                let ms = time_ms(&k, |i| {
                    k.cast_to_16(&mut x16, &x, rows * kk, Half::Bf16)?;
                    k.dequantize_bf16(&mut scratch, &ws[i % copies])?;
                    Ok(blas.linear_16(&mut y, &scratch, &x16, Half::Bf16, rows, n, kk)?)
                })?;
                record("dequant+cublas", ms, weight_bytes);
                if rows <= 1024 {
                    let ms = time_ms(&k, |i| Ok(k.gemv_rows(&mut y, &ws[i % copies], &x, rows)?))?;
                    record("cores", ms, weight_bytes);
                }
            }
            let ms = time_ms(&k, |i| {
                k.cast_to_16(&mut x16, &x, rows * kk, Half::Bf16)?;
                Ok(blas.linear_16(&mut y, &w16s[i % copies], &x16, Half::Bf16, rows, n, kk)?)
            })?;
            record("cublas-bf16", ms, n as f64 * kk as f64 * 2.0);
        }
    }
    if staged {
        // Milliseconds per path, the faster staged kernel's weight GB/s,
        // and its speed-up over each of the others.
        println!(
            "\n| weight | rows | mma-registers ms | staged-3 ms | staged-4 ms | cublas-bf16 ms | staged GB/s | staged vs registers | staged vs cuBLAS |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        let mut keys: Vec<(String, usize)> = table.iter().map(|r| (r.weight.clone(), r.rows)).collect();
        keys.dedup();
        for (w, rows) in keys {
            let mine = |p: &str| table.iter().find(|r| r.weight == w && r.rows == rows && r.path == p);
            if let (Some(a), Some(s3), Some(s4), Some(c)) = (mine("mma-registers"), mine("staged-3"), mine("staged-4"), mine("cublas-bf16"))
            {
                let b = if s3.ms < s4.ms { s3 } else { s4 };
                println!(
                    "| {w} | {rows} | {:.4} | {:.4} | {:.4} | {:.4} | {:.0} ({}) | {:.2}× | {:.2}× |",
                    a.ms,
                    s3.ms,
                    s4.ms,
                    c.ms,
                    b.gbs,
                    b.path,
                    a.ms / b.ms,
                    c.ms / b.ms
                );
            }
        }
        return Ok(());
    }
    if let Some(plans) = &plans {
        // Weight GB/s per plan, and the fastest.
        let labels: Vec<&str> = plans.iter().map(|(l, _)| l.as_str()).chain(std::iter::once("mma")).collect();
        println!("\n| weight | rows | {} | best |", labels.join(" | "));
        println!("|---|---:|{}---|", "---:|".repeat(labels.len()));
        let mut keys: Vec<(String, usize)> = table.iter().map(|r| (r.weight.clone(), r.rows)).collect();
        keys.dedup();
        for (w, rows) in keys {
            let mine = |p: &str| table.iter().find(|r| r.weight == w && r.rows == rows && r.path == p);
            let cells: Vec<String> = labels.iter().map(|l| mine(l).map_or("-".to_string(), |r| format!("{:.0}", r.gbs))).collect();
            let best = table
                .iter()
                .filter(|r| r.weight == w && r.rows == rows)
                .min_by(|a, b| a.ms.total_cmp(&b.ms))
                .map_or("-", |r| r.path.as_str());
            println!("| {w} | {rows} | {} | {best} |", cells.join(" | "));
        }
        return Ok(());
    }
    // The short table, last: the fastest path per (weight, rows).
    println!("\n| weight | rows | gemv | mma | dequant+cublas | cublas-bf16 | cores | best |");
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    let mut keys: Vec<(String, usize)> = table.iter().map(|r| (r.weight.clone(), r.rows)).collect();
    keys.dedup();
    for (w, rows) in keys {
        let cell = |p: &str| {
            table.iter().find(|r| r.weight == w && r.rows == rows && r.path == p).map_or("-".to_string(), |r| format!("{:.3}", r.ms))
        };
        let best = table
            .iter()
            .filter(|r| r.weight == w && r.rows == rows && r.path != "cublas-bf16")
            .min_by(|a, b| a.ms.total_cmp(&b.ms))
            .map_or("-", |r| r.path.as_str());
        println!(
            "| {w} | {rows} | {} | {} | {} | {} | {} | {best} |",
            cell("gemv"),
            cell("mma"),
            cell("dequant+cublas"),
            cell("cublas-bf16"),
            cell("cores")
        );
    }
    Ok(())
}
