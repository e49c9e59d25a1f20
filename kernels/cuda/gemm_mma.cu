// Linear layers on tensor cores: y[r, n] = Σ_k x[r, k] · W[n, k] with x in
// bf16 (`cast_f32_to_bf16` rounds the activations first), W in one of the
// weight layouts of common.cuh (Q8, Q4, F32) dequantized to bf16 as it is
// staged, f32 accumulation (`mma.sync.m16n8k16` bf16 → f32, sm_80 and
// later), y in f32. Also `dequantize_bf16_*`: a whole weight to bf16 (a
// scratch for cuBLAS on large batches, where its GEMM outruns this one).
//
// Tiling: a thread block of 8 warps computes an MMA_BM × 128 tile of y
// (MMA_BM = 32, 64 or 128: a compile-time define chosen by the batch's rows),
// the warps as 2 (rows) × 4 (columns), each an (MMA_BM / 2) × 32 tile: MT × 4
// fragments of 16 × 8. k advances 32 at a time (one scale block) through two
// shared-memory stages:
// - x: MMA_BM rows × 32 bf16, copied by `cp.async` (16 bytes a copy, rows
//   past the batch filled with zeros by the copy itself);
// - W: 128 columns × 32 weights, thread t fetching 16 weights of column
//   t / 2 into registers one step ahead, decoding them to bf16 and storing
//   them after the current step's products. (A ring of four steps in
//   registers was measured slower on an H100: twice the registers, half
//   the thread blocks a multiprocessor holds.)
// Rows of both stages are 40 bf16 (80 bytes) apart, so the eight 16-byte
// rows an `ldmatrix` reads fall in distinct banks. Fragments come from
// shared memory by `ldmatrix.x4`: four 8 × 8 matrices a call, giving a
// 16 × 16 A fragment or the B fragments of two 8-column tiles.
//
// Split-K as in gemv_q.cu: blockIdx.z takes the blocks of 32 from
// z · kb_per_split on and writes its partial tile at y + z · rows · n;
// `gemm_sum_splits` (gemv_q.cu) adds them in order.

#ifndef MMA_BM
#define MMA_BM 128
#endif
#define MMA_BN 128
#define MMA_THREADS 256
#define MMA_LDS 40
#define MMA_WM (MMA_BM / 2)
#define MMA_MT (MMA_WM / 16)
#define MMA_NT 4

static_assert(MMA_BM == 32 || MMA_BM == 64 || MMA_BM == 128, "MMA_BM must be 32, 64 or 128");

// 16 decoded weights as bf16, 32 bytes at `dst` (16-byte aligned).
__device__ __forceinline__ void store16_bf16(unsigned short *dst, const float w[16]) {
    uint4 a, b;
    a.x = pack_bf16(w[0], w[1]), a.y = pack_bf16(w[2], w[3]), a.z = pack_bf16(w[4], w[5]), a.w = pack_bf16(w[6], w[7]);
    b.x = pack_bf16(w[8], w[9]), b.y = pack_bf16(w[10], w[11]), b.z = pack_bf16(w[12], w[13]), b.w = pack_bf16(w[14], w[15]);
    reinterpret_cast<uint4 *>(dst)[0] = a;
    reinterpret_cast<uint4 *>(dst)[1] = b;
}

