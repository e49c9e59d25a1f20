//! `kernels/cuda/gemm_mma.cu`'s staged tensor-core GEMM (`gemm_mma_staged_*`,
//! Q8 and Q4 weights, `cp.async` stages several steps deep) compiled for the
//! host and run under the emulation of `common/host_cuda.rs` (a host thread
//! per GPU thread; `mma.sync`, `ldmatrix` and `cp.async` by the PTX ISA's
//! rules), beside `gemm_mma_*`, which GPUs have passed:
//!
//! - the two agree **bit for bit** on every output of every part of k (the
//!   staged kernel takes each output's k in the same order, from the same
//!   bf16 values), and both are within float32 rounding of the float64
//!   product of the same bf16-rounded activations and weights;
//! - tile heights 32, 64 and 128 (each its own build, as NVRTC builds
//!   them), rows and columns cutting tiles short, k split into parts of
//!   [`Kernels::mma_staged_plan`]'s even sizes, fewer steps than stages;
//! - a stage read before its copies land reads NaN (the emulation's
//!   `cp.async`), a copy off its alignment ends the program, and nothing is
//!   written past the dynamic shared memory `mma_staged_smem_bytes` gives.
//!
//! Without a C++ compiler the test says SKIPPED by name; CI has one.
//!
//! [`Kernels::mma_staged_plan`]: vellum_backend_cuda::launch::Kernels::mma_staged_plan

#[path = "common/host_cuda.rs"]
mod host_cuda;
#[path = "common/host_cxx.rs"]
mod host_cxx;

use host_cuda::EMULATION as SHIM;
use std::path::Path;
use std::process::Command;
use vellum_backend_cuda::launch::{mma_staged_smem_bytes, MMA_TILE_COLS};
use vellum_backend_cuda::layout::QuantFormat;
use vellum_base::SeededRng;

/// Guard bytes after a launch's dynamic shared memory.
const GUARD: usize = 4096;

/// Reads a case, runs `gemm_mma_<layout>` and `gemm_mma_staged_<layout>`
/// over the same split of k, writes both outputs (every part's).
const MAIN: &str = r#"
int main(int argc, char **argv) {
    if (argc != 2) return 2;
    const std::string dir = argv[1];
    auto ints = slurp<int>(dir + "/ints");  // rows n k per_split splits layout (0 Q8, 1 Q4)
    auto x = slurp<unsigned short>(dir + "/x");
    auto codes = slurp<unsigned char>(dir + "/codes");
    auto scales = slurp<unsigned short>(dir + "/scales");
    const int rows = ints[0], n = ints[1], k = ints[2], per_split = ints[3], splits = ints[4], layout = ints[5];
    const size_t len = (size_t)splits * rows * n;
    std::vector<float> plain(len, NAN), staged(len, NAN);
    const unsigned gx = (n + MMA_BN - 1) / MMA_BN, gy = (rows + MMA_BM - 1) / MMA_BM;
    launch3(gx, gy, splits, MMA_THREADS, [&] {
        if (layout == 0) gemm_mma_q8(plain.data(), codes.data(), scales.data(), x.data(), rows, n, k, per_split);
        else gemm_mma_q4(plain.data(), codes.data(), scales.data(), x.data(), rows, n, k, per_split);
    });
    const int used = layout == 0 ? STG_BYTES_Q8 : STG_BYTES_Q4;
    std::memset(stg_smem + used, 0x5a, sizeof(stg_smem) - used);
    launch3(gx, gy, splits, MMA_THREADS, [&] {
        if (layout == 0) gemm_mma_staged_q8(staged.data(), codes.data(), scales.data(), x.data(), rows, n, k, per_split);
        else gemm_mma_staged_q4(staged.data(), codes.data(), scales.data(), x.data(), rows, n, k, per_split);
    });
    for (size_t i = used; i < sizeof(stg_smem); i++)
        if (stg_smem[i] != 0x5a) return 6;  // wrote past its dynamic shared memory
    for (auto [name, y] : {std::pair{"plain", &plain}, std::pair{"staged", &staged}}) {
        FILE *f = std::fopen((dir + "/" + name).c_str(), "wb");
        if (!f || std::fwrite(y->data(), 4, y->size(), f) != y->size()) return 4;
        std::fclose(f);
    }
    return 0;
}
"#;

