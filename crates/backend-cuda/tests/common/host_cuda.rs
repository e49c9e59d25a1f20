//! CUDA for the host's C++ compiler, for the `*_on_host` tests of kernels
//! that use shared memory, barriers and warp-wide operations: a host
//! thread per GPU thread, a block's barrier, and `mma.sync`, `ldmatrix`,
//! shuffles and ballots emulated by the PTX ISA's rules (each lane
//! publishes its part and reads the others' between two barriers of its
//! warp). `kernels/cuda/common.cuh`'s tensor-core section states the
//! fragment rules this follows.

/// The emulation: keywords, vector types, `launch(gx, gy, threads, kernel)`
/// (blocks one after another, a thread per GPU thread), the barrier and the
/// warp-wide operations. A program defines `__shared__` and `__align__`
/// itself (static shared arrays, or one dynamic buffer).
pub const EMULATION: &str = r#"
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include <algorithm>
#include <cstdint>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
using std::min;
using std::max;
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct Dim { unsigned x, y, z; };
static Dim blockIdx, gridDim, blockDim;
static thread_local Dim threadIdx;
static inline unsigned int __float_as_uint(float x) { unsigned int u; std::memcpy(&u, &x, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float x; std::memcpy(&x, &u, 4); return x; }
static inline float __int_as_float(int u) { float x; std::memcpy(&x, &u, 4); return x; }
static inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };
using std::fmaf;
#define __expf(x) std::exp((float)(x))
static inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// Byte n of the result: byte (s >> 4n) & 7 of y:x.
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long in = x | ((unsigned long long)y << 32);
    unsigned r = 0;
    for (int n = 0; n < 4; n++) r |= (unsigned)((in >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
    return r;
}


static std::barrier<> *block_barrier;
static void __syncthreads() { block_barrier->arrive_and_wait(); }
static const int WARPS = 8;
struct Warp {
    std::barrier<> *bar;
    unsigned long long word[32][6];
    const void *ptr[32];
};
static Warp warps[WARPS];
static inline int lane_id() { return threadIdx.x & 31; }
static inline Warp &my_warp() { return warps[threadIdx.x >> 5]; }
static inline void warp_sync() { my_warp().bar->arrive_and_wait(); }

template <typename T> static unsigned long long bits_of(T v) { unsigned long long u = 0; std::memcpy(&u, &v, sizeof(T)); return u; }
template <typename T> static T of_bits(unsigned long long u) { T v; std::memcpy(&v, &u, sizeof(T)); return v; }
template <typename T> static T exchange(T v, int src) {
    Warp &w = my_warp();
    w.word[lane_id()][0] = bits_of(v);
    warp_sync();
    T r = of_bits<T>(w.word[src][0]);
    warp_sync();
    return r;
}
template <typename T> static T __shfl_xor_sync(unsigned, T v, int o) { return exchange(v, lane_id() ^ o); }
template <typename T> static T __shfl_sync(unsigned, T v, int src) { return exchange(v, src & 31); }
template <typename T> static T __shfl_up_sync(unsigned, T v, unsigned d) {
    const int src = lane_id() - (int)d;
    T r = exchange(v, src < 0 ? lane_id() : src);
    return r;
}
static unsigned __ballot_sync(unsigned, bool p) {
    Warp &w = my_warp();
    w.word[lane_id()][0] = p ? 1 : 0;
    warp_sync();
    unsigned r = 0;
    for (int l = 0; l < 32; l++) r |= (unsigned)w.word[l][0] << l;
    warp_sync();
    return r;
}

// 16-bit values.
static float bf16_value(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
static float f16_value(unsigned short b) { _Float16 h; std::memcpy(&h, &b, 2); return (float)h; }
static unsigned short bf16_bits(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static unsigned short f16_bits(float x) { _Float16 h = (_Float16)x; unsigned short b; std::memcpy(&b, &h, 2); return b; }
static unsigned pack_bf16(float lo, float hi) { return bf16_bits(lo) | ((unsigned)bf16_bits(hi) << 16); }
static int sext_byte0(unsigned v) { return (int)(signed char)(v & 0xffu); }
static int sext_byte1(unsigned v) { return (int)(signed char)((v >> 8) & 0xffu); }
static unsigned pack_f16(float lo, float hi) { return f16_bits(lo) | ((unsigned)f16_bits(hi) << 16); }

// cp.async: the source is read at issue (global memory nobody writes
// meanwhile); the destination reads as garbage (all ones: a 16-bit NaN)
// until a wait lands the copy's group, so a kernel that reads a stage
// before waiting for it, or waits too little, reads NaN. A copy whose
// addresses are not aligned to its size (a fault on a GPU) ends the
// program with status 7.
struct PendingCopy { void *dst; int bytes; unsigned char data[16]; };
static thread_local std::vector<std::vector<PendingCopy>> cp_groups;
static thread_local std::vector<PendingCopy> cp_open;
static void cp_async_any(void *dst, const void *src, int bytes, int src_bytes) {
    if ((uintptr_t)dst % bytes != 0 || (uintptr_t)src % bytes != 0) std::exit(7);
    PendingCopy c;
    c.dst = dst;
    c.bytes = bytes;
    if (src_bytes == bytes) std::memcpy(c.data, src, bytes); else std::memset(c.data, 0, bytes);
    std::memset(dst, 0xff, bytes);
    cp_open.push_back(c);
}
static void cp_async16(void *dst, const void *src, int src_bytes) { cp_async_any(dst, src, 16, src_bytes); }
template <int BYTES> static void cp_async_small(void *dst, const void *src) { cp_async_any(dst, src, BYTES, BYTES); }
static void cp_async_commit() { cp_groups.push_back(cp_open); cp_open.clear(); }
// Lands every committed group but the newest N.
template <int N> static void cp_async_wait() {
    while (cp_groups.size() > (size_t)N) {
        for (auto &c : cp_groups.front()) std::memcpy(c.dst, c.data, c.bytes);
        cp_groups.erase(cp_groups.begin());
    }
}
static void cp_async_wait_one() { cp_async_wait<1>(); }

// ldmatrix.x4: lanes 8i .. 8i+7 give matrix i's row addresses; lane
// (g, t) receives row g's columns 2t, 2t+1 (.trans: column g's rows 2t, 2t+1).
static void ldmatrix_any(unsigned r[4], const void *p, bool trans) {
    Warp &w = my_warp();
    w.ptr[lane_id()] = p;
    warp_sync();
    const int g = lane_id() >> 2, t = lane_id() & 3;
    for (int i = 0; i < 4; i++) {
        unsigned short lo, hi;
        if (!trans) {
            const unsigned short *row = (const unsigned short *)w.ptr[8 * i + g];
            lo = row[2 * t], hi = row[2 * t + 1];
        } else {
            lo = ((const unsigned short *)w.ptr[8 * i + 2 * t])[g];
            hi = ((const unsigned short *)w.ptr[8 * i + 2 * t + 1])[g];
        }
        r[i] = lo | ((unsigned)hi << 16);
    }
    warp_sync();
}
static void ldmatrix_x4(unsigned r[4], const void *p) { ldmatrix_any(r, p, false); }
// Shared-memory addresses: offsets into the program's shared window (a
// kernel of dynamic shared memory: the buffer standing for it), which the
// program sets before a launch.
static unsigned char *shared_window = nullptr;
static unsigned smem_addr(const void *p) { return (unsigned)((const unsigned char *)p - shared_window); }
static void ldmatrix_x4_at(unsigned r[4], unsigned addr) { ldmatrix_any(r, shared_window + addr, false); }
static void ldmatrix_x4_trans(unsigned r[4], const void *p) { ldmatrix_any(r, p, true); }

// mma.m16n8k16 with f32 accumulation, from the warp's fragments.
static void mma_any(float c[4], const unsigned a[4], unsigned b0, unsigned b1, float (*value)(unsigned short)) {
    Warp &w = my_warp();
    unsigned long long *mine = w.word[lane_id()];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b0, mine[5] = b1;
    warp_sync();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        const unsigned long long *f = w.word[l];
        const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
        for (int i = 0; i < 4; i++) {
            A[ar[i]][ac[i]] = value((unsigned short)(f[i] & 0xffffu));
            A[ar[i]][ac[i] + 1] = value((unsigned short)(f[i] >> 16));
        }
        B[2 * t][g] = value((unsigned short)(f[4] & 0xffffu)), B[2 * t + 1][g] = value((unsigned short)(f[4] >> 16));
        B[2 * t + 8][g] = value((unsigned short)(f[5] & 0xffffu)), B[2 * t + 9][g] = value((unsigned short)(f[5] >> 16));
    }
    warp_sync();
    const int g = lane_id() >> 2, t = lane_id() & 3;
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = 0.f;
        for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
        c[e] += s;
    }
}
static inline float to_float(f16 h) { return f16_value(h.bits); }
// common.cuh's vector load and warp sum, for kernels of f32 activations.
struct vec4f { float x, y, z, w; };
static inline vec4f load4(const float *p) { return {p[0], p[1], p[2], p[3]}; }
static inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static void mma_bf16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) { mma_any(c, a, b0, b1, bf16_value); }
static void mma_f16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) { mma_any(c, a, b0, b1, f16_value); }