template <typename L>
__device__ __forceinline__ void gemm_mma(float *__restrict__ y, const unsigned char *__restrict__ codes,
                                         const unsigned short *__restrict__ scales, const unsigned short *__restrict__ x, int rows,
                                         int n_cols, int k, int kb_per_split) {
    __shared__ __align__(16) unsigned short as[2][MMA_BM * MMA_LDS];
    __shared__ __align__(16) unsigned short bs[2][MMA_BN * MMA_LDS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int r0 = blockIdx.y * MMA_BM, n0 = blockIdx.x * MMA_BN;
    const int kb_begin = blockIdx.z * kb_per_split, kb_end = min(k / 32, kb_begin + kb_per_split);
    y += (long long)blockIdx.z * rows * n_cols;

    // This thread's weight loads: column bc of the tile, weights 16·bh .. + 15 of a block.
    const int bc = tid >> 1, bh = tid & 1;
    const bool b_valid = n0 + bc < n_cols;
    const int b_col = min(n0 + bc, n_cols - 1);

    float acc[MMA_MT][MMA_NT][4];
#pragma unroll
    for (int i = 0; i < MMA_MT; i++)
#pragma unroll
        for (int j = 0; j < MMA_NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    auto load_x = [&](int stage, int kb) {
        // MMA_BM rows × 4 copies of 8 bf16.
#pragma unroll
        for (int c = tid; c < MMA_BM * 4; c += MMA_THREADS) {
            const int row = c >> 2, part = c & 3, gr = r0 + row;
            const unsigned short *src = x + (long long)min(gr, rows - 1) * k + 32 * kb + 8 * part;
            cp_async16(&as[stage][row * MMA_LDS + 8 * part], src, gr < rows ? 16 : 0);
        }
    };
    auto store_w = [&](int stage, const typename L::Raw &raw) {
        float w[16];
        L::decode(raw, w);
        if (!b_valid) {
#pragma unroll
            for (int i = 0; i < 16; i++) w[i] = 0.f;
        }
        store16_bf16(&bs[stage][bc * MMA_LDS + 16 * bh], w);
    };

    typename L::Raw raw;
    if (kb_begin < kb_end) {
        load_x(0, kb_begin);
        raw = L::fetch(codes, scales, b_col, k, 32 * kb_begin + 16 * bh);
        store_w(0, raw);
    }
    cp_async_commit();
    for (int kb = kb_begin; kb < kb_end; kb++) {
        const int s = (kb - kb_begin) & 1;
        const bool more = kb + 1 < kb_end;
        if (more) {
            load_x(s ^ 1, kb + 1);
            raw = L::fetch(codes, scales, b_col, k, 32 * (kb + 1) + 16 * bh);
        }
        cp_async_commit();
        cp_async_wait_one();
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < 32; ks += 16) {
            unsigned a[MMA_MT][4], b[MMA_NT][2];
#pragma unroll
            for (int i = 0; i < MMA_MT; i++) {
                // Lanes 0-15: rows 0-15 at k ks; lanes 16-31: rows 0-15 at ks + 8.
                const int row = wm * MMA_WM + 16 * i + (lane & 15);
                ldmatrix_x4(a[i], &as[s][row * MMA_LDS + ks + 8 * (lane >> 4)]);
            }
#pragma unroll
            for (int p = 0; p < MMA_NT / 2; p++) {
                // Matrix j = lane / 8: column tile 2p + j / 2, k half j % 2.
                const int j = lane >> 3;
                const int col = wn * 32 + 8 * (2 * p + (j >> 1)) + (lane & 7);
                unsigned r[4];
                ldmatrix_x4(r, &bs[s][col * MMA_LDS + ks + 8 * (j & 1)]);
                b[2 * p][0] = r[0], b[2 * p][1] = r[1], b[2 * p + 1][0] = r[2], b[2 * p + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MMA_MT; i++)
#pragma unroll
                for (int j = 0; j < MMA_NT; j++) mma_bf16(acc[i][j], a[i], b[j][0], b[j][1]);
        }
        if (more) store_w(s ^ 1, raw);
        __syncthreads();
    }

    // Fragment element e of tile (i, j): row 16i + lane/4 (+8 for e ≥ 2),
    // column 8j + 2·(lane % 4) (+1 for odd e).
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int i = 0; i < MMA_MT; i++)
#pragma unroll
        for (int j = 0; j < MMA_NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = r0 + wm * MMA_WM + 16 * i + g + 8 * (e >> 1);
                const int n = n0 + wn * 32 + 8 * j + 2 * t4 + (e & 1);
                if (r < rows && n < n_cols) y[(long long)r * n_cols + n] = acc[i][j][e];
            }
}

#define MMA_ENTRY(SUFFIX, LAYOUT)                                                                                          \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                                             \
        gemm_mma_##SUFFIX(float *y, const unsigned char *codes, const unsigned short *scales, const unsigned short *x,     \
                          int rows, int n_cols, int k, int kb_per_split) {                                                \
        gemm_mma<LAYOUT>(y, codes, scales, x, rows, n_cols, k, kb_per_split);                                             \
    }
MMA_ENTRY(q8, LayoutQ8)
MMA_ENTRY(q4, LayoutQ4)
MMA_ENTRY(q4k, LayoutQ4K)
MMA_ENTRY(q5k, LayoutQ5K)
MMA_ENTRY(q6k, LayoutQ6K)
MMA_ENTRY(f32, LayoutF32)

