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
// multiple of 32), PARTITION_SIZE (tokens per partition of v2).
//
// v1: grid (num_heads, num_tokens); one thread block walks the whole
//     context; the scores live in dynamic shared memory (4 bytes a token).
// v2: grid (num_heads, num_tokens, max_num_partitions); each thread block
//     takes PARTITION_SIZE positions and writes its softmax statistics (max,
//     sum of exp) and its normalized partial output; `paged_attention_v2_reduce`
//     combines the partitions. For long contexts or few sequences.
//
// Within a thread block, warps take KV blocks in turn. Scores: a KV block's
// BLOCK_SIZE tokens are spread over the warp's 32 lanes, LANES = 32 /
// BLOCK_SIZE lanes per token, each lane taking every LANES-th group of four
// dims (so the lanes of one token read adjacent 16-byte pieces). Values: each
// lane owns HEAD_DIM / 32 consecutive dims and accumulates p · v over the
// warp's tokens; warps meet in shared memory at the end.
//
// Cache layout: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] (cache.cu).
// Grouped-query attention: head h reads kv head h / (num_heads / num_kv_heads).

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

#define NUM_WARPS (NUM_THREADS / 32)
#define LANES (32 / BLOCK_SIZE)
#define CHUNKS (HEAD_DIM / 4)
#define VDIMS (HEAD_DIM / 32)

static_assert(HEAD_DIM % 64 == 0, "HEAD_DIM must be a multiple of 64");
static_assert(BLOCK_SIZE == 8 || BLOCK_SIZE == 16 || BLOCK_SIZE == 32, "BLOCK_SIZE must be 8, 16 or 32");
static_assert(CHUNKS % LANES == 0, "a token's dims split evenly over its lanes");
static_assert(NUM_THREADS % 32 == 0 && NUM_THREADS <= 1024, "NUM_THREADS must be whole warps");

// The metadata every kernel of this file reads the same way.
struct Query {
    int seq;     // its sequence
    int n_ctx;   // positions it sees: 0 .. n_ctx - 1 (itself included)
    int first;   // first position it sees (sliding window)
};

__device__ __forceinline__ Query query_of(int t, const int *token_seq, const int *query_start_loc, const int *context_lens,
                                          int window) {
    Query q;
    q.seq = token_seq[t];
    const int q0 = query_start_loc[q.seq];
    const int q_len = query_start_loc[q.seq + 1] - q0;
    q.n_ctx = context_lens[q.seq] - q_len + (t - q0) + 1;
    q.first = (window > 0 && q.n_ctx > window) ? q.n_ctx - window : 0;
    return q;
}

// Attends query token blockIdx.y, head blockIdx.x, over positions
// [start, end); returns the unnormalized output in `acc_out` (thread i holds
// dims i, i + NUM_THREADS, ...), and the max and sum of exp of the scores.
template <typename T>
__device__ void attend(const float *__restrict__ q, const T *__restrict__ k_cache, const T *__restrict__ v_cache,
                       const int *__restrict__ block_table, int num_heads, int num_kv_heads, float scale, float softcap, int start,
                       int end, float *logits, float *out, float *max_out, float *sum_out) {
    __shared__ __align__(16) float q_s[HEAD_DIM];
    __shared__ float red[NUM_WARPS];
    __shared__ float acc_s[NUM_WARPS][HEAD_DIM];
    const int h = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (num_heads / num_kv_heads);
    const long long row = (long long)num_kv_heads * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) q_s[d] = q[((long long)t * num_heads + h) * HEAD_DIM + d] * scale;
    __syncthreads();

    // 1. Scores of the positions in [start, end).
    const int first_block = start / BLOCK_SIZE, last_block = (end - 1) / BLOCK_SIZE;
    const int tok = lane / LANES, sub = lane % LANES;
    float m = -3.0e38f;
    for (int b = first_block + warp; b <= last_block; b += NUM_WARPS) {
        const int pos = b * BLOCK_SIZE + tok;
        const long long phys = block_table[b];
        const T *k = k_cache + (phys * BLOCK_SIZE + tok) * row + (long long)kvh * HEAD_DIM;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < CHUNKS / LANES; j++) {
            const int c = sub + LANES * j;
            const vec4f kv = load4(k + 4 * c);
            const vec4f qv = {q_s[4 * c], q_s[4 * c + 1], q_s[4 * c + 2], q_s[4 * c + 3]};
            dot += dot4(qv, kv);
        }
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (sub == 0 && pos >= start && pos < end) {
            const float s = softcap > 0.f ? softcap * tanhf(dot / softcap) : dot;
            logits[pos - start] = s;
            m = fmaxf(m, s);
        }
    }
    __syncthreads();

    // 2. Softmax statistics; the scores become exp(s - max).
    m = block_max(m, red);
    float sum = 0.f;
    for (int i = threadIdx.x; i < end - start; i += NUM_THREADS) {
        const float e = __expf(logits[i] - m);
        logits[i] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // ends with a barrier: every exp is visible

    // 3. Values: lane owns dims VDIMS·lane .. VDIMS·lane + VDIMS - 1.
    float acc[VDIMS];
#pragma unroll
    for (int i = 0; i < VDIMS; i++) acc[i] = 0.f;
    for (int b = first_block + warp; b <= last_block; b += NUM_WARPS) {
        const long long phys = block_table[b];
        const int lo = max(start - b * BLOCK_SIZE, 0), hi = min(end - b * BLOCK_SIZE, BLOCK_SIZE);
        for (int i = lo; i < hi; i++) {
            const float p = logits[b * BLOCK_SIZE + i - start];
            const T *v = v_cache + (phys * BLOCK_SIZE + i) * row + (long long)kvh * HEAD_DIM + VDIMS * lane;
#pragma unroll
            for (int c = 0; c < VDIMS; c += 2) {
                acc[c] += p * to_float(v[c]);
                acc[c + 1] += p * to_float(v[c + 1]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < VDIMS; i++) acc_s[warp][VDIMS * lane + i] = acc[i];
    __syncthreads();
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; w++) a += acc_s[w][d];
        out[d] = a;
    }
    *max_out = m;
    *sum_out = sum;
}

template <typename T>
__device__ void paged_attention_v1(float *__restrict__ out, const float *__restrict__ q, const T *__restrict__ k_cache,
                                   const T *__restrict__ v_cache, const int *__restrict__ block_tables, int max_blocks_per_seq,
                                   const int *__restrict__ token_seq, const int *__restrict__ query_start_loc,
                                   const int *__restrict__ context_lens, int num_heads, int num_kv_heads, float scale, float softcap,
                                   int window) {
    extern __shared__ float logits[];
    __shared__ float o_s[HEAD_DIM];
    __shared__ float stats[2];
    const Query qr = query_of(blockIdx.y, token_seq, query_start_loc, context_lens, window);
    attend<T>(q, k_cache, v_cache, block_tables + (long long)qr.seq * max_blocks_per_seq, num_heads, num_kv_heads, scale, softcap,
              qr.first, qr.n_ctx, logits, o_s, &stats[0], &stats[1]);
    __syncthreads();
    const float inv = 1.f / stats[1];
    float *o = out + ((long long)blockIdx.y * num_heads + blockIdx.x) * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) o[d] = o_s[d] * inv;
}
VELLUM_FOR_EACH_DTYPE(paged_attention_v1,
                      (float *out, const float *q, const void *k_cache, const void *v_cache, const int *block_tables,
                       int max_blocks_per_seq, const int *token_seq, const int *query_start_loc, const int *context_lens,
                       int num_heads, int num_kv_heads, float scale, float softcap, int window),
                      (out, q, (const T *)k_cache, (const T *)v_cache, block_tables, max_blocks_per_seq, token_seq,
                       query_start_loc, context_lens, num_heads, num_kv_heads, scale, softcap, window))

