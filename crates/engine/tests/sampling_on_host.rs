//! `kernels/cuda/sampling.cu`, the device sampler, compiled for the host
//! and run with one host thread per GPU thread (its reductions use shared
//! memory and barriers only), against the host sampler
//! (`vellum_engine::sampler::sample`) on the same rows and the same draws:
//! greedy, plain draws, top-k, top-p, min-p and their mix, penalties and
//! logit bias, the sampled token's logprob and the top logprobs, over
//! peaked, flat, tied, one-hot and banned (-inf) rows. The kernel's text is the very one
//! NVRTC compiles, so a mistake in its cuts shows on any machine. It runs
//! three ways: as NVRTC builds it (rows without min-p drawn from the score
//! bins, the rest by the radix descents), with few bins and a small gather
//! (many rows left to the descents, the bins' walks across several bins),
//! and with the bins off (the descents alone).
//!
//! Without a C++ compiler (`c++`, `g++` or `clang++`, or `CXX`) the test
//! says SKIPPED by name; CI has one.

#[path = "../../backend-cuda/tests/common/host_cxx.rs"]
mod host_cxx;

use vellum_backend_cuda::sampling::pack;
use vellum_base::{PenaltyEntry, RowSampling, SamplingParams, SeededRng, TokenId};
use vellum_engine::sampler::{penalty_entries, row_sampling, sample};

/// What the kernel needs from CUDA, for a host compiler; 16 threads a block
/// (`check_at` sets others).
const SHIM: &str = r#"
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#define SAMPLE_THREADS 16
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static
struct Index { unsigned x; };
static Index blockIdx, blockDim = {SAMPLE_THREADS};
static thread_local Index threadIdx;
static std::barrier<> *block_barrier;
static void __syncthreads() { block_barrier->arrive_and_wait(); }
static float __fadd_rn(float a, float b) { return a + b; }
static float __fsub_rn(float a, float b) { return a - b; }
static float __fmul_rn(float a, float b) { return a * b; }
static unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static double __longlong_as_double(long long u) { double f; std::memcpy(&f, &u, 8); return f; }
static unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
using std::log;
using std::fmaxf;
// Per row: drawn from the bins (1), left to the descents (0), neither (-1);
// the top logprobs listed from the bins likewise.
static std::vector<int> binned_row, top_row;
#define SAMPLE_NOTE_BINNED(took) (binned_row[blockIdx.x] = (took) ? 1 : 0)
#define SAMPLE_NOTE_TOP(took) (top_row[blockIdx.x] = (took) ? 1 : 0)
"#;

const MAIN: &str = r#"
template <typename T> static std::vector<T> slurp(const std::string &path) {
    FILE *f = std::fopen(path.c_str(), "rb");
    if (!f) std::exit(3);
    std::fseek(f, 0, SEEK_END);
    long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<T> v(n / sizeof(T));
    if (std::fread(v.data(), 1, n, f) != (size_t)n) std::exit(3);
    std::fclose(f);
    return v;
}
template <typename T> static void spill(const std::string &path, const std::vector<T> &v) {
    FILE *f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) std::exit(4);
    std::fclose(f);
}
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    const int vocab = std::atoi(argv[1]), stride = std::atoi(argv[2]);
    const std::string dir = argv[3];
    auto logits = slurp<float>(dir + "/logits");
    auto fparams = slurp<float>(dir + "/fparams");
    auto iparams = slurp<int>(dir + "/iparams");
    auto uniform = slurp<double>(dir + "/uniform");
    auto pen_tokens = slurp<int>(dir + "/pen_tokens");
    auto pen_values = slurp<float>(dir + "/pen_values");
    const int rows = (int)uniform.size();
    binned_row.assign(rows, -1);
    top_row.assign(rows, -1);
    std::vector<int> tokens(rows, -7), top_ids((size_t)rows * stride, -7);
    std::vector<float> lps(rows), top_lp((size_t)rows * stride), pen_raw(pen_tokens.size());
    std::barrier<> bar(SAMPLE_THREADS);
    block_barrier = &bar;
    for (int r = 0; r < rows; r++) {
        blockIdx.x = r;
        std::vector<std::thread> threads;
        for (int t = 0; t < SAMPLE_THREADS; t++)
            threads.emplace_back([&, t] {
                threadIdx.x = t;
                sample_rows(tokens.data(), lps.data(), top_ids.data(), top_lp.data(), stride, logits.data(), pen_raw.data(), vocab,
                            fparams.data(), iparams.data(), uniform.data(), pen_tokens.data(), pen_values.data());
            });
        for (auto &th : threads) th.join();
    }
    spill(dir + "/tokens", tokens);
    spill(dir + "/logprobs", lps);
    spill(dir + "/top_ids", top_ids);
    spill(dir + "/top_lp", top_lp);
    spill(dir + "/binned", binned_row);
    spill(dir + "/top_binned", top_row);
    return 0;
}
"#;

fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain numbers (f32, f64, i32) viewed as their bytes, native order.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)).to_vec() }
}

fn read<T: Copy + Default>(path: &std::path::Path) -> Vec<T> {
    let b = std::fs::read(path).expect("kernel output");
    let n = b.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    // SAFETY: `v` holds exactly `n · size_of::<T>()` bytes, all overwritten.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr().cast::<u8>(), n * std::mem::size_of::<T>()) };
    v
}

/// A row of logits of the given kind.
fn row(kind: usize, vocab: usize, rng: &mut SeededRng) -> Vec<f32> {
    match kind {
        // Peaked: a language model's shape, a few far above the rest.
        0 => (0..vocab).map(|i| (rng.normal() * 2.0) as f32 + if i % 97 == 3 { 6.0 } else { 0.0 }).collect(),
        // Flat: top-p cuts deep into the row.
        1 => (0..vocab).map(|_| rng.signed_f32() * 0.5).collect(),
        // Tied: a quarter-step grid, equal scores everywhere.
        2 => (0..vocab).map(|_| (rng.signed_f32() * 8.0).round() / 4.0).collect(),
        // One far ahead: every other weight underflows to zero.
        3 => (0..vocab).map(|i| if i == vocab / 3 { 150.0 } else { rng.signed_f32() }).collect(),
        // Banned tokens: every seventh at -inf (a logit bias of -inf).
        _ => (0..vocab).map(|i| if i % 7 == 2 { f32::NEG_INFINITY } else { (rng.normal() * 2.0) as f32 }).collect(),
    }
}

fn params() -> Vec<SamplingParams> {
    let base = SamplingParams { temperature: 0.8, ..SamplingParams::greedy(8) };
    let pens = SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.3,
        logit_bias: vec![(5, 2.5), (11, -100.0)],
        ..base.clone()
    };
    vec![
        SamplingParams::greedy(8),
        base.clone(),
        SamplingParams { temperature: 1.0, ..base.clone() },
        SamplingParams { top_k: 1, ..base.clone() },
        SamplingParams { top_k: 5, ..base.clone() },
        SamplingParams { top_k: 50, temperature: 1.3, ..base.clone() },
        SamplingParams { top_p: 0.9, ..base.clone() },
        SamplingParams { top_p: 0.5, ..base.clone() },
        SamplingParams { top_p: 0.99, temperature: 1.0, ..base.clone() },
        SamplingParams { min_p: 0.05, temperature: 1.0, ..base.clone() },
        SamplingParams { min_p: 0.3, ..base.clone() },
        SamplingParams { top_k: 40, top_p: 0.9, min_p: 0.02, temperature: 0.9, ..base.clone() },
        SamplingParams { top_p: 0.95, temperature: 0.8, logprobs: Some(5), ..base.clone() },
        // The edges: top-k past the gather, a cut at the top entry, nearly
        // greedy and nearly uniform temperatures.
        SamplingParams { top_k: 1025, temperature: 1.0, ..base.clone() },
        SamplingParams { top_p: 1e-6, ..base.clone() },
        SamplingParams { top_p: 0.9, temperature: 1e-3, ..base.clone() },
        SamplingParams { top_k: 50, top_p: 0.95, temperature: 100.0, ..base.clone() },
        SamplingParams { top_k: 20, logprobs: Some(20), ..base.clone() },
        SamplingParams { temperature: 0.0, logprobs: Some(2), ..base.clone() },
        SamplingParams { temperature: 0.0, ..pens.clone() },
        SamplingParams { logprobs: Some(3), ..pens.clone() },
        SamplingParams { top_p: 0.9, ..pens },
    ]
}