// ---------------------------------------------------------------------------
// `gemm_mma_staged_*`: the same product for Q8, Q4 and the K-quants, with
// the weight's bytes brought in by `cp.async` several steps ahead. Decode
// batches (3 to 127 rows) are bound by reading the weight once, and
// `gemm_mma` has one step of 32 (a sixteen-byte load a thread) in flight;
// here each thread block has MMA_STAGES − 1 steps of 64 in flight (24 KB of
// Q8 codes), and no register holds them.
//
// - A stage (dynamic shared memory, `mma_staged_smem_bytes` on the host):
//   x's MMA_BM rows × 64 bf16 (rows STG_ALD = 72 apart), the 128 columns'
//   64 weights as the file's codes (`Staged<L>::CODE_LD` bytes apart), and
//   their two blocks' scales. Every part comes by `cp.async`; rows past the
//   batch read as zeros, columns past n repeat the last (never stored).
// - The warps split the columns: warp w owns columns 16w .. 16w + 15 of the
//   tile for all MMA_BM rows (MMA_BM / 16 × 2 fragments), so each weight is
//   decoded once. A lane builds its B fragments straight from the codes in
//   shared memory (`Staged<L>::pair`: two weights, decoded as `L::decode`
//   does and rounded to bf16 as `store16_bf16` does), and its A fragments
//   by `ldmatrix.x4`.
// - Each output takes its k in the same order and its products from the same
//   bf16 values as `gemm_mma`'s, so the two kernels agree bit for bit.
// - One barrier a step: waiting for step i's group, then issuing step
//   i + MMA_STAGES − 1's into the slot step i − 1 used.
// The host sends here only weights whose k/32 and whose parts of k are even
// (a step is two scale blocks; the scales' copies are then aligned), and
// Q6_K weights only with k/256 even.

#define STG_KC 64
#define STG_ALD (STG_KC + 8)
#ifndef MMA_STAGES
#define MMA_STAGES (MMA_BM == 128 ? 3 : 4)
#endif
#define STG_MT (MMA_BM / 16)
// Blocks a multiprocessor is to hold (registers for them: at most 85 a
// thread at tile height 32, 128 above): three of 61 KB of stages at tile
// height 32, two of 80-88 KB above.
#define STG_MIN_BLOCKS (MMA_BM == 32 ? 3 : 2)

template <typename L> struct Staged;
// Each layout's staging: CODE_BYTES of codes a column a step (rows
// CODE_LD bytes apart in shared memory: the eight columns a fragment reads
// fall in distinct banks), SCALE_BYTES of scales, copied by
// `copy_scales` in aligned 4- or 8-byte pieces; `step` turns a column's
// scales into the floats its weights take, once a step (at block kb), and
// `pair` decodes weights kk and kk + 1 (kk even, in the 16 from `ks`) as
// bf16x2, by the arithmetic of the layout's `decode`.

// The code planes: a byte a weight (Q8, Q5_K, Q6_K; rows 80 bytes apart)
// or a nibble (Q4, Q4_K; 48), code 2i in the low nibble of byte i. `two`
// gives codes kk and kk + 1 (kk even) as the low two bytes of a word.
struct StagedBytes {
    static constexpr int CODE_BYTES = 64, CODE_LD = 80;
    __device__ static __forceinline__ const unsigned char *codes_at(const unsigned char *codes, int n, int k, int kb) {
        return codes + (long long)n * k + 32 * kb;
    }
    __device__ static __forceinline__ unsigned two(const unsigned char *col, int kk) {
        return *reinterpret_cast<const unsigned short *>(col + kk);
    }
};
struct StagedNibbles {
    static constexpr int CODE_BYTES = 32, CODE_LD = 48;
    __device__ static __forceinline__ const unsigned char *codes_at(const unsigned char *codes, int n, int k, int kb) {
        return codes + (long long)n * (k / 2) + 16 * kb;
    }
    __device__ static __forceinline__ unsigned two(const unsigned char *col, int kk) {
        const unsigned byte = col[kk >> 1];
        return (byte & 0xfu) | (byte >> 4) << 8;
    }
};

// Two signed byte codes times d (Q8, Q6_K), and two unsigned codes as
// fma(d, q, m) (Q4, Q4_K, Q5_K), as bf16x2.
__device__ __forceinline__ unsigned pair_scaled(unsigned two, float d) {
    return pack_bf16(d * (float)sext_byte0(two), d * (float)sext_byte1(two));
}
__device__ __forceinline__ unsigned pair_fma(unsigned two, float d, float m) {
    return pack_bf16(fmaf(d, (float)(two & 0xffu), m), fmaf(d, (float)(two >> 8), m));
}

