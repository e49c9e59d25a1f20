// Paged attention (paper §4.1, Figure 5): queries attend to keys and values
// read through block tables, never a contiguous copy. One kernel serves a
// mixed batch: each query token t belongs to sequence s = token_seq[t], sits
// at position context_lens[s] - q_len + (t - query_start_loc[s]) and attends
// causally to the positions before it (only the last `window` with a sliding
// window). A decode is the case q_len = 1; a prefill chunk runs one thread
// block per (head, query token) over the same tables.
//
// Compile-time constants (NVRTC -D): HEAD_DIM (a multiple of 64: 64, 128,
// 256), BLOCK_SIZE (8, 16 or 32 tokens per KV block), NUM_THREADS (a
// multiple of 32), PARTITION_SIZE (tokens per partition of v2), QUERIES (the
// query heads a thread block serves: a divisor of the GQA group size).
//
// Grouped-query attention: head h reads kv head h / (num_heads /
// num_kv_heads). A thread block takes QUERIES consecutive heads of one group,
// so each key and value it loads serves QUERIES queries (without grouping,
// each head's block reads the same KV again, from L2 at best).
//
// v1: grid (num_heads / QUERIES, num_tokens); one thread block walks the
//     whole context; the scores live in dynamic shared memory (4 bytes a
//     token and query head).
// v2: grid (num_heads / QUERIES, num_tokens, max_num_partitions); each thread
//     block takes PARTITION_SIZE positions and writes its softmax statistics
//     (max, sum of exp) and its normalized partial output per head;
//     `paged_attention_v2_reduce` combines the partitions. For long contexts
//     or few sequences.
//
// Within a thread block, warps take KV blocks in turn. Scores: a KV block's
// BLOCK_SIZE tokens are spread over the warp's 32 lanes, LANES = 32 /
// BLOCK_SIZE lanes per token, each lane taking every LANES-th group of four
// dims (so the lanes of one token read adjacent pieces). Softmax: a warp per
// query head. Values: each lane owns HEAD_DIM / 32 consecutive dims and
// accumulates p · v over the warp's tokens for every head of the group,
// loading V_TILE tokens' dims before it uses the first (a token at a time,
// a lane had one 8-byte load in flight and the phase waited on each one's
// latency); warps add their sums in shared memory in a fixed order.
//
// Cache layout: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] (cache.cu).
//
// `skip_min_q` (0: none): the tokens of sequences with at least that many
// query tokens are left alone, flash_attention.cu attends them in the same
// step.
//
// Scales: `scale` multiplies q·k as stored (the host folds a layer's key
// scale into it, with the 2^8 of an FP8 code's widening, common.cuh);
// `v_scale` multiplies the outputs (1 but for FP8).
//
// CONTIGUOUS_KV (defined only by the bandwidth benchmark's baseline): the
// same kernel without the block table; sequence s's block b is physical block
// s · max_blocks_per_seq + b, the layout of a contiguous per-sequence cache
// (FasterTransformer's), so the two differ only in the indirection.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_SIZE
#define BLOCK_SIZE 16
#endif
#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif
#ifndef PARTITION_SIZE
#define PARTITION_SIZE 512
#endif
#ifndef QUERIES
#define QUERIES 1
#endif
// Tokens whose values a lane loads before it uses the first (32 floats of
// registers: 16 tokens at head size 64, 8 at 128, 4 at 256; at most a KV
// block). 1: a token at a time.
#ifndef V_TILE
#define V_TILE ((32 / (HEAD_DIM / 32)) < BLOCK_SIZE ? (32 / (HEAD_DIM / 32)) : BLOCK_SIZE)
#endif
// 1: a warp asks L2 for the keys (values) of its next KV block while it
// works on this one, and for its first block's values during the softmax.
#ifndef PA_PREFETCH
#define PA_PREFETCH 1
#endif

#define NUM_WARPS (NUM_THREADS / 32)
#define LANES (32 / BLOCK_SIZE)
#define CHUNKS (HEAD_DIM / 4)
#define VDIMS (HEAD_DIM / 32)

static_assert(HEAD_DIM % 64 == 0, "HEAD_DIM must be a multiple of 64");
static_assert(BLOCK_SIZE == 8 || BLOCK_SIZE == 16 || BLOCK_SIZE == 32, "BLOCK_SIZE must be 8, 16 or 32");
static_assert(CHUNKS % LANES == 0, "a token's dims split evenly over its lanes");
static_assert(NUM_THREADS % 32 == 0 && NUM_THREADS <= 1024, "NUM_THREADS must be whole warps");
static_assert(QUERIES >= 1 && QUERIES * HEAD_DIM <= 2048, "QUERIES heads of HEAD_DIM must fit the registers");
static_assert(V_TILE >= 1 && V_TILE <= BLOCK_SIZE, "V_TILE: 1 to BLOCK_SIZE tokens");

