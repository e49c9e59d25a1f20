//! `kernels/cuda/paged_attention.cu`, the decode kernels (v1, and v2 with
//! its reduction), compiled for the host and run with one host thread per
//! GPU thread (`common/host_cuda.rs`: barriers, shuffles): a wrong block
//! walk, mask, partition or GQA head shows on any machine, against a
//! float64 reference, not only on a GPU.
//!
//! Checked: every KV-cache type (f32, f16, bf16, FP8 with scales), head
//! sizes 64, 128 and 256, blocks of 8, 16 and 32 tokens, a thread block
//! serving 1 to 4 query heads of a GQA group, mixed batches (decodes, a
//! speculative verification, a prompt chunk after cached positions),
//! sliding windows, a soft-cap, v2's partitions (several a sequence, the
//! last cut short) and `skip_min_q` (the rows flash prefill takes stay
//! untouched). Nothing is written past the dynamic shared memory the
//! launch gives v1, and every prefetch names a line of a block that some
//! sequence's table holds.
//!
//! The value loop's tiles (`V_TILE` tokens' values loaded before any is
//! used) and the prefetches of the next KV block must not change a bit:
//! each program is also built as the kernel was before them (`V_TILE=1`,
//! `PA_PREFETCH=0`) and the two outputs compared bit for bit.
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
use std::path::{Path, PathBuf};
use std::process::Command;
use vellum_backend_cuda::launch::PoolDtype;
use vellum_base::SeededRng;