#[test]
fn the_device_sampler_compiled_for_the_host_draws_the_host_samplers_tokens_or_skips_without_a_compiler() {
    let test = "the_device_sampler_compiled_for_the_host_draws_the_host_samplers_tokens";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    // 16 threads a block, and 64: the kernel sums its bins' columns in
    // groups of 16 threads, so only the larger block adds groups together
    // as a GPU block (256) does.
    for threads in [16, 64] {
        // Of the 510 rows with rank cuts and no min-p, all but the tied top-p
        // rows of 20,011 (a score shared by ~1,180 entries, past the
        // gather: 15 rows) and top-k 1,025 (past the gather: 30 rows) are
        // drawn from the bins (top-k 1 as the argmax): 465 on 2026-11-28.
        // Fewer means the walks or the bins' placing left rows to the
        // descents that they used to draw.
        // The 90 rows asking for 3 or 5 top logprobs are all listed from the
        // bins (the tied rows' top score is shared by ~625 entries).
        let took = check_at(&cxx, threads, Bins::AsBuilt);
        assert!(took[1] >= 455 && took[0] <= 45, "{threads} threads: {took:?} rows [drawn: descents, bins; top: passes, bins]");
        assert!(took[3] >= 85 && took[2] <= 5, "{threads} threads: {took:?} rows [drawn: descents, bins; top: passes, bins]");
    }
    let took = check_at(&cxx, 16, Bins::Few);
    assert!(took.iter().all(|&n| n >= 20), "few bins: both paths run ({took:?}: [drawn: descents, bins; top: passes, bins])");
    let took = check_at(&cxx, 64, Bins::Off);
    assert_eq!(took, [0; 4], "the bins off");
}

/// How `sample_binned` is built for a run.
#[derive(Clone, Copy, Debug)]
enum Bins {
    /// As NVRTC builds it.
    AsBuilt,
    /// 64 bins and 16 gathered entries: bins full past the gather, cuts
    /// the fixed point places wrongly on coarse bins.
    Few,
    /// `SAMPLE_BINNED 0`: the radix descents alone.
    Off,
}