// Lane l's share of a warp's walk over KV blocks b0, b0 + NUM_WARPS, ...:
// the physical id of block b0 + l · NUM_WARPS (0 past the last). A warp
// reads 32 block-table entries in one load and passes them on by shuffle, so
// the table's latency is not paid before every block's keys. (The
// contiguous baseline computes each id where it is used instead.)
__device__ __forceinline__ int block_ids(const int *__restrict__ block_table, int b0, int last_block, int lane) {
#ifdef CONTIGUOUS_KV
    return 0;
#else
    const int b = b0 + lane * NUM_WARPS;
    return b <= last_block ? block_table[b] : 0;
#endif
}

// Prefetches (PA_PREFETCH) the rows of kv head `kvh` in physical block
// `phys` of `cache`: its BLOCK_SIZE tokens' HEAD_DIM elements, a 128-byte
// line a lane.
template <typename T>
__device__ __forceinline__ void prefetch_block(const T *__restrict__ cache, long long phys, long long row, int kvh, int lane) {
#if PA_PREFETCH
    const int line = 128 / (int)sizeof(T), per_token = (HEAD_DIM + line - 1) / line;
    for (int x = lane; x < BLOCK_SIZE * per_token; x += 32)
        prefetch_l2(cache + (phys * BLOCK_SIZE + x / per_token) * row + (long long)kvh * HEAD_DIM + (x % per_token) * line);
#endif
}

// A lane's VDIMS consecutive value dims, in loads of four where they divide
// (VDIMS · lane elements in: aligned for the 8- and 16-byte loads).
template <typename T> __device__ __forceinline__ void load_dims(const T *__restrict__ v, float out[VDIMS]) {
#if VDIMS % 4 == 0
#pragma unroll
    for (int c = 0; c < VDIMS; c += 4) {
        const vec4f x = load4_nc(v + c);
        out[c] = x.x, out[c + 1] = x.y, out[c + 2] = x.z, out[c + 3] = x.w;
    }
#else
#pragma unroll
    for (int c = 0; c < VDIMS; c++) out[c] = load1_nc(v + c);
#endif
}

// The metadata every kernel of this file reads the same way.
struct Query {
    int seq;     // its sequence
    int q_len;   // its sequence's query tokens in this step
    int n_ctx;   // positions it sees: 0 .. n_ctx - 1 (itself included)
    int first;   // first position it sees (sliding window)
};

__device__ __forceinline__ Query query_of(int t, const int *token_seq, const int *query_start_loc, const int *context_lens,
                                          int window) {
    Query q;
    q.seq = token_seq[t];
    const int q0 = query_start_loc[q.seq];
    q.q_len = query_start_loc[q.seq + 1] - q0;
    q.n_ctx = context_lens[q.seq] - q.q_len + (t - q0) + 1;
    q.first = (window > 0 && q.n_ctx > window) ? q.n_ctx - window : 0;
    return q;
}

