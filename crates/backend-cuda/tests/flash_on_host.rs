//! `kernels/cuda/flash_attention.cu`, flash prefill on tensor cores,
//! compiled for the host and run with one host thread per GPU thread, its
//! warp-wide operations (`mma.sync`, `ldmatrix`, shuffles, ballots)
//! emulated by the rules of the PTX ISA that `common.cuh`'s tensor-core
//! section documents: a fragment-layout mistake, a wrong mask or a lost
//! row shows on any machine, against a float64 reference, not only on a
//! GPU. The same emulation runs `gemm_mma.cu`'s product, which passed on
//! GPUs, so the emulation's rules are the hardware's as those kernels use
//! them.
//!
//! Checked: every cache type flash prefill takes (bf16, f16, FP8 with
//! scales), head sizes 64, 128 and 256 with their key tiles, KV blocks of
//! 8, 16 and 32 tokens, GQA, a sliding
//! window, a soft-cap, prefix hits (queries after cached positions), query
//! tiles cut short, and tile slots past the batch's tiles (as a CUDA
//! graph launches them); rows of short sequences stay untouched (the
//! decode kernels attend those); nothing is written past the shared memory
//! the launch gives a block; and `cp.async` copies land only at the wait
//! that covers them (a stage read early reads NaN).
//!
//! Without a C++ compiler (`c++`, `g++` or `clang++`, or `CXX`) the test
//! says SKIPPED by name; CI has one.

#[path = "common/attention_case.rs"]
mod attention_case;
#[path = "common/host_cuda.rs"]
mod host_cuda;
#[path = "common/host_cxx.rs"]
mod host_cxx;

use attention_case::Case;
use host_cuda::EMULATION as SHIM;

use std::path::Path;
use std::process::Command;
use vellum_backend_cuda::launch::{flash_keys_per_tile, flash_smem_bytes, PoolDtype, QueryLens, FLASH_MIN_QUERIES};
use vellum_base::SeededRng;

/// Reads the inputs, runs flash prefill over its slots, writes the output.
const MAIN: &str = r#"
int main(int argc, char **argv) {
    if (argc != 3) return 2;
    const std::string dir = argv[2];
    const int dtype = std::atoi(argv[1]);  // 0 f16, 1 bf16, 2 fp8
    auto ints = slurp<int>(dir + "/ints");    // slots heads max_blocks num_seqs min_q num_heads num_kv_heads window out_len
    auto floats = slurp<float>(dir + "/floats");  // scale softcap v_scale
    auto q = slurp<float>(dir + "/q");
    auto kc = slurp<unsigned char>(dir + "/k");
    auto vc = slurp<unsigned char>(dir + "/v");
    auto tables = slurp<int>(dir + "/tables");
    auto qsl = slurp<int>(dir + "/qsl");
    auto ctx = slurp<int>(dir + "/ctx");
    std::vector<float> out(ints[8], NAN);
    for (int i = 0; i < FLASH_GUARD; i++) flash_smem[FLASH_SMEM_ELEMS + i] = 0x7f7f;
    launch(ints[0], ints[1], 128, [&] {
        auto run = [&](auto kernel) {
            kernel(out.data(), q.data(), kc.data(), vc.data(), tables.data(), ints[2], qsl.data(), ctx.data(), ints[3], ints[4],
                   ints[5], ints[6], floats[0], floats[1], ints[7], floats[2]);
        };
        if (dtype == 0) run(flash_attention_f16);
        else if (dtype == 1) run(flash_attention_bf16);
        else run(flash_attention_fp8);
    });
    for (int i = 0; i < FLASH_GUARD; i++)
        if (flash_smem[FLASH_SMEM_ELEMS + i] != 0x7f7f) return 6;  // wrote past its shared memory
    FILE *f = std::fopen((dir + "/out").c_str(), "wb");
    if (!f || std::fwrite(out.data(), 4, out.size(), f) != out.size()) return 4;
    return std::fclose(f);
}
"#;

