//! The kernels' FP8 E4M3 conversions, compiled for the host: the "FP8"
//! section of `kernels/cuda/common.cuh` — the very text `reshape_and_cache`
//! rounds with and paged attention widens with — built with the machine's
//! C++ compiler behind a shim for CUDA's intrinsics, and compared with
//! `vellum_base::fp8` (the CPU backend's rounding) on every code's value,
//! every midpoint between two codes, the range's edges and a million random
//! bit patterns. So the GPU stores the codes the CPU stores, bit for bit,
//! checked on any machine.
//!
//! Without a C++ compiler (`c++`, `g++` or `clang++`, or `CXX`) the test
//! says SKIPPED by name; CI has one.

#[path = "common/host_cxx.rs"]
mod host_cxx;

use std::process::Command;
use vellum_base::fp8;

/// What the FP8 section needs from CUDA, for a host compiler.
const SHIM: &str = r#"
#include <cmath>
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
static inline unsigned int __float_as_uint(float x) { unsigned int u; std::memcpy(&u, &x, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float x; std::memcpy(&x, &u, 4); return x; }
// Round to nearest, ties to even (the default rounding mode).
static inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
"#;

/// Reads f32 bit patterns from argv[1], writes one code a pattern to
/// argv[2]; then the binary16 bits of all 256 codes to argv[3].
const MAIN: &str = r#"
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    FILE *in = std::fopen(argv[1], "rb"), *out = std::fopen(argv[2], "wb"), *halves = std::fopen(argv[3], "wb");
    if (!in || !out || !halves) return 3;
    unsigned int u;
    while (std::fread(&u, 4, 1, in) == 1) {
        unsigned char c = fp8_from_float(__uint_as_float(u));
        std::fwrite(&c, 1, 1, out);
    }
    for (unsigned int c = 0; c < 256; c++) {
        unsigned short h = fp8_f16_bits(c);
        std::fwrite(&h, 2, 1, halves);
    }
    return std::fclose(out) | std::fclose(halves);
}
"#;

/// The inputs: every code's value and its negation, the midpoints and
/// quarter points between neighbouring codes, the edges of the range and
/// of the subnormals, and random bit patterns (NaNs and infinities among
/// them).
fn inputs() -> Vec<f32> {
    let mut xs = Vec::new();
    let finite: Vec<u8> = (0..=0x7eu8).collect();
    for &c in &finite {
        xs.push(fp8::to_f32(c));
        if c < 0x7e {
            let (lo, hi) = (fp8::to_f32(c), fp8::to_f32(c + 1));
            xs.extend([(lo + hi) / 2.0, lo + (hi - lo) / 4.0, lo + 3.0 * (hi - lo) / 4.0]);
        }
    }
    xs.extend([448.0, 463.9, 464.0, 464.1, 1e30, f32::INFINITY, f32::NAN, 0.0, f32::MIN_POSITIVE, 2f32.powi(-10), 2f32.powi(-6)]);
    xs.extend(xs.clone().iter().map(|x| -x));
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..1_000_000 {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        xs.push(f32::from_bits((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32));
    }
    xs
}

#[test]
fn the_kernels_fp8_conversions_compiled_for_the_host_match_the_cpu_bit_for_bit_or_skip_without_a_compiler() {
    let test = "the_kernels_fp8_conversions_compiled_for_the_host_match_the_cpu_bit_for_bit";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let common = vellum_kernels::cuda::COMMON;
    let start = common.find("FP8 (begin)\n").expect("common.cuh has its FP8 section") + "FP8 (begin)\n".len();
    let end = common.find("// FP8 (end)").expect("common.cuh ends its FP8 section");
    let source = format!("{SHIM}\n#line 1 \"common.cuh (FP8)\"\n{}\n{MAIN}", &common[start..end]);
    let dir = std::env::temp_dir().join(format!("vellum-fp8-on-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = host_cxx::build(&cxx, &dir, "fp8", &source);

    let xs = inputs();
    let (input, codes, halves) = (dir.join("in"), dir.join("codes"), dir.join("halves"));
    std::fs::write(&input, xs.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect::<Vec<u8>>()).expect("inputs");
    let status = Command::new(&exe).args([&input, &codes, &halves]).status().expect("run the conversions");
    assert!(status.success(), "the conversions exited with {status}");
    let got = std::fs::read(&codes).expect("codes");
    assert_eq!(got.len(), xs.len());
    let mut nan = 0;
    for (&x, &c) in xs.iter().zip(&got) {
        let want = fp8::from_f32(x);
        assert_eq!(c, want, "{x:e} ({:#010x}): the kernel's code {c:#04x}, the CPU's {want:#04x}", x.to_bits());
        nan += usize::from(x.is_nan());
    }
    assert!(nan > 100, "the random patterns hold NaNs ({nan})");
    let halves = std::fs::read(&halves).expect("halves");
    for c in 0..=255u8 {
        let h = u16::from_le_bytes([halves[2 * c as usize], halves[2 * c as usize + 1]]);
        assert_eq!(h, fp8::to_f16_bits(c), "code {c:#04x} widens to other binary16 bits");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
