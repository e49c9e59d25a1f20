// The element-wise and per-row layers around attention and the linears, on
// f32 activations: RMSNorm (optionally fused with the residual add), RoPE,
// the gated activations, the embedding gather, and the small glue of the
// model executor (residual add, scale, bias, logits-row gather). Row
// kernels take whole rows: grid (rows), NUM_THREADS threads (a multiple of
// 32); element-wise kernels stride over `n` elements from any grid.

#ifndef NUM_THREADS
#define NUM_THREADS 256
#endif

// y = x / sqrt(mean(x²) + eps) · (w + offset), per row of `cols`;
// offset 1 for Gemma's (1 + w) weights, 0 otherwise. In place when y == x.
extern "C" __global__ void rms_norm(float *y, const float *x, const float *__restrict__ w, int cols, float eps, float offset) {
    __shared__ float red[NUM_THREADS / 32];
    const float *xr = x + (long long)blockIdx.x * cols;
    float *yr = y + (long long)blockIdx.x * cols;
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += NUM_THREADS) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / cols + eps);
    for (int i = threadIdx.x; i < cols; i += NUM_THREADS) yr[i] = xr[i] * r * (w[i] + offset);
}

// residual += x; x = rms_norm(residual) (the pre-norm of the next layer),
// one pass over each row.
extern "C" __global__ void fused_add_rms_norm(float *x, float *residual, const float *__restrict__ w, int cols, float eps,
                                              float offset) {
    __shared__ float red[NUM_THREADS / 32];
    float *xr = x + (long long)blockIdx.x * cols;
    float *rr = residual + (long long)blockIdx.x * cols;
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += NUM_THREADS) {
        const float v = rr[i] + xr[i];
        rr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / cols + eps);
    for (int i = threadIdx.x; i < cols; i += NUM_THREADS) xr[i] = rr[i] * r * (w[i] + offset);
}

// Half-split RoPE (GPT-NeoX / Llama layout: dim i pairs with i + rot/2) on
// the first `rot` dims of every head of q [tokens, num_heads, head_dim] and
// k [tokens, num_kv_heads, head_dim], in place. cos_sin [max_pos, rot]
// holds cos for the rot/2 frequencies then sin, built on the host in f64
// (Llama-3 frequency scaling included there). Grid (tokens).
extern "C" __global__ void rope_half_split(float *q, float *k, const float *__restrict__ cos_sin, const long long *__restrict__ positions,
                                           int num_heads, int num_kv_heads, int head_dim, int rot) {
    const int t = blockIdx.x;
    const int half = rot / 2;
    const float *cs = cos_sin + positions[t] * rot;
    const int pairs_q = num_heads * half, pairs = (num_heads + num_kv_heads) * half;
    for (int i = threadIdx.x; i < pairs; i += NUM_THREADS) {
        const bool is_q = i < pairs_q;
        const int j = is_q ? i : i - pairs_q;
        const int head = j / half, f = j % half;
        float *v = is_q ? q + ((long long)t * num_heads + head) * head_dim : k + ((long long)t * num_kv_heads + head) * head_dim;
        const float c = cs[f], s = cs[half + f];
        const float a = v[f], b = v[f + half];
        v[f] = a * c - b * s;
        v[f + half] = b * c + a * s;
    }
}

// out[t, i] = act(x[t, i]) · x[t, inter + i] for the gate and up halves of
// each row of x [tokens, 2·inter] (SwiGLU with silu, GeGLU with gelu-tanh).
extern "C" __global__ void silu_and_mul(float *out, const float *__restrict__ x, int inter) {
    const float *xr = x + (long long)blockIdx.x * 2 * inter;
    float *o = out + (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += NUM_THREADS) o[i] = silu(xr[i]) * xr[inter + i];
}
extern "C" __global__ void gelu_tanh_and_mul(float *out, const float *__restrict__ x, int inter) {
    const float *xr = x + (long long)blockIdx.x * 2 * inter;
    float *o = out + (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += NUM_THREADS) o[i] = gelu_tanh(xr[i]) * xr[inter + i];
}