// A whole file as values of T, with `pad` more (zeros) after them.
template <typename T> static std::vector<T> slurp(const std::string &path, size_t pad = 0) {
    FILE *f = std::fopen(path.c_str(), "rb");
    if (!f) std::exit(3);
    std::fseek(f, 0, SEEK_END);
    long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<T> v(n / sizeof(T) + pad);
    if (std::fread(v.data(), 1, n, f) != (size_t)n) std::exit(3);
    std::fclose(f);
    return v;
}

// Runs `kernel` over a grid of (x, y, z) blocks of `threads` threads.
template <typename F> static void launch3(unsigned gx, unsigned gy, unsigned gz, int threads, F kernel) {
    std::barrier<> bar(threads);
    block_barrier = &bar;
    for (int w = 0; w < threads / 32; w++) warps[w].bar = new std::barrier<>(32);
    gridDim = {gx, gy, gz};
    blockDim = {(unsigned)threads, 1, 1};
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                blockIdx = {x, y, z};
                std::vector<std::thread> ts;
                for (int t = 0; t < threads; t++) ts.emplace_back([&, t] { threadIdx = {(unsigned)t, 0, 0}; kernel(); });
                for (auto &th : ts) th.join();
            }
    for (int w = 0; w < threads / 32; w++) delete warps[w].bar;
}
// Runs `kernel` over a grid of (x, y) blocks of `threads` threads.
template <typename F> static void launch(unsigned gx, unsigned gy, int threads, F kernel) { launch3(gx, gy, 1, threads, kernel); }
"#;
