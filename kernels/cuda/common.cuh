// Shared by every CUDA kernel of vellum-backend-cuda. The backend prepends
// this file to each kernel source before NVRTC compiles it, so the kernels
// need no header from a CUDA installation: 16-bit floats are stored as
// `unsigned short` and converted with PTX instructions.
//
// Element types of a KV cache or a table (the `_f32`, `_f16`, `_bf16`
// entry-point suffixes): `float`, `f16` (IEEE binary16), `bf16` (bfloat16);
// a KV cache also `fp8e4m3` (`_fp8`, OCP FP8 E4M3). Arithmetic is always f32.

// Distinct storage types, so that overloads pick the right conversion.
struct bf16 {
    unsigned short bits;
};
struct f16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(bf16 x) { return __int_as_float(((int)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
    // Round to nearest even; NaN stays NaN (quiet).
    unsigned int u = __float_as_uint(x);
    bf16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        b.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return b;
}

// FP8 E4M3 (vellum_base::fp8): sign, 4 exponent bits (bias 7), 3 mantissa
// bits; finite to ±448, NaN at 0x7f/0xff, no infinities. A code's seven
// low bits moved to bits 13..7 of a binary16 (its sign to bit 15) give the
// code's value divided by 2^8, subnormals included: to_float(fp8e4m3)
// returns that, and the host folds the 2^8 into the layer's scales. The
// conversions are plain integer arithmetic (no sm_89 instruction), so
// sm_80 runs them too and the host test (fp8_on_host.rs) builds this very
// section. FP8 (begin)
struct fp8e4m3 {
    unsigned char bits;
};

// The binary16 bits of the code's value / 2^8; a NaN code gives a quiet
// binary16 NaN of its sign.
__device__ __forceinline__ unsigned short fp8_f16_bits(unsigned int c) {
    const unsigned int low = c & 0x7fu;
    return (unsigned short)(((c & 0x80u) << 8) | (low == 0x7fu ? 0x7e00u : low << 7));
}

// The code nearest x (ties to even); |x| >= 448 and infinities saturate
// to ±448, NaN stays NaN.
__device__ __forceinline__ unsigned char fp8_from_float(float x) {
    const unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned char)(sign | 0x7fu);  // NaN
    if (a >= 0x43e00000u) return (unsigned char)(sign | 0x7eu);  // 448 and beyond
    if (a < 0x3c800000u) {
        // Below 2^-6: a multiple of 2^-9 (scaling by 2^9 is exact); 8 is
        // the smallest normal, code 0x08, by the same arithmetic.
        return (unsigned char)(sign | (unsigned int)__float2int_rn(__uint_as_float(a) * 512.f));
    }
    const unsigned int e = (a >> 23) - 120u;  // f32 bias 127, E4M3 bias 7
    const unsigned int m = a & 0x7fffffu, q = m >> 20, rest = m & 0xfffffu;
    const unsigned int up = (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) ? 1u : 0u;
    const unsigned int code = (e << 3) + q + up;  // a carry moves to the next exponent
    return (unsigned char)(sign | (code < 0x7eu ? code : 0x7eu));
}
// FP8 (end)

__device__ __forceinline__ float to_float(fp8e4m3 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(fp8_f16_bits(x.bits)));
    return f;
}
template <> __device__ __forceinline__ fp8e4m3 from_float<fp8e4m3>(float x) {
    fp8e4m3 c;
    c.bits = fp8_from_float(x);
    return c;
}

// Four consecutive elements as one load (16 bytes of f32, 8 of f16/bf16,
// 4 of FP8).
struct vec4f {
    float x, y, z, w;
};
template <typename T> struct Vec4;
template <> struct Vec4<float> {
    typedef float4 storage;
};
template <> struct Vec4<f16> {
    typedef uint2 storage;
};
template <> struct Vec4<bf16> {
    typedef uint2 storage;
};