// One row of a stacked q/k/v product split into its q, k and v columns,
// each value handed to `put(part, col, x)` (part 0: q, 1: k, 2: v); with
// `rotate`, q and k are rotated as rope_half_split rotates them (every
// head_dim-wide head, `cs` the table's cos then sin at the token's position).
template <class Put>
__device__ __forceinline__ void split_row(const float *row, const float *cs, int nq, int nk, int nv, int head_dim, int rotate, Put put) {
    for (int i = threadIdx.x; i < nv; i += NUM_THREADS) put(2, i, row[nq + nk + i]);
    if (!rotate) {
        for (int i = threadIdx.x; i < nq + nk; i += NUM_THREADS) {
            if (i < nq) put(0, i, row[i]);
            else put(1, i - nq, row[i]);
        }
        return;
    }
    const int half = head_dim / 2;
    for (int i = threadIdx.x; i < (nq + nk) / 2; i += NUM_THREADS) {
        const int head = i / half, f = i % half;
        const int col = head * head_dim + f;
        const float c = cs[f], s = cs[half + f];
        const float a = row[col], b = row[col + half];
        const float lo = a * c - b * s, hi = b * c + a * s;
        const int part = col < nq ? 0 : 1, at = col < nq ? col : col - nq;
        put(part, at, lo);
        put(part, at + half, hi);
    }
}

// Each row of qkv [tokens, nq + nk + nv] (one product by the q, k and v
// weights stacked) split into q [tokens, nq], k [tokens, nk] and v [tokens,
// nv], q and k rotated with `rotate` (split_row). Grid (tokens).
extern "C" __global__ void split_qkv_rope(float *q, float *k, float *v, const float *__restrict__ qkv, const float *__restrict__ cos_sin,
                                          const long long *__restrict__ positions, int nq, int nk, int nv, int head_dim, int rotate) {
    const int t = blockIdx.x;
    const float *row = qkv + (long long)t * (nq + nk + nv);
    float *qr = q + (long long)t * nq, *kr = k + (long long)t * nk, *vr = v + (long long)t * nv;
    const float *cs = rotate ? cos_sin + positions[t] * head_dim : cos_sin;
    split_row(row, cs, nq, nk, nv, head_dim, rotate, [&](int part, int col, float x) { (part == 0 ? qr : part == 1 ? kr : vr)[col] = x; });
}

// split_qkv_rope with the keys and values going straight into the paged
// cache as reshape_and_cache (cache.cu) writes them — times the layer's
// inverse scales (k_inv, v_inv: 1 but for FP8), converted to the pool's
// type, at slot `slot_mapping[t]` (a negative slot, a padding token, writes
// none) — and only q to memory: one launch instead of two, no k and v
// tensors. nkv = num_kv_heads · head_dim, a pool row. Grid (tokens).
template <typename T>
__device__ void split_qkv_rope_cache(float *q, const float *__restrict__ qkv, const float *__restrict__ cos_sin,
                                     const long long *__restrict__ positions, T *__restrict__ k_cache, T *__restrict__ v_cache,
                                     const long long *__restrict__ slot_mapping, int nq, int nkv, int head_dim, int rotate, float k_inv,
                                     float v_inv) {
    const int t = blockIdx.x;
    const long long slot = slot_mapping[t];
    const float *row = qkv + (long long)t * (nq + 2 * nkv);
    float *qr = q + (long long)t * nq;
    const float *cs = rotate ? cos_sin + positions[t] * head_dim : cos_sin;
    split_row(row, cs, nq, nkv, nkv, head_dim, rotate, [&](int part, int col, float x) {
        if (part == 0) qr[col] = x;
        else if (slot >= 0 && part == 1) k_cache[slot * nkv + col] = from_float<T>(x * k_inv);
        else if (slot >= 0) v_cache[slot * nkv + col] = from_float<T>(x * v_inv);
    });
}
VELLUM_FOR_EACH_KV_DTYPE(split_qkv_rope_cache,
                         (float *q, const float *qkv, const float *cos_sin, const long long *positions, void *k_cache, void *v_cache,
                          const long long *slot_mapping, int nq, int nkv, int head_dim, int rotate, float k_inv, float v_inv),
                         (q, qkv, cos_sin, positions, (T *)k_cache, (T *)v_cache, slot_mapping, nq, nkv, head_dim, rotate, k_inv, v_inv))

