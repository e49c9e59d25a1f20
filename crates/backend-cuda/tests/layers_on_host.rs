//! Kernels of `kernels/cuda/layers.cu` that use no shared memory and no
//! barrier, compiled for the host and run block by block, thread by thread
//! (each thread's strided loop, one after another, covers what the threads
//! of a block cover together): the split of a stacked q/k/v product with
//! and without RoPE, the same split writing its keys and values into a
//! paged cache (float32 pool, scaled), and the gated activations of a
//! stacked gate/up product, against Rust's own arithmetic. The kernels' text is taken from
//! the very source NVRTC compiles, so a mistake in their indexing shows on
//! any machine, not only on a GPU.
//!
//! Without a C++ compiler (`c++`, `g++` or `clang++`, or `CXX`) the test
//! says SKIPPED by name; CI has one.

#[path = "common/host_cxx.rs"]
mod host_cxx;

use std::path::{Path, PathBuf};
use std::process::Command;

/// What the kernels need from CUDA, for a host compiler.
const SHIM: &str = r#"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define NUM_THREADS 256
struct Index { int x; };
static Index blockIdx, threadIdx;
// CUDA's fast exponential: the C library's exact one (tanhf is math.h's).
#define __expf(x) std::exp((float)(x))
// common.cuh's conversion, for a float32 pool.
template <typename T> T from_float(float x) { return (T)x; }
"#;

/// Reads the inputs, runs every kernel over its grid, writes the outputs.
const MAIN: &str = r#"
static std::vector<float> slurp(const char *path, size_t n) {
    std::vector<float> v(n);
    FILE *f = std::fopen(path, "rb");
    if (!f || std::fread(v.data(), 4, n, f) != n) std::exit(3);
    std::fclose(f);
    return v;
}
static void spill(const char *path, const std::vector<float> &v) {
    FILE *f = std::fopen(path, "wb");
    if (!f || std::fwrite(v.data(), 4, v.size(), f) != v.size()) std::exit(4);
    std::fclose(f);
}
template <typename F> static void grid(int blocks, F f) {
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < NUM_THREADS; t++) {
            blockIdx.x = b;
            threadIdx.x = t;
            f();
        }
}
int main(int argc, char **argv) {
    // tokens nq nk nv head_dim positions inter pool_slots dir
    if (argc != 10) return 2;
    int tokens = std::atoi(argv[1]), nq = std::atoi(argv[2]), nk = std::atoi(argv[3]), nv = std::atoi(argv[4]);
    int hd = std::atoi(argv[5]), npos = std::atoi(argv[6]), inter = std::atoi(argv[7]), pool = std::atoi(argv[8]);
    std::string dir = argv[9];
    std::vector<float> qkv = slurp((dir + "/qkv").c_str(), (size_t)tokens * (nq + nk + nv));
    std::vector<float> table = slurp((dir + "/table").c_str(), (size_t)npos * hd);
    std::vector<float> posf = slurp((dir + "/positions").c_str(), tokens);
    std::vector<long long> pos(tokens);
    for (int t = 0; t < tokens; t++) pos[t] = (long long)posf[t];
    for (int rotate = 0; rotate < 2; rotate++) {
        std::vector<float> q((size_t)tokens * nq, NAN), k((size_t)tokens * nk, NAN), v((size_t)tokens * nv, NAN);
        grid(tokens, [&] { split_qkv_rope(q.data(), k.data(), v.data(), qkv.data(), table.data(), pos.data(), nq, nk, nv, hd, rotate); });
        std::string tag = rotate ? "_rope" : "";
        spill((dir + "/q" + tag).c_str(), q);
        spill((dir + "/k" + tag).c_str(), k);
        spill((dir + "/v" + tag).c_str(), v);
        // The split writing k and v into a float32 pool of `pool` slots
        // (NaN where nothing is written) at the tokens' slots, scaled.
        std::vector<float> slotf = slurp((dir + "/slots").c_str(), tokens);
        std::vector<long long> slots(tokens);
        for (int t = 0; t < tokens; t++) slots[t] = (long long)slotf[t];
        std::vector<float> qc((size_t)tokens * nq, NAN), kc((size_t)pool * nk, NAN), vc((size_t)pool * nk, NAN);
        grid(tokens, [&] {
            split_qkv_rope_cache<float>(qc.data(), qkv.data(), table.data(), pos.data(), kc.data(), vc.data(), slots.data(), nq, nk, hd,
                                        rotate, 0.5f, 2.0f);
        });
        spill((dir + "/q_cache" + tag).c_str(), qc);
        spill((dir + "/k_pool" + tag).c_str(), kc);
        spill((dir + "/v_pool" + tag).c_str(), vc);
    }
    std::vector<float> gu = slurp((dir + "/gate_up").c_str(), (size_t)tokens * 2 * inter);
    std::vector<float> silu_out((size_t)tokens * inter, NAN), gelu_out((size_t)tokens * inter, NAN);
    grid(tokens, [&] { silu_and_mul(silu_out.data(), gu.data(), inter); });
    grid(tokens, [&] { gelu_tanh_and_mul(gelu_out.data(), gu.data(), inter); });
    spill((dir + "/silu").c_str(), silu_out);
    spill((dir + "/gelu").c_str(), gelu_out);
    return 0;
}
"#;

