// Sampling on the device: one thread block per logits row turns the row
// into a token (and the logprobs the request asked for), so that a step
// copies a few bytes a row to the host instead of a row of the vocabulary.
//
// It draws what the host sampler (crates/engine/src/sampler.rs) draws for
// the same uniform number `u` (taken from the request's own generator on
// the host): the same weights, bit for bit (`exp_poly` is the host's
// `exp_f32`, every multiply and add rounded on its own), and the same
// order:
//
//  * greedy: the largest score, the lowest id among equals;
//  * no filter: the cumulative weights in id order, the first entry whose
//    running sum passes `u · total`;
//  * top-k / min-p / top-p: the candidates ranked by score (lower id first
//    on ties), cut by k, then by min-p (`p ≥ min_p · p_max`, stopping at the
//    first that fails), then by top-p (kept while the mass before an entry
//    is under `top_p`), then drawn in rank order.
//
// Ranks are 64-bit keys (the score's order-preserving bits, then the id
// reversed), so a cut is one key. No row is sorted: each cut is a radix
// descent over the keys, four bits a pass, that counts and weighs the
// candidates of each digit and keeps the digit where the cut falls; it ends
// when one entry is left. A pass adds each candidate's weight and a count
// to its digit's bin in the thread's own column of shared memory (16 bins a
// thread: one add, not a select per bin), then the columns are summed, 16
// threads a digit. The descent starts below the leading digits that every
// candidate shares (those of the smallest candidate, or the cut's floor,
// and of the largest key). Every loop over a row loads SAMPLE_UNROLL
// entries a thread before it works on them.
//
// Full passes over a row: one for the NaN check and the largest and
// smallest keys; with penalties, one more for those of the scores; with
// logprobs, one for the log-sum, and for top logprobs past the first one
// more (`top_binned`: the log-sum's pass bins the row by score, the second
// gathers the bins down to the last entry asked for, sorted in shared
// memory) or, where those bins are too full, one per entry after the first;
// then per descent one a digit taken and one for the entry found (none when
// every digit was taken). A descent whose floor is the entry the last one
// found (top-p after top-k, the draw after either) starts from the last
// one's recorded passes: it follows that path while its own cut does, and
// passes over the row only below the level where it leaves it. The mass
// of every candidate comes from a descent's first pass (top-p's
// normalization without top-k or min-p, the draw's kept mass after min-p
// alone); min-p needs one pass for the total and one for its floor.
//
// Rows without min-p take a shorter way first (`sample_binned`): one pass
// bins the candidates by score into SAMPLE_HIST_BINS bins (runs of rank
// keys), counting and weighing them; a second gathers the entries of the
// bins where the cuts fall (at most SAMPLE_GATHER) and weighs everything
// above them; the gathered entries are sorted in shared memory and walked
// in rank order with the descents' arithmetic. Three passes in all for
// top-k and top-p rows (16 or more by the descents on a flat 262,144-wide
// row); a row whose cut bins are too full to gather is left to the
// descents.
//
// Sums run in a different order than the host's, so a draw within ~1e-15
// of a boundary may land on the neighbour; nowhere else do they differ
// (-0 ranks as +0, as the host's comparisons have it).
//
// Penalties (repetition, frequency, presence, logit bias) arrive as one
// entry per distinct token of the row, in increasing token order, and are
// applied to the row in place once its logprobs (always the model's own) are
// taken; the raw values of the entries' tokens are kept in `pen_raw`, for
// the sampled token's logprob. A row with a NaN is left as it is and gets
// the token -1: the host samples that step (the host sampler's rules for
// NaN are its own).
//
// The kernel uses shared memory, barriers and integer atomics only (no warp
// shuffles; no float atomics: its sums are the same from run to run, the
// bins' weights being summed in fixed point and the gathered entries
// sorted before they are walked), so the host tests run its very text with
// one host thread per GPU thread.

#ifndef SAMPLE_THREADS
#define SAMPLE_THREADS 256
#endif
#define SAMPLE_BINS 16
#define SAMPLE_GROUPS (SAMPLE_THREADS / SAMPLE_BINS)
// Entries a thread loads before it works on any (loads in flight); the
// kernel stays under 128 registers, two blocks of 256 threads an SM.
#define SAMPLE_UNROLL 8
static_assert(SAMPLE_THREADS >= SAMPLE_BINS && (SAMPLE_THREADS & (SAMPLE_THREADS - 1)) == 0,
              "SAMPLE_THREADS: a power of two, at least SAMPLE_BINS");

// The host's `exp_f32`: Cody–Waite reduction, a degree-6 polynomial, no
// fused multiply-add (each operation rounded on its own, as on the host).
__device__ __forceinline__ float exp_poly(float x) {
    const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f, ROUND = 12582912.0f;
    const float xc = fminf(fmaxf(x, -87.0f), 88.0f);
    const float shifted = __fadd_rn(__fmul_rn(xc, LOG2E), ROUND);
    const float n = __fsub_rn(shifted, ROUND);
    const int ni = (int)__float_as_uint(shifted) - (int)__float_as_uint(ROUND);
    const float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    const float er = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    const float scale = __uint_as_float((unsigned)((ni + 127) << 23));
    const float y = __fmul_rn(er, scale);
    return x < -87.0f ? 0.0f : (x > 88.0f ? __uint_as_float(0x7f800000u) : y);
}

// exp((x − max)/t) as the host's `vector::weight`.
__device__ __forceinline__ float sample_weight(float x, float max, float inv_t) {
    return exp_poly(__fmul_rn(__fsub_rn(x, max), inv_t));
}