// The same with gate and up in separate tensors [tokens, inter] (as the
// model code computes them): out[i] = act(gate[i]) · up[i] over n elements.
extern "C" __global__ void silu_mul_split(float *out, const float *__restrict__ gate, const float *__restrict__ up, long long n) {
    for (long long i = blockIdx.x * (long long)NUM_THREADS + threadIdx.x; i < n; i += (long long)gridDim.x * NUM_THREADS)
        out[i] = silu(gate[i]) * up[i];
}
extern "C" __global__ void gelu_tanh_mul_split(float *out, const float *__restrict__ gate, const float *__restrict__ up, long long n) {
    for (long long i = blockIdx.x * (long long)NUM_THREADS + threadIdx.x; i < n; i += (long long)gridDim.x * NUM_THREADS)
        out[i] = gelu_tanh(gate[i]) * up[i];
}

// x[i] += y[i] (the residual add) over n elements.
extern "C" __global__ void add_inplace(float *x, const float *__restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)NUM_THREADS + threadIdx.x; i < n; i += (long long)gridDim.x * NUM_THREADS) x[i] += y[i];
}

// x[i] *= factor over n elements.
extern "C" __global__ void scale_inplace(float *x, float factor, long long n) {
    for (long long i = blockIdx.x * (long long)NUM_THREADS + threadIdx.x; i < n; i += (long long)gridDim.x * NUM_THREADS) x[i] *= factor;
}

// y[i] = x[i] rounded to nearest (even) in the 16-bit type, over n
// elements: activations cast for a 16-bit tensor-core GEMM. Grid-stride.
template <typename T> __device__ __forceinline__ void cast_from_f32(T *y, const float *__restrict__ x, long long n) {
    for (long long i = blockIdx.x * (long long)NUM_THREADS + threadIdx.x; i < n; i += (long long)gridDim.x * NUM_THREADS) y[i] = from_float<T>(x[i]);
}
extern "C" __global__ void cast_f32_to_f16(f16 *y, const float *__restrict__ x, long long n) { cast_from_f32(y, x, n); }
extern "C" __global__ void cast_f32_to_bf16(bf16 *y, const float *__restrict__ x, long long n) { cast_from_f32(y, x, n); }

// y[r, :] += b for every row of y [rows, cols]. Grid (rows).
extern "C" __global__ void add_bias_rows(float *y, const float *__restrict__ b, int cols) {
    float *yr = y + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += NUM_THREADS) yr[i] += b[i];
}

// out[r, :] = x[rows[r], :] (the rows whose logits are returned). Grid
// (number of rows); the host checks every index against x's rows.
extern "C" __global__ void gather_rows(float *out, const float *__restrict__ x, const int *__restrict__ rows, int cols) {
    const float *xr = x + (long long)rows[blockIdx.x] * cols;
    float *o = out + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += NUM_THREADS) o[i] = xr[i];
}

// out[t, :] = table[ids[t] - first, :] · scale (Gemma scales by
// sqrt(hidden)), from a table stored as f32, f16 or bf16 that holds the
// vocabulary rows first..first + vocab (a whole table: first = 0; one rank's
// shard under tensor parallelism otherwise). An id outside those rows gives
// zeros: another rank's token, summed in by the all-reduce that follows (the
// host validates ids against the whole vocabulary).
template <typename T>
__device__ void embedding(float *out, const T *__restrict__ table, const int *__restrict__ ids, int first, int vocab, int cols,
                          float scale) {
    const int id = ids[blockIdx.x] - first;
    float *o = out + (long long)blockIdx.x * cols;
    const bool ok = id >= 0 && id < vocab;
    const T *row = table + (long long)(ok ? id : 0) * cols;
    for (int i = threadIdx.x; i < cols; i += NUM_THREADS) o[i] = ok ? to_float(row[i]) * scale : 0.f;
}
VELLUM_FOR_EACH_DTYPE(embedding, (float *out, const void *table, const int *ids, int first, int vocab, int cols, float scale),
                      (out, (const T *)table, ids, first, vocab, cols, scale))

// The greedy token of each row of logits [rows, vocab]: the largest logit,
// the lowest id among equals (as the CPU sampler breaks ties).
extern "C" __global__ void argmax_rows(int *out, const float *__restrict__ logits, int vocab) {
    __shared__ float best_v[NUM_THREADS];
    __shared__ int best_i[NUM_THREADS];
    const float *l = logits + (long long)blockIdx.x * vocab;
    float bv = -3.4e38f;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += NUM_THREADS) {
        if (l[i] > bv) {
            bv = l[i];
            bi = i;
        }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = NUM_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = best_v[threadIdx.x + s];
            const int oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_i[0];
}