// Q8: int8 codes, an f16 scale a block.
template <> struct Staged<LayoutQ8> : StagedBytes {
    static constexpr int SCALE_BYTES = 4;
    struct Step {
        float d[2];
    };
    __device__ static __forceinline__ void copy_scales(unsigned char *dst, const unsigned short *scales, int n, int k, int kb) {
        cp_async_small<4>(dst, scales + (long long)n * (k / 32) + kb);
    }
    __device__ static __forceinline__ Step step(const unsigned char *s, int) {
        const unsigned short *h = reinterpret_cast<const unsigned short *>(s);
        return Step{{half_bits_to_float(h[0]), half_bits_to_float(h[1])}};
    }
    __device__ static __forceinline__ unsigned pair(const unsigned char *col, const Step &t, int kk, int ks) {
        return pair_scaled(two(col, kk), t.d[ks / 32]);
    }
};

// Q4 (Q4_0, Q4_1): nibbles, an f16 (d, m) a block.
template <> struct Staged<LayoutQ4> : StagedNibbles {
    static constexpr int SCALE_BYTES = 8;
    struct Step {
        float d[2], m[2];
    };
    __device__ static __forceinline__ void copy_scales(unsigned char *dst, const unsigned short *scales, int n, int k, int kb) {
        cp_async_small<8>(dst, scales + 2 * ((long long)n * (k / 32) + kb));
    }
    __device__ static __forceinline__ Step step(const unsigned char *s, int) {
        const unsigned short *h = reinterpret_cast<const unsigned short *>(s);
        return Step{{half_bits_to_float(h[0]), half_bits_to_float(h[2])}, {half_bits_to_float(h[1]), half_bits_to_float(h[3])}};
    }
    __device__ static __forceinline__ unsigned pair(const unsigned char *col, const Step &t, int kk, int ks) {
        return pair_fma(two(col, kk), t.d[ks / 32], t.m[ks / 32]);
    }
};

// Q4_K (nibbles) and Q5_K (bytes 0..31): a step's two (sc, m) sub-block
// words (4 bytes) and its super-block's (d, dmin) pair (4 bytes; a step of
// 64 lies in one super block of 256); w = fma(d·sc, q, −dmin·m) as
// `decode_k4`.
template <typename Codes> struct StagedK4 : Codes {
    static constexpr int SCALE_BYTES = 8;
    struct Step {
        float d[2], min[2];
    };
    __device__ static __forceinline__ void copy_scales(unsigned char *dst, const unsigned short *scales, int n, int k, int kb) {
        const unsigned short *row = scales + (long long)n * (k / 32 + k / 128);
        cp_async_small<4>(dst, row + kb);
        cp_async_small<4>(dst + 4, row + k / 32 + 2 * (kb / 8));
    }
    __device__ static __forceinline__ Step step(const unsigned char *s, int) {
        const unsigned short *h = reinterpret_cast<const unsigned short *>(s);
        const float d = half_bits_to_float(h[2]), dmin = half_bits_to_float(h[3]);
        Step t;
#pragma unroll
        for (int b = 0; b < 2; b++) {
            t.d[b] = d * (float)(h[b] & 0xffu);
            t.min[b] = dmin * (float)(h[b] >> 8);
        }
        return t;
    }
    __device__ static __forceinline__ unsigned pair(const unsigned char *col, const Step &t, int kk, int ks) {
        return pair_fma(Codes::two(col, kk), t.d[ks / 32], -t.min[ks / 32]);
    }
};
template <> struct Staged<LayoutQ4K> : StagedK4<StagedNibbles> {};
template <> struct Staged<LayoutQ5K> : StagedK4<StagedBytes> {};

// Q6_K: int8 codes (−32..31); a step's two sub-block words (an int8 scale
// per 16) and, as an aligned 4-byte copy, the word pair holding its super
// block's f16 d (the host sends only weights whose k/256 is even, so the
// rows' words are aligned and the pair lies in the row);
// w = (d·sc)·q as `LayoutQ6K::decode`.
template <> struct Staged<LayoutQ6K> : StagedBytes {
    static constexpr int SCALE_BYTES = 8;
    struct Step {
        float ds[4];
    };
    __device__ static __forceinline__ void copy_scales(unsigned char *dst, const unsigned short *scales, int n, int k, int kb) {
        const unsigned short *row = scales + (long long)n * (k / 32 + k / 256);
        cp_async_small<4>(dst, row + kb);
        cp_async_small<4>(dst + 4, row + k / 32 + ((kb / 8) & ~1));
    }
    __device__ static __forceinline__ Step step(const unsigned char *s, int kb) {
        const unsigned short *h = reinterpret_cast<const unsigned short *>(s);
        const float d = half_bits_to_float(h[2 + ((kb / 8) & 1)]);
        Step t;
#pragma unroll
        for (int i = 0; i < 4; i++) t.ds[i] = d * (float)(signed char)((h[i >> 1] >> (8 * (i & 1))) & 0xffu);
        return t;
    }
    __device__ static __forceinline__ unsigned pair(const unsigned char *col, const Step &t, int kk, int ks) {
        return pair_scaled(two(col, kk), t.ds[ks / 16]);
    }
};