// The four values of one load's bits.
__device__ __forceinline__ vec4f unpack4(float4 v) {
    vec4f r = {v.x, v.y, v.z, v.w};
    return r;
}
template <typename T> __device__ __forceinline__ vec4f unpack4_16(uint2 v) {
    T a, b, c, d;
    a.bits = (unsigned short)(v.x & 0xffffu);
    b.bits = (unsigned short)(v.x >> 16);
    c.bits = (unsigned short)(v.y & 0xffffu);
    d.bits = (unsigned short)(v.y >> 16);
    vec4f r = {to_float(a), to_float(b), to_float(c), to_float(d)};
    return r;
}
__device__ __forceinline__ vec4f unpack4_fp8(unsigned int v) {
    fp8e4m3 a, b, c, d;
    a.bits = (unsigned char)(v & 0xffu);
    b.bits = (unsigned char)((v >> 8) & 0xffu);
    c.bits = (unsigned char)((v >> 16) & 0xffu);
    d.bits = (unsigned char)(v >> 24);
    vec4f r = {to_float(a), to_float(b), to_float(c), to_float(d)};
    return r;
}

__device__ __forceinline__ vec4f load4(const float *p) { return unpack4(*reinterpret_cast<const float4 *>(p)); }
__device__ __forceinline__ vec4f load4(const f16 *p) { return unpack4_16<f16>(*reinterpret_cast<const uint2 *>(p)); }
__device__ __forceinline__ vec4f load4(const bf16 *p) { return unpack4_16<bf16>(*reinterpret_cast<const uint2 *>(p)); }
__device__ __forceinline__ vec4f load4(const fp8e4m3 *p) { return unpack4_fp8(*reinterpret_cast<const unsigned int *>(p)); }

// `load4` through the read-only data path (`ld.global.nc`), named: for a
// kernel with inline asm that has side effects (a prefetch), after which
// the compiler no longer proves on its own that its inputs stay unwritten.
__device__ __forceinline__ vec4f load4_nc(const float *p) { return unpack4(__ldg(reinterpret_cast<const float4 *>(p))); }
__device__ __forceinline__ vec4f load4_nc(const f16 *p) { return unpack4_16<f16>(__ldg(reinterpret_cast<const uint2 *>(p))); }
__device__ __forceinline__ vec4f load4_nc(const bf16 *p) { return unpack4_16<bf16>(__ldg(reinterpret_cast<const uint2 *>(p))); }
__device__ __forceinline__ vec4f load4_nc(const fp8e4m3 *p) {
    return unpack4_fp8(__ldg(reinterpret_cast<const unsigned int *>(p)));
}
// One element so.
__device__ __forceinline__ float load1_nc(const float *p) { return __ldg(p); }
__device__ __forceinline__ float load1_nc(const f16 *p) {
    f16 x;
    x.bits = __ldg(reinterpret_cast<const unsigned short *>(p));
    return to_float(x);
}
__device__ __forceinline__ float load1_nc(const bf16 *p) {
    bf16 x;
    x.bits = __ldg(reinterpret_cast<const unsigned short *>(p));
    return to_float(x);
}
__device__ __forceinline__ float load1_nc(const fp8e4m3 *p) {
    fp8e4m3 x;
    x.bits = __ldg(reinterpret_cast<const unsigned char *>(p));
    return to_float(x);
}