/// What the kernel reads of `common.cuh` besides the FP8 section and the
/// block reductions (taken as they are): the conversions, the read-only
/// loads, the four-element dot product, the warp maximum, the prefetch.
const HELPERS: &str = r#"
static inline float to_float(float x) { return x; }
static inline float to_float(bf16 x) { return bf16_value(x.bits); }
static inline float to_float(fp8e4m3 x) { return f16_value(fp8_f16_bits(x.bits)); }
template <typename T> static inline vec4f load4_nc(const T *p) { return {to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3])}; }
template <typename T> static inline float load1_nc(const T *p) { return to_float(*p); }
static inline float dot4(vec4f a, vec4f b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
static inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// A prefetch reads nothing here; it must name a line of a block some
// block table holds, in one of the pools.
static const unsigned char *pool_lo[2], *pool_hi[2];
static size_t block_bytes = 1;
static std::vector<char> referenced;
static bool prefetched_outside = false;
static inline void prefetch_l2(const void *p) {
    const unsigned char *b = (const unsigned char *)p;
    for (int i = 0; i < 2; i++)
        if (b >= pool_lo[i] && b < pool_hi[i] && referenced[(size_t)(b - pool_lo[i]) / block_bytes]) return;
    prefetched_outside = true;
}
"#;

/// Reads the inputs, runs v1 or v2 + reduce over the batch, writes `out`.
const MAIN: &str = r#"
template <typename T> static void put(const std::string &path, const std::vector<T> &v) {
    FILE *f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) std::exit(4);
    std::fclose(f);
}
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    const int dtype = std::atoi(argv[1]);  // 0 f32, 1 f16, 2 bf16, 3 fp8
    const int version = std::atoi(argv[2]);
    const std::string dir = argv[3];
    auto ints = slurp<int>(dir + "/ints");  // heads kv_heads max_blocks tokens window skip_min_q max_parts max_context
    auto floats = slurp<float>(dir + "/floats");  // scale softcap v_scale
    auto q = slurp<float>(dir + "/q");
    auto kc = slurp<unsigned char>(dir + "/k");
    auto vc = slurp<unsigned char>(dir + "/v");
    auto tables = slurp<int>(dir + "/tables");
    auto qsl = slurp<int>(dir + "/qsl");
    auto ctx = slurp<int>(dir + "/ctx");
    auto token_seq = slurp<int>(dir + "/token_seq");
    const int heads = ints[0], kv_heads = ints[1], max_blocks = ints[2], tokens = ints[3], window = ints[4];
    const int skip = ints[5], max_parts = ints[6], max_context = ints[7];
    std::vector<float> out((size_t)tokens * heads * HEAD_DIM, NAN);
    pool_lo[0] = kc.data(), pool_hi[0] = kc.data() + kc.size();
    pool_lo[1] = vc.data(), pool_hi[1] = vc.data() + vc.size();
    block_bytes = (size_t)BLOCK_SIZE * kv_heads * HEAD_DIM * (dtype == 0 ? 4 : dtype == 3 ? 1 : 2);
    referenced.assign(kc.size() / block_bytes, 0);
    for (int b = 0; b < (int)qsl.size() - 1; b++)
        for (int j = 0; j < (ctx[b] + BLOCK_SIZE - 1) / BLOCK_SIZE; j++) referenced[tables[(size_t)b * max_blocks + j]] = 1;
    const int smem = version == 1 ? QUERIES * max_context : max_parts;
    if (smem + PA_GUARD > PA_SMEM) return 5;
    for (int i = smem; i < smem + PA_GUARD; i++) pa_dynamic_smem[i] = 1234.5f;
    if (version == 1) {
        launch(heads / QUERIES, tokens, NUM_THREADS, [&] {
            auto run = [&](auto kernel) {
                kernel(out.data(), q.data(), kc.data(), vc.data(), tables.data(), max_blocks, token_seq.data(), qsl.data(),
                       ctx.data(), heads, kv_heads, floats[0], floats[1], window, floats[2], skip);
            };
            if (dtype == 0) run(paged_attention_v1_f32);
            else if (dtype == 1) run(paged_attention_v1_f16);
            else if (dtype == 2) run(paged_attention_v1_bf16);
            else run(paged_attention_v1_fp8);
        });
    } else {
        const size_t slots = (size_t)tokens * heads * max_parts;
        std::vector<float> tmp(slots * HEAD_DIM, NAN), maxes(slots, NAN), sums(slots, NAN);
        launch3(heads / QUERIES, tokens, max_parts, NUM_THREADS, [&] {
            auto run = [&](auto kernel) {
                kernel(tmp.data(), maxes.data(), sums.data(), q.data(), kc.data(), vc.data(), tables.data(), max_blocks,
                       token_seq.data(), qsl.data(), ctx.data(), heads, kv_heads, floats[0], floats[1], window, floats[2], skip);
            };
            if (dtype == 0) run(paged_attention_v2_f32);
            else if (dtype == 1) run(paged_attention_v2_f16);
            else if (dtype == 2) run(paged_attention_v2_bf16);
            else run(paged_attention_v2_fp8);
        });
        launch(heads, tokens, NUM_THREADS, [&] {
            paged_attention_v2_reduce(out.data(), tmp.data(), maxes.data(), sums.data(), token_seq.data(), qsl.data(), ctx.data(),
                                      heads, max_parts, window, skip);
        });
    }
    for (int i = smem; i < smem + PA_GUARD; i++)
        if (pa_dynamic_smem[i] != 1234.5f) return 6;  // wrote past its dynamic shared memory
    if (prefetched_outside) return 7;  // a prefetch named a line outside the pools
    put(dir + "/out", out);
    return 0;
}
"#;

/// The section of `common.cuh` from `begin` up to `end`.
fn section(begin: &str, end: &str) -> &'static str {
    let common = vellum_kernels::cuda::COMMON;
    let start = common.find(begin).unwrap_or_else(|| panic!("common.cuh has {begin:?}"));
    let stop = start + common[start..].find(end).unwrap_or_else(|| panic!("common.cuh has {end:?} after {begin:?}"));
    &common[start..stop]
}

/// One compiled configuration of the kernel file.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Config {
    head_dim: usize,
    block: usize,
    queries: usize,
    partition: usize,
}

