//! `kernels/cuda/gemm_mma.cu`'s staged tensor-core GEMM (`gemm_mma_staged_*`,
//! Q8, Q4, Q4_K, Q5_K and Q6_K weights, `cp.async` stages several steps deep) compiled for the
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
//!   even sizes (as [`mma_plan_for`] cuts it), fewer steps than stages and
//!   enough to go round the stages several times;
//! - a stage read before its copies land reads NaN (the emulation's
//!   `cp.async`), a copy off its alignment ends the program, and nothing is
//!   written past the dynamic shared memory `mma_staged_smem_bytes` gives.
//!
//! Without a C++ compiler the test says SKIPPED by name; CI has one.
//!
//! [`mma_plan_for`]: vellum_backend_cuda::launch::mma_plan_for

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
    auto ints = slurp<int>(dir + "/ints");  // rows n k per_split splits layout (0 Q8, 1 Q4, 2 Q4K, 3 Q5K, 4 Q6K)
    auto x = slurp<unsigned short>(dir + "/x");
    auto codes = slurp<unsigned char>(dir + "/codes");
    auto scales = slurp<unsigned short>(dir + "/scales");
    const int rows = ints[0], n = ints[1], k = ints[2], per_split = ints[3], splits = ints[4], layout = ints[5];
    const size_t len = (size_t)splits * rows * n;
    std::vector<float> plain(len, NAN), staged(len, NAN);
    const unsigned gx = (n + MMA_BN - 1) / MMA_BN, gy = (rows + MMA_BM - 1) / MMA_BM;
    typedef void (*Kernel)(float *, const unsigned char *, const unsigned short *, const unsigned short *, int, int, int, int);
    const Kernel plain_kernels[5] = {gemm_mma_q8, gemm_mma_q4, gemm_mma_q4k, gemm_mma_q5k, gemm_mma_q6k};
    const Kernel staged_kernels[5] = {gemm_mma_staged_q8, gemm_mma_staged_q4, gemm_mma_staged_q4k, gemm_mma_staged_q5k, gemm_mma_staged_q6k};
    const int stage_bytes[5] = {STG_BYTES_Q8, STG_BYTES_Q4, STG_BYTES_Q4K, STG_BYTES_Q5K, STG_BYTES_Q6K};
    if (layout < 0 || layout > 4) return 2;
    launch3(gx, gy, splits, MMA_THREADS,
            [&] { plain_kernels[layout](plain.data(), codes.data(), scales.data(), x.data(), rows, n, k, per_split); });
    shared_window = stg_smem;
    const int used = stage_bytes[layout];
    std::memset(stg_smem + used, 0x5a, sizeof(stg_smem) - used);
    launch3(gx, gy, splits, MMA_THREADS,
            [&] { staged_kernels[layout](staged.data(), codes.data(), scales.data(), x.data(), rows, n, k, per_split); });
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
fn build(cxx: &str, dir: &Path, bm: usize, stages: usize) -> std::path::PathBuf {
    let bytes = LAYOUTS.map(|l| mma_staged_smem_bytes(l.format(), bm, stages).expect("every quantized layout is staged"));
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
#define MMA_STAGES {stages}
#define STG_BYTES_Q8 {}
#define STG_BYTES_Q4 {}
#define STG_BYTES_Q4K {}
#define STG_BYTES_Q5K {}
#define STG_BYTES_Q6K {}
alignas(16) static unsigned char stg_smem[{} + {GUARD}];
#line 1 \"common.cuh (weight layouts)\"
// Weight layouts{layouts}
#line 1 \"gemm_mma.cu\"
{}
{MAIN}",
        bytes[0],
        bytes[1],
        bytes[2],
        bytes[3],
        bytes[4],
        bytes.iter().max().expect("five layouts"),
        kernels.replacen(declaration, "", 1)
    );
    host_cxx::build_threaded(cxx, dir, &format!("gemm_staged_{bm}_{stages}"), &source)
}

/// The quantized layouts of `crates/backend-cuda/src/layout.rs`, in the
/// program's order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    Q8,
    Q4,
    Q4K,
    Q5K,
    Q6K,
}
const LAYOUTS: [Layout; 5] = [Layout::Q8, Layout::Q4, Layout::Q4K, Layout::Q5K, Layout::Q6K];

