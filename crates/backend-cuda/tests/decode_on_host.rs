//! The kernels' weight decoders, compiled for the host: the "weight layouts"
//! section of `kernels/cuda/common.cuh` — the very text every GEMV, GEMM and
//! dequantization kernel includes — is built with the machine's C++
//! compiler behind a small shim for CUDA's keywords and vector types, run
//! over every layout of random weights, and compared bit for bit with
//! `layout::dequantize_repacked` (itself checked against ggml's
//! dequantization). So a decoding mistake shows on any machine, not only
//! on a GPU.
//!
//! Without a C++ compiler (`c++`, `g++` or `clang++`, or `CXX`) the test
//! says SKIPPED by name; CI has one.

#[path = "common/host_cxx.rs"]
mod host_cxx;

use std::path::{Path, PathBuf};
use std::process::Command;
use vellum_backend_cuda::layout::{dequantize_repacked, f32_layout, repack, QuantFormat, Repacked};
use vellum_ops::quant::GgmlType;

/// What the decoders need from CUDA, for a host compiler.
const SHIM: &str = r#"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
using std::fmaf;
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
// Byte n of the result: byte (s >> 4n) & 7 of y:x.
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long in = x | ((unsigned long long)y << 32);
    unsigned r = 0;
    for (int n = 0; n < 4; n++) r |= (unsigned)((in >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
    return r;
}
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct f16 { unsigned short bits; };
// IEEE binary16 to binary32, exactly (subnormals too).
static inline float to_float(f16 h) {
    unsigned s = (h.bits >> 15) & 1u, e = (h.bits >> 10) & 31u, m = h.bits & 1023u, bits;
    if (e == 0) {
        float v = std::ldexp((float)m, -24);
        return s ? -v : v;
    }
    bits = e == 31 ? (s << 31) | 0x7f800000u | (m << 13) : (s << 31) | ((e + 112u) << 23) | (m << 13);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
"#;

/// Reads the planes and the shape, writes every row's values, 16 at a time
/// through the layout's own fetch and decode.
const MAIN: &str = r#"
template <typename L>
static void run(const unsigned char *codes, const unsigned short *scales, int n, int k, std::vector<float> &out) {
    for (int row = 0; row < n; row++)
        for (int k0 = 0; k0 < k; k0 += 16) {
            float w[16];
            L::decode(L::fetch(codes, scales, row, k, k0), w);
            for (int i = 0; i < 16; i++) out[(size_t)row * k + k0 + i] = w[i];
        }
}
// Q8 through `decode_unscaled`: the scale times each exact code.
static void run_q8_unscaled(const unsigned char *codes, const unsigned short *scales, int n, int k, std::vector<float> &out) {
    for (int row = 0; row < n; row++)
        for (int k0 = 0; k0 < k; k0 += 16) {
            float q[16];
            const float d = LayoutQ8::decode_unscaled(LayoutQ8::fetch(codes, scales, row, k, k0), q);
            for (int i = 0; i < 16; i++) out[(size_t)row * k + k0 + i] = d * q[i];
        }
}
static std::vector<unsigned char> slurp(const char *path) {
    FILE *f = std::fopen(path, "rb");
    if (!f) std::exit(3);
    std::vector<unsigned char> v;
    int c;
    while ((c = std::fgetc(f)) != EOF) v.push_back((unsigned char)c);
    std::fclose(f);
    v.resize(v.size() + 16);  // room for the last fetch of a shorter plane
    return v;
}
int main(int argc, char **argv) {
    if (argc != 7) return 2;
    int format = std::atoi(argv[1]), n = std::atoi(argv[2]), k = std::atoi(argv[3]);
    std::vector<unsigned char> codes = slurp(argv[4]), scale_bytes = slurp(argv[5]);
    std::vector<unsigned short> scales(scale_bytes.size() / 2 + 1);
    std::memcpy(scales.data(), scale_bytes.data(), scale_bytes.size() / 2 * 2);
    std::vector<float> out((size_t)n * k);
    switch (format) {
    case 0: run<LayoutQ8>(codes.data(), scales.data(), n, k, out); break;
    case 1: run<LayoutQ4>(codes.data(), scales.data(), n, k, out); break;
    case 2: run<LayoutQ4K>(codes.data(), scales.data(), n, k, out); break;
    case 3: run<LayoutQ5K>(codes.data(), scales.data(), n, k, out); break;
    case 4: run<LayoutQ6K>(codes.data(), scales.data(), n, k, out); break;
    case 5: run<LayoutF32>(codes.data(), scales.data(), n, k, out); break;
    case 6: run_q8_unscaled(codes.data(), scales.data(), n, k, out); break;
    default: return 2;
    }
    FILE *f = std::fopen(argv[6], "wb");
    if (!f || std::fwrite(out.data(), 4, out.size(), f) != out.size()) return 4;
    std::fclose(f);
    return 0;
}
"#;

fn format_id(f: QuantFormat) -> u32 {
    match f {
        QuantFormat::Q8 => 0,
        QuantFormat::Q4 => 1,
        QuantFormat::Q4K => 2,
        QuantFormat::Q5K => 3,
        QuantFormat::Q6K => 4,
        QuantFormat::F32 => 5,
    }
}

/// Builds the decoders' program in `dir`.
fn build(cxx: &str, dir: &Path) -> PathBuf {
    let common = vellum_kernels::cuda::COMMON;
    let start = common.find("// Weight layouts").expect("common.cuh has its weight-layouts section");
    let source = format!("{SHIM}\n#line 1 \"common.cuh (weight layouts)\"\n{}\n{MAIN}", &common[start..]);
    host_cxx::build(cxx, dir, "decode", &source)
}

/// xorshift64*.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Random GGUF blocks of `dtype`, finite f16 fields, in `[n, k]`.
fn blocks(dtype: GgmlType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let (block, bb) = dtype.block_layout();
    let mut data = bytes(seed, n * k / block * bb);
    let halves: &[usize] = match dtype {
        GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[0],
    };
    for (i, b) in data.chunks_exact_mut(bb).enumerate() {
        for (h, &at) in halves.iter().enumerate() {
            let v = half::f16::from_f32(if h == 0 { 3e-3 + (i % 89) as f32 * 7e-5 } else { -0.04 + (i % 11) as f32 * 2e-3 });
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    data
}

#[test]
fn the_kernels_weight_decoders_compiled_for_the_host_give_the_layouts_values_bit_for_bit_or_skip_without_a_compiler() {
    let test = "the_kernels_weight_decoders_compiled_for_the_host_give_the_layouts_values_bit_for_bit";
    let Some(cxx) = host_cxx::compiler_or_skip(test) else { return };
    let dir = std::env::temp_dir().join(format!("vellum-decode-on-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = build(&cxx, &dir);
    let (n, k) = (5, 768);
    let cases: Vec<(String, Repacked)> = [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K]
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), repack(t, &blocks(t, n, k, 17 + i as u64), n, k).expect("repacks")))
        .chain(std::iter::once((
            "F32".to_string(),
            f32_layout(&bytes(5, n * k).iter().map(|&b| f32::from(b) / 7.0 - 18.0).collect::<Vec<_>>()),
        )))
        .collect();
    // Q8 twice: through `decode` and through `decode_unscaled` times its scale.
    let q8 = cases[0].1.clone();
    let cases = cases.into_iter().map(|(name, r)| (name, r, None)).chain(std::iter::once(("Q8_0 unscaled".to_string(), q8, Some(6))));
    for (name, r, id) in cases {
        let (codes, scales, out) = (dir.join("codes"), dir.join("scales"), dir.join("out"));
        std::fs::write(&codes, &r.codes).expect("codes");
        std::fs::write(&scales, r.scales.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>()).expect("scales");
        let status = Command::new(&exe)
            .args([id.unwrap_or_else(|| format_id(r.format)).to_string(), n.to_string(), k.to_string()])
            .args([&codes, &scales, &out])
            .status()
            .expect("run the decoders");
        assert!(status.success(), "{name}: the decoders exited with {status}");
        let got: Vec<f32> =
            std::fs::read(&out).expect("out").chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let want = dequantize_repacked(&r, n, k);
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.to_bits() == w.to_bits() || (g == w), "{name} value {i} (row {}, column {}): kernel {g} vs layout {w}", i / k, i % k);
        }
        assert!(want.iter().any(|v| *v != 0.0), "{name}: nonzero values");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
