// Prefill attention on tensor cores over the paged cache: the sequences of a
// mixed batch with at least `min_q` query tokens (prompt chunks, prefix hits
// included: their queries start after the cached positions) attend causally
// to their keys and values read through the block table, FlashAttention-2's
// way — a tile of FLASH_BM queries stays on chip while tiles of FLASH_BN keys
// stream past it, the softmax computed online, so K and V are read once per
// query tile, not once per query token as the decode kernels
// (paged_attention.cu) read them. The sequences with fewer query tokens are
// left to those kernels (their `skip_min_q`), in the same step.
//
// Compile-time constants (NVRTC -D): HEAD_DIM (64, 128 or 256), BLOCK_SIZE
// (tokens per KV block), FLASH_BN (keys per tile: 16, 32 or 64).
//
// Grid (tile slots, num_heads), FLASH_THREADS threads (`__launch_bounds__`
// with one block a multiprocessor: without it ptxas held the head-size-64
// FP8 kernel to 128 registers on sm_90 and spilled). Slot x takes the
// (gridDim.x - 1 - x)-th query tile of the batch, counting the tiles of the
// long sequences in order (so the last, longest-context tiles start first);
// slots past the last tile return at once. Each block finds its tile from
// `query_start_loc` itself, so one launch (and one CUDA graph) serves any
// batch whose tiles fit the grid.
//
// A warp owns 16 query rows. Per key tile: S = Q·Kᵀ (m16n8k16 `mma`, f32
// accumulation), scaled, soft-capped, masked (causal, sliding window, keys
// past the context), the row maxima and sums updated online in base 2, P
// rounded to the 16-bit type and O += P·V with P taken straight from S's
// accumulator fragments (C and A share their rows). K and V tiles are
// double-buffered in shared memory: the copies of tile j + 1 (`cp.async`)
// run under tile j's products.
//
// Element types: a bf16 cache multiplies in bf16, an f16 cache in f16; an
// FP8 cache is widened to f16 as it is staged (exactly: a code's value /
// 2^8, the host folds the 2^8 into the scales as for the decode kernels).
// Queries (f32 activations) are scaled, then rounded to the same 16-bit
// type. Outputs are f32, `out [num_tokens, num_heads, HEAD_DIM]`, times `v_scale`.
//
// Shared memory (dynamic, FLASH_LDS = HEAD_DIM + 8 elements a row, so the
// eight rows an `ldmatrix` reads fall in distinct banks): Q [FLASH_BM], K
// [2][FLASH_BN], V [2][FLASH_BN] rows; `flash_smem_bytes` in launch.rs
// computes the same.

#define FLASH_BM 64
#define FLASH_THREADS 128
#ifndef FLASH_BN
#define FLASH_BN 64
#endif
#define FLASH_LDS (HEAD_DIM + 8)
#define FLASH_NEG_INF (__int_as_float(0xff800000))

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert(FLASH_BN == 16 || FLASH_BN == 32 || FLASH_BN == 64, "FLASH_BN must be 16, 32 or 64");

// The 16-bit type a cache of T multiplies in, and its packing and product.
// `pack_q` rounds queries (already scaled), f16's saturating at its range.
struct Bf16Math {
    __device__ static __forceinline__ unsigned pack(float lo, float hi) { return pack_bf16(lo, hi); }
    __device__ static __forceinline__ unsigned pack_q(float lo, float hi) { return pack_bf16(lo, hi); }
    __device__ static __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) { mma_bf16(c, a, b0, b1); }
};
struct F16Math {
    __device__ static __forceinline__ unsigned pack(float lo, float hi) { return pack_f16(lo, hi); }
    __device__ static __forceinline__ unsigned pack_q(float lo, float hi) {
        return pack_f16(fminf(fmaxf(lo, -65504.f), 65504.f), fminf(fmaxf(hi, -65504.f), 65504.f));
    }
    __device__ static __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) { mma_f16(c, a, b0, b1); }
};
template <typename T> struct MathOf;
template <> struct MathOf<bf16> {
    typedef Bf16Math type;
};
template <> struct MathOf<f16> {
    typedef F16Math type;
};
template <> struct MathOf<fp8e4m3> {
    typedef F16Math type;
};