/// The program for tile height `bm`: both kernels of `gemm_mma.cu`, the
/// staged one's dynamic shared memory a static buffer with a guard band.
fn build(cxx: &str, dir: &Path, bm: usize) -> std::path::PathBuf {
    let q8 = mma_staged_smem_bytes(QuantFormat::Q8, bm).expect("Q8 is staged");
    let q4 = mma_staged_smem_bytes(QuantFormat::Q4, bm).expect("Q4 is staged");
    let declaration = "extern __shared__ __align__(16) unsigned char stg_smem[];";
    let kernels = vellum_kernels::cuda::GEMM_MMA;
    assert!(kernels.contains(declaration), "gemm_mma.cu declares the staged kernel's dynamic shared memory");
    let common = vellum_kernels::cuda::COMMON;
    let layouts = &common[common.find("// Weight layouts").expect("common.cuh has its weight layouts") + "// Weight layouts".len()..];
    let source = format!(
        "{SHIM}
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define MMA_BM {bm}
#define STG_BYTES_Q8 {q8}
#define STG_BYTES_Q4 {q4}
alignas(16) static unsigned char stg_smem[{} + {GUARD}];
#line 1 \"common.cuh (weight layouts)\"
// Weight layouts{layouts}
#line 1 \"gemm_mma.cu\"
{}
{MAIN}",
        q8.max(q4),
        kernels.replacen(declaration, "", 1)
    );
    host_cxx::build_threaded(cxx, dir, &format!("gemm_staged_{bm}"), &source)
}

/// A random weight as the layout's planes, and its values rounded to bf16
/// as both kernels round them.
struct Weight {
    codes: Vec<u8>,
    scales: Vec<u16>,
    values: Vec<f32>,
}

fn f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

fn random_weight(rng: &mut SeededRng, q4: bool, n: usize, k: usize) -> Weight {
    let blocks = k / 32;
    let mut w = Weight { codes: Vec::new(), scales: Vec::new(), values: vec![0.0; n * k] };
    for c in 0..n {
        for b in 0..blocks {
            let d = f16(0.002 + 0.05 * rng.uniform() as f32);
            let m = f16(-0.4 * rng.uniform() as f32);
            let (d_f, m_f) = (half::f16::from_bits(d).to_f32(), half::f16::from_bits(m).to_f32());
            w.scales.push(d);
            if q4 {
                w.scales.push(m);
            }
            for i in 0..32 {
                let value = if q4 {
                    let q = rng.below(16) as u8;
                    if i % 2 == 0 {
                        w.codes.push(q);
                    } else {
                        *w.codes.last_mut().expect("the even code came first") |= q << 4;
                    }
                    d_f.mul_add(f32::from(q), m_f)
                } else {
                    let q = rng.below(256) as u8;
                    w.codes.push(q);
                    d_f * f32::from(q as i8)
                };
                w.values[c * k + 32 * b + i] = bf16_round(value);
            }
        }
    }
    w
}

struct Case {
    rows: usize,
    n: usize,
    k: usize,
    /// Blocks of 32 a part of k (even).
    per_split: usize,
}