/// The program for `config`: the kernel's default loads, or (`one_token`)
/// a token's values at a time and no prefetch. (The host does not contract
/// multiplies and adds; the GPU suite compares the loads' bits as a GPU
/// rounds them.)
fn build(cxx: &str, dir: &Path, c: Config, one_token: bool) -> PathBuf {
    // v1's scores and v2_reduce's weights live in dynamic shared memory:
    // one host buffer stands in for it, a guard band after what the launch
    // gives (checked by the program).
    let kernel = vellum_kernels::cuda::PAGED_ATTENTION
        .replacen("extern __shared__ float logits[];", "float *logits = pa_dynamic_smem;", 1)
        .replacen("extern __shared__ float weights[];", "float *weights = pa_dynamic_smem;", 1);
    assert!(!kernel.contains("extern __shared__"), "every dynamic shared buffer of paged_attention.cu is stood in for");
    let source = format!(
        "{SHIM}
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define PA_SMEM (1 << 16)
#define PA_GUARD 1024
static float pa_dynamic_smem[PA_SMEM];
#line 1 \"common.cuh (FP8)\"
{}
{HELPERS}
#line 1 \"common.cuh (block reductions)\"
{}
#line 1 \"common.cuh (entry points)\"
{}
#define HEAD_DIM {}
#define BLOCK_SIZE {}
#define QUERIES {}
#define PARTITION_SIZE {}
{}
#line 1 \"paged_attention.cu\"
{kernel}
{MAIN}",
        section("struct fp8e4m3 {", "// FP8 (end)"),
        section("// Sum (or max) over a thread block", "// Tensor-core primitives"),
        section("// Instantiates the entry points", "// -----"),
        c.head_dim,
        c.block,
        c.queries,
        c.partition,
        if one_token { "#define V_TILE 1\n#define PA_PREFETCH 0" } else { "" },
    );
    let name = format!("paged{}_{}_{}_{}{}", c.head_dim, c.block, c.queries, c.partition, if one_token { "_v1tok" } else { "" });
    host_cxx::build_threaded(cxx, dir, &name, &source)
}

/// Runs `exe` on the batch written in `dir`; its output.
fn run(exe: &Path, dir: &Path, dtype: PoolDtype, version: u32) -> Vec<f32> {
    let dtype_id = match dtype {
        PoolDtype::F32 => 0,
        PoolDtype::F16 => 1,
        PoolDtype::Bf16 => 2,
        PoolDtype::Fp8E4m3 => 3,
    };
    let status = Command::new(exe).arg(dtype_id.to_string()).arg(version.to_string()).arg(dir).status().expect("run the kernel");
    assert!(status.success(), "{} (v{version}) exited with {status}", exe.display());
    host_cxx::read_f32s(&dir.join("out"))
}

/// Writes `case`'s batch, runs v1 and v2 with both value loops, checks
/// them against float64 and the two loops against each other.
fn check(dir: &Path, exes: (&Path, &Path), c: Config, case: &Case, skip_min_q: usize, rng: &mut SeededRng) {
    let d = case.head_dim;
    let b = case.batch(rng);
    let mut token_seq = Vec::new();
    for (s, &(_, ql)) in case.seqs.iter().enumerate() {
        token_seq.extend(std::iter::repeat_n(s as i32, ql));
    }
    let max_context = case.seqs.iter().map(|&(ctx, _)| ctx).max().unwrap_or(0);
    let max_parts = max_context.div_ceil(c.partition);
    let ints = [
        case.heads as i32,
        case.kv_heads as i32,
        b.max_blocks as i32,
        b.num_tokens as i32,
        case.window as i32,
        skip_min_q as i32,
        max_parts as i32,
        max_context as i32,
    ];
    let floats = case.kernel_scales(&b);
    b.write(dir);
    for (name, data) in
        [("ints", host_cxx::bytes_of(&ints)), ("floats", host_cxx::bytes_of(&floats)), ("token_seq", host_cxx::bytes_of(&token_seq))]
    {
        std::fs::write(dir.join(name), data).expect("write an input");
    }
    let started = std::time::Instant::now();
    for version in [1, 2] {
        let got = run(exes.0, dir, case.dtype, version);
        let one_token = run(exes.1, dir, case.dtype, version);
        let differ = got.iter().zip(&one_token).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "v{version} {c:?} {:?}: the tiled value loop changed {differ} outputs' bits", case.dtype);
        let (mut worst, mut t, mut rows) = (0f64, 0usize, 0usize);
        for (s, &(_, ql)) in case.seqs.iter().enumerate() {
            for i in 0..ql {
                for h in 0..case.heads {
                    let out = &got[(t * case.heads + h) * d..(t * case.heads + h + 1) * d];
                    if skip_min_q > 0 && ql >= skip_min_q {
                        assert!(out.iter().all(|x| x.is_nan()), "v{version} seq {s} token {i} head {h}: a skipped row was written");
                        continue;
                    }
                    for (e, (&g, want)) in out.iter().zip(case.reference(&b, s, i, t, h, f64::from)).enumerate() {
                        let err = if g.is_finite() { (f64::from(g) - want).abs() } else { f64::INFINITY };
                        assert!(err < 1e-5, "v{version} {c:?} {:?}: seq {s} token {i} head {h} dim {e}: kernel {g} vs {want}", case.dtype);
                        worst = worst.max(err);
                    }
                    rows += 1;
                }
                t += 1;
            }
        }
        assert!(rows > 0, "the case has rows the kernel attends");
        eprintln!(
            "v{version} {c:?} {:?} heads {}/{} window {} softcap {} skip {skip_min_q}: {rows} rows, max |err| {worst:.2e}",
            case.dtype, case.heads, case.kv_heads, case.window, case.softcap
        );
    }
    eprintln!("  ({:.1} s)", started.elapsed().as_secs_f64());
}

