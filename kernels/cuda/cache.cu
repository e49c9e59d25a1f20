// Writing new keys and values into the paged KV cache, and copy-on-write
// block copies (paper §4.1, §4.4).
//
// Cache layout (one pool for K, one for V): [num_blocks, block_size,
// num_kv_heads, head_dim], so one token's row of `row = num_kv_heads ·
// head_dim` elements is contiguous and slot `s` (block s / block_size,
// offset s % block_size) starts at element s · row.

// One thread block per token: the token's K and V rows (f32, as the model
// produced them) go to slot `slot_mapping[t]`, multiplied by the inverse of
// the layer's scales (k_inv, v_inv: 1 but for FP8) and converted to the
// cache's element type. A negative slot (a padding token) writes nothing.
template <typename T>
__device__ void reshape_and_cache(const float *__restrict__ key, const float *__restrict__ value, T *__restrict__ k_cache,
                                  T *__restrict__ v_cache, const long long *__restrict__ slot_mapping, int row, float k_inv,
                                  float v_inv) {
    const int t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;
    const float *k = key + (long long)t * row;
    const float *v = value + (long long)t * row;
    T *kd = k_cache + slot * row;
    T *vd = v_cache + slot * row;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        kd[i] = from_float<T>(k[i] * k_inv);
        vd[i] = from_float<T>(v[i] * v_inv);
    }
}
VELLUM_FOR_EACH_KV_DTYPE(reshape_and_cache,
                         (const float *key, const float *value, void *k_cache, void *v_cache, const long long *slot_mapping,
                          int row, float k_inv, float v_inv),
                         (key, value, (T *)k_cache, (T *)v_cache, slot_mapping, row, k_inv, v_inv))

// Batched block copies: pair p copies block pairs[2p] to block pairs[2p+1]
// in both pools. Grid: (num_pairs, chunks); each thread block copies a
// strided share of the block's `block_elems` elements as 32-bit words
// (block_elems · sizeof(T) is a multiple of 4 for every shape we allow).
extern "C" __global__ void copy_blocks(unsigned int *__restrict__ k_cache, unsigned int *__restrict__ v_cache,
                                       const long long *__restrict__ pairs, long long block_words) {
    const long long src = pairs[2 * blockIdx.x] * block_words;
    const long long dst = pairs[2 * blockIdx.x + 1] * block_words;
    for (long long i = blockIdx.y * blockDim.x + threadIdx.x; i < block_words; i += (long long)gridDim.y * blockDim.x) {
        k_cache[dst + i] = k_cache[src + i];
        v_cache[dst + i] = v_cache[src + i];
    }
}