fn run_case(dir: &Path, exe: &Path, case: &Case, q4: bool, rng: &mut SeededRng) -> f64 {
    let Case { rows, n, k, per_split } = *case;
    let splits = (k / 32).div_ceil(per_split);
    let w = random_weight(rng, q4, n, k);
    let x: Vec<u16> = (0..rows * k).map(|_| half::bf16::from_f32(rng.signed_f32()).to_bits()).collect();
    let ints = [rows, n, k, per_split, splits, usize::from(q4)].map(|v| v as i32);
    std::fs::write(dir.join("ints"), host_cxx::bytes_of(&ints)).expect("ints");
    std::fs::write(dir.join("x"), host_cxx::bytes_of(&x)).expect("x");
    std::fs::write(dir.join("codes"), &w.codes).expect("codes");
    std::fs::write(dir.join("scales"), host_cxx::bytes_of(&w.scales)).expect("scales");
    let status = Command::new(exe).arg(dir).status().expect("run the GEMMs");
    let what = format!("{} [{rows}x{k}]·[{n}x{k}]ᵀ in {splits} parts of {per_split} blocks", if q4 { "Q4" } else { "Q8" });
    assert!(status.success(), "{what}: the program exited with {status} (6: past its shared memory, 7: a misaligned copy)");
    let plain = host_cxx::read_f32s(&dir.join("plain"));
    let staged = host_cxx::read_f32s(&dir.join("staged"));
    let mut worst = 0f64;
    for z in 0..splits {
        let (k0, k1) = (32 * per_split * z, (32 * per_split * (z + 1)).min(k));
        for r in 0..rows {
            for c in 0..n {
                let at = z * rows * n + r * n + c;
                assert_eq!(
                    staged[at].to_bits(),
                    plain[at].to_bits(),
                    "{what}: part {z} y[{r}, {c}] staged {} against gemm_mma {}",
                    staged[at],
                    plain[at]
                );
                let (mut want, mut mag) = (0f64, 0f64);
                for i in k0..k1 {
                    let p = f64::from(half::bf16::from_bits(x[r * k + i]).to_f32()) * f64::from(w.values[c * k + i]);
                    want += p;
                    mag += p.abs();
                }
                let got = f64::from(staged[at]);
                let err = if got.is_finite() { (got - want).abs() } else { f64::INFINITY };
                assert!(err <= 1e-6 * mag * ((k1 - k0) as f64).sqrt() + 1e-6, "{what}: part {z} y[{r}, {c}] {got} against {want}");
                worst = worst.max(err);
            }
        }
    }
    worst
}

#[test]
fn the_staged_tensor_core_gemm_matches_gemm_mma_bit_for_bit_on_q8_and_q4_or_skips_without_a_compiler() {
    let test = "the_staged_tensor_core_gemm_matches_gemm_mma_bit_for_bit_on_q8_and_q4";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-gemm-staged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut rng = SeededRng::new(0x2545_f491_4f6c_dd1d);
    // Per tile height: rows cutting a tile short, columns past one tile
    // (the second cut short), k in several parts, in one, and in fewer
    // steps than stages.
    let plans: [(usize, Vec<Case>); 3] = [
        (32, vec![Case { rows: 9, n: 200, k: 320, per_split: 4 }, Case { rows: 32, n: 64, k: 64, per_split: 2 }]),
        (64, vec![Case { rows: 40, n: 130, k: 512, per_split: 16 }, Case { rows: 64, n: 128, k: 256, per_split: 2 }]),
        (128, vec![Case { rows: 100, n: 136, k: 192, per_split: 6 }, Case { rows: 128, n: 16, k: 128, per_split: 4 }]),
    ];
    for (bm, cases) in &plans {
        let exe = build(&cxx, &dir, *bm);
        for case in cases {
            assert!(case.rows <= *bm && case.rows > bm / 2 || *bm == 32, "the case takes tile height {bm}");
            assert!(case.per_split.is_multiple_of(2) && (case.k / 32).is_multiple_of(2), "the host sends even parts");
            for q4 in [false, true] {
                let worst = run_case(&dir, &exe, case, q4, &mut rng);
                eprintln!(
                    "tile {bm}: {} [{}x{}]·[{}x{}]ᵀ, parts of {} blocks ({} column tiles): bit for bit, max |err| {worst:.2e}",
                    if q4 { "Q4" } else { "Q8" },
                    case.rows,
                    case.k,
                    case.n,
                    case.k,
                    case.per_split,
                    case.n.div_ceil(MMA_TILE_COLS)
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