// One query tile: queries q0 .. q0 + rows - 1 of sequence `seq` (relative to
// its first query token `q_start`), at positions pos0 .. pos0 + rows - 1.
struct FlashTile {
    int seq, q_start, q0, rows, pos0;
};

// The tile of slot `b` among the query tiles of the sequences with at least
// `min_q` query tokens; false past the last. Every lane of every warp
// computes the same answer (a warp-wide scan of the sequences, 32 at a
// time), so a block that returns does so as a whole.
__device__ __forceinline__ bool find_tile(int b, const int *__restrict__ query_start_loc, const int *__restrict__ context_lens,
                                          int num_seqs, int min_q, FlashTile &tile) {
    const int lane = threadIdx.x & 31;
    int before = 0;  // tiles of the sequences already scanned
    for (int s0 = 0; s0 < num_seqs; s0 += 32) {
        const int s = s0 + lane;
        int q_len = 0, n = 0;
        if (s < num_seqs) {
            q_len = query_start_loc[s + 1] - query_start_loc[s];
            n = q_len >= min_q ? (q_len + FLASH_BM - 1) / FLASH_BM : 0;
        }
        int incl = n;  // inclusive prefix sum over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int chunk = __shfl_sync(0xffffffffu, incl, 31);
        if (b < before + chunk) {
            const unsigned mine = __ballot_sync(0xffffffffu, n > 0 && b >= before + incl - n && b < before + incl);
            const int src = __ffs(mine) - 1;
            const int first_tile = before + __shfl_sync(0xffffffffu, incl - n, src);
            tile.seq = s0 + src;
            q_len = __shfl_sync(0xffffffffu, q_len, src);
            tile.q_start = query_start_loc[tile.seq];
            tile.q0 = (b - first_tile) * FLASH_BM;
            tile.rows = min(FLASH_BM, q_len - tile.q0);
            tile.pos0 = context_lens[tile.seq] - q_len + tile.q0;
            return true;
        }
        before += chunk;
    }
    return false;
}

