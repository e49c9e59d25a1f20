// Linear layers in f32 arithmetic on the weight layouts of common.cuh
// (Q8, Q4, F32: the file's blocks as planes of codes and scales):
// y[r, n] = Σ_k x[r, k] · W[n, k], x and y f32.
//
// gemv_*: decode batches of ROWS = 1..8 rows, one launch reading the weight
// once. A block of GEMV_THREADS / 32 warps; a group of GEMV_KSPLIT warps
// owns NC columns, each warp of the group every GEMV_KSPLIT-th stretch of
// 512 weights along k. Lane l takes 16 weights of each column at
// k0 = 16·l + 512·(slice + GEMV_KSPLIT·i) (a warp's loads of one column are
// 512 consecutive weights: 512 or 256 contiguous bytes), decodes them once
// and applies them to every row; the warp sums its lanes, and the group's
// warps add their sums through shared memory, in slice order. The three
// compile-time knobs (the launch in launch.rs picks them, and a benchmark
// can through VELLUM_GEMV):
//  * NC: columns a warp streams at once. The activations a warp re-reads
//    from L1 (ROWS · 2 KB an iteration) against the weights it streams
//    (NC · 512 weights) — and NC independent loads a lane has in flight.
//  * GEMV_KSPLIT: warps sharing a column group, so that a small weight
//    (n = 1024 .. 4096 columns) still puts enough warps in flight.
//  * GEMV_MAGIC: Q8 codes through `decode_unscaled` (a permute and an add
//    a weight instead of an integer conversion and a multiply), the scale
//    applied once per 16 products.
// And two fusions, each saving a launch of a decode step (where launches,
// not bytes, bound the step):
//  * GEMV_IN: what the product reads. 0: x [ROWS, k]. 1: RMSNorm(x) · `aux`
//    (the norm's weight): the dot product takes x · aux, each warp also sums
//    x² over its stretch, and the sum closes the row as rsqrt(Σx²/k + eps)
//    times the dot (the norm's scale factors out of it), so x is read once.
//  * GEMV_OUT: 0: y = x·Wᵀ. 1: y += x·Wᵀ (the residual stream's add). 2, 3:
//    W is a stacked gate/up weight [2·n_cols, k] and y [ROWS, n_cols] is
//    act(gate) · up, act SiLU (2) or GELU-tanh (3): a warp's NC columns are
//    NC / 2 gate columns and the matching up columns, so each activation is
//    computed once, as the product is written.
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
#ifndef GEMV_NC
#define GEMV_NC ((ROWS + 1) / 2)
#endif
#define NC GEMV_NC
#ifndef GEMV_KSPLIT
#define GEMV_KSPLIT 1
#endif
#ifndef GEMV_MAGIC
#define GEMV_MAGIC 0
#endif
#ifndef GEMV_IN
#define GEMV_IN 0
#endif
#ifndef GEMV_OUT
#define GEMV_OUT 0
#endif
#define GEMV_WARPS (GEMV_THREADS / 32)

static_assert(ROWS >= 1 && ROWS <= 8, "ROWS must be 1..8");
static_assert(NC >= 1 && NC <= 4, "GEMV_NC must be 1..4");
static_assert(GEMV_KSPLIT == 1 || GEMV_KSPLIT == 2 || GEMV_KSPLIT == 4, "GEMV_KSPLIT must be 1, 2 or 4");
static_assert(GEMV_WARPS % GEMV_KSPLIT == 0, "GEMV_KSPLIT must divide the block's warps");
static_assert((GEMV_IN == 0 || GEMV_IN == 1) && GEMV_OUT >= 0 && GEMV_OUT <= 3, "GEMV_IN 0 or 1, GEMV_OUT 0..3");
static_assert(GEMV_OUT < 2 || NC % 2 == 0, "a gated output takes an even GEMV_NC (gate and up columns in pairs)");
// Output columns a warp writes.
#define GEMV_COLS (GEMV_OUT >= 2 ? NC / 2 : NC)

// The 16 inputs of row r at k0 as the product reads them (GEMV_IN): times
// the norm's 16 weights `nw` (loaded once for every row), adding x² to `ss`.
__device__ __forceinline__ void gemv_input(float xv[16], const float *__restrict__ x, const float nw[16], int r, int k, int k0,
                                           float &ss) {
    const float *xr = x + (long long)r * k + k0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const vec4f v = load4(xr + 4 * i);
        xv[4 * i] = v.x, xv[4 * i + 1] = v.y, xv[4 * i + 2] = v.z, xv[4 * i + 3] = v.w;
    }
#if GEMV_IN == 1
#pragma unroll
    for (int i = 0; i < 16; i++) {
        ss = fmaf(xv[i], xv[i], ss);
        xv[i] *= nw[i];
    }
#endif
}

// Row r's outputs from the dot products `s` of the warp's NC columns and
// the row's Σx² `ss` (GEMV_IN 1): column n0 + c at y[r, n0 + c] for the
// GEMV_COLS columns inside n_cols.
__device__ __forceinline__ void gemv_output(float *__restrict__ y, int r, int n0, int n_cols, const float s[NC], float ss, int k,
                                            float eps) {
    float scale = 1.f;
#if GEMV_IN == 1
    scale = rsqrtf(ss / k + eps);
#endif
#pragma unroll
    for (int c = 0; c < GEMV_COLS; c++) {
        if (n0 + c >= n_cols) continue;
        const long long at = (long long)r * n_cols + n0 + c;
#if GEMV_OUT == 0
        y[at] = s[c] * scale;
#elif GEMV_OUT == 1
        y[at] += s[c] * scale;
#elif GEMV_OUT == 2
        y[at] = silu(s[c] * scale) * (s[c + NC / 2] * scale);
#else
        y[at] = gelu_tanh(s[c] * scale) * (s[c + NC / 2] * scale);
#endif
    }
}

