//! `kernels/cuda/gemv_q.cu`'s GEMV with its fusions (`GEMV_IN`: the RMSNorm
//! of the input rows; `GEMV_OUT`: the residual add, or the gated activation
//! of a stacked gate/up weight's columns in pairs), compiled for the host
//! and run with a thread per GPU thread (common/host_cuda.rs: barriers,
//! shuffles), against float64 on the layouts' exact values. The plans the
//! launch picks at one and two rows (two columns a warp, two warps a column
//! group, Q8's conversion-free decode), four warps a group, and the float32
//! path's at three, five and eight rows (one warp a group, 2–4 columns a
//! warp); Q8_0, Q4_1 and f32 weights; k past a whole warp stride
//! (SmolLM2's 576); 69 output columns, so that the last column group is
//! cut short; inputs with no slack past their last element.
//!
//! Without a C++ compiler (`c++`, `g++` or `clang++`, or `CXX`) the test
//! says SKIPPED by name; CI has one.

#[path = "common/host_cuda.rs"]
mod host_cuda;
#[path = "common/host_cxx.rs"]
mod host_cxx;

use host_cuda::EMULATION;
use std::path::{Path, PathBuf};
use std::process::Command;
use vellum_backend_cuda::launch::{GemvFusion, GemvInput, GemvOutput, GemvPlan};
use vellum_backend_cuda::layout::{dequantize_repacked, f32_layout, repack, Repacked};
use vellum_base::SeededRng;
use vellum_ops::quant::GgmlType;

/// Runs the GEMV for one weight: reads `ints` (rows, output columns, k,
/// format) and `eps`,
/// `codes`, `scales`, `x`, `aux` (the norm's weight), `y` (the residual),
/// writes `out`.
const MAIN: &str = r#"
int main(int argc, char **argv) {
    if (argc != 2) return 2;
    const std::string dir = argv[1];
    auto ints = slurp<int>(dir + "/ints");
    auto eps = slurp<float>(dir + "/eps");
    auto codes = slurp<unsigned char>(dir + "/codes");
    auto scales = slurp<unsigned short>(dir + "/scales", 1);  // an F32 weight has none
    auto x = slurp<float>(dir + "/x");
    auto aux = slurp<float>(dir + "/aux");
    auto y = slurp<float>(dir + "/y");
    // n: the output columns (a gated weight has twice as many rows).
    const int rows = ints[0], n = ints[1], k = ints[2], format = ints[3];
    if (rows != ROWS) return 5;
    const int per_block = GEMV_WARPS / GEMV_KSPLIT * GEMV_COLS;
    launch((n + per_block - 1) / per_block, 1, GEMV_THREADS, [&] {
        auto run = [&](auto kernel) { kernel(y.data(), codes.data(), scales.data(), x.data(), n, k, aux.data(), eps[0]); };
        if (format == 0) run(gemv_q8);
        else if (format == 1) run(gemv_q4);
        else run(gemv_f32);
    });
    FILE *f = std::fopen((dir + "/out").c_str(), "wb");
    if (!f || std::fwrite(y.data(), 4, (size_t)rows * n, f) != (size_t)rows * n) return 4;
    return std::fclose(f);
}
"#;

/// The text of the function `name` in `src` (its declaration line to its
/// closing brace at the start of a line, or its one line).
fn function(src: &str, name: &str) -> String {
    let at = src.find(&format!(" {name}(")).unwrap_or_else(|| panic!("the source defines {name}"));
    let start = src[..at].rfind('\n').map_or(0, |i| i + 1);
    let line_end = start + src[start..].find('\n').unwrap_or(src.len() - start);
    let line = &src[start..line_end];
    if line.matches('{').count() > 0 && line.matches('{').count() == line.matches('}').count() {
        return line.to_string();
    }
    let end = start + src[start..].find("\n}").unwrap_or_else(|| panic!("{name} ends")) + 2;
    src[start..end].to_string()
}