/// The text of the function `name` in `src`: from the line that declares it
/// (and the `template` line above it, if any) to its closing brace at the
/// start of a line.
fn function(src: &str, name: &str) -> String {
    let at = src.find(&format!(" {name}(")).unwrap_or_else(|| panic!("the source defines {name}"));
    let mut start = src[..at].rfind('\n').map_or(0, |i| i + 1);
    if let Some(above) = src[..start.saturating_sub(1)].rfind('\n').map(|i| i + 1) {
        if src[above..start].starts_with("template") {
            start = above;
        }
    }
    let line_end = start + src[start..].find('\n').unwrap_or(src.len() - start);
    let line = &src[start..line_end];
    if line.matches('{').count() > 0 && line.matches('{').count() == line.matches('}').count() {
        return line.to_string();
    }
    let end = start + src[start..].find("\n}").unwrap_or_else(|| panic!("{name} ends")) + 2;
    src[start..end].to_string()
}

fn build(cxx: &str, dir: &Path) -> PathBuf {
    let (layers, common) = (vellum_kernels::cuda::LAYERS, vellum_kernels::cuda::COMMON);
    let kernels: Vec<String> = ["silu", "gelu_tanh"]
        .iter()
        .map(|n| function(common, n))
        .chain(
            ["split_row", "split_qkv_rope", "split_qkv_rope_cache", "silu_and_mul", "gelu_tanh_and_mul"]
                .iter()
                .map(|n| function(layers, n)),
        )
        .collect();
    host_cxx::build(cxx, dir, "layers", &format!("{SHIM}\n#include <string>\n{}\n{MAIN}", kernels.join("\n\n")))
}