__device__ __forceinline__ float dot4(vec4f a, vec4f b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Asks L2 for the 128-byte line holding `p` (global memory), ahead of the
// loads that read it: no register waits for it, so a kernel can have the
// lines of its next iteration on their way while it works on this one.
__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// The gated activations (layers.cu's gated products, gemv_q.cu's gated
// input): SiLU, and GELU with the tanh approximation.
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// Sum (or max) over a thread block of `blockDim.x` threads, a multiple of
// 32; `scratch` holds one float per warp. Every thread gets the result.
template <typename WarpOp>
__device__ __forceinline__ float block_reduce(float v, float *scratch, float identity, WarpOp warp_op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_op(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : identity;
    return warp_op(v);
}
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    return block_reduce(v, scratch, 0.f, [](float x) { return warp_sum(x); });
}
__device__ __forceinline__ float block_max(float v, float *scratch) {
    return block_reduce(v, scratch, -3.0e38f, [](float x) { return warp_max(x); });
}

// Tensor-core primitives (sm_80 and later): `cp.async` copies into shared
// memory, `ldmatrix` fragment loads and the m16n8k16 `mma.sync` of 16-bit
// operands with f32 accumulation. Fragment layouts (PTX ISA, "Matrix
// fragments for mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A (16 × 16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g,
//     2t+8..), a3 = (g+8, 2t+8..), two 16-bit values a register, the lower
//     column in the low half;
//   B (16 × 8, "col"): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g);
//   C (16 × 8, f32): c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1).
// `ldmatrix.x4`: lanes 8i .. 8i+7 give the row addresses of 8 × 8 matrix i;
// each lane receives, from matrix i, row g's columns 2t, 2t+1 (`.trans`:
// column g's rows 2t, 2t+1). The host tests (flash_on_host.rs) replace this
// section with an emulation of exactly these rules. Tensor cores (begin)
__device__ __forceinline__ unsigned smem_addr(const void *p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global to shared memory; `src_bytes` = 0 writes zeros.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 4 or 8 bytes (through L1: `.cg` takes 16 only), both addresses aligned
// to their size.
template <int BYTES> __device__ __forceinline__ void cp_async_small(void *dst, const void *src) {
    static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most one committed group of this thread is in flight.
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
// Waits until at most N committed groups of this thread are in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
// `ldmatrix_x4` at a shared-memory address (`smem_addr`'s), for a loop that
// steps the address itself.
__device__ __forceinline__ void ldmatrix_x4_at(unsigned r[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte 0 (byte 1) of `v` as a signed 32-bit integer: `prmt`'s sign mode
// (`__byte_perm` masks its selector to three bits, dropping it), which
// ptxas turns, with the conversion to float after it, into sm_90's fast
// integer-to-float instruction.
__device__ __forceinline__ int sext_byte0(unsigned v) {
    int r;
    asm("prmt.b32 %0, %1, 0, 0x8880;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ int sext_byte1(unsigned v) {
    int r;
    asm("prmt.b32 %0, %1, 0, 0x9991;" : "=r"(r) : "r"(v));
    return r;
}
// Two f32 as bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Two f32 as f16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned pack_f16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Tensor cores (end)

// Instantiates the entry points `NAME_f32`, `NAME_f16`, `NAME_bf16` of a
// device function template `NAME<T>`: PARAMS is the entry points' parameter
// list (element pointers as `void *`), ARGS the call's argument list, in
// which `T` names the element type (cast the pointers with it).
#define VELLUM_FOR_EACH_DTYPE(NAME, PARAMS, ARGS)                                                                     \
    extern "C" __global__ void NAME##_f32 PARAMS {                                                                 \
        typedef float T;                                                                                           \
        NAME<T> ARGS;                                                                                              \
    }                                                                                                              \
    extern "C" __global__ void NAME##_f16 PARAMS {                                                                 \
        typedef f16 T;                                                                                             \
        NAME<T> ARGS;                                                                                              \
    }                                                                                                              \
    extern "C" __global__ void NAME##_bf16 PARAMS {                                                                \
        typedef bf16 T;                                                                                            \
        NAME<T> ARGS;                                                                                              \
    }

// VELLUM_FOR_EACH_DTYPE and `NAME_fp8` (FP8 E4M3): the kernels of a KV
// cache.
#define VELLUM_FOR_EACH_KV_DTYPE(NAME, PARAMS, ARGS)                                                                  \
    VELLUM_FOR_EACH_DTYPE(NAME, PARAMS, ARGS)                                                                      \
    extern "C" __global__ void NAME##_fp8 PARAMS {                                                                 \
        typedef fp8e4m3 T;                                                                                         \
        NAME<T> ARGS;                                                                                              \
    }

// ---------------------------------------------------------------------------
// Weight layouts (crates/backend-cuda/src/layout.rs writes them): a [n, k]
// weight as a plane of codes and a plane of f16 scales, row-major.
//   Q8:  codes int8 [n][k];                      scales d [n][k/32]:      w = d·q
//   Q4:  codes [n][k/2], code 2i in the low nibble of byte i, 2i+1 in the
//        high;                                   scales (d, m) [n][k/32]: w = fma(d, q, m)
//   F32: codes f32 [n][k];                       no scales
// `fetch` loads 16 consecutive weights of column n from k0 (a multiple of
// 16) as raw bits, with aligned 8- or 16-byte loads; `decode` turns them
// into f32. Splitting the two lets a kernel put every load of an iteration
// in flight before the first use.

__device__ __forceinline__ float half_bits_to_float(unsigned short b) {
    f16 h;
    h.bits = b;
    return to_float(h);
}

struct LayoutQ8 {
    struct Raw {
        uint4 codes;
        unsigned short d;
    };
    __device__ static __forceinline__ Raw fetch(const unsigned char *__restrict__ codes, const unsigned short *__restrict__ scales,
                                                int n, int k, int k0) {
        Raw r;
        r.codes = *reinterpret_cast<const uint4 *>(codes + (long long)n * k + k0);
        r.d = scales[(long long)n * (k / 32) + k0 / 32];
        return r;
    }
    __device__ static __forceinline__ void decode(const Raw &r, float w[16]) {
        const float d = half_bits_to_float(r.d);
        const unsigned words[4] = {r.codes.x, r.codes.y, r.codes.z, r.codes.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * i + j] = d * (float)(signed char)((words[i] >> (8 * j)) & 0xffu);
        }
    }
    // The 16 codes as exact floats, without their scale (returned, so that
    // d · q[i] is `decode`'s w[i] bit for bit). No integer-to-float
    // conversion (a quarter of the multiply-add rate): a byte permute puts
    // the code, its sign bit flipped (q + 128), under the bits of 2²³, and
    // 2²³ + 128 is subtracted. A permute and an add a weight.
    __device__ static __forceinline__ float decode_unscaled(const Raw &r, float q[16]) {
        const unsigned words[4] = {r.codes.x ^ 0x80808080u, r.codes.y ^ 0x80808080u, r.codes.z ^ 0x80808080u, r.codes.w ^ 0x80808080u};
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int j = 0; j < 4; j++) q[4 * i + j] = __uint_as_float(__byte_perm(words[i], 0x4b000000u, 0x7440u | (unsigned)j)) - 8388736.0f;
        }
        return half_bits_to_float(r.d);
    }
};