// Attends query token blockIdx.y, query heads h0 .. h0 + QUERIES - 1 (h0 =
// blockIdx.x · QUERIES, all reading kv head kvh) over positions [start, end):
// each key and value is loaded once for the group's QUERIES heads. Writes
// each head's unnormalized output to `out[g · HEAD_DIM ..]` and its max and
// sum of exp to max_out[g], sum_out[g]; `logits` holds QUERIES rows of
// end - start scores.
template <typename T>
__device__ void attend(const float *__restrict__ q, const T *__restrict__ k_cache, const T *__restrict__ v_cache,
                       const int *__restrict__ block_table, long long contig_base, int num_heads, int num_kv_heads, float scale,
                       float softcap, int start, int end, float *logits, float *out, float *max_out, float *sum_out) {
    __shared__ __align__(16) float q_s[QUERIES][HEAD_DIM];
    const int h0 = blockIdx.x * QUERIES, t = blockIdx.y, n = end - start;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h0 / (num_heads / num_kv_heads);
    const long long row = (long long)num_kv_heads * HEAD_DIM;
    // The group's heads are consecutive in q: [t][h0 .. h0 + QUERIES)[d].
    const float *qg = q + ((long long)t * num_heads + h0) * HEAD_DIM;
    for (int i = threadIdx.x; i < QUERIES * HEAD_DIM; i += NUM_THREADS) q_s[i / HEAD_DIM][i % HEAD_DIM] = qg[i] * scale;
    for (int i = threadIdx.x; i < QUERIES * HEAD_DIM; i += NUM_THREADS) out[i] = 0.f;
    __syncthreads();

    // 1. Scores of the positions in [start, end).
    const int first_block = start / BLOCK_SIZE, last_block = (end - 1) / BLOCK_SIZE;
    const int tok = lane / LANES, sub = lane % LANES;
    for (int b0 = first_block + warp; b0 <= last_block; b0 += 32 * NUM_WARPS) {
        // The physical ids of the warp's next 32 blocks, one a lane, in one load.
        const int ids = block_ids(block_table, b0, last_block, lane);
        const int count = min(32, (last_block - b0) / NUM_WARPS + 1);
        for (int i = 0; i < count; i++) {
            const int b = b0 + i * NUM_WARPS;
            const int pos = b * BLOCK_SIZE + tok;
#ifdef CONTIGUOUS_KV
            const long long phys = contig_base + b;
            if (PA_PREFETCH && i + 1 < count) prefetch_block(k_cache, phys + NUM_WARPS, row, kvh, lane);
#else
            const long long phys = __shfl_sync(0xffffffffu, ids, i);
            // (count is the warp's: every lane shuffles, or none.)
            if (PA_PREFETCH && i + 1 < count) prefetch_block(k_cache, (long long)__shfl_sync(0xffffffffu, ids, i + 1), row, kvh, lane);
#endif
            const T *k = k_cache + (phys * BLOCK_SIZE + tok) * row + (long long)kvh * HEAD_DIM;
            float dot[QUERIES];
#pragma unroll
            for (int g = 0; g < QUERIES; g++) dot[g] = 0.f;
            // Unrolled by 8 at most: with one lane a token (BLOCK_SIZE 32) a full
            // unroll hoists every load of the row and runs out of registers.
#pragma unroll 8
            for (int j = 0; j < CHUNKS / LANES; j++) {
                const int c = sub + LANES * j;
                const vec4f kv = load4_nc(k + 4 * c);
#pragma unroll
                for (int g = 0; g < QUERIES; g++) {
                    const vec4f qv = {q_s[g][4 * c], q_s[g][4 * c + 1], q_s[g][4 * c + 2], q_s[g][4 * c + 3]};
                    dot[g] += dot4(qv, kv);
                }
            }
#pragma unroll
            for (int g = 0; g < QUERIES; g++) {
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
            }
            if (sub == 0 && pos >= start && pos < end) {
#pragma unroll
                for (int g = 0; g < QUERIES; g++)
                    logits[g * n + pos - start] = softcap > 0.f ? softcap * tanhf(dot[g] / softcap) : dot[g];
            }
        }
    }
#if PA_PREFETCH
    // The values of the warp's first block, on their way during the softmax.
    if (first_block + warp <= last_block) {
#ifdef CONTIGUOUS_KV
        const long long phys0 = contig_base + first_block + warp;
#else
        const long long phys0 = block_table[first_block + warp];
#endif
        prefetch_block(v_cache, phys0, row, kvh, lane);
    }
#endif
    __syncthreads();

    // 2. Softmax statistics, a warp per head; the scores become exp(s - max).
    for (int g = warp; g < QUERIES; g += NUM_WARPS) {
        float *lg = logits + g * n;
        float m = -3.0e38f;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, lg[i]);
        m = warp_max(m);
        float sum = 0.f;
        for (int i = lane; i < n; i += 32) {
            const float e = __expf(lg[i] - m);
            lg[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            max_out[g] = m;
            sum_out[g] = sum;
        }
    }
    __syncthreads();

    // 3. Values: lane owns dims VDIMS·lane .. VDIMS·lane + VDIMS - 1 of every head.
    float acc[QUERIES][VDIMS];
#pragma unroll
    for (int g = 0; g < QUERIES; g++)
#pragma unroll
        for (int i = 0; i < VDIMS; i++) acc[g][i] = 0.f;
    for (int b0 = first_block + warp; b0 <= last_block; b0 += 32 * NUM_WARPS) {
        const int ids = block_ids(block_table, b0, last_block, lane);
        const int count = min(32, (last_block - b0) / NUM_WARPS + 1);
        for (int bi = 0; bi < count; bi++) {
            const int b = b0 + bi * NUM_WARPS;
#ifdef CONTIGUOUS_KV
            const long long phys = contig_base + b;
            if (PA_PREFETCH && bi + 1 < count) prefetch_block(v_cache, phys + NUM_WARPS, row, kvh, lane);
#else
            const long long phys = __shfl_sync(0xffffffffu, ids, bi);
            if (PA_PREFETCH && bi + 1 < count) prefetch_block(v_cache, (long long)__shfl_sync(0xffffffffu, ids, bi + 1), row, kvh, lane);
#endif
            const int lo = max(start - b * BLOCK_SIZE, 0), hi = min(end - b * BLOCK_SIZE, BLOCK_SIZE);
            const T *vb = v_cache + phys * BLOCK_SIZE * row + (long long)kvh * HEAD_DIM + VDIMS * lane;
            // V_TILE tokens' values in flight before the first is used, in
            // the same order of additions as one token at a time.
            int i = lo;
#if V_TILE > 1
            for (; i + V_TILE <= hi; i += V_TILE) {
                float vv[V_TILE][VDIMS];
#pragma unroll
                for (int j = 0; j < V_TILE; j++) load_dims(vb + (long long)(i + j) * row, vv[j]);
#pragma unroll
                for (int j = 0; j < V_TILE; j++) {
                    const int at = b * BLOCK_SIZE + i + j - start;
#pragma unroll
                    for (int g = 0; g < QUERIES; g++) {
                        const float p = logits[g * n + at];
#pragma unroll
                        for (int c = 0; c < VDIMS; c++) acc[g][c] += p * vv[j][c];
                    }
                }
            }
#endif
            for (; i < hi; i++) {
                const int at = b * BLOCK_SIZE + i - start;
                float vv[VDIMS];
                load_dims(vb + (long long)i * row, vv);
#pragma unroll
                for (int g = 0; g < QUERIES; g++) {
                    const float p = logits[g * n + at];
#pragma unroll
                    for (int c = 0; c < VDIMS; c++) acc[g][c] += p * vv[c];
                }
            }
        }
    }
    // Warps add their sums in a fixed order (the same bits every run).
    for (int w = 0; w < NUM_WARPS; w++) {
        if (warp == w) {
#pragma unroll
            for (int g = 0; g < QUERIES; g++)
#pragma unroll
                for (int i = 0; i < VDIMS; i++) out[g * HEAD_DIM + VDIMS * lane + i] += acc[g][i];
        }
        __syncthreads();
    }
}