/// Values in [-2, 2), xorshift64*.
fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            ((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn write(dir: &Path, name: &str, v: &[f32]) {
    std::fs::write(dir.join(name), v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).expect("write input");
}

fn read(dir: &Path, name: &str) -> Vec<f32> {
    std::fs::read(dir.join(name)).expect("output").chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: kernel {g}, reference {w}");
    }
}

#[test]
fn split_qkv_rope_and_the_stacked_gated_activations_run_on_the_host_as_the_reference_or_skip_without_a_compiler() {
    let test = "split_qkv_rope_and_the_stacked_gated_activations_run_on_the_host_as_the_reference";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-layers-on-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = build(&cxx, &dir);
    // SmolLM2's split (9 query and 3 KV heads of 64) on 5 tokens; more
    // columns than a block's 256 threads, so every thread loops.
    let (tokens, hd, npos, inter) = (5usize, 64usize, 40usize, 300usize);
    let (nq, nk, nv) = (9 * hd, 3 * hd, 3 * hd);
    let width = nq + nk + nv;
    let qkv = values(1, tokens * width);
    let table = values(2, npos * hd);
    let positions: Vec<f32> = [0, 7, 39, 12, 3].map(|p| p as f32).to_vec();
    // Slots in an 8-slot pool, one token padding (-1).
    let (pool, slots) = (8usize, [5i64, -1, 0, 7, 2]);
    let gate_up = values(3, tokens * 2 * inter);
    let slot_values: Vec<f32> = slots.iter().map(|&s| s as f32).collect();
    for (name, v) in [("qkv", &qkv), ("table", &table), ("positions", &positions), ("gate_up", &gate_up), ("slots", &slot_values)] {
        write(&dir, name, v);
    }
    let status = Command::new(&exe)
        .args([tokens, nq, nk, nv, hd, npos, inter, pool].map(|n| n.to_string()))
        .arg(&dir)
        .status()
        .expect("run the kernels");
    assert!(status.success(), "the kernels exited with {status}");

    // The split alone: each part's columns of each row, exactly.
    let part =
        |from: usize, n: usize| -> Vec<f32> { (0..tokens).flat_map(|t| qkv[t * width + from..t * width + from + n].to_vec()).collect() };
    let (q, k, v) = (part(0, nq), part(nq, nk), part(nq + nk, nv));
    close(&read(&dir, "q"), &q, 0.0, "q");
    close(&read(&dir, "k"), &k, 0.0, "k");
    close(&read(&dir, "v"), &v, 0.0, "v");
    // With RoPE: every head's pairs (f, f + 32) rotated by the table's row
    // at the token's position; v as without.
    let rotate = |x: &[f32], heads: usize| -> Vec<f32> {
        let mut out = x.to_vec();
        let half = hd / 2;
        for t in 0..tokens {
            let cs = &table[positions[t] as usize * hd..][..hd];
            for h in 0..heads {
                let row = &mut out[(t * heads + h) * hd..][..hd];
                for f in 0..half {
                    let (a, b) = (row[f], row[f + half]);
                    row[f] = a * cs[f] - b * cs[half + f];
                    row[f + half] = b * cs[f] + a * cs[half + f];
                }
            }
        }
        out
    };
    close(&read(&dir, "q_rope"), &rotate(&q, 9), 1e-6, "q rotated");
    close(&read(&dir, "k_rope"), &rotate(&k, 3), 1e-6, "k rotated");
    close(&read(&dir, "v_rope"), &v, 0.0, "v beside the rotation");
    // Split into the cache: q as the split gives it, bit for bit; each
    // token's k and v (rotated k with RoPE) at its slot times 0.5 and 2;
    // the padding token and the slots no token has left as they were.
    for tag in ["", "_rope"] {
        let (q_split, k_split) = (read(&dir, &format!("q{tag}")), read(&dir, &format!("k{tag}")));
        let q_cache = read(&dir, &format!("q_cache{tag}"));
        assert!(q_cache.iter().zip(&q_split).all(|(a, b)| a.to_bits() == b.to_bits()), "q{tag} through the cache split");
        let (k_pool, v_pool) = (read(&dir, &format!("k_pool{tag}")), read(&dir, &format!("v_pool{tag}")));
        for slot in 0..pool {
            let kp = &k_pool[slot * nk..][..nk];
            let vp = &v_pool[slot * nk..][..nk];
            match slots.iter().position(|&s| s == slot as i64) {
                Some(t) => {
                    let want_k: Vec<f32> = k_split[t * nk..][..nk].iter().map(|x| x * 0.5).collect();
                    let want_v: Vec<f32> = v[t * nv..][..nv].iter().map(|x| x * 2.0).collect();
                    close(kp, &want_k, 0.0, &format!("k{tag} at slot {slot}"));
                    close(vp, &want_v, 0.0, &format!("v{tag} at slot {slot}"));
                }
                None => assert!(kp.iter().chain(vp).all(|x| x.is_nan()), "slot {slot}{tag} was written"),
            }
        }
    }
    // The gated activations of [gate | up] rows.
    let gated = |act: &dyn Fn(f32) -> f32| -> Vec<f32> {
        (0..tokens)
            .flat_map(|t| (0..inter).map(move |i| (t, i)))
            .map(|(t, i)| act(gate_up[t * 2 * inter + i]) * gate_up[t * 2 * inter + inter + i])
            .collect()
    };
    let silu = |x: f32| x / (1.0 + (-x).exp());
    let gelu = |x: f32| 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh());
    close(&read(&dir, "silu"), &gated(&silu), 1e-6, "silu_and_mul");
    close(&read(&dir, "gelu"), &gated(&gelu), 1e-6, "gelu_tanh_and_mul");
    let _ = std::fs::remove_dir_all(&dir);
}