struct LayoutQ4 {
    struct Raw {
        uint2 codes;
        unsigned dm;
    };
    __device__ static __forceinline__ Raw fetch(const unsigned char *__restrict__ codes, const unsigned short *__restrict__ scales,
                                                int n, int k, int k0) {
        Raw r;
        r.codes = *reinterpret_cast<const uint2 *>(codes + (long long)n * (k / 2) + k0 / 2);
        r.dm = *reinterpret_cast<const unsigned *>(scales + 2 * ((long long)n * (k / 32) + k0 / 32));
        return r;
    }
    __device__ static __forceinline__ void decode(const Raw &r, float w[16]) {
        const float d = half_bits_to_float((unsigned short)(r.dm & 0xffffu)), m = half_bits_to_float((unsigned short)(r.dm >> 16));
        const unsigned words[2] = {r.codes.x, r.codes.y};
#pragma unroll
        for (int i = 0; i < 2; i++) {
#pragma unroll
            for (int j = 0; j < 8; j++) w[8 * i + j] = fmaf(d, (float)((words[i] >> (4 * j)) & 0xfu), m);
        }
    }
};

struct LayoutF32 {
    struct Raw {
        float4 v[4];
    };
    __device__ static __forceinline__ Raw fetch(const unsigned char *__restrict__ codes, const unsigned short *__restrict__ scales,
                                                int n, int k, int k0) {
        Raw r;
        const float4 *p = reinterpret_cast<const float4 *>(reinterpret_cast<const float *>(codes) + (long long)n * k + k0);
#pragma unroll
        for (int i = 0; i < 4; i++) r.v[i] = p[i];
        return r;
    }
    __device__ static __forceinline__ void decode(const Raw &r, float w[16]) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[4 * i] = r.v[i].x;
            w[4 * i + 1] = r.v[i].y;
            w[4 * i + 2] = r.v[i].z;
            w[4 * i + 3] = r.v[i].w;
        }
    }
};

// The K-quants: a row's scale words are its sub-block scales (k/32 words),
// then its super-block scales; `row` is the row's first word.
//   Q4K: sub word = sc | m << 8 per 32; super = (d, dmin) f16 pair per 256:
//        w = fma(d·sc, q, −dmin·m), q the nibble (as Q4).
//   Q5K: as Q4K with q a byte 0..31 (as Q8's planes).
//   Q6K: sub words = two int8 scales, one per 16; super = d f16 per 256:
//        w = (d·sc)·q, q an int8 (−32..31).
// d·sc and dmin·m are exact in f32, so each weight is rounded once, as
// ggml rounds it.