// Larger score, larger key; -0 as +0; NaN below everything.
__device__ __forceinline__ unsigned score_key(float x) {
    const unsigned b = x == 0.0f ? 0u : __float_as_uint(x);
    if (x != x) return 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The rank key of entry `id`: score first, then the lower id.
__device__ __forceinline__ unsigned long long rank_key(float x, int id, int vocab) {
    return ((unsigned long long)score_key(x) << 32) | (unsigned)(vocab - 1 - id);
}

__device__ __forceinline__ int key_id(unsigned long long k, int vocab) {
    return vocab - 1 - (int)(unsigned)(k & 0xffffffffull);
}

// The score of a rank key (-0 comes back as +0).
__device__ __forceinline__ float key_score(unsigned long long k) {
    const unsigned sk = (unsigned)(k >> 32);
    return __uint_as_float((sk & 0x80000000u) ? (sk & 0x7fffffffu) : ~sk);
}

// `f(i, x[i])` for this thread's entries of a row (i = threadIdx.x, then
// every SAMPLE_THREADS), SAMPLE_UNROLL loads issued before the first call.
template <class F> __device__ __forceinline__ void for_entries(const float *x, int vocab, F f) {
    for (int base = threadIdx.x; base < vocab; base += SAMPLE_THREADS * SAMPLE_UNROLL) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; u++) {
            const int i = base + u * SAMPLE_THREADS;
            v[u] = i < vocab ? x[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; u++) {
            const int i = base + u * SAMPLE_THREADS;
            if (i < vocab) f(i, v[u]);
        }
    }
}

// The block's shared memory: the reductions' slots, and the radix bins,
// a column per thread (`m`: weight, `n`: count; a thread counts at most
// ceil(vocab / SAMPLE_THREADS) entries a pass, below 65,536 as the launch
// checks), then their sums per group of SAMPLE_BINS threads (`gn`, and
// `red` for the weights) and per digit (`tm`, `tn`); `kred` shares the
// weight columns' memory (never in use at once). The last descent's
// passes: each one's digit totals (`hm`, `hn`), prefix (`hp`), digit
// position (`hs`) and digit taken (`hd`), `levels` of them.
// The histogram's bins and the entries a gather pass keeps (see
// `sample_binned`): 2,048 bins of 8 + 4 bytes and 1,024 keys, the 32 KB of
// the descent's weight columns at 256 threads, whose memory they share.
#ifndef SAMPLE_HIST_BINS
#define SAMPLE_HIST_BINS 2048
#endif
#ifndef SAMPLE_GATHER
#define SAMPLE_GATHER 1024
#endif
// How far below the largest score the bins reach where only ranks matter
// (top-k, the top logprobs): a row's 1,024th entry lies well within it in
// practice, and a score of -inf (a banned token) does not stretch the bins
// to the smallest finite score's depth. Deeper entries share the last bin.
#define SAMPLE_RANK_SPAN 256.0f
static_assert(SAMPLE_GATHER <= SAMPLE_HIST_BINS && (SAMPLE_GATHER & (SAMPLE_GATHER - 1)) == 0,
              "SAMPLE_GATHER: a power of two, at most SAMPLE_HIST_BINS");
// SAMPLE_BINNED 0 leaves every rank cut to the descents (the host tests).
#ifndef SAMPLE_BINNED
#define SAMPLE_BINNED 1
#endif
// A hook for the host tests (which path a row took); nothing on a GPU.
#ifndef SAMPLE_NOTE_BINNED
#define SAMPLE_NOTE_BINNED(took)
#endif
#ifndef SAMPLE_NOTE_TOP
#define SAMPLE_NOTE_TOP(took)
#endif
struct SampleHist {
    // Per bin: the weights in fixed point (× 2^32, integer sums: the same
    // from run to run in any order), and the entries. Once the bins are
    // read, `mass` holds the gathered entries' weights (as doubles).
    unsigned long long mass[SAMPLE_HIST_BINS];
    unsigned count[SAMPLE_HIST_BINS];
    unsigned long long keys[SAMPLE_GATHER];
};

struct SampleShared {
    double red[SAMPLE_THREADS];
    union {
        double m[SAMPLE_BINS][SAMPLE_THREADS];
        unsigned long long kred[SAMPLE_THREADS];
        SampleHist hist;
    };
    unsigned short n[SAMPLE_BINS][SAMPLE_THREADS];
    unsigned gn[SAMPLE_BINS][SAMPLE_GROUPS];
    double tm[SAMPLE_BINS];
    unsigned tn[SAMPLE_BINS];
    double hm[16][SAMPLE_BINS];
    unsigned hn[16][SAMPLE_BINS];
    unsigned long long hp[16];
    int hs[16], hd[16], levels;
};

// Block reductions through shared memory (SAMPLE_THREADS a power of two).
__device__ double sample_sum(double v, double *red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    const double r = red[0];
    __syncthreads();
    return r;
}

__device__ unsigned long long sample_max_key(unsigned long long v, unsigned long long *red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s && red[threadIdx.x + s] > red[threadIdx.x]) red[threadIdx.x] = red[threadIdx.x + s];
        __syncthreads();
    }
    const unsigned long long r = red[0];
    __syncthreads();
    return r;
}

// The bins' totals per digit into `tm`, `tn`: thread t sums digit t % 16
// over the 16 columns of group t / 16 (starting at a column that differs
// per digit, so that the 16 digits fall in different banks), then thread
// d < 16 sums digit d over the groups. The columns stay as they are.
__device__ void sample_bin_totals(SampleShared &b) {
    const int t = (int)threadIdx.x, d = t % SAMPLE_BINS, g = t / SAMPLE_BINS;
    __syncthreads();
    double m = 0.0;
    unsigned n = 0;
#pragma unroll
    for (int j = 0; j < SAMPLE_BINS; j++) {
        const int c = g * SAMPLE_BINS + ((j + d) % SAMPLE_BINS);
        m += b.m[d][c];
        n += b.n[d][c];
    }
    b.red[d * SAMPLE_GROUPS + g] = m;
    b.gn[d][g] = n;
    __syncthreads();
    if (t < SAMPLE_BINS) {
        double tm = 0.0;
        unsigned tn = 0;
        for (int h = 0; h < SAMPLE_GROUPS; h++) {
            tm += b.red[t * SAMPLE_GROUPS + h];
            tn += b.gn[t][h];
        }
        b.tm[t] = tm;
        b.tn[t] = tn;
    }
    __syncthreads();
}