// Stages keys (or values) pos j0 .. j0 + FLASH_BN - 1 of kv head `kvh` into
// `dst` [FLASH_BN][FLASH_LDS]; positions outside [begin, end) are zeros
// (they are masked; zeros keep 0 · v finite, and a block the window has
// left behind is never read). A 16-bit cache is copied as it is
// (`cp.async`, 16 bytes a copy); FP8 codes are widened to f16 on the way.
template <typename T>
__device__ __forceinline__ void stage_kv(unsigned short *dst, const T *__restrict__ cache, const int *__restrict__ table, int j0,
                                         int begin, int end, int num_kv_heads, int kvh) {
    constexpr int PARTS = HEAD_DIM / 8;  // 8 elements a copy
    for (int c = threadIdx.x; c < FLASH_BN * PARTS; c += FLASH_THREADS) {
        const int key = c / PARTS, part = c % PARTS, pos = j0 + key;
        const bool valid = pos >= begin && pos < end;
        const int p = valid ? pos : end - 1;  // an address inside the sequence's blocks
        const long long row = ((long long)table[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE) * num_kv_heads + kvh;
        const T *src = cache + row * HEAD_DIM + 8 * part;
        unsigned short *to = dst + key * FLASH_LDS + 8 * part;
        if constexpr (sizeof(T) == 2) {
            cp_async16(to, src, valid ? 16 : 0);
        } else {
            uint4 w = {0u, 0u, 0u, 0u};
            if (valid) {
                const uint2 codes = *reinterpret_cast<const uint2 *>(src);
                const unsigned c8[2] = {codes.x, codes.y};
                unsigned h[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const unsigned word = c8[i >> 1] >> (16 * (i & 1));
                    h[i] = (unsigned)fp8_f16_bits(word & 0xffu) | ((unsigned)fp8_f16_bits((word >> 8) & 0xffu) << 16);
                }
                w.x = h[0], w.y = h[1], w.z = h[2], w.w = h[3];
            }
            *reinterpret_cast<uint4 *>(to) = w;
        }
    }
}

template <typename T>
__device__ void flash_attention(float *__restrict__ out, const float *__restrict__ q, const T *__restrict__ k_cache,
                                const T *__restrict__ v_cache, const int *__restrict__ block_tables, int max_blocks_per_seq,
                                const int *__restrict__ query_start_loc, const int *__restrict__ context_lens, int num_seqs,
                                int min_q, int num_heads, int num_kv_heads, float scale, float softcap, int window,
                                float v_scale) {
    typedef typename MathOf<T>::type Math;
    constexpr int NT = FLASH_BN / 8;   // 8-key column tiles of S
    constexpr int DT = HEAD_DIM / 8;   // 8-dim column tiles of O
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(16) unsigned short flash_smem[];
    unsigned short *qs = flash_smem;
    unsigned short *ks = qs + FLASH_BM * FLASH_LDS;
    unsigned short *vs = ks + 2 * FLASH_BN * FLASH_LDS;

    FlashTile tile;
    if (!find_tile(gridDim.x - 1 - blockIdx.x, query_start_loc, context_lens, num_seqs, min_q, tile)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int head = blockIdx.y, kvh = head / (num_heads / num_kv_heads);
    const int *table = block_tables + (long long)tile.seq * max_blocks_per_seq;
    // Keys [begin, end): up to the last row's position, from the first
    // row's window on.
    const int end = tile.pos0 + tile.rows;
    const int begin = window > 0 ? max(0, tile.pos0 - window + 1) : 0;
    const int j_first = begin / FLASH_BN * FLASH_BN;
    const int n_tiles = (end - j_first + FLASH_BN - 1) / FLASH_BN;

    // Q: the tile's rows times the scale (so the f16 of an f16 or FP8 cache
    // holds queries far past its range unscaled), rounded to the 16-bit
    // type (zeros past the last row).
    for (int c = tid; c < FLASH_BM * (HEAD_DIM / 4); c += FLASH_THREADS) {
        const int r = c / (HEAD_DIM / 4), d = 4 * (c % (HEAD_DIM / 4));
        float4 x = {0.f, 0.f, 0.f, 0.f};
        if (r < tile.rows) x = *reinterpret_cast<const float4 *>(q + ((long long)(tile.q_start + tile.q0 + r) * num_heads + head) * HEAD_DIM + d);
        uint2 packed;
        packed.x = Math::pack_q(x.x * scale, x.y * scale), packed.y = Math::pack_q(x.z * scale, x.w * scale);
        *reinterpret_cast<uint2 *>(qs + r * FLASH_LDS + d) = packed;
    }
    stage_kv<T>(ks, k_cache, table, j_first, begin, end, num_kv_heads, kvh);
    stage_kv<T>(vs, v_cache, table, j_first, begin, end, num_kv_heads, kvh);
    cp_async_commit();

    // This lane's two rows (g and g + 8 of the warp's 16) and their positions.
    const int r_lo = 16 * warp + (lane >> 2), t2 = 2 * (lane & 3);
    const int rows_of[2] = {r_lo, r_lo + 8};
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {FLASH_NEG_INF, FLASH_NEG_INF}, l_run[2] = {0.f, 0.f};

    for (int it = 0; it < n_tiles; it++) {
        const int s = it & 1, j0 = j_first + it * FLASH_BN;
        const unsigned short *k_s = ks + s * FLASH_BN * FLASH_LDS, *v_s = vs + s * FLASH_BN * FLASH_LDS;
        if (it + 1 < n_tiles) {
            stage_kv<T>(ks + (s ^ 1) * FLASH_BN * FLASH_LDS, k_cache, table, j0 + FLASH_BN, begin, end, num_kv_heads, kvh);
            stage_kv<T>(vs + (s ^ 1) * FLASH_BN * FLASH_LDS, v_cache, table, j0 + FLASH_BN, begin, end, num_kv_heads, kvh);
        }
        cp_async_commit();
        cp_async_wait_one();
        __syncthreads();

        // S = Q · Kᵀ for the warp's 16 rows.
        float sc[NT][4];
#pragma unroll
        for (int i = 0; i < NT; i++) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
        for (int kd = 0; kd < HEAD_DIM; kd += 16) {
            unsigned a[4];
            // Lanes 0-15: rows 0-15 at dims kd..; lanes 16-31: the same rows at kd + 8.
            ldmatrix_x4(a, qs + (16 * warp + (lane & 15)) * FLASH_LDS + kd + 8 * (lane >> 4));
#pragma unroll
            for (int p = 0; p < NT / 2; p++) {
                // Matrix i = lane / 8: keys of column tile 2p + i / 2, dims half i % 2.
                const int i = lane >> 3;
                unsigned r[4];
                ldmatrix_x4(r, k_s + (16 * p + 8 * (i >> 1) + (lane & 7)) * FLASH_LDS + kd + 8 * (i & 1));
                Math::mma(sc[2 * p], a, r[0], r[1]);
                Math::mma(sc[2 * p + 1], a, r[2], r[3]);
            }
        }

        // Scale, soft-cap and mask in base 2; the online softmax per row. A
        // tile every row sees whole (below the diagonal, inside every row's
        // window) needs no mask: rows past the tile's last are zero queries,
        // finite, and never written.
        const bool whole = j0 + FLASH_BN - 1 <= tile.pos0 && (window <= 0 || j0 >= tile.pos0 + tile.rows - window);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = rows_of[h], pos = tile.pos0 + row;
            const int first = window > 0 ? pos - window + 1 : 0;
            float mx = FLASH_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = j0 + 8 * nt + t2 + e;
                    float x = sc[nt][2 * h + e];
                    if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                    x = (whole || (row < tile.rows && key <= pos && key >= first)) ? x * LOG2E : FLASH_NEG_INF;
                    sc[nt][2 * h + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run[h], mx);
            // A row that has seen no key yet keeps its zeros (no -inf - -inf).
            const float base = m_new == FLASH_NEG_INF ? 0.f : m_new;
            const float alpha = exp2f(m_run[h] - base);
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float p = exp2f(sc[nt][2 * h + e] - base);
                    sc[nt][2 * h + e] = p;
                    sum += p;
                }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l_run[h] = l_run[h] * alpha + sum;
            m_run[h] = m_new;
#pragma unroll
            for (int d = 0; d < DT; d++) o[d][2 * h] *= alpha, o[d][2 * h + 1] *= alpha;
        }

        // O += P · V: P's A fragments are S's accumulators of column tiles
        // 2kk and 2kk + 1; V's B fragments come transposed from its rows.
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++) {
            unsigned a[4];
            a[0] = Math::pack(sc[2 * kk][0], sc[2 * kk][1]);
            a[1] = Math::pack(sc[2 * kk][2], sc[2 * kk][3]);
            a[2] = Math::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            a[3] = Math::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < DT / 2; dp++) {
                // Matrix i = lane / 8: keys half i % 2, dims tile 2dp + i / 2.
                const int i = lane >> 3;
                unsigned r[4];
                ldmatrix_x4_trans(r, v_s + (16 * kk + 8 * (i & 1) + (lane & 7)) * FLASH_LDS + 16 * dp + 8 * (i >> 1));
                Math::mma(o[2 * dp], a, r[0], r[1]);
                Math::mma(o[2 * dp + 1], a, r[2], r[3]);
            }
        }
        __syncthreads();  // every warp is done with stage s before it is refilled
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = rows_of[h];
        if (row >= tile.rows) continue;
        const float inv = l_run[h] > 0.f ? v_scale / l_run[h] : 0.f;
        float *dst = out + ((long long)(tile.q_start + tile.q0 + row) * num_heads + head) * HEAD_DIM + t2;
#pragma unroll
        for (int d = 0; d < DT; d++) {
            float2 v;
            v.x = o[d][2 * h] * inv, v.y = o[d][2 * h + 1] * inv;
            *reinterpret_cast<float2 *>(dst + 8 * d) = v;
        }
    }
}

#define FLASH_ENTRY(SUFFIX, T)                                                                                               \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 1)                                                            \
        flash_attention_##SUFFIX(float *out, const float *q, const void *k_cache, const void *v_cache, const int *block_tables, \
                                 int max_blocks_per_seq, const int *query_start_loc, const int *context_lens, int num_seqs,     \
                                 int min_q, int num_heads, int num_kv_heads, float scale, float softcap, int window,            \
                                 float v_scale) {                                                                               \
        flash_attention<T>(out, q, (const T *)k_cache, (const T *)v_cache, block_tables, max_blocks_per_seq, query_start_loc,   \
                           context_lens, num_seqs, min_q, num_heads, num_kv_heads, scale, softcap, window, v_scale);           \
    }
FLASH_ENTRY(f16, f16)
FLASH_ENTRY(bf16, bf16)
FLASH_ENTRY(fp8, fp8e4m3)