template <typename L> struct StagedSizes {
    static constexpr int A = MMA_BM * STG_ALD * 2;
    static constexpr int W = MMA_BN * Staged<L>::CODE_LD;
    static constexpr int SCALES = MMA_BN * Staged<L>::SCALE_BYTES;
    static constexpr int STAGE = A + W + SCALES;
};

template <typename L>
__device__ __forceinline__ void gemm_mma_staged(float *__restrict__ y, const unsigned char *__restrict__ codes,
                                                const unsigned short *__restrict__ scales, const unsigned short *__restrict__ x,
                                                int rows, int n_cols, int k, int kb_per_split) {
    typedef Staged<L> S;
    typedef StagedSizes<L> Z;
    static_assert(Z::A % 16 == 0 && Z::W % 16 == 0 && Z::STAGE % 16 == 0, "stage parts 16-byte aligned");
    extern __shared__ __align__(16) unsigned char stg_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r0 = blockIdx.y * MMA_BM, n0 = blockIdx.x * MMA_BN;
    const int kb_begin = blockIdx.z * kb_per_split, kb_end = min(k / 32, kb_begin + kb_per_split);
    const int steps = kb_end > kb_begin ? (kb_end - kb_begin) / 2 : 0;
    y += (long long)blockIdx.z * rows * n_cols;

    float acc[STG_MT][2][4];
#pragma unroll
    for (int i = 0; i < STG_MT; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    auto load_stage = [&](int slot, int step) {
        unsigned char *base = stg_smem + slot * Z::STAGE;
        unsigned short *as = reinterpret_cast<unsigned short *>(base);
        const int kb = kb_begin + 2 * step;
        // x: MMA_BM rows × 8 copies of 8 bf16. (Loops of a constant count,
        // fully unrolled, and unsigned division by powers of two: a loop
        // bounded by the thread's index cost a third of the kernel's
        // instructions.)
        static_assert(MMA_BM * 8 % MMA_THREADS == 0, "whole rounds of row copies");
#pragma unroll
        for (int it = 0; it < MMA_BM * 8 / MMA_THREADS; it++) {
            const unsigned c = tid + it * MMA_THREADS, row = c / 8, part = c % 8;
            const int gr = r0 + (int)row;
            const unsigned short *src = x + (long long)min(gr, rows - 1) * k + 32 * kb + 8 * part;
            cp_async16(&as[row * STG_ALD + 8 * part], src, gr < rows ? 16 : 0);
        }
        // The codes: 128 columns × CODE_BYTES / 16 copies.
        constexpr unsigned per_col = S::CODE_BYTES / 16;
        static_assert(MMA_BN * per_col % MMA_THREADS == 0, "whole rounds of code copies");
#pragma unroll
        for (int it = 0; it < (int)(MMA_BN * per_col / MMA_THREADS); it++) {
            const unsigned c = tid + it * MMA_THREADS, col = c / per_col, part = c % per_col;
            const int gc = min(n0 + (int)col, n_cols - 1);
            cp_async16(base + Z::A + col * S::CODE_LD + 16 * part, S::codes_at(codes, gc, k, kb) + 16 * part, 16);
        }
        // The scales: a thread a column.
        if (tid < MMA_BN) S::copy_scales(base + Z::A + Z::W + tid * S::SCALE_BYTES, scales, min(n0 + tid, n_cols - 1), k, kb);
    };

#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; s++) {
        if (s < steps) load_stage(s, s);
        cp_async_commit();
    }
    const int g = lane >> 2, t4 = lane & 3;
    // A lane's ldmatrix row in the stages, as a shared-memory address (no
    // generic-to-shared conversion a load).
    const unsigned a_lane = smem_addr(stg_smem) + 2 * ((lane & 15) * STG_ALD + 8 * (lane >> 4));
    // Fragments of rows past the batch are skipped (their outputs are never
    // stored); the first always holds a row.
    const int live_rows = rows - r0;
    for (int i = 0; i < steps; i++) {
        cp_async_wait<MMA_STAGES - 2>();
        __syncthreads();
        if (i + MMA_STAGES - 1 < steps) load_stage((i + MMA_STAGES - 1) % MMA_STAGES, i + MMA_STAGES - 1);
        cp_async_commit();
        const int slot = i % MMA_STAGES;
        const unsigned char *base = stg_smem + slot * Z::STAGE;
        const unsigned a_stage = a_lane + slot * Z::STAGE;
        const unsigned char *cols[2];
        typename S::Step scale[2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = 16 * warp + 8 * j + g;
            cols[j] = base + Z::A + col * S::CODE_LD;
            scale[j] = S::step(base + Z::A + Z::W + col * S::SCALE_BYTES, kb_begin + 2 * i);
        }
#pragma unroll
        for (int ks = 0; ks < STG_KC; ks += 16) {
            unsigned a[STG_MT][4], b[2][2];
#pragma unroll
            for (int mi = 0; mi < STG_MT; mi++)
                if (mi == 0 || 16 * mi < live_rows) ldmatrix_x4_at(a[mi], a_stage + 2 * (16 * mi * STG_ALD + ks));
#pragma unroll
            for (int j = 0; j < 2; j++) {
                b[j][0] = S::pair(cols[j], scale[j], ks + 2 * t4, ks);
                b[j][1] = S::pair(cols[j], scale[j], ks + 2 * t4 + 8, ks);
            }
#pragma unroll
            for (int mi = 0; mi < STG_MT; mi++)
                if (mi == 0 || 16 * mi < live_rows) {
#pragma unroll
                    for (int j = 0; j < 2; j++) mma_bf16(acc[mi][j], a[mi], b[j][0], b[j][1]);
                }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < STG_MT; mi++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = r0 + 16 * mi + g + 8 * (e >> 1);
                const int n = n0 + 16 * warp + 8 * j + 2 * t4 + (e & 1);
                if (r < rows && n < n_cols) y[(long long)r * n_cols + n] = acc[mi][j][e];
            }
}

#define MMA_STAGED_ENTRY(SUFFIX, LAYOUT)                                                                                   \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, STG_MIN_BLOCKS)                                             \
        gemm_mma_staged_##SUFFIX(float *y, const unsigned char *codes, const unsigned short *scales,                      \
                                 const unsigned short *x, int rows, int n_cols, int k, int kb_per_split) {                \
        gemm_mma_staged<LAYOUT>(y, codes, scales, x, rows, n_cols, k, kb_per_split);                                     \
    }