#[test]
fn paged_decode_kernels_compiled_for_the_host_match_the_float64_reference_or_skip_without_a_compiler() {
    let test = "paged_decode_kernels_compiled_for_the_host_match_the_float64_reference";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-paged-on-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut rng = SeededRng::new(0x2545_f491_4f6c_dd1d);
    // Decodes at a one-token context, a partial block, several partitions
    // of 512; a verification of 5 positions; a prompt chunk after 40 cached
    // positions.
    let mixed = vec![(1, 1), (17, 1), (600, 1), (1100, 1), (40, 5), (70, 30)];
    let short = vec![(1, 1), (9, 1), (33, 1), (200, 1), (50, 3), (90, 20)];
    let case = |head_dim, block, dtype, heads, kv_heads, window, softcap, seqs: &Vec<(usize, usize)>| Case {
        head_dim,
        block,
        dtype,
        heads,
        kv_heads,
        window,
        softcap,
        seqs: seqs.clone(),
        extra_slots: 0,
    };
    let runs: Vec<(Config, Case, usize)> = vec![
        // Llama's shape: a GQA group of 4 a thread block.
        (Config { head_dim: 128, block: 16, queries: 4, partition: 512 }, case(128, 16, PoolDtype::Bf16, 8, 2, 0, 0.0, &mixed), 0),
        (Config { head_dim: 128, block: 16, queries: 4, partition: 512 }, case(128, 16, PoolDtype::F32, 8, 2, 0, 0.0, &short), 0),
        (Config { head_dim: 128, block: 16, queries: 4, partition: 512 }, case(128, 16, PoolDtype::Fp8E4m3, 4, 1, 0, 0.0, &short), 16),
        // SmolLM2's: 3 heads a group, a sliding window, blocks of 8.
        (Config { head_dim: 64, block: 8, queries: 3, partition: 512 }, case(64, 8, PoolDtype::F16, 3, 1, 45, 0.0, &mixed), 0),
        // No grouping, blocks of 32.
        (Config { head_dim: 128, block: 32, queries: 1, partition: 512 }, case(128, 32, PoolDtype::F16, 2, 2, 0, 0.0, &short), 0),
        // Gemma's head size with a soft-cap and window; partitions of 64.
        (Config { head_dim: 256, block: 16, queries: 2, partition: 64 }, case(256, 16, PoolDtype::Bf16, 4, 2, 150, 30.0, &short), 0),
        (Config { head_dim: 256, block: 32, queries: 2, partition: 64 }, case(256, 32, PoolDtype::Fp8E4m3, 2, 1, 0, 0.0, &short), 0),
    ];
    let mut built = std::collections::HashMap::new();
    for (config, case, skip) in &runs {
        let (tiled, one) =
            built.entry(*config).or_insert_with(|| (build(&cxx, &dir, *config, false), build(&cxx, &dir, *config, true))).clone();
        check(&dir, (&tiled, &one), *config, case, *skip, &mut rng);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