template <typename T>
__device__ void paged_attention_v1(float *__restrict__ out, const float *__restrict__ q, const T *__restrict__ k_cache,
                                   const T *__restrict__ v_cache, const int *__restrict__ block_tables, int max_blocks_per_seq,
                                   const int *__restrict__ token_seq, const int *__restrict__ query_start_loc,
                                   const int *__restrict__ context_lens, int num_heads, int num_kv_heads, float scale, float softcap,
                                   int window, float v_scale, int skip_min_q) {
    extern __shared__ float logits[];  // QUERIES · max_context
    __shared__ float o_s[QUERIES * HEAD_DIM];
    __shared__ float stats[2 * QUERIES];
    const Query qr = query_of(blockIdx.y, token_seq, query_start_loc, context_lens, window);
    if (skip_min_q > 0 && qr.q_len >= skip_min_q) return;
    attend<T>(q, k_cache, v_cache, block_tables + (long long)qr.seq * max_blocks_per_seq,
              (long long)qr.seq * max_blocks_per_seq, num_heads, num_kv_heads, scale, softcap, qr.first, qr.n_ctx, logits, o_s,
              &stats[0], &stats[QUERIES]);
    float *o = out + ((long long)blockIdx.y * num_heads + blockIdx.x * QUERIES) * HEAD_DIM;
    for (int i = threadIdx.x; i < QUERIES * HEAD_DIM; i += NUM_THREADS) o[i] = o_s[i] / stats[QUERIES + i / HEAD_DIM] * v_scale;
}
VELLUM_FOR_EACH_KV_DTYPE(paged_attention_v1,
                         (float *out, const float *q, const void *k_cache, const void *v_cache, const int *block_tables,
                          int max_blocks_per_seq, const int *token_seq, const int *query_start_loc, const int *context_lens,
                          int num_heads, int num_kv_heads, float scale, float softcap, int window, float v_scale, int skip_min_q),
                         (out, q, (const T *)k_cache, (const T *)v_cache, block_tables, max_blocks_per_seq, token_seq,
                          query_start_loc, context_lens, num_heads, num_kv_heads, scale, softcap, window, v_scale, skip_min_q))