/// The section of `common.cuh` between `begin` and `end`.
fn section(begin: &str, end: &str) -> &'static str {
    let common = vellum_kernels::cuda::COMMON;
    let start = common.find(begin).unwrap_or_else(|| panic!("common.cuh has {begin:?}")) + begin.len();
    let stop = start + common[start..].find(end).unwrap_or_else(|| panic!("common.cuh has {end:?} after {begin:?}"));
    &common[start..stop]
}

/// The program for one head size (its key tile as launch.rs picks it) and
/// block size.
fn build(cxx: &str, dir: &Path, head_dim: usize, block_size: usize) -> std::path::PathBuf {
    let source = format!(
        "{SHIM}
// The dynamic shared memory of the block running now: the bytes the launch
// gives it (flash_smem_bytes), then a guard band that must stay as it is.
#define __shared__
#define __align__(n)
#define FLASH_SMEM_ELEMS {}
#define FLASH_GUARD 4096
alignas(16) unsigned short flash_smem[FLASH_SMEM_ELEMS + FLASH_GUARD];
#define HEAD_DIM {head_dim}
#define BLOCK_SIZE {block_size}
#define FLASH_BN {}
#line 1 \"common.cuh (FP8)\"
{}
#line 1 \"flash_attention.cu\"
{}
{MAIN}",
        flash_smem_bytes(head_dim) / 2,
        flash_keys_per_tile(head_dim),
        section("FP8 (begin)\n", "// FP8 (end)"),
        vellum_kernels::cuda::FLASH_ATTENTION
    );
    host_cxx::build_threaded(cxx, dir, &format!("flash{head_dim}_{block_size}"), &source)
}

/// `gemm_mma.cu` on float32 weights, y = x · Wᵀ with 32-row tiles:
/// reads `ints` (rows n k), `x` (bf16 bits), `w` (f32), writes `y`.
const GEMM_MAIN: &str = r#"
int main(int argc, char **argv) {
    if (argc != 2) return 2;
    const std::string dir = argv[1];
    auto ints = slurp<int>(dir + "/ints");
    auto x = slurp<unsigned short>(dir + "/x");
    auto w = slurp<unsigned char>(dir + "/w");
    const int rows = ints[0], n = ints[1], k = ints[2];
    std::vector<float> y((size_t)rows * n, NAN);
    unsigned short scales[1] = {0};
    launch((n + MMA_BN - 1) / MMA_BN, (rows + MMA_BM - 1) / MMA_BM, MMA_THREADS,
           [&] { gemm_mma_f32(y.data(), w.data(), scales, x.data(), rows, n, k, k / 32); });
    FILE *f = std::fopen((dir + "/y").c_str(), "wb");
    if (!f || std::fwrite(y.data(), 4, y.size(), f) != y.size()) return 4;
    return std::fclose(f);
}
"#;

/// The tensor-core GEMM's program: static shared arrays and the weight
/// layouts of `common.cuh`.
fn build_gemm(cxx: &str, dir: &Path) -> std::path::PathBuf {
    let source = format!(
        "{SHIM}
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define MMA_BM 32
#line 1 \"common.cuh (weight layouts)\"
// Weight layouts{}
#line 1 \"gemm_mma.cu\"
{}
{GEMM_MAIN}",
        {
            let common = vellum_kernels::cuda::COMMON;
            &common[common.find("// Weight layouts").expect("common.cuh has its weight layouts") + "// Weight layouts".len()..]
        },
        // The staged kernel (gemm_on_host.rs runs it) has no shared memory here.
        vellum_kernels::cuda::GEMM_MMA.replacen(
            "extern __shared__ __align__(16) unsigned char stg_smem[];",
            "unsigned char *stg_smem = nullptr;",
            1
        )
    );
    host_cxx::build_threaded(cxx, dir, "gemm", &source)
}