// What a cut asks of the entries above it: fewer than `count` of them
// (top-k), or a mass before it under (`strict`) or at most `mass`, with
// masses divided by `total` first when it is nonzero (the host compares
// normalized probabilities). `from_candidates`: 1, `total` is the
// candidates' mass; 2, `mass` is multiplied by (candidates' mass / total)
// first (the draw's `u` scaled to the kept mass); both taken from the
// descent's first pass, which weighs every candidate.
struct SampleCut {
    int by_count;
    unsigned long long count;
    double mass;
    double total;
    int strict;
    int from_candidates;
};

__device__ __forceinline__ bool cut_holds(const SampleCut &c, unsigned long long n_above, double m_above) {
    if (c.by_count) return n_above < c.count;
    const double before = c.total > 0.0 ? m_above / c.total : m_above;
    return c.strict ? before < c.mass : before <= c.mass;
}

// Down from the highest digit to `lowest`: the lowest nonempty one whose
// first entry the cut still keeps (-1: none), with `*am`, `*an` advanced
// to the mass and count above it.
__device__ int sample_choose(const SampleCut &cut, const double *m, const unsigned *n, int lowest, double *am, unsigned *an) {
    double a = *am;
    unsigned c = *an;
    int chosen = -1;
    for (int d = SAMPLE_BINS - 1; d >= lowest; d--) {
        if (n[d] == 0) continue;
        if (!cut_holds(cut, (unsigned long long)c, a)) break;
        chosen = d;
        *am = a;
        *an = c;
        a += m[d];
        c += n[d];
    }
    return chosen;
}

// The smallest rank key at or above `floor` whose entries above (at or
// above `floor`) satisfy the cut: the last entry, in rank order, that the
// cut keeps. Every candidate (key ≥ floor) lies in [lo, hi]: the descent
// starts below their common leading digits. With `reuse` (`floor` is the
// entry the last descent found), it starts instead from that descent's
// passes: their bins above its path hold exactly our candidates, so it
// follows the path while the cut keeps to it, and makes its own passes
// only below the level where it leaves it (none if it never does: the
// entry is `floor`); the levels it followed stay in the record, as its
// own. `*kept_mass` receives the weight of every entry from the top down
// to it, `*cand_mass` that of every candidate (without `reuse`). The cut
// must hold for the top entry.
__device__ __noinline__ unsigned long long select_cut(const float *s, int vocab, float max, float inv_t, unsigned long long floor,
                                                      unsigned long long lo, unsigned long long hi, SampleCut cut, bool reuse,
                                                      double *kept_mass, double *cand_mass, SampleShared &b) {
    // The candidates under the prefix (`k & mask_s == pbits_s`) are binned
    // by their digit at `shift_s`; the entries above the prefix weigh
    // `above_m_s` (none at the start: the prefix is common to them all).
    __shared__ unsigned long long pbits_s, mask_s;
    __shared__ int shift_s, done_s;
    __shared__ double above_m_s, cand_m_s;
    __shared__ unsigned above_n_s;
    const int t = (int)threadIdx.x;
    if (t == 0) {
        done_s = 0;
        cand_m_s = 0.0;
        bool fresh = true;
        double am = 0.0;
        unsigned an = 0;
        for (int l = 0; reuse && l < b.levels; l++) {
            const int path = b.hd[l];
            const int d = sample_choose(cut, b.hm[l], b.hn[l], path, &am, &an);
            if (d < 0) break; // unreachable: the path's digit keeps the cut
            if (d == path && l + 1 < b.levels) continue;
            fresh = false;
            if (d == path) {
                pbits_s = floor; // the last descent's entry, and its passes
                mask_s = ~0ull;
                done_s = 1;
            } else {
                pbits_s = b.hp[l] | ((unsigned long long)d << b.hs[l]);
                mask_s = ~0ull << b.hs[l];
                shift_s = b.hs[l] - 4;
                if (b.hn[l][d] == 1 || b.hs[l] == 0) done_s = 1;
                b.hd[l] = d; // this descent's path down to here
                b.levels = l + 1;
            }
            break;
        }
        if (fresh) {
            const unsigned long long diff = lo ^ hi;
            int shift = 60;
            while (shift > 0 && (diff >> shift) == 0) shift -= 4;
            mask_s = shift == 60 ? 0ull : ~0ull << (shift + 4);
            pbits_s = hi & mask_s;
            shift_s = shift;
            am = 0.0;
            an = 0;
            b.levels = 0;
        }
        above_m_s = am;
        above_n_s = an;
    }
    __syncthreads();
    bool first = true;
    while (!done_s) {
        const int shift = shift_s;
        const unsigned long long pbits = pbits_s, mask = mask_s;
#pragma unroll
        for (int d = 0; d < SAMPLE_BINS; d++) {
            b.m[d][t] = 0.0;
            b.n[d][t] = 0;
        }
        // Only this thread's column: no barrier before, no bank conflicts.
        double *const mcol = &b.m[0][t];
        unsigned short *const ncol = &b.n[0][t];
        for_entries(s, vocab, [&](int i, float v) {
            const unsigned long long k = rank_key(v, i, vocab);
            if (k < floor || (k & mask) != pbits) return;
            const int at = (int)((unsigned)(k >> shift) & 15u) * SAMPLE_THREADS;
            mcol[at] += (double)sample_weight(v, max, inv_t);
            ncol[at] += 1;
        });
        sample_bin_totals(b);
        if (t == 0) {
            if (first) {
                double all = 0.0;
                for (int d = SAMPLE_BINS - 1; d >= 0; d--) all += b.tm[d];
                cand_m_s = all;
                if (cut.from_candidates == 1) cut.total = all;
                if (cut.from_candidates == 2) cut.mass = cut.mass * (all / cut.total);
            }
            double am = above_m_s;
            unsigned an = above_n_s;
            const int chosen = sample_choose(cut, b.tm, b.tn, 0, &am, &an);
            if (chosen < 0) {
                done_s = 2; // unreachable while the cut keeps the top entry
                b.levels = 0;
            } else {
                const int l = b.levels;
                for (int d = 0; d < SAMPLE_BINS; d++) {
                    b.hm[l][d] = b.tm[d];
                    b.hn[l][d] = b.tn[d];
                }
                b.hp[l] = pbits;
                b.hs[l] = shift;
                b.hd[l] = chosen;
                b.levels = l + 1;
                above_m_s = am;
                above_n_s = an;
                pbits_s = pbits | ((unsigned long long)chosen << shift);
                mask_s = ~0ull << shift;
                if (b.tn[chosen] == 1 || shift == 0) done_s = 1;
                shift_s = shift - 4;
            }
        }
        first = false;
        __syncthreads();
    }
    // The entry: the prefix once every digit is taken, else the largest
    // key under it.
    const unsigned long long pbits = pbits_s, mask = mask_s;
    unsigned long long best = pbits;
    if (mask != ~0ull || done_s == 2) {
        best = 0;
        for_entries(s, vocab, [&](int i, float v) {
            const unsigned long long k = rank_key(v, i, vocab);
            if (k >= floor && (k & mask) == pbits && k > best) best = k;
        });
        best = sample_max_key(best, b.kred);
    }
    if (t == 0) above_m_s += (double)sample_weight(s[key_id(best, vocab)], max, inv_t);
    __syncthreads();
    *kept_mass = above_m_s;
    *cand_mass = cand_m_s;
    __syncthreads();
    return best;
}