/// The GEMV of `plan` at `rows` rows with `fusion`, for the host: the
/// defines its launch uses, the activations and weight layouts of
/// `common.cuh`, the GEMV half of `gemv_q.cu`.
fn build(cxx: &str, dir: &Path, rows: usize, plan: GemvPlan, fusion: GemvFusion) -> PathBuf {
    let common = vellum_kernels::cuda::COMMON;
    let gemv = vellum_kernels::cuda::GEMV_Q;
    let gemv = &gemv[..gemv.find("#define GEMM_BM").expect("gemv_q.cu has its GEMM after the GEMV")];
    let layouts = &common[common.find("// Weight layouts").expect("common.cuh has its weight layouts")..];
    let defines: String = plan.fused_variant(rows, fusion).defines.iter().map(|(k, v)| format!("#define {k} {v}\n")).collect();
    let source = format!(
        "{EMULATION}
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
{defines}
{}
{}
#line 1 \"common.cuh (weight layouts)\"
{layouts}
#line 1 \"gemv_q.cu\"
{gemv}
{MAIN}",
        function(common, "silu"),
        function(common, "gelu_tanh"),
    );
    let name = format!(
        "gemv_r{rows}_nc{}_ks{}_m{}_in{}_out{}",
        plan.columns_per_warp, plan.k_split, plan.magic as u8, fusion.input as u8, fusion.output as u8
    );
    host_cxx::build_threaded(cxx, dir, &name, &source)
}

/// Random GGUF blocks of `dtype` (finite f16 scales and mins) for `[n, k]`.
fn blocks(dtype: GgmlType, n: usize, k: usize, rng: &mut SeededRng) -> Vec<u8> {
    let (block, bb) = dtype.block_layout();
    let mut data: Vec<u8> = (0..n * k / block * bb).map(|_| (rng.next_u64() >> 56) as u8).collect();
    let halves: &[usize] = if dtype == GgmlType::Q4_1 { &[0, 2] } else { &[0] };
    for b in data.chunks_exact_mut(bb) {
        for (h, &at) in halves.iter().enumerate() {
            let v = if h == 0 { 0.01 + 0.02 * rng.signed_f32().abs() } else { -0.1 * rng.signed_f32().abs() };
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    data
}

/// The input row r as the fused GEMV reads it, in float64.
fn input(fusion: GemvFusion, x: &[f32], aux: &[f32], eps: f32, r: usize, k: usize) -> Vec<f64> {
    let row = &x[r * k..(r + 1) * k];
    match fusion.input {
        GemvInput::Plain => row.iter().map(|&v| f64::from(v)).collect(),
        GemvInput::RmsNorm => {
            let inv = 1.0 / (row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / k as f64 + f64::from(eps)).sqrt();
            row.iter().zip(aux).map(|(&v, &w)| f64::from(v) * inv * f64::from(w)).collect()
        }
    }
}

/// The gated activation, in float64.
fn act(output: GemvOutput, g: f64) -> f64 {
    if output == GemvOutput::Silu {
        g / (1.0 + (-g).exp())
    } else {
        0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
    }
}

/// A weight and its layout's id in the program (0 Q8, 1 Q4, 2 F32), with
/// `n_out` output columns (its rows, or half of them when gated).
struct Weight {
    m: Repacked,
    format: i32,
}

fn check(dir: &Path, exe: &Path, rows: usize, fusion: GemvFusion, weight: &Weight, (n_out, k): (usize, usize), rng: &mut SeededRng) {
    let Weight { m: weight, format } = weight;
    let format = *format;
    let gated = fusion.output.is_gated();
    let n_rows = if gated { 2 * n_out } else { n_out };
    // Activations of a residual stream's size (RMSNorm takes any scale).
    let x: Vec<f32> = (0..rows * k).map(|_| rng.signed_f32() * 3.0).collect();
    let aux: Vec<f32> = (0..k).map(|_| 0.5 + rng.signed_f32().abs()).collect();
    let y0: Vec<f32> = (0..rows * n_out).map(|_| rng.signed_f32() * 10.0).collect();
    let eps = 1e-5f32;
    for (name, data) in [
        ("ints", host_cxx::bytes_of(&[rows as i32, n_out as i32, k as i32, format])),
        ("eps", host_cxx::bytes_of(&[eps])),
        ("codes", weight.codes.clone()),
        ("scales", host_cxx::bytes_of(&weight.scales)),
        ("x", host_cxx::bytes_of(&x)),
        ("aux", host_cxx::bytes_of(&aux)),
        ("y", host_cxx::bytes_of(&y0)),
    ] {
        std::fs::write(dir.join(name), data).expect("write an input");
    }
    let status = Command::new(exe).arg(dir).status().expect("run the GEMV");
    assert!(status.success(), "the GEMV's program exited with {status}");
    let got = host_cxx::read_f32s(&dir.join("out"));
    let w = dequantize_repacked(weight, n_rows, k);
    let dot = |xin: &[f64], c: usize| -> (f64, f64) {
        w[c * k..(c + 1) * k].iter().zip(xin).map(|(&w, &x)| f64::from(w) * x).fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()))
    };
    let mut worst = 0f64;
    for r in 0..rows {
        let xin = input(fusion, &x, &aux, eps, r, k);
        for c in 0..n_out {
            let (want, size) = match fusion.output {
                GemvOutput::Store => dot(&xin, c),
                GemvOutput::Add => {
                    let (d, size) = dot(&xin, c);
                    (f64::from(y0[r * n_out + c]) + d, size)
                }
                GemvOutput::Silu | GemvOutput::GeluTanh => {
                    let ((g, gs), (u, us)) = (dot(&xin, c), dot(&xin, n_out + c));
                    // The gate's error passes through the activation's slope (< 1.2).
                    (act(fusion.output, g) * u, 1.2 * gs * u.abs() + act(fusion.output, g).abs() * us)
                }
            };
            let g = f64::from(got[r * n_out + c]);
            let err = if g.is_finite() { (g - want).abs() } else { f64::INFINITY };
            let tol = 2e-6 * (k as f64).sqrt() * size + 1e-5 * want.abs() + 1e-6;
            assert!(err <= tol, "{fusion:?} format {format} rows {rows}: y[{r}, {c}] = {g}, want {want} (tolerance {tol:.2e})");
            worst = worst.max(err / tol);
        }
    }
    eprintln!("{fusion:?}, format {format}, {rows} rows, [{n_out} x {k}]: worst error {worst:.3} of its tolerance");
}

