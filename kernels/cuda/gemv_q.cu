// Dequantizing GEMV for decode batches: y[r, n] = Σ_k x[r, k] · W[n, k]
// with W kept in the GGUF file's blocks of 32 (so a decode step reads 4 or
// 8 bits a weight, not 32): Q8_0 (f16 scale d, 32 int8 codes: w = d·q) and
// Q4_1 (f16 scale d, f16 min m, 16 bytes of nibbles, low nibbles first:
// w = d·q + m). Weights of any other type are dequantized to f32 when they
// load and read as "blocks" of 32 floats (`gemv_f32`). Prefill batches run
// it eight rows a launch; a tiled GEMM for them is left to do.
//
// One warp per output column n, NUM_THREADS / 32 columns per thread block;
// lane l takes blocks l, l + 32, ... of the row (adjacent lanes read
// adjacent blocks), decodes its 32 weights once and applies them to the
// ROWS activation rows (compile-time, 1..8) before the warp sums.
// Blocks are read as 16-bit words (34- and 20-byte blocks are 2-aligned).

#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif
#ifndef ROWS
#define ROWS 1
#endif

static_assert(ROWS >= 1 && ROWS <= 8, "ROWS must be 1..8");

__device__ __forceinline__ float half_bits_to_float(unsigned short b) {
    f16 h;
    h.bits = b;
    return to_float(h);
}

// Applies 32 decoded weights of block `b` to every row of x.
__device__ __forceinline__ void apply_block(const float w[32], const float *__restrict__ x, int k, int b, float acc[ROWS]) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const float *xr = x + (long long)r * k + 32 * b;
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 32; j += 4) {
            const vec4f xv = load4(xr + j);
            s += w[j] * xv.x + w[j + 1] * xv.y + w[j + 2] * xv.z + w[j + 3] * xv.w;
        }
        acc[r] += s;
    }
}

__device__ __forceinline__ void finish(float acc[ROWS], float *y, int n, int num_cols) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const float s = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0) y[(long long)r * num_cols + n] = s;
    }
}

// Decodes block `b` of a row into 32 weights (`blk` = the block's words).
struct Q8_0 {
    static constexpr int WORDS = 17;  // 34 bytes: f16 d, 32 int8 codes
    __device__ static void decode(const unsigned short *blk, float wv[32]) {
        const float d = half_bits_to_float(blk[0]);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const unsigned short two = blk[1 + j];
            wv[2 * j] = d * (float)(signed char)(two & 0xff);
            wv[2 * j + 1] = d * (float)(signed char)(two >> 8);
        }
    }
};

struct Q4_1 {
    static constexpr int WORDS = 10;  // 20 bytes: f16 d, f16 m, 16 bytes of nibbles
    __device__ static void decode(const unsigned short *blk, float wv[32]) {
        const float d = half_bits_to_float(blk[0]), m = half_bits_to_float(blk[1]);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const unsigned short two = blk[2 + j];  // bytes 2j and 2j + 1 of the nibbles
            wv[2 * j] = d * (float)(two & 0xf) + m;
            wv[2 * j + 16] = d * (float)((two >> 4) & 0xf) + m;
            wv[2 * j + 1] = d * (float)((two >> 8) & 0xf) + m;
            wv[2 * j + 17] = d * (float)(two >> 12) + m;
        }
    }
};

// 32 f32 weights (128 bytes) as a block: weights the GEMV has no decoder for.
struct F32 {
    static constexpr int WORDS = 64;
    __device__ static void decode(const unsigned short *blk, float wv[32]) {
        const float *f = (const float *)blk;  // 128-byte aligned: a whole number of blocks precedes it
#pragma unroll
        for (int j = 0; j < 32; j += 4) {
            const vec4f v = load4(f + j);
            wv[j] = v.x;
            wv[j + 1] = v.y;
            wv[j + 2] = v.z;
            wv[j + 3] = v.w;
        }
    }
};

// W: [n_cols, k] in blocks of `Format`; k a multiple of 32.
template <typename Format>
__device__ void gemv(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int n_cols, int k) {
    const int n = blockIdx.x * (NUM_THREADS / 32) + (threadIdx.x >> 5);
    if (n >= n_cols) return;
    const int lane = threadIdx.x & 31, blocks = k / 32;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.f;
    for (int b = lane; b < blocks; b += 32) {
        float wv[32];
        Format::decode(w + ((long long)n * blocks + b) * Format::WORDS, wv);
        apply_block(wv, x, k, b, acc);
    }
    finish(acc, y, n, n_cols);
}

extern "C" __global__ void gemv_q8_0(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int n_cols, int k) {
    gemv<Q8_0>(y, w, x, n_cols, k);
}

extern "C" __global__ void gemv_q4_1(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int n_cols, int k) {
    gemv<Q4_1>(y, w, x, n_cols, k);
}

extern "C" __global__ void gemv_f32(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int n_cols, int k) {
    gemv<F32>(y, w, x, n_cols, k);
}
