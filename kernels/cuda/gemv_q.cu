// Dequantizing GEMV for decode batches: y[r, n] = Σ_k x[r, k] · W[n, k]
// with W kept in the GGUF file's blocks of 32 (so a decode step reads 4 or
// 8 bits a weight, not 32): Q8_0 (f16 scale d, 32 int8 codes: w = d·q) and
// Q4_1 (f16 scale d, f16 min m, 16 bytes of nibbles, low nibbles first:
// w = d·q + m). Weights of any other type are dequantized to f32 when they
// load and read as "blocks" of 32 floats (`gemv_f32`). Batches of up to 8
// rows run the GEMV (one launch reads the weight once); larger ones the tiled
// GEMM at the end of this file (`gemm_*`), which decodes each block once per
// 64 rows into shared memory.
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
    // Weights 8·quarter .. 8·quarter + 7 of the block.
    __device__ static void decode8(const unsigned short *blk, int quarter, float wv[8]) {
        const float d = half_bits_to_float(blk[0]);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const unsigned short two = blk[1 + 4 * quarter + j];
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
    // Weights 8·quarter .. 8·quarter + 7: the low nibbles of bytes 8·quarter
    // .. + 7 for quarters 0 and 1, the high nibbles of bytes 8·(quarter - 2)
    // .. + 7 for 2 and 3.
    __device__ static void decode8(const unsigned short *blk, int quarter, float wv[8]) {
        const float d = half_bits_to_float(blk[0]), m = half_bits_to_float(blk[1]);
        const int shift = quarter < 2 ? 0 : 4;
        const unsigned short *bytes = blk + 2 + 4 * (quarter & 1);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const unsigned short two = bytes[j];
            wv[2 * j] = d * (float)((two >> shift) & 0xf) + m;
            wv[2 * j + 1] = d * (float)((two >> (8 + shift)) & 0xf) + m;
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
    __device__ static void decode8(const unsigned short *blk, int quarter, float wv[8]) {
        const float *f = (const float *)blk + 8 * quarter;
        const vec4f a = load4(f), b = load4(f + 4);
        wv[0] = a.x, wv[1] = a.y, wv[2] = a.z, wv[3] = a.w;
        wv[4] = b.x, wv[5] = b.y, wv[6] = b.z, wv[7] = b.w;
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

// Tiled GEMM for batches of more than 8 rows: y[r, n] = Σ_k x[r, k] · W[n, k].
// A thread block of GEMM_THREADS computes a GEMM_BM × GEMM_BN tile of y, each
// thread 4 × 4 outputs. Per block of 32 along k it stages the x tile and the
// tile's 64 weight blocks, decoded to f32, in shared memory (both k-major:
// a thread reads four rows' and four columns' values as two 16-byte loads),
// so a weight block is decoded once per 64 rows. Loaders: thread i takes
// row (column) i % 64 and the quarter i / 64 of the 32 values.
//
// Split-K: when the tiles alone are too few to fill the GPU (a decode batch
// of 64 rows through a 576-wide layer is 9 tiles), blockIdx.z takes the
// blocks of 32 along k from z · kb_per_split on and writes its partial tile
// to y + z · rows · n_cols; `gemm_sum_splits` then adds the splits in order
// (the same bits every run).
#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_THREADS 256

template <typename Format>
__device__ void gemm(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int rows, int n_cols, int k,
                     int kb_per_split) {
    __shared__ __align__(16) float xs[32][GEMM_BM];
    __shared__ __align__(16) float ws[32][GEMM_BN];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int r0 = blockIdx.y * GEMM_BM, n0 = blockIdx.x * GEMM_BN;
    const int lr = tid % 64, lq = tid / 64;
    const int blocks = k / 32;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    const int kb_end = min(blocks, (int)(blockIdx.z + 1) * kb_per_split);
    y += (long long)blockIdx.z * rows * n_cols;
    for (int kb = blockIdx.z * kb_per_split; kb < kb_end; kb++) {
        float v[8];
        if (r0 + lr < rows) {
            const float *src = x + (long long)(r0 + lr) * k + 32 * kb + 8 * lq;
            const vec4f a = load4(src), b = load4(src + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; i++) xs[8 * lq + i][lr] = v[i];
        if (n0 + lr < n_cols) {
            Format::decode8(w + ((long long)(n0 + lr) * blocks + kb) * Format::WORDS, lq, v);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; i++) ws[8 * lq + i][lr] = v[i];
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 32; kk++) {
            const float4 a = *reinterpret_cast<const float4 *>(&xs[kk][4 * ty]);
            const float4 b = *reinterpret_cast<const float4 *>(&ws[kk][4 * tx]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = r0 + 4 * ty + i;
        if (r >= rows) break;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int n = n0 + 4 * tx + j;
            if (n < n_cols) y[(long long)r * n_cols + n] = acc[i][j];
        }
    }
}

extern "C" __global__ void gemm_q8_0(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int rows, int n_cols,
                                     int k, int kb_per_split) {
    gemm<Q8_0>(y, w, x, rows, n_cols, k, kb_per_split);
}

extern "C" __global__ void gemm_q4_1(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int rows, int n_cols,
                                     int k, int kb_per_split) {
    gemm<Q4_1>(y, w, x, rows, n_cols, k, kb_per_split);
}

extern "C" __global__ void gemm_f32(float *y, const unsigned short *__restrict__ w, const float *__restrict__ x, int rows, int n_cols,
                                    int k, int kb_per_split) {
    gemm<F32>(y, w, x, rows, n_cols, k, kb_per_split);
}

// y[i] = Σ_z parts[z · n + i] for z = 0 .. splits - 1, in that order.
extern "C" __global__ void gemm_sum_splits(float *__restrict__ y, const float *__restrict__ parts, long long n, int splits) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float a = 0.f;
        for (int z = 0; z < splits; z++) a += parts[z * n + i];
        y[i] = a;
    }
}