// The scales of 16 Q4K/Q5K weights: their sub-block's (sc, m) word and
// their super-block's (d, dmin) pair.
struct K4Scales {
    unsigned short sm;
    unsigned dd;
};

__device__ __forceinline__ K4Scales fetch_k4_scales(const unsigned short *__restrict__ scales, int n, int k, int k0) {
    const unsigned short *row = scales + (long long)n * (k / 32 + k / 128);
    K4Scales s;
    s.sm = row[k0 / 32];
    s.dd = *reinterpret_cast<const unsigned *>(row + k / 32 + 2 * (k0 / 256));
    return s;
}

__device__ __forceinline__ void decode_k4(const K4Scales &s, const unsigned char q[16], float w[16]) {
    const float d = half_bits_to_float((unsigned short)(s.dd & 0xffffu)), dmin = half_bits_to_float((unsigned short)(s.dd >> 16));
    const float d0 = d * (float)(s.sm & 0xffu), min0 = dmin * (float)(s.sm >> 8);
#pragma unroll
    for (int i = 0; i < 16; i++) w[i] = fmaf(d0, (float)q[i], -min0);
}

struct LayoutQ4K {
    struct Raw {
        uint2 codes;
        K4Scales s;
    };
    __device__ static __forceinline__ Raw fetch(const unsigned char *__restrict__ codes, const unsigned short *__restrict__ scales,
                                                int n, int k, int k0) {
        Raw r;
        r.codes = *reinterpret_cast<const uint2 *>(codes + (long long)n * (k / 2) + k0 / 2);
        r.s = fetch_k4_scales(scales, n, k, k0);
        return r;
    }
    __device__ static __forceinline__ void decode(const Raw &r, float w[16]) {
        unsigned char q[16];
        const unsigned words[2] = {r.codes.x, r.codes.y};
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) q[8 * i + j] = (unsigned char)((words[i] >> (4 * j)) & 0xfu);
        decode_k4(r.s, q, w);
    }
};

struct LayoutQ5K {
    struct Raw {
        uint4 codes;
        K4Scales s;
    };
    __device__ static __forceinline__ Raw fetch(const unsigned char *__restrict__ codes, const unsigned short *__restrict__ scales,
                                                int n, int k, int k0) {
        Raw r;
        r.codes = *reinterpret_cast<const uint4 *>(codes + (long long)n * k + k0);
        r.s = fetch_k4_scales(scales, n, k, k0);
        return r;
    }
    __device__ static __forceinline__ void decode(const Raw &r, float w[16]) {
        unsigned char q[16];
        const unsigned words[4] = {r.codes.x, r.codes.y, r.codes.z, r.codes.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) q[4 * i + j] = (unsigned char)((words[i] >> (8 * j)) & 0xffu);
        decode_k4(r.s, q, w);
    }
};

struct LayoutQ6K {
    struct Raw {
        uint4 codes;
        unsigned short sc2;
        unsigned short d;
        int half;
    };
    __device__ static __forceinline__ Raw fetch(const unsigned char *__restrict__ codes, const unsigned short *__restrict__ scales,
                                                int n, int k, int k0) {
        Raw r;
        r.codes = *reinterpret_cast<const uint4 *>(codes + (long long)n * k + k0);
        const unsigned short *row = scales + (long long)n * (k / 32 + k / 256);
        r.sc2 = row[k0 / 32];
        r.d = row[k / 32 + k0 / 256];
        r.half = (k0 / 16) & 1;
        return r;
    }
    __device__ static __forceinline__ void decode(const Raw &r, float w[16]) {
        const float ds = half_bits_to_float(r.d) * (float)(signed char)((r.sc2 >> (8 * r.half)) & 0xffu);
        const unsigned words[4] = {r.codes.x, r.codes.y, r.codes.z, r.codes.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * i + j] = ds * (float)(signed char)((words[i] >> (8 * j)) & 0xffu);
    }
};