impl Layout {
    fn format(self) -> QuantFormat {
        match self {
            Layout::Q8 => QuantFormat::Q8,
            Layout::Q4 => QuantFormat::Q4,
            Layout::Q4K => QuantFormat::Q4K,
            Layout::Q5K => QuantFormat::Q5K,
            Layout::Q6K => QuantFormat::Q6K,
        }
    }
    fn id(self) -> i32 {
        LAYOUTS.iter().position(|&l| l == self).expect("listed") as i32
    }
}

/// A random weight as the layout's planes, and its values rounded to bf16
/// as both kernels round them (each value as `common.cuh`'s `decode`).
struct Weight {
    codes: Vec<u8>,
    scales: Vec<u16>,
    values: Vec<f32>,
}

fn f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

fn f16_value(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Codes, then the value of weight `i` of a row from them and its scales.
fn random_weight(rng: &mut SeededRng, layout: Layout, n: usize, k: usize) -> Weight {
    let mut w = Weight { codes: Vec::new(), scales: Vec::new(), values: vec![0.0; n * k] };
    for c in 0..n {
        // Codes as small integers (nibbles packed two a byte below).
        let q: Vec<i32> = (0..k)
            .map(|_| match layout {
                Layout::Q8 => rng.below(256) as i32 - 128,
                Layout::Q4 | Layout::Q4K => rng.below(16) as i32,
                Layout::Q5K => rng.below(32) as i32,
                Layout::Q6K => rng.below(64) as i32 - 32,
            })
            .collect();
        match layout {
            Layout::Q4 | Layout::Q4K => w.codes.extend(q.chunks_exact(2).map(|p| (p[0] | p[1] << 4) as u8)),
            _ => w.codes.extend(q.iter().map(|&v| v as u8)),
        }
        let value: Vec<f32> = match layout {
            Layout::Q8 | Layout::Q4 => {
                let mut v = Vec::with_capacity(k);
                for b in 0..k / 32 {
                    let d = f16(0.002 + 0.05 * rng.uniform() as f32);
                    w.scales.push(d);
                    let m = f16(-0.4 * rng.uniform() as f32);
                    if layout == Layout::Q4 {
                        w.scales.push(m);
                    }
                    for i in 0..32 {
                        let qi = q[32 * b + i] as f32;
                        v.push(if layout == Layout::Q4 { f16_value(d).mul_add(qi, f16_value(m)) } else { f16_value(d) * qi });
                    }
                }
                v
            }
            Layout::Q4K | Layout::Q5K => {
                // Sub-block words (sc | m << 8, 6 bits each), then (d, dmin) per 256.
                let sub: Vec<(u16, u16)> = (0..k / 32).map(|_| (rng.below(64) as u16, rng.below(64) as u16)).collect();
                let sup: Vec<(u16, u16)> =
                    (0..k / 256).map(|_| (f16(0.0005 + 0.002 * rng.uniform() as f32), f16(0.001 * rng.uniform() as f32))).collect();
                w.scales.extend(sub.iter().map(|&(sc, m)| sc | m << 8));
                w.scales.extend(sup.iter().flat_map(|&(d, dmin)| [d, dmin]));
                (0..k)
                    .map(|i| {
                        let (sc, m) = sub[i / 32];
                        let (d, dmin) = sup[i / 256];
                        let d0 = f16_value(d) * f32::from(sc);
                        let min0 = f16_value(dmin) * f32::from(m);
                        d0.mul_add(q[i] as f32, -min0)
                    })
                    .collect()
            }
            Layout::Q6K => {
                // Sub-block words (two int8 scales, one per 16), then d per 256.
                let sc: Vec<i8> = (0..k / 16).map(|_| rng.below(256) as u8 as i8).collect();
                let d: Vec<u16> = (0..k / 256).map(|_| f16(0.0001 + 0.0005 * rng.uniform() as f32)).collect();
                w.scales.extend(sc.chunks_exact(2).map(|p| u16::from(p[0] as u8) | u16::from(p[1] as u8) << 8));
                w.scales.extend(&d);
                (0..k).map(|i| (f16_value(d[i / 256]) * f32::from(sc[i / 16])) * q[i] as f32).collect()
            }
        };
        for (i, v) in value.into_iter().enumerate() {
            w.values[c * k + i] = bf16_round(v);
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

fn run_case(dir: &Path, exe: &Path, case: &Case, layout: Layout, rng: &mut SeededRng) -> f64 {
    let Case { rows, n, k, per_split } = *case;
    let splits = (k / 32).div_ceil(per_split);
    let w = random_weight(rng, layout, n, k);
    let x: Vec<u16> = (0..rows * k).map(|_| half::bf16::from_f32(rng.signed_f32()).to_bits()).collect();
    let ints = [rows as i32, n as i32, k as i32, per_split as i32, splits as i32, layout.id()];
    std::fs::write(dir.join("ints"), host_cxx::bytes_of(&ints)).expect("ints");
    std::fs::write(dir.join("x"), host_cxx::bytes_of(&x)).expect("x");
    std::fs::write(dir.join("codes"), &w.codes).expect("codes");
    std::fs::write(dir.join("scales"), host_cxx::bytes_of(&w.scales)).expect("scales");
    let status = Command::new(exe).arg(dir).status().expect("run the GEMMs");
    let what = format!("{layout:?} [{rows}x{k}]·[{n}x{k}]ᵀ in {splits} parts of {per_split} blocks");
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
fn the_staged_tensor_core_gemm_matches_gemm_mma_bit_for_bit_on_every_quantized_layout_or_skips_without_a_compiler() {
    let test = "the_staged_tensor_core_gemm_matches_gemm_mma_bit_for_bit_on_every_quantized_layout";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-gemm-staged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut rng = SeededRng::new(0x2545_f491_4f6c_dd1d);
    // Per tile height: rows cutting a tile short (whole fragments of
    // padding among them), columns past one tile (the second cut short, an
    // odd count), k in several parts, in one, in fewer steps than stages and
    // in enough to go round the stages several times. The K-quants take k in super blocks of
    // 256 (Q6_K an even number of them, as the host sends it).
    let plans: [(usize, usize, Vec<Case>); 5] = [
        (
            32,
            4,
            vec![
                Case { rows: 9, n: 200, k: 320, per_split: 4 },
                Case { rows: 32, n: 64, k: 64, per_split: 2 },
                Case { rows: 5, n: 77, k: 512, per_split: 4 },
                Case { rows: 3, n: 77, k: 2048, per_split: 44 },
                Case { rows: 17, n: 136, k: 1216, per_split: 14 },
            ],
        ),
        (
            64,
            4,
            vec![
                Case { rows: 40, n: 130, k: 512, per_split: 16 },
                Case { rows: 64, n: 128, k: 256, per_split: 2 },
                Case { rows: 33, n: 9, k: 1024, per_split: 18 },
            ],
        ),
        (
            128,
            3,
            vec![
                Case { rows: 100, n: 136, k: 192, per_split: 6 },
                Case { rows: 128, n: 16, k: 128, per_split: 4 },
                Case { rows: 70, n: 129, k: 1024, per_split: 8 },
                Case { rows: 65, n: 130, k: 1280, per_split: 16 },
                Case { rows: 127, n: 8, k: 704, per_split: 22 },
            ],
        ),
        // Three stages where four is the default (gemm_bench compares them).
        (32, 3, vec![Case { rows: 20, n: 150, k: 1024, per_split: 32 }]),
        (64, 3, vec![Case { rows: 50, n: 77, k: 1024, per_split: 12 }]),
    ];
    let mut ran = [0usize; 5];
    for (bm, stages, cases) in &plans {
        let exe = build(&cxx, &dir, *bm, *stages);
        for case in cases {
            assert!(case.rows <= *bm, "the case fits tile height {bm}");
            assert!(case.per_split.is_multiple_of(2) && (case.k / 32).is_multiple_of(2), "the host sends even parts");
            for layout in LAYOUTS {
                let whole = match layout {
                    Layout::Q8 | Layout::Q4 => 32,
                    Layout::Q4K | Layout::Q5K => 256,
                    Layout::Q6K => 512,
                };
                if !case.k.is_multiple_of(whole) {
                    continue;
                }
                let worst = run_case(&dir, &exe, case, layout, &mut rng);
                ran[layout.id() as usize] += 1;
                eprintln!(
                    "tile {bm}, {stages} stages: {layout:?} [{}x{}]·[{}x{}]ᵀ, parts of {} blocks ({} column tiles): bit for bit, max |err| {worst:.2e}",
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
    assert!(ran.iter().all(|&r| r >= 5), "every layout ran at every tile height and stage count: {ran:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