/// Runs the kernel on every row kind and parameter set against the host
/// sampler; returns how many rows the bins [left to the descents, drew],
/// and whose top logprobs they [left to a pass each, listed].
fn check_at(cxx: &str, threads: usize, bins: Bins) -> [i32; 4] {
    let dir = std::env::temp_dir().join(format!("vellum-sampling-on-host-{}-{threads}-{bins:?}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut shim = SHIM.replace("#define SAMPLE_THREADS 16", &format!("#define SAMPLE_THREADS {threads}"));
    assert!(shim.contains(&format!("SAMPLE_THREADS {threads}\n")), "the shim sets the block size");
    match bins {
        Bins::AsBuilt => {}
        Bins::Few => shim.push_str("#define SAMPLE_HIST_BINS 64\n#define SAMPLE_GATHER 16\n"),
        Bins::Off => shim.push_str("#define SAMPLE_BINNED 0\n"),
    }
    let exe = host_cxx::build_threaded(cxx, &dir, "sampling", &format!("{shim}\n{}\n{MAIN}", vellum_kernels::cuda::SAMPLING));

    let (mut rows_checked, mut draws, mut disagreements, mut took) = (0, 0, Vec::new(), [0i32; 4]);
    for vocab in [37usize, 3001, 20011] {
        let mut gen = SeededRng::new(vocab as u64);
        let (mut logits, mut rows, mut pens, mut want) = (Vec::new(), Vec::new(), Vec::<PenaltyEntry>::new(), Vec::new());
        let prompt: Vec<TokenId> = vec![1, 2, 3, 5, 8, 13];
        let output: Vec<TokenId> = vec![3, 3, 21, 34, 2, 3];
        for kind in 0..5 {
            for p in params() {
                for seed in 0..3u64 {
                    let x = row(kind, vocab, &mut gen);
                    let mut rng = SeededRng::new(seed * 7919 + kind as u64);
                    let uniform = rng.clone().uniform();
                    let k = p.logprobs.unwrap_or(0);
                    let s = sample(&x, &p, &mut rng, k, (&prompt, &output));
                    let entries = penalty_entries(&p, &prompt, &output, vocab).expect("no duplicate bias");
                    let start = pens.len() as u32;
                    pens.extend(entries);
                    rows.push(row_sampling(&p, uniform, (start, pens.len() as u32)));
                    logits.extend(x);
                    want.push((s, kind, p.clone()));
                }
            }
        }
        // -0 ties +0 (the lower id wins, as on the host); a row with a NaN
        // comes back as -1 (the host samples that step).
        let mut zeros: Vec<f32> = (0..vocab).map(|i| -1.0 - i as f32 * 0.01).collect();
        (zeros[0], zeros[2]) = (-0.0, 0.0);
        let mut nan = row(0, vocab, &mut gen);
        nan[5] = f32::NAN;
        for (x, p) in [(zeros, SamplingParams::greedy(8)), (nan, SamplingParams { temperature: 0.8, ..SamplingParams::greedy(8) })] {
            let mut rng = SeededRng::new(1);
            let uniform = rng.clone().uniform();
            let s = sample(&x, &p, &mut rng, 0, (&[], &[]));
            let start = pens.len() as u32;
            rows.push(RowSampling { temperature: p.temperature, top_p: 1.0, uniform, penalties: (start, start), ..RowSampling::default() });
            logits.extend(x);
            want.push((s, 99, p));
        }
        // The kernel's inputs as the CUDA backend packs them.
        let packed = pack(&rows, &pens, vocab).expect("rows the kernel takes");
        let stride = packed.top_stride;
        for (name, data) in [
            ("logits", bytes(&logits)),
            ("fparams", bytes(&packed.fparams)),
            ("iparams", bytes(&packed.iparams)),
            ("uniform", bytes(&packed.uniform)),
            ("pen_tokens", bytes(&packed.pen_tokens)),
            ("pen_values", bytes(&packed.pen_values)),
        ] {
            std::fs::write(dir.join(name), data).expect("write input");
        }
        let run = std::process::Command::new(&exe).arg(vocab.to_string()).arg(stride.to_string()).arg(&dir).output().expect("run");
        assert!(run.status.success(), "the host build of sample_rows failed: {run:?}");
        let tokens: Vec<i32> = read(&dir.join("tokens"));
        let lps: Vec<f32> = read(&dir.join("logprobs"));
        let top_ids: Vec<i32> = read(&dir.join("top_ids"));
        let top_lp: Vec<f32> = read(&dir.join("top_lp"));
        let binned: Vec<i32> = read(&dir.join("binned"));
        let top_binned: Vec<i32> = read(&dir.join("top_binned"));
        assert_eq!(binned.len(), rows.len());
        assert_eq!(tokens.len(), rows.len());
        for (i, (s, kind, p)) in want.iter().enumerate() {
            rows_checked += 1;
            if *kind == 99 && p.temperature > 0.0 {
                assert_eq!(tokens[i], -1, "a row with a NaN goes back to the host");
                continue;
            }
            if *kind == 99 {
                assert_eq!((tokens[i], s.token), (0, 0), "-0 and +0 tie: the lower id");
            }
            draws += usize::from(p.temperature > 0.0);
            if binned[i] >= 0 {
                took[binned[i] as usize] += 1;
            }
            if top_binned[i] >= 0 {
                took[2 + top_binned[i] as usize] += 1;
            }
            if tokens[i] != s.token as i32 {
                disagreements.push(format!(
                    "vocab {vocab}, row kind {kind}, {p:?}: device {} host {} (u = {})",
                    tokens[i], s.token, rows[i].uniform
                ));
                continue;
            }
            if rows[i].logprob {
                assert!((lps[i] - s.logprob).abs() < 1e-5, "logprob {} against {} ({p:?})", lps[i], s.logprob);
            } else {
                assert!(lps[i].is_nan(), "an unasked logprob is NaN");
            }
            for (j, &(id, lp)) in s.top_logprobs.iter().enumerate() {
                assert_eq!(top_ids[i * stride + j], id as i32, "top entry {j} of row {i} ({p:?})");
                assert!((top_lp[i * stride + j] - lp).abs() < 1e-5, "top logprob {j}: {} against {lp}", top_lp[i * stride + j]);
            }
        }
    }
    eprintln!(
        "{threads} threads a block, bins {bins:?}: {rows_checked} rows, {draws} of them draws ({} from the bins, {} left to the descents), \
         top logprobs of {} rows from the bins, {} a pass each: {} disagreements",
        took[1],
        took[0],
        took[3],
        took[2],
        disagreements.len()
    );
    assert!(disagreements.is_empty(), "the device sampler drew other tokens than the host's:\n{}", disagreements.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
    took
}