// Partition blockIdx.z of query token blockIdx.y: positions first + z·P ..
// first + (z+1)·P - 1 of its window. tmp_out [tokens, heads, max_parts,
// HEAD_DIM] (normalized within the partition), max_logits and exp_sums
// [tokens, heads, max_parts].
template <typename T>
__device__ void paged_attention_v2(float *__restrict__ tmp_out, float *__restrict__ max_logits, float *__restrict__ exp_sums,
                                   const float *__restrict__ q, const T *__restrict__ k_cache, const T *__restrict__ v_cache,
                                   const int *__restrict__ block_tables, int max_blocks_per_seq, const int *__restrict__ token_seq,
                                   const int *__restrict__ query_start_loc, const int *__restrict__ context_lens, int num_heads,
                                   int num_kv_heads, float scale, float softcap, int window) {
    __shared__ float logits[PARTITION_SIZE];
    __shared__ float o_s[HEAD_DIM];
    __shared__ float stats[2];
    const Query qr = query_of(blockIdx.y, token_seq, query_start_loc, context_lens, window);
    const int start = qr.first + blockIdx.z * PARTITION_SIZE;
    if (start >= qr.n_ctx) return;  // this token's window has fewer partitions
    const int end = min(start + PARTITION_SIZE, qr.n_ctx);
    attend<T>(q, k_cache, v_cache, block_tables + (long long)qr.seq * max_blocks_per_seq, num_heads, num_kv_heads, scale, softcap,
              start, end, logits, o_s, &stats[0], &stats[1]);
    __syncthreads();
    const long long slot = ((long long)blockIdx.y * num_heads + blockIdx.x) * gridDim.z + blockIdx.z;
    const float inv = 1.f / stats[1];
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) tmp_out[slot * HEAD_DIM + d] = o_s[d] * inv;
    if (threadIdx.x == 0) {
        max_logits[slot] = stats[0];
        exp_sums[slot] = stats[1];
    }
}
VELLUM_FOR_EACH_DTYPE(paged_attention_v2,
                      (float *tmp_out, float *max_logits, float *exp_sums, const float *q, const void *k_cache,
                       const void *v_cache, const int *block_tables, int max_blocks_per_seq, const int *token_seq,
                       const int *query_start_loc, const int *context_lens, int num_heads, int num_kv_heads, float scale,
                       float softcap, int window),
                      (tmp_out, max_logits, exp_sums, q, (const T *)k_cache, (const T *)v_cache, block_tables,
                       max_blocks_per_seq, token_seq, query_start_loc, context_lens, num_heads, num_kv_heads, scale, softcap,
                       window))

// Combines the partitions of v2: out = Σ_p w_p · tmp_p / Σ_p w_p with
// w_p = exp_sum_p · exp(max_p - max). Grid (num_heads, num_tokens);
// dynamic shared memory: max_parts floats.
extern "C" __global__ void paged_attention_v2_reduce(float *__restrict__ out, const float *__restrict__ tmp_out,
                                                     const float *__restrict__ max_logits, const float *__restrict__ exp_sums,
                                                     const int *__restrict__ token_seq, const int *__restrict__ query_start_loc,
                                                     const int *__restrict__ context_lens, int num_heads, int max_parts,
                                                     int window) {
    extern __shared__ float weights[];
    __shared__ float red[NUM_WARPS];
    const Query qr = query_of(blockIdx.y, token_seq, query_start_loc, context_lens, window);
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
