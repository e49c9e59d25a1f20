// Linear layers in f32 arithmetic on the weight layouts of common.cuh
// (Q8, Q4, F32: the file's blocks as planes of codes and scales):
// y[r, n] = Σ_k x[r, k] · W[n, k], x and y f32.
//
// gemv_*: decode batches of ROWS = 1..8 rows, one launch reading the weight
// once. A warp owns NC = ceil(ROWS / 2) columns; lane l takes 16 weights of
// each at k0 = 16·l, 16·l + 512, ... (a warp's loads of one column are 512
// consecutive weights: 512 or 256 contiguous bytes), decodes them once and
// applies them to every row before the warp sums. NC grows with ROWS so
// that the activations a warp re-reads from L1 (ROWS · 2 KB an iteration)
// stay in proportion to the weights it streams (NC · 512 weights). (Issuing
// a lane's loads of several iterations before the first use was measured
// slower on an H100 — more registers, fewer warps in flight.)
//
// gemm_*: more rows, on CUDA cores (the float32 path; the default path
// runs its larger batches on tensor cores, gemm_mma.cu). A thread block of
// GEMM_THREADS computes a GEMM_BM × GEMM_BN tile, each thread 4 × 4
// outputs; per block of 32 along k it stages the x tile and the tile's
// weights, decoded to f32, in shared memory (both k-major), so a weight is
// decoded once per 64 rows. Split-K: when the tiles alone are too few to
// fill the GPU, blockIdx.z takes the blocks of 32 along k from
// z · kb_per_split on and writes its partial tile to y + z · rows · n_cols;
// gemm_sum_splits then adds the splits in order (the same bits every run).

#ifndef GEMV_THREADS
#define GEMV_THREADS 128
#endif
#ifndef ROWS
#define ROWS 1
#endif
#define NC ((ROWS + 1) / 2)

static_assert(ROWS >= 1 && ROWS <= 8, "ROWS must be 1..8");

template <typename L>
__device__ __forceinline__ void gemv(float *__restrict__ y, const unsigned char *__restrict__ codes,
                                     const unsigned short *__restrict__ scales, const float *__restrict__ x, int n_cols, int k) {
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * (GEMV_THREADS / 32) + (threadIdx.x >> 5)) * NC;
    if (n0 >= n_cols) return;
    float acc[ROWS][NC];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int c = 0; c < NC; c++) acc[r][c] = 0.f;
    for (int k0 = 16 * lane; k0 < k; k0 += 512) {
        typename L::Raw raw[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) raw[c] = L::fetch(codes, scales, min(n0 + c, n_cols - 1), k, k0);
        float w[NC][16];
#pragma unroll
        for (int c = 0; c < NC; c++) L::decode(raw[c], w[c]);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float *xr = x + (long long)r * k + k0;
            float xv[16];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const vec4f v = load4(xr + 4 * i);
                xv[4 * i] = v.x, xv[4 * i + 1] = v.y, xv[4 * i + 2] = v.z, xv[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int c = 0; c < NC; c++) {
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < 16; i++) s = fmaf(w[c][i], xv[i], s);
                acc[r][c] += s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const float s = warp_sum(acc[r][c]);
            if (lane == 0 && n0 + c < n_cols) y[(long long)r * n_cols + n0 + c] = s;
        }
}

#define GEMV_ENTRY(SUFFIX, LAYOUT)                                                                                          \
    extern "C" __global__ void                                                                                             \
        gemv_##SUFFIX(float *y, const unsigned char *codes, const unsigned short *scales, const float *x, int n_cols, int k) { \
        gemv<LAYOUT>(y, codes, scales, x, n_cols, k);                                                                      \
    }
GEMV_ENTRY(q8, LayoutQ8)
GEMV_ENTRY(q4, LayoutQ4)
GEMV_ENTRY(q4k, LayoutQ4K)
GEMV_ENTRY(q5k, LayoutQ5K)
GEMV_ENTRY(q6k, LayoutQ6K)
GEMV_ENTRY(f32, LayoutF32)

#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_THREADS 256

template <typename L>
__device__ void gemm(float *y, const unsigned char *__restrict__ codes, const unsigned short *__restrict__ scales,
                     const float *__restrict__ x, int rows, int n_cols, int k, int kb_per_split) {
    __shared__ __align__(16) float xs[32][GEMM_BM];
    __shared__ __align__(16) float ws[32][GEMM_BN];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int r0 = blockIdx.y * GEMM_BM, n0 = blockIdx.x * GEMM_BN;
    // x loader: row tid % 64, values 8·(tid / 64) .. + 7 of the block of 32.
    const int lr = tid % 64, lq = tid / 64;
    // Weight loader (threads 0..127): column tid / 2, values 16·(tid % 2) .. + 15.
    const int wc = (tid >> 1) & 63, wh = tid & 1;
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
        if (tid < 128) {
            float w[16];
            if (n0 + wc < n_cols) {
                L::decode(L::fetch(codes, scales, n0 + wc, k, 32 * kb + 16 * wh), w);
            } else {
#pragma unroll
                for (int i = 0; i < 16; i++) w[i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < 16; i++) ws[16 * wh + i][wc] = w[i];
        }
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

#define GEMM_ENTRY(SUFFIX, LAYOUT)                                                                                         \
    extern "C" __global__ void                                                                                            \
        gemm_##SUFFIX(float *y, const unsigned char *codes, const unsigned short *scales, const float *x, int rows, int n_cols, \
                      int k, int kb_per_split) {                                                                          \
        gemm<LAYOUT>(y, codes, scales, x, rows, n_cols, k, kb_per_split);                                                 \
    }
GEMM_ENTRY(q8, LayoutQ8)
GEMM_ENTRY(q4, LayoutQ4)
GEMM_ENTRY(q4k, LayoutQ4K)
GEMM_ENTRY(q5k, LayoutQ5K)
GEMM_ENTRY(q6k, LayoutQ6K)
GEMM_ENTRY(f32, LayoutF32)

// y[i] = Σ_z parts[z · n + i] for z = 0 .. splits - 1, in that order.
extern "C" __global__ void gemm_sum_splits(float *__restrict__ y, const float *__restrict__ parts, long long n, int splits) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float a = 0.f;
        for (int z = 0; z < splits; z++) a += parts[z * n + i];
        y[i] = a;
    }
}