fn run_case(dir: &Path, exe: &Path, case: &Case, rng: &mut SeededRng) {
    let d = case.head_dim;
    let b = case.batch(rng);
    let lens = QueryLens::of(&b.qsl);
    let slots = lens.flash_tiles + case.extra_slots;
    let ints = [
        slots as i32,
        case.heads as i32,
        b.max_blocks as i32,
        case.seqs.len() as i32,
        FLASH_MIN_QUERIES as i32,
        case.heads as i32,
        case.kv_heads as i32,
        case.window as i32,
        (b.num_tokens * case.heads * d) as i32,
    ];
    let floats = case.kernel_scales(&b);
    b.write(dir);
    std::fs::write(dir.join("ints"), host_cxx::bytes_of(&ints)).expect("write ints");
    std::fs::write(dir.join("floats"), host_cxx::bytes_of(&floats)).expect("write floats");
    let dtype_id = match case.dtype {
        PoolDtype::F16 => 0,
        PoolDtype::Bf16 => 1,
        PoolDtype::Fp8E4m3 => 2,
        PoolDtype::F32 => unreachable!("flash prefill takes 16-bit and FP8 caches"),
    };
    let started = std::time::Instant::now();
    let status = Command::new(exe).arg(dtype_id.to_string()).arg(dir).status().expect("run the kernel");
    assert!(status.success(), "the kernel's program exited with {status}");
    let got = host_cxx::read_f32s(&dir.join("out"));

    // The float64 reference, the queries rounded as the kernel multiplies them.
    // (times the score's scale, in its 16-bit type).
    let s_total = floats[0];
    let q_round = |x: f32| {
        let scaled = x * s_total;
        f64::from(match case.dtype {
            PoolDtype::Bf16 => half::bf16::from_f32(scaled).to_f32(),
            _ => half::f16::from_f32(scaled).to_f32(),
        }) / f64::from(s_total)
    };
    let tol = if case.dtype == PoolDtype::Bf16 { 1e-2 } else { 2e-3 };
    let (mut worst, mut t, mut flash_rows) = (0f64, 0usize, 0usize);
    for (s, &(_, ql)) in case.seqs.iter().enumerate() {
        for i in 0..ql {
            for h in 0..case.heads {
                let out = &got[(t * case.heads + h) * d..(t * case.heads + h + 1) * d];
                if ql < FLASH_MIN_QUERIES {
                    assert!(out.iter().all(|x| x.is_nan()), "seq {s} token {i} head {h}: a short sequence's row was written");
                    continue;
                }
                for (e, (&g, want)) in out.iter().zip(case.reference(&b, s, i, t, h, q_round)).enumerate() {
                    let err = if g.is_finite() { (f64::from(g) - want).abs() } else { f64::INFINITY };
                    assert!(err < tol, "seq {s} token {i} head {h} dim {e}: kernel {g} vs {want} ({:?}, head_dim {d})", case.dtype);
                    worst = worst.max(err);
                }
                flash_rows += 1;
            }
            t += 1;
        }
    }
    eprintln!(
        "{:?} head_dim {d} heads {}/{} window {} softcap {} slots {slots}: {flash_rows} rows, max |err| {worst:.2e} ({:.1} s)",
        case.dtype,
        case.heads,
        case.kv_heads,
        case.window,
        case.softcap,
        started.elapsed().as_secs_f64()
    );
    assert!(flash_rows > 0, "the case has long sequences");
}