// Partition blockIdx.z of query token blockIdx.y: positions first + z·P ..
// first + (z+1)·P - 1 of its window. tmp_out [tokens, heads, max_parts,
// HEAD_DIM] (normalized within the partition), max_logits and exp_sums
// [tokens, heads, max_parts].
template <typename T>
__device__ void paged_attention_v2(float *__restrict__ tmp_out, float *__restrict__ max_logits, float *__restrict__ exp_sums,
                                   const float *__restrict__ q, const T *__restrict__ k_cache, const T *__restrict__ v_cache,
                                   const int *__restrict__ block_tables, int max_blocks_per_seq, const int *__restrict__ token_seq,
                                   const int *__restrict__ query_start_loc, const int *__restrict__ context_lens, int num_heads,
                                   int num_kv_heads, float scale, float softcap, int window, float v_scale, int skip_min_q) {
    __shared__ float logits[QUERIES * PARTITION_SIZE];
    __shared__ float o_s[QUERIES * HEAD_DIM];
    __shared__ float stats[2 * QUERIES];
    const Query qr = query_of(blockIdx.y, token_seq, query_start_loc, context_lens, window);
    if (skip_min_q > 0 && qr.q_len >= skip_min_q) return;
    const int start = qr.first + blockIdx.z * PARTITION_SIZE;
    if (start >= qr.n_ctx) return;  // this token's window has fewer partitions
    const int end = min(start + PARTITION_SIZE, qr.n_ctx);
    attend<T>(q, k_cache, v_cache, block_tables + (long long)qr.seq * max_blocks_per_seq,
              (long long)qr.seq * max_blocks_per_seq, num_heads, num_kv_heads, scale, softcap, start, end, logits, o_s,
              &stats[0], &stats[QUERIES]);
    for (int g = 0; g < QUERIES; g++) {
        const long long slot = ((long long)blockIdx.y * num_heads + blockIdx.x * QUERIES + g) * gridDim.z + blockIdx.z;
        const float inv = v_scale / stats[QUERIES + g];
        for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) tmp_out[slot * HEAD_DIM + d] = o_s[g * HEAD_DIM + d] * inv;
        if (threadIdx.x == 0) {
            max_logits[slot] = stats[g];
            exp_sums[slot] = stats[QUERIES + g];
        }
    }
}
VELLUM_FOR_EACH_KV_DTYPE(paged_attention_v2,
                         (float *tmp_out, float *max_logits, float *exp_sums, const float *q, const void *k_cache,
                          const void *v_cache, const int *block_tables, int max_blocks_per_seq, const int *token_seq,
                          const int *query_start_loc, const int *context_lens, int num_heads, int num_kv_heads, float scale,
                          float softcap, int window, float v_scale, int skip_min_q),
                         (tmp_out, max_logits, exp_sums, q, (const T *)k_cache, (const T *)v_cache, block_tables,
                          max_blocks_per_seq, token_seq, query_start_loc, context_lens, num_heads, num_kv_heads, scale,
                          softcap, window, v_scale, skip_min_q))

// Combines the partitions of v2: out = Σ_p w_p · tmp_p / Σ_p w_p with
// w_p = exp_sum_p · exp(max_p - max). Grid (num_heads, num_tokens);
// dynamic shared memory: max_parts floats.
extern "C" __global__ void paged_attention_v2_reduce(float *__restrict__ out, const float *__restrict__ tmp_out,
                                                     const float *__restrict__ max_logits, const float *__restrict__ exp_sums,
                                                     const int *__restrict__ token_seq, const int *__restrict__ query_start_loc,
                                                     const int *__restrict__ context_lens, int num_heads, int max_parts,
                                                     int window, int skip_min_q) {
    extern __shared__ float weights[];
    __shared__ float red[NUM_WARPS];
    const Query qr = query_of(blockIdx.y, token_seq, query_start_loc, context_lens, window);
    if (skip_min_q > 0 && qr.q_len >= skip_min_q) return;
    const int parts = (qr.n_ctx - qr.first + PARTITION_SIZE - 1) / PARTITION_SIZE;
    const long long base = ((long long)blockIdx.y * num_heads + blockIdx.x) * max_parts;
    float m = -3.0e38f;
    for (int p = threadIdx.x; p < parts; p += NUM_THREADS) m = fmaxf(m, max_logits[base + p]);
    m = block_max(m, red);
    float total = 0.f;
    for (int p = threadIdx.x; p < parts; p += NUM_THREADS) {
        const float w = exp_sums[base + p] * __expf(max_logits[base + p] - m);
        weights[p] = w;
        total += w;
    }
    total = block_sum(total, red);  // ends with a barrier: weights are visible
    const float inv = 1.f / total;
    float *o = out + ((long long)blockIdx.y * num_heads + blockIdx.x) * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
        float a = 0.f;
        for (int p = 0; p < parts; p++) a += weights[p] * tmp_out[(base + p) * HEAD_DIM + d];
        o[d] = a * inv;
    }
}