// `*m += v` for a bin's fixed-point weights (any v: a weight is at most
// 2^32, a thread's last-bin total more), as two 32-bit
// atomic additions (the low word, then the high word on a carry; a 64-bit
// addition to shared memory is a compare-and-swap loop): the sum is exact,
// so the same in any order.
__device__ __forceinline__ void hist_add(unsigned long long *m, unsigned long long v) {
    unsigned *w = (unsigned *)m; // little-endian: the low word first
    const unsigned lo = (unsigned)v, hi = (unsigned)(v >> 32);
    const unsigned old = atomicAdd(&w[0], lo);
    const unsigned carry = old + lo < old ? 1u : 0u;
    if (hi + carry != 0u) atomicAdd(&w[1], hi + carry);
}

// The bin of score `v`: bin 0 holds the largest scores; scores at or
// under `lo` share the last bin. Larger scores never land in a later bin
// (each rounded step is monotone), so bins are runs of rank keys.
__device__ __forceinline__ int hist_bin(float v, float smax, float lo, float scale) {
    if (!(v > lo)) return SAMPLE_HIST_BINS - 1;
    const int b = (int)__fmul_rn(__fsub_rn(smax, v), scale);
    return b < SAMPLE_HIST_BINS - 1 ? b : SAMPLE_HIST_BINS - 1;
}

// The gathered entries' weights `q[from..end)` (in rank order) turned in
// place into the mass through each, starting from `m0` (one thread, in
// order: the descents' running sums).
__device__ void hist_through(double *q, int from, int end, double m0) {
    double a = m0;
    for (int i = from; i < end; i++) {
        a += q[i];
        q[i] = a;
    }
}

// The last entry in [from, end) whose mass before it (`m0` for `from`,
// else `q[i - 1]`: `hist_through`'s masses) divided by `total` is under
// (`strict`) or at most `target`, as `cut_holds` compares it; -1 when not
// even `from` holds. The masses only grow, so a binary search.
__device__ int hist_find(const double *q, int from, int end, double m0, double total, double target, bool strict) {
    int lo = from - 1, hi = end; // holds at lo (or none), fails from hi
    while (hi - lo > 1) {
        const int mid = lo + (hi - lo) / 2;
        const double a = mid == from ? m0 : q[mid - 1];
        const double before = total > 0.0 ? a / total : a;
        if (strict ? before < target : before <= target) lo = mid;
        else hi = mid;
    }
    return lo >= from ? lo : -1;
}