#[test]
fn the_fused_gemv_compiled_for_the_host_norms_activates_and_accumulates_as_float64_or_skips_without_a_compiler() {
    let test = "the_fused_gemv_compiled_for_the_host_norms_activates_and_accumulates_as_float64";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-gemv-on-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut rng = SeededRng::new(0x2545_f491_4f6c_dd1d);
    // 69 output columns: the last column group is cut short. k = 576: the
    // second warp stride covers 64 of its 512.
    let (n, k) = (69usize, 576usize);
    let weight = |ty: GgmlType, rows: usize, rng: &mut SeededRng, format: i32| Weight {
        m: if ty == GgmlType::F32 {
            f32_layout(&(0..rows * k).map(|_| rng.signed_f32() * 0.05).collect::<Vec<_>>())
        } else {
            repack(ty, &blocks(ty, rows, k, rng), rows, k).expect("repacks")
        },
        format,
    };
    let kinds = [(GgmlType::Q8_0, 0), (GgmlType::Q4_1, 1), (GgmlType::F32, 2)];
    let plain: Vec<Weight> = kinds.iter().map(|&(ty, f)| weight(ty, n, &mut rng, f)).collect();
    let stacked: Vec<Weight> = kinds.iter().map(|&(ty, f)| weight(ty, 2 * n, &mut rng, f)).collect();
    let fused = |input, output| GemvFusion { input, output };
    let four_warps = GemvPlan { columns_per_warp: 2, k_split: 4, magic: true };
    let cases = [
        // The launch's plans at one and two rows: a block's first product
        // normed, the o and down projections added into the residual, the
        // gate/up product normed and activated.
        (1, GemvPlan::for_rows(1), fused(GemvInput::RmsNorm, GemvOutput::Store)),
        (1, GemvPlan::for_rows(1), fused(GemvInput::Plain, GemvOutput::Add)),
        (2, GemvPlan::for_rows(2), fused(GemvInput::RmsNorm, GemvOutput::Add)),
        (2, GemvPlan::for_rows(2).paired(), fused(GemvInput::RmsNorm, GemvOutput::Silu)),
        (1, GemvPlan::for_rows(1).paired(), fused(GemvInput::Plain, GemvOutput::Silu)),
        // Four warps a column group.
        (1, four_warps, fused(GemvInput::RmsNorm, GemvOutput::GeluTanh)),
        // The float32 path's plans: one warp a group, 2, 3 and 4 columns a warp.
        (3, GemvPlan::for_rows(3), fused(GemvInput::RmsNorm, GemvOutput::Store)),
        (5, GemvPlan::for_rows(5), fused(GemvInput::Plain, GemvOutput::Add)),
        (8, GemvPlan::for_rows(8).paired(), fused(GemvInput::RmsNorm, GemvOutput::Silu)),
        (1, GemvPlan::for_rows(1), GemvFusion::default()),
    ];
    for (rows, plan, fusion) in cases {
        let exe = build(&cxx, &dir, rows, plan, fusion);
        for w in if fusion.output.is_gated() { &stacked } else { &plain } {
            check(&dir, &exe, rows, fusion, w, (n, k), &mut rng);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