// The weight row of the warp's column c: n0 + c, or for a gated output the
// gate row n0 + c and the up row n_cols + n0 + c - NC/2 (clamped inside the
// weight: a column past the last is read and never written).
__device__ __forceinline__ int gemv_weight_row(int n0, int c, int n_cols) {
#if GEMV_OUT >= 2
    return c < NC / 2 ? min(n0 + c, n_cols - 1) : n_cols + min(n0 + c - NC / 2, n_cols - 1);
#else
    return min(n0 + c, n_cols - 1);
#endif
}

// The 16 weights at `raw` for the GEMV: w[i] · (returned scale) is the
// weight. Every layout decodes whole values (scale 1); with GEMV_MAGIC, Q8
// leaves its scale to the caller.
template <typename L> __device__ __forceinline__ float gemv_decode(const typename L::Raw &raw, float w[16]) {
    L::decode(raw, w);
    return 1.f;
}
#if GEMV_MAGIC
template <> __device__ __forceinline__ float gemv_decode<LayoutQ8>(const LayoutQ8::Raw &raw, float w[16]) {
    return LayoutQ8::decode_unscaled(raw, w);
}
#endif

template <typename L>
__device__ __forceinline__ void gemv(float *__restrict__ y, const unsigned char *__restrict__ codes,
                                     const unsigned short *__restrict__ scales, const float *__restrict__ x, int n_cols, int k,
                                     const float *__restrict__ aux, float eps) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = warp % GEMV_KSPLIT;
    const int n0 = (blockIdx.x * (GEMV_WARPS / GEMV_KSPLIT) + warp / GEMV_KSPLIT) * GEMV_COLS;
    float acc[ROWS][NC], ss[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        ss[r] = 0.f;
#pragma unroll
        for (int c = 0; c < NC; c++) acc[r][c] = 0.f;
    }
    // A group past the last column still reaches the barrier below.
    if (n0 < n_cols)
        for (int k0 = 16 * lane + 512 * slice; k0 < k; k0 += 512 * GEMV_KSPLIT) {
            typename L::Raw raw[NC];
#pragma unroll
            for (int c = 0; c < NC; c++) raw[c] = L::fetch(codes, scales, gemv_weight_row(n0, c, n_cols), k, k0);
            float w[NC][16], d[NC];
#pragma unroll
            for (int c = 0; c < NC; c++) d[c] = gemv_decode<L>(raw[c], w[c]);
            float nw[16];
#if GEMV_IN == 1
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const vec4f w = load4(aux + k0 + 4 * i);
                nw[4 * i] = w.x, nw[4 * i + 1] = w.y, nw[4 * i + 2] = w.z, nw[4 * i + 3] = w.w;
            }
#endif
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float xv[16];
                gemv_input(xv, x, nw, r, k, k0, ss[r]);
#pragma unroll
                for (int c = 0; c < NC; c++) {
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < 16; i++) s = fmaf(w[c][i], xv[i], s);
                    acc[r][c] = fmaf(d[c], s, acc[r][c]);
                }
            }
        }
#if GEMV_IN == 1
#pragma unroll
    for (int r = 0; r < ROWS; r++) ss[r] = warp_sum(ss[r]);
#endif
#if GEMV_KSPLIT > 1
    __shared__ float part[GEMV_WARPS][ROWS][NC + 1];  // the last: Σx² (GEMV_IN 1)
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int c = 0; c < NC; c++) {
            const float s = warp_sum(acc[r][c]);
            if (lane == 0) part[warp][r][c] = s;
        }
#if GEMV_IN == 1
        if (lane == 0) part[warp][r][NC] = ss[r];
#endif
    }
    __syncthreads();
    if (slice != 0 || lane != 0 || n0 >= n_cols) return;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float sq = 0.f, s[NC];
#if GEMV_IN == 1
        sq = part[warp][r][NC];
#pragma unroll
        for (int q = 1; q < GEMV_KSPLIT; q++) sq += part[warp + q][r][NC];
#endif
#pragma unroll
        for (int c = 0; c < NC; c++) {
            s[c] = part[warp][r][c];
#pragma unroll
            for (int q = 1; q < GEMV_KSPLIT; q++) s[c] += part[warp + q][r][c];
        }
        gemv_output(y, r, n0, n_cols, s, sq, k, eps);
    }
#else
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float s[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) s[c] = warp_sum(acc[r][c]);
        if (lane == 0 && n0 < n_cols) gemv_output(y, r, n0, n_cols, s, ss[r], k, eps);
    }
#endif
}

#define GEMV_ENTRY(SUFFIX, LAYOUT)                                                                                          \
    extern "C" __global__ void                                                                                             \
        gemv_##SUFFIX(float *y, const unsigned char *codes, const unsigned short *scales, const float *x, int n_cols, int k,   \
                      const float *aux, float eps) {                                                                       \
        gemv<LAYOUT>(y, codes, scales, x, n_cols, k, aux, eps);                                                           \
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