// The first `n` gathered keys sorted descending (bitonic, padded with key
// 0, below every entry), by the whole block; ends with a barrier.
__device__ void hist_sort(SampleHist &h, int n) {
    const int t = (int)threadIdx.x;
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + t; i < size; i += SAMPLE_THREADS) h.keys[i] = 0;
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = t; i < size; i += SAMPLE_THREADS) {
                const int p = i ^ j;
                if (p > i) {
                    const unsigned long long x = h.keys[i], y = h.keys[p];
                    if (((i & k) == 0) ? x < y : x > y) {
                        h.keys[i] = y;
                        h.keys[p] = x;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// The bins' reach: scores from `max` down to `depth` below it (or the
// smallest score, `bottom`'s) over SAMPLE_HIST_BINS bins; false where that
// is no finite, nonempty range (the caller then keeps to its passes).
__device__ __forceinline__ bool hist_span(float max, unsigned long long bottom, float depth, float &lo, float &scale) {
    lo = fmaxf(key_score(bottom), __fsub_rn(max, depth));
    scale = (float)SAMPLE_HIST_BINS / __fsub_rn(max, lo);
    return max > lo && scale > 0.0f && scale < 3.0e38f && max < 3.0e38f && lo > -3.0e38f;
}

// The row's `n` largest entries (top-k's candidates, the top logprobs),
// where block maxima or descents take a pass a digit: one pass counts the
// row into bins over the SAMPLE_RANK_SPAN below the largest score (`mx`),
// adding, when `acc` is given, this thread's exp(x − mx) to it (the
// log-sum's terms, in the order the plain pass adds them); a second
// gathers the bins down to the n-th entry's, sorted into `h.keys` (the n
// entries first). Returns how many were gathered (at least n), 0 when the
// bins were too full (`acc` added) and -1 when the row has no span for
// them (`acc` not added).
__device__ int top_binned(const float *x, int vocab, float mx, unsigned long long bottom, int n, double *acc, SampleShared &b) {
    __shared__ int g1_s, ng_s;
    const int t = (int)threadIdx.x;
    SampleHist &h = b.hist;
    float lo, scale;
    if (n > SAMPLE_GATHER || !hist_span(mx, bottom, SAMPLE_RANK_SPAN, lo, scale)) return -1;
    for (int i = t; i < SAMPLE_HIST_BINS; i += SAMPLE_THREADS) h.count[i] = 0;
    __syncthreads();
    unsigned last_n = 0; // the last bin's entries, added once a thread
    for_entries(x, vocab, [&](int, float v) {
        if (acc) *acc += (double)sample_weight(v, mx, 1.0f);
        const int bin = hist_bin(v, mx, lo, scale);
        if (bin == SAMPLE_HIST_BINS - 1) last_n += 1;
        else atomicAdd(&h.count[bin], 1u);
    });
    atomicAdd(&h.count[SAMPLE_HIST_BINS - 1], last_n);
    __syncthreads();
    if (t == 0) {
        unsigned through = 0;
        int g1 = -1;
        for (int i = 0; i < SAMPLE_HIST_BINS && g1 < 0; i++) {
            through += h.count[i];
            if (through >= (unsigned)n) g1 = i;
        }
        g1_s = through <= SAMPLE_GATHER ? g1 : -1;
        ng_s = 0;
    }
    __syncthreads();
    const int g1 = g1_s;
    if (g1 < 0) return 0;
    for_entries(x, vocab, [&](int i, float v) {
        if (hist_bin(v, mx, lo, scale) <= g1) {
            const int slot = (int)atomicAdd((unsigned *)&ng_s, 1u);
            if (slot < SAMPLE_GATHER) h.keys[slot] = rank_key(v, i, vocab);
        }
    });
    __syncthreads();
    const int gathered = ng_s < SAMPLE_GATHER ? ng_s : SAMPLE_GATHER; // (never more: the counts said)
    hist_sort(h, gathered);
    return gathered;
}

// The rank cuts of a row without min-p in two passes over it, where the
// descents of `select_cut` take one a digit: the token, or -1 to leave the
// row to them. The same cuts and sums as theirs (masses in rank order,
// divided by the same totals), so the same token up to the order of the
// sums.
//
// top-k (0 < k < vocab): `top_binned` gathers the k largest entries, and
// top-p and the draw are walked among them.
//
// top-p alone: pass 1 bins the row by score (SAMPLE_HIST_BINS bins from the
// largest score down to 40 temperatures below it, or to the smallest
// score), counting and weighing them in fixed point, and sums the row's
// weights in double. The bins place top-p's cut and the draw up to the
// fixed point's rounding (2^-32 an entry): the cut's bin, and the bins the
// draw can fall in (its target is u times the kept mass, which lies
// between the mass above the cut's bin and the mass through it). Pass 2
// gathers their entries (at most SAMPLE_GATHER) and weighs, in double,
// every entry above them; the gathered entries are sorted by rank key and
// walked in order. Bins too full to gather, or a cut the exact masses
// place outside its bin, leave the row to the descents.
__device__ int sample_binned(const float *s, int vocab, int argmax, float max, float temperature, float inv_t, double u, int top_k,
                             float top_p, unsigned long long bottom, SampleShared &b) {
    __shared__ int go_s, g0_s, g1_s, c_s, ng_s, nd_s, tail_s, token_s;
    __shared__ double total_s;
    const int t = (int)threadIdx.x;
    SampleHist &h = b.hist;
    double *w = (double *)h.mass; // once the bins are read: the gathered entries' weights
    if (top_k > 0 && top_k < vocab) {
        if (top_k == 1) { // whatever top-p says, one entry is kept
            if (t == 0) SAMPLE_NOTE_BINNED(true);
            return argmax;
        }
        const bool gathered = top_binned(s, vocab, max, bottom, top_k, nullptr, b) > 0;
        for (int i = t; gathered && i < top_k; i += SAMPLE_THREADS) w[i] = (double)sample_weight(key_score(h.keys[i]), max, inv_t);
        __syncthreads();
        if (t == 0) {
            int pick = -1;
            if (gathered) {
                // The k largest entries, in rank order: top-k's mass, top-p
                // among them, the draw.
                hist_through(w, 0, top_k, 0.0);
                const double tot = w[top_k - 1];
                double kept = tot;
                int end = top_k;
                if (top_p < 1.0f) {
                    const int cut = hist_find(w, 0, top_k, 0.0, tot, (double)top_p, true);
                    kept = cut >= 0 ? w[cut] : 0.0;
                    end = cut + 1;
                }
                pick = hist_find(w, 0, end, 0.0, tot, u * (kept / tot), false);
            }
            token_s = pick >= 0 ? key_id(h.keys[pick], vocab) : -1;
            SAMPLE_NOTE_BINNED(pick >= 0);
        }
        __syncthreads();
        return token_s;
    }

    float lo, scale;
    if (!hist_span(max, bottom, __fmul_rn(40.0f, temperature), lo, scale)) {
        if (t == 0) SAMPLE_NOTE_BINNED(false);
        return -1;
    }
    // Pass 1: the histogram, and the row's weight.
    for (int i = t; i < SAMPLE_HIST_BINS; i += SAMPLE_THREADS) {
        h.mass[i] = 0;
        h.count[i] = 0;
    }
    __syncthreads();
    double acc = 0.0;
    unsigned last_n = 0;   // the last bin's entries, added once a thread: the
    unsigned long long last_m = 0; // many far below the top would all contend
                                   // for its counters
    for_entries(s, vocab, [&](int, float v) {
        const int bin = hist_bin(v, max, lo, scale);
        const float wv = sample_weight(v, max, inv_t);
        acc += (double)wv;
        const unsigned long long fixed = (unsigned long long)__fmul_rn(wv, 4294967296.0f);
        if (bin == SAMPLE_HIST_BINS - 1) {
            last_n += 1;
            last_m += fixed;
        } else {
            atomicAdd(&h.count[bin], 1u);
            hist_add(&h.mass[bin], fixed);
        }
    });
    atomicAdd(&h.count[SAMPLE_HIST_BINS - 1], last_n);
    hist_add(&h.mass[SAMPLE_HIST_BINS - 1], last_m);
    const double total = sample_sum(acc, b.red); // its barriers publish the bins

    // The bins to gather: the draw's [g0, g1], and the cut's c (past g1,
    // or g1 itself).
    if (t == 0) {
        // top-p's cut: the last nonempty bin whose mass above is under
        // top_p of the total; the draw's target lies in u times [mass above
        // it, mass through it], widened by the fixed point's error. Masses
        // in the bins' fixed point (integer sums: one thread's loop with no
        // floating-point chain), compared with thresholds converted once.
        const double fix = 4294967296.0; // a unit of weight
        const unsigned long long p_fixed = (unsigned long long)((double)top_p * total * fix);
        unsigned long long above = 0, above_c = 0, through_c = 0;
        unsigned through = 0; // entries down to the cut's bin
        int c = -1, g0 = -1, g1 = -1;
        for (int i = 0; i < SAMPLE_HIST_BINS; i++) {
            const unsigned k = h.count[i];
            if (k == 0) continue;
            if (!(above < p_fixed)) break;
            c = i;
            above_c = above;
            above += h.mass[i];
            through_c = above;
            through += k;
        }
        const double slack = 1e-9 * total * fix + (double)vocab;
        const double lo_t = u * (double)above_c - slack, hi_t = u * (double)through_c + slack;
        unsigned long long a = 0;
        for (int i = 0; i <= c; i++) {
            if (h.count[i] == 0) continue;
            const double ad = (double)a;
            if (ad <= hi_t) g1 = i; // the draw's last possible bin
            if (ad <= lo_t || g0 < 0) g0 = i;
            a += h.mass[i];
        }
        unsigned n = 0;
        for (int i = g0; g0 >= 0 && i <= g1; i++) n += h.count[i];
        nd_s = (int)n;
        if (c > g1) n += h.count[c];
        go_s = c >= 0 && g0 >= 0 && g1 >= g0 && n <= SAMPLE_GATHER;
        tail_s = through < (unsigned)vocab; // entries follow bin c
        g0_s = g0;
        g1_s = g1;
        c_s = c;
        ng_s = 0;
        total_s = total;
    }
    __syncthreads();
    if (!go_s) {
        if (t == 0) SAMPLE_NOTE_BINNED(false);
        return -1;
    }
    const int g0 = g0_s, g1 = g1_s, c = c_s;

    // Pass 2: gather, and weigh what lies above the gathered bins.
    double above_g = 0.0, above_c = 0.0;
    for_entries(s, vocab, [&](int i, float v) {
        const int bin = hist_bin(v, max, lo, scale);
        if ((bin >= g0 && bin <= g1) || bin == c) {
            const int slot = (int)atomicAdd((unsigned *)&ng_s, 1u);
            if (slot < SAMPLE_GATHER) h.keys[slot] = rank_key(v, i, vocab);
        }
        if (bin < c) {
            const double wv = (double)sample_weight(v, max, inv_t);
            if (bin < g0) above_g += wv;
            above_c += wv;
        }
    });
    above_g = sample_sum(above_g, b.red);
    above_c = sample_sum(above_c, b.red);
    const int n = ng_s < SAMPLE_GATHER ? ng_s : SAMPLE_GATHER; // (never more: the counts said)
    hist_sort(h, n);
    for (int i = t; i < n; i += SAMPLE_THREADS) w[i] = (double)sample_weight(key_score(h.keys[i]), max, inv_t);
    __syncthreads();

    if (t == 0) {
        // The draw's bins come first among the gathered entries (nd of
        // them), then the cut's bin when it lies past them; else all are
        // one run from the draw's first bin.
        int pick = -1;
        const double tot = total_s;
        const int nd = nd_s;
        const bool apart = c > g1;
        const int cs = apart ? nd : 0;               // where the cut's run starts
        const double cm = apart ? above_c : above_g; // the mass before it
        if (apart) hist_through(w, 0, nd, above_g);
        hist_through(w, cs, n, cm);
        const int cut = hist_find(w, cs, n, cm, tot, (double)top_p, true);
        // The cut must fall in its bin: its first entry kept, and the
        // entry after the bin (if any) not.
        const bool cut_ok = cut >= 0 && (cut < n - 1 || !tail_s || !(w[n - 1] / tot < (double)top_p));
        if (cut_ok) {
            const double target = u * (w[cut] / tot);
            // (Past the draw's bins, when they end before the cut's, the
            // next entry fails: its mass above passes u times the mass
            // through the cut's bin, the fixed point's error included.)
            pick = hist_find(w, 0, apart ? nd : cut + 1, above_g, tot, target, false);
        }
        token_s = pick >= 0 ? key_id(h.keys[pick], vocab) : -1;
        SAMPLE_NOTE_BINNED(pick >= 0);
    }
    __syncthreads();
    return token_s;
}

// Per row: fparams [temperature, top_p, min_p, -], iparams [top_k (0 or
// ≥ vocab: none), num_logprobs, penalty start, penalty end, wants the
// sampled logprob (0/1)]; penalties: tokens (increasing within a row) and
// [repetition, subtract, bias], and `pen_raw`, one float per entry, where
// the raw values go. Grid (rows), SAMPLE_THREADS threads. `logits` rows
// with penalties are overwritten with their scores. Out: the token (-1 for
// a row with a NaN), its logprob (NaN unless asked), and `top_stride`
// (id, logprob) slots of which the first min(num_logprobs, vocab) are
// written.
extern "C" __global__ void sample_rows(int *out_token, float *out_logprob, int *out_top_ids, float *out_top_lp, int top_stride,
                                       float *logits, float *pen_raw, int vocab, const float *__restrict__ fparams,
                                       const int *__restrict__ iparams, const double *__restrict__ uniform,
                                       const int *__restrict__ pen_tokens, const float *__restrict__ pen_values) {
    __shared__ SampleShared sh;
    __shared__ int chosen_s;
    double *red = sh.red;
    unsigned long long *kred = sh.kred;
    const int row = blockIdx.x;
    float *x = logits + (long long)row * vocab;
    const float temperature = fparams[row * 4], top_p = fparams[row * 4 + 1], min_p = fparams[row * 4 + 2];
    const int top_k = iparams[row * 5], num_logprobs = iparams[row * 5 + 1];
    const int pen_start = iparams[row * 5 + 2], pen_end = iparams[row * 5 + 3], wants_logprob = iparams[row * 5 + 4];

    // One pass over the raw row: a NaN (the row goes back to the host
    // untouched), the largest and the smallest rank key.
    unsigned long long top = 0, bottom = ~0ull;
    for_entries(x, vocab, [&](int i, float v) {
        const unsigned long long k = rank_key(v, i, vocab);
        top = v != v ? ~0ull : (k > top ? k : top);
        bottom = k < bottom ? k : bottom;
    });
    top = sample_max_key(top, kred);
    if (top == ~0ull) {
        if (threadIdx.x == 0) {
            out_token[row] = -1;
            out_logprob[row] = __uint_as_float(0x7fc00000u);
        }
        return;
    }
    bottom = ~sample_max_key(~bottom, kred);

    // The model's own logprobs: ln Σ exp(x − max) + max over the raw row.
    double lse = 0.0;
    if (wants_logprob || num_logprobs > 0) {
        const float mx = key_score(top);
        double acc = 0.0;
        const int n_top = num_logprobs < top_stride ? (num_logprobs < vocab ? num_logprobs : vocab) : (top_stride < vocab ? top_stride : vocab);
        // From the bins (2 passes, the first adding the log-sum's terms), or
        // a block maximum a pass each.
        const int binned = SAMPLE_BINNED && n_top >= 2 ? top_binned(x, vocab, mx, bottom, n_top, &acc, sh) : -1;
        if (SAMPLE_BINNED && threadIdx.x == 0 && n_top >= 2) SAMPLE_NOTE_TOP(binned > 0);
        if (binned < 0) for_entries(x, vocab, [&](int, float v) { acc += (double)sample_weight(v, mx, 1.0f); });
        const bool listed = binned > 0;
        lse = log(sample_sum(acc, red)) + (double)mx;
        unsigned long long below = top;
        if (threadIdx.x == 0 && num_logprobs > 0 && top_stride > 0) {
            const int id = key_id(top, vocab);
            out_top_ids[row * top_stride] = id;
            out_top_lp[row * top_stride] = (float)((double)x[id] - lse);
            // From the bins, sorted: the first is `top`.
            for (int j = 1; listed && j < n_top; j++) {
                const int e = key_id(sh.hist.keys[j], vocab);
                out_top_ids[row * top_stride + j] = e;
                out_top_lp[row * top_stride + j] = (float)((double)x[e] - lse);
            }
        }
        // Else the top entries, one block maximum each, every one below the last.
        for (int j = 1; !listed && j < num_logprobs && j < top_stride && j < vocab; j++) {
            unsigned long long best = 0;
            for_entries(x, vocab, [&](int i, float v) {
                const unsigned long long k = rank_key(v, i, vocab);
                if (k < below && k > best) best = k;
            });
            best = sample_max_key(best, kred);
            below = best;
            if (threadIdx.x == 0) {
                const int id = key_id(best, vocab);
                out_top_ids[row * top_stride + j] = id;
                out_top_lp[row * top_stride + j] = (float)((double)x[id] - lse);
            }
        }
    }

    // The scores: the row, with the penalties applied in place (once every
    // thread is done reading it raw), and their largest and smallest keys.
    unsigned long long best = top;
    if (pen_end > pen_start) {
        __syncthreads();
        for (int e = pen_start + threadIdx.x; e < pen_end; e += SAMPLE_THREADS) {
            const int t = pen_tokens[e];
            if (t < 0 || t >= vocab) continue;
            const float rep = pen_values[e * 3], sub = pen_values[e * 3 + 1], bias = pen_values[e * 3 + 2];
            float l = x[t];
            pen_raw[e] = l;
            if (rep != 1.0f) l = l > 0.0f ? l / rep : __fmul_rn(l, rep);
            if (sub != 0.0f) l = __fsub_rn(l, sub);
            if (bias != 0.0f) l = __fadd_rn(l, bias);
            x[t] = l;
        }
        __syncthreads();
        best = 0;
        bottom = ~0ull;
        for_entries(x, vocab, [&](int i, float v) {
            const unsigned long long k = rank_key(v, i, vocab);
            best = k > best ? k : best;
            bottom = k < bottom ? k : bottom;
        });
        best = sample_max_key(best, kred);
        bottom = ~sample_max_key(~bottom, kred);
    }
    const float *s = x;

    // The largest score (ties: the lowest id).
    const int argmax = key_id(best, vocab);
    const float max = s[argmax];
    int token = argmax;
    if (temperature > 0.0f && s[argmax] == s[argmax]) {
        const float inv_t = 1.0f / temperature;
        const double u = uniform[row];
        const bool plain = (top_k <= 0 || top_k >= vocab) && top_p >= 1.0f && min_p <= 0.0f;
        if (plain) {
            // Cumulative weights in id order: each thread a contiguous
            // segment, the segments' sums scanned, one segment walked.
            const int seg = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
            const int lo = threadIdx.x * seg, hi = lo + seg < vocab ? lo + seg : vocab;
            double own = 0.0;
            for (int i = lo; i < hi; i++) own += (double)sample_weight(s[i], max, inv_t);
            red[threadIdx.x] = own;
            __syncthreads();
            if (threadIdx.x == 0) {
                double total = 0.0;
#pragma unroll 1
                for (int t = 0; t < SAMPLE_THREADS; t++) total += red[t];
                int pick = -1, last = -1;
                double target = u * total;
                if (total > 0.0 && total <= 1.79e308) {
#pragma unroll 1
                    for (int t = 0; t < SAMPLE_THREADS; t++) {
                        if (red[t] <= 0.0) continue;
                        last = t;
                        if (target >= red[t]) {
                            target -= red[t];
                            continue;
                        }
                        pick = t;
                        break;
                    }
                }
                chosen_s = pick >= 0 ? pick : -(last + 2); // -1: no weight at all
                red[0] = target;
            }
            __syncthreads();
            const int c = chosen_s;
            const int walker = c >= 0 ? c : -c - 2;
            const double target = red[0];
            __syncthreads();
            if (c != -1 && (int)threadIdx.x == walker) {
                double left = c >= 0 ? target : 1.0 / 0.0;
                int t_lo = walker * seg, t_hi = t_lo + seg < vocab ? t_lo + seg : vocab, lastpos = t_lo, found = -1;
                for (int i = t_lo; i < t_hi; i++) {
                    const double w = (double)sample_weight(s[i], max, inv_t);
                    if (w > 0.0) {
                        if (left < w) {
                            found = i;
                            break;
                        }
                        left -= w;
                        lastpos = i;
                    }
                }
                chosen_s = found >= 0 ? found : lastpos;
            }
            __syncthreads();
            if (c != -1) token = chosen_s;
        } else if (SAMPLE_BINNED && min_p <= 0.0f && (token = sample_binned(s, vocab, argmax, max, temperature, inv_t, u, top_k, top_p, bottom, sh)) >= 0) {
            // Drawn from the bins (two passes).
        } else {
            token = argmax;
            // Rank cuts: top-k, then min-p, then top-p; then the draw. Each
            // descent's candidates lie between `floor` (or the smallest key)
            // and the largest key.
            // `chain`: the floor is the entry the last descent found.
            unsigned long long floor = 0;
            double total = 0.0, unused = 0.0;
            bool total_known = true, chain = false;
            if (top_k > 0 && top_k < vocab) {
                SampleCut c = {1, (unsigned long long)top_k, 0.0, 0.0, 0, 0};
                floor = select_cut(s, vocab, max, inv_t, 0, bottom, best, c, false, &total, &unused, sh);
                chain = true;
            } else if (min_p > 0.0f) {
                double acc = 0.0;
                for_entries(s, vocab, [&](int, float v) { acc += (double)sample_weight(v, max, inv_t); });
                total = sample_sum(acc, red);
            } else {
                total_known = false; // top-p's first pass weighs the row
            }
            if (min_p > 0.0f) {
                // Kept down to the first entry (in rank order) under the floor.
                const double p_floor = (double)min_p * (1.0 / total);
                unsigned long long fail = 0;
                for_entries(s, vocab, [&](int i, float v) {
                    const unsigned long long k = rank_key(v, i, vocab);
                    if (k >= floor && k > fail && (double)sample_weight(v, max, inv_t) / total < p_floor) fail = k;
                });
                fail = sample_max_key(fail, kred);
                if (fail + 1 > floor && fail != 0) {
                    floor = fail + 1;
                    chain = false;
                }
            }
            // u · kept / total (after top-k alone, `total` is the kept mass).
            SampleCut draw = chain ? SampleCut{0, 0, u * (total / total), total, 0, 0} : SampleCut{0, 0, u, total, 0, 2};
            if (top_p < 1.0f) {
                SampleCut c = {0, 0, (double)top_p, total, 1, total_known ? 0 : 1};
                double kept = 0.0, all = 0.0;
                floor = select_cut(s, vocab, max, inv_t, floor, floor > bottom ? floor : bottom, best, c, chain, &kept, &all, sh);
                if (!total_known) total = all;
                draw = SampleCut{0, 0, u * (kept / total), total, 0, 0};
                chain = true;
            }
            const unsigned long long k =
                select_cut(s, vocab, max, inv_t, floor, floor > bottom ? floor : bottom, best, draw, chain, &unused, &unused, sh);
            token = key_id(k, vocab);
        }
    }
    if (threadIdx.x == 0) {
        // The sampled token's raw logit: kept aside if a penalty changed it.
        float raw = x[token];
        int lo = pen_start, hi = pen_end;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (pen_tokens[mid] < token) lo = mid + 1;
            else hi = mid;
        }
        if (lo < pen_end && pen_tokens[lo] == token) raw = pen_raw[lo];
        out_token[row] = token;
        out_logprob[row] = wants_logprob ? (float)((double)raw - lse) : __uint_as_float(0x7fc00000u);
    }
}

// Puts back the raw logits that `sample_rows` replaced with their scores,
// in every row it sampled (token ≥ 0), so that the host can sample the step
// from the logits when another row had a NaN. Grid (rows), any block size.
extern "C" __global__ void unpenalize_rows(float *logits, int vocab, const int *__restrict__ iparams, const int *__restrict__ tokens,
                                           const int *__restrict__ pen_tokens, const float *__restrict__ pen_raw) {
    const int row = blockIdx.x;
    if (tokens[row] < 0) return;
    float *x = logits + (long long)row * vocab;
    for (int e = iparams[row * 5 + 2] + threadIdx.x; e < iparams[row * 5 + 3]; e += blockDim.x) {
        const int t = pen_tokens[e];
        if (t >= 0 && t < vocab) x[t] = pen_raw[e];
    }
}