MMA_STAGED_ENTRY(q8, LayoutQ8)
MMA_STAGED_ENTRY(q4, LayoutQ4)
MMA_STAGED_ENTRY(q4k, LayoutQ4K)
MMA_STAGED_ENTRY(q5k, LayoutQ5K)
MMA_STAGED_ENTRY(q6k, LayoutQ6K)

// out[n, k] = W[n, k] as bf16, 16 weights a thread (grid-stride).
template <typename L>
__device__ __forceinline__ void dequantize_bf16(unsigned short *__restrict__ out, const unsigned char *__restrict__ codes,
                                                const unsigned short *__restrict__ scales, int n_cols, int k) {
    const long long chunks = (long long)n_cols * (k / 16);
    for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < chunks; c += (long long)gridDim.x * blockDim.x) {
        const int n = (int)(c / (k / 16)), k0 = 16 * (int)(c % (k / 16));
        float w[16];
        L::decode(L::fetch(codes, scales, n, k, k0), w);
        store16_bf16(out + (long long)n * k + k0, w);
    }
}

#define DEQUANTIZE_ENTRY(SUFFIX, LAYOUT)                                                                                  \
    extern "C" __global__ void dequantize_bf16_##SUFFIX(unsigned short *out, const unsigned char *codes,                \
                                                         const unsigned short *scales, int n_cols, int k) {              \
        dequantize_bf16<LAYOUT>(out, codes, scales, n_cols, k);                                                          \
    }
DEQUANTIZE_ENTRY(q8, LayoutQ8)
DEQUANTIZE_ENTRY(q4, LayoutQ4)
DEQUANTIZE_ENTRY(q4k, LayoutQ4K)
DEQUANTIZE_ENTRY(q5k, LayoutQ5K)
DEQUANTIZE_ENTRY(q6k, LayoutQ6K)
DEQUANTIZE_ENTRY(f32, LayoutF32)