/// The emulation against a kernel GPUs have passed: `gemm_mma.cu`'s
/// product over two row tiles (the second cut short) and two column tiles,
/// against float64 products of the same bf16-rounded inputs.
#[test]
fn the_tensor_core_emulation_runs_gemm_mma_as_gpus_do_or_skips_without_a_compiler() {
    let test = "the_tensor_core_emulation_runs_gemm_mma_as_gpus_do";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-gemm-on-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = build_gemm(&cxx, &dir);
    let (rows, n, k) = (40usize, 256usize, 96usize);
    let mut rng = SeededRng::new(0x5851_f42d_4c95_7f2d);
    let x: Vec<u16> = (0..rows * k).map(|_| half::bf16::from_f32(rng.signed_f32()).to_bits()).collect();
    let w: Vec<f32> = (0..n * k).map(|_| rng.signed_f32()).collect();
    std::fs::write(dir.join("ints"), host_cxx::bytes_of(&[rows as i32, n as i32, k as i32])).expect("ints");
    std::fs::write(dir.join("x"), host_cxx::bytes_of(&x)).expect("x");
    std::fs::write(dir.join("w"), host_cxx::bytes_of(&w)).expect("w");
    let status = Command::new(&exe).arg(&dir).status().expect("run the GEMM");
    assert!(status.success(), "the GEMM's program exited with {status}");
    let y = host_cxx::read_f32s(&dir.join("y"));
    let mut worst = 0f64;
    for r in 0..rows {
        for c in 0..n {
            let want: f64 = (0..k)
                .map(|i| f64::from(half::bf16::from_bits(x[r * k + i]).to_f32()) * f64::from(half::bf16::from_f32(w[c * k + i]).to_f32()))
                .sum();
            let got = f64::from(y[r * n + c]);
            let err = if got.is_finite() { (got - want).abs() } else { f64::INFINITY };
            assert!(err < 1e-4, "y[{r}, {c}]: emulated gemm_mma {got} vs {want}");
            worst = worst.max(err);
        }
    }
    eprintln!("gemm_mma emulated, {rows} x {n} x {k}: max |err| {worst:.2e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flash_prefill_compiled_for_the_host_matches_the_float64_reference_or_skips_without_a_compiler() {
    let test = "flash_prefill_compiled_for_the_host_matches_the_float64_reference";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-flash-on-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut rng = SeededRng::new(0x9e37_79b9_7f4a_7c15);
    // A decode, a prompt at the threshold, a prefix hit over two tiles (the
    // second cut short), a short verification, a one-tile prompt.
    let mixed = vec![(33, 1), (16, 16), (150, 70), (9, 3), (20, 20)];
    let long = vec![(130, 100), (40, 40)];
    // More sequences than a warp scans at once, long ones past the first 32
    // (tile slots counted across the scan's chunks), two of several tiles.
    let many: Vec<(usize, usize)> = std::iter::repeat_n((5, 1), 34).chain([(140, 130), (3, 2), (17, 17), (200, 200), (6, 1)]).collect();
    let cases = [
        Case {
            head_dim: 64,
            block: 16,
            dtype: PoolDtype::Bf16,
            heads: 4,
            kv_heads: 2,
            window: 0,
            softcap: 0.0,
            seqs: mixed.clone(),
            extra_slots: 0,
        },
        Case { head_dim: 64, block: 8, dtype: PoolDtype::F16, heads: 3, kv_heads: 1, window: 0, softcap: 0.0, seqs: mixed, extra_slots: 5 },
        Case {
            head_dim: 64,
            block: 16,
            dtype: PoolDtype::Bf16,
            heads: 2,
            kv_heads: 1,
            window: 0,
            softcap: 0.0,
            seqs: many,
            extra_slots: 2,
        },
        // Key tile 128..191 is whole for the first query tile's rows but for
        // the last's window (positions 129 on): the edge of the unmasked path.
        Case {
            head_dim: 64,
            block: 32,
            dtype: PoolDtype::Bf16,
            heads: 2,
            kv_heads: 1,
            window: 135,
            softcap: 0.0,
            seqs: vec![(400, 200)],
            extra_slots: 0,
        },
        Case {
            head_dim: 128,
            block: 16,
            dtype: PoolDtype::F16,
            heads: 2,
            kv_heads: 2,
            window: 45,
            softcap: 0.0,
            seqs: long.clone(),
            extra_slots: 0,
        },
        Case {
            head_dim: 256,
            block: 16,
            dtype: PoolDtype::Fp8E4m3,
            heads: 2,
            kv_heads: 1,
            window: 50,
            softcap: 30.0,
            seqs: long.clone(),
            extra_slots: 1,
        },
        Case {
            head_dim: 256,
            block: 32,
            dtype: PoolDtype::Bf16,
            heads: 2,
            kv_heads: 1,
            window: 0,
            softcap: 0.0,
            seqs: long,
            extra_slots: 0,
        },
    ];
    let mut built = std::collections::HashMap::new();
    for case in &cases {
        let exe = built.entry((case.head_dim, case.block)).or_insert_with(|| build(&cxx, &dir, case.head_dim, case.block)).clone();
        run_case(&dir, &exe, case, &mut rng);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
