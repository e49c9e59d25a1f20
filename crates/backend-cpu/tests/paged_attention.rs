//! Paged attention, the K/V block write and block copies/swaps against plain,
//! obviously-correct references.
//!
//! Every random case builds a mixed batch: each sequence has a logical K/V
//! history `[ctx, kv_heads, head_dim]`, its earlier context is written to the
//! cache in a "previous step", this step's tokens with a second `write_kv`,
//! and its blocks are physical ids drawn out of order from a shuffled pool —
//! except the shared prefix blocks, which two sequences list in their tables.
//!
//! Every cache test runs for each storage dtype (`f32`, `f16`, `bf16`, FP8
//! E4M3 with scales that are not powers of two, see [`kv_scale`]). A
//! narrow cache is compared two ways: with the reference computed on the
//! K/V rounded to the storage type (what the kernel actually reads; the
//! `f32` tolerance applies unchanged), and with the reference on the exact
//! inputs, within the bound that rounding implies (see [`rounding_bound`]).

use half::{bf16, f16};
use proptest::prelude::*;
use vellum_backend_cpu::kv_cache::{KvCache, KvCacheLayout, KvPool, LayerKvCache};
use vellum_backend_cpu::paged_attention::{contiguous_attention, paged_attention, write_kv};
use vellum_base::SeededRng as Rng;
use vellum_base::{fp8, AttentionMetadata, AttentionShape, BlockCopy, BlockId, BlockSwap, HostBlockId, KvCacheDtype, KvScale};

const DTYPES: [KvCacheDtype; 4] = [KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3];

/// The layer scales the tests give a cache of `dtype`: an FP8 cache gets
/// ones that are not powers of two and differ between K and V, so that
/// folding them into the kernel's arithmetic is checked; |x| <= 1 becomes
/// up to 81 (K) and 143 (V) in the pool, within E4M3's ±448.
fn kv_scale(dtype: KvCacheDtype) -> KvScale {
    if dtype.is_scaled() {
        KvScale { k: 0.0123, v: 0.007 }
    } else {
        KvScale::ONE
    }
}

/// What the pool holds for `x` stored with scale `s`: `x · (1/s)` rounded
/// to `dtype` (nearest, ties to even), read back as `f32`.
fn stored_as(dtype: KvCacheDtype, s: f32, x: f32) -> f32 {
    match dtype {
        KvCacheDtype::F32 => x,
        KvCacheDtype::F16 => f16::from_f32(x).to_f32(),
        KvCacheDtype::Bf16 => bf16::from_f32(x).to_f32(),
        KvCacheDtype::Fp8E4m3 => fp8::to_f32(fp8::from_f32(x * (1.0 / s))),
    }
}

fn stored(dtype: KvCacheDtype, s: f32, xs: &[f32]) -> Vec<f32> {
    xs.iter().map(|&x| stored_as(dtype, s, x)).collect()
}

/// `xs` as the kernel reads them back: stored, times the scale.
fn rounded(dtype: KvCacheDtype, s: f32, xs: &[f32]) -> Vec<f32> {
    xs.iter().map(|&x| stored_as(dtype, s, x) * s).collect()
}

/// Unit roundoff of `dtype`: `|round(x) - x| <= u |x|` (normal range; for
/// FP8 plus the subnormal step, 2⁻⁹ · s < 1e-4, at the scales of
/// [`kv_scale`]).
fn unit_roundoff(dtype: KvCacheDtype) -> f32 {
    match dtype {
        KvCacheDtype::F32 => 0.0, // the f32 inputs are stored exactly
        KvCacheDtype::F16 => 2f32.powi(-11),
        KvCacheDtype::Bf16 => 2f32.powi(-8),
        KvCacheDtype::Fp8E4m3 => 2f32.powi(-4) + 1e-4,
    }
}

/// Largest |paged(rounded K/V) - reference(exact K/V)| that rounding can
/// cause, for inputs in [-1, 1] (|q|, |k|, |v| <= 1):
///
/// - each score `scale * q·k` moves by at most `δ = scale * head_dim * u`
///   (`|Δk_i| <= u`), so the softmax weights change by a factor within
///   `e^{±2δ}` and the output, a convex combination of values `|v| <= 1`,
///   by at most `e^{2δ} - 1`;
/// - the values themselves move by at most `u`.
///
/// Plus the f32 tolerance of [`assert_close`] for the arithmetic.
fn rounding_bound(dtype: KvCacheDtype, head_dim: usize, scale: f32) -> f32 {
    let u = unit_roundoff(dtype);
    let delta = scale * head_dim as f32 * u;
    (2.0 * delta).exp_m1() + u + 1e-4
}

/// The naive reference: plain loops, `f64` accumulation, whole score vector.
/// `k[s]`, `v[s]`: `[ctx_s, kvh, hd]`; `q`: `[tokens, heads, hd]`. A query
/// at position `pos` sees the last `window` positions up to its own; scores
/// are soft-capped when `attn` says so.
fn reference_attention(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], query_start_loc: &[u32], attn: &AttentionShape) -> Vec<f32> {
    let (num_heads, num_kv_heads, head_dim, scale) = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale);
    let mut out = vec![0.0f32; q.len()];
    let group = num_heads / num_kv_heads;
    for s in 0..query_start_loc.len() - 1 {
        let (start, end) = (query_start_loc[s] as usize, query_start_loc[s + 1] as usize);
        let ctx = k[s].len() / (num_kv_heads * head_dim);
        let q_len = end - start;
        for i in 0..q_len {
            let t = start + i;
            let pos = ctx - q_len + i;
            for h in 0..num_heads {
                let kh = h / group;
                let qv = &q[(t * num_heads + h) * head_dim..][..head_dim];
                let first = attn.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let scores: Vec<f64> = (first..=pos)
                    .map(|p| {
                        let kr = &k[s][(p * num_kv_heads + kh) * head_dim..][..head_dim];
                        let d: f64 = qv.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64;
                        attn.logit_softcap.map_or(d, |cap| cap as f64 * (d / cap as f64).tanh())
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..head_dim {
                    let mut acc = 0.0f64;
                    for (p, w) in (first..).zip(&weights) {
                        acc += w * v[s][(p * num_kv_heads + kh) * head_dim + d] as f64;
                    }
                    out[(t * num_heads + h) * head_dim + d] = (acc / total) as f32;
                }
            }
        }
    }
    out
}

fn assert_within(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "{what}: element {i}: got {g}, want {w} (tolerance {tol})");
    }
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-4 * w.abs().max(1.0);
        assert!((g - w).abs() <= tol, "{what}: element {i}: got {g}, want {w}");
    }
}

/// Parameters of one random batch.
#[derive(Clone, Debug)]
struct Case {
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
    /// Per sequence: (context length after the step, query rows this step).
    seqs: Vec<(usize, usize)>,
    /// Full blocks sequence 1 shares with sequence 0 (clamped to what fits).
    shared_blocks: usize,
    /// Sliding window, if any.
    window: Option<usize>,
    /// Score soft-cap, if any.
    softcap: Option<f32>,
    seed: u64,
}

fn seq_strategy() -> impl Strategy<Value = (usize, usize)> {
    // Half decodes (q_len 1), half prefill chunks (q_len up to ctx).
    (1usize..70, any::<bool>(), any::<u32>()).prop_map(|(ctx, decode, r)| {
        let q_len = if decode { 1 } else { 1 + r as usize % ctx };
        (ctx, q_len)
    })
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        1usize..=3,
        1usize..=3,
        prop_oneof![Just(64usize), 4usize..=64],
        prop::collection::vec(seq_strategy(), 1..=5),
        0usize..4,
        prop_oneof![3 => Just(None), 1 => (1usize..40).prop_map(Some)],
        prop_oneof![3 => Just(None), 1 => prop::sample::select(vec![0.5f32, 5.0, 30.0]).prop_map(Some)],
        any::<u64>(),
    )
        .prop_map(|(block_size, num_kv_heads, group, head_dim, seqs, shared_blocks, window, softcap, seed)| Case {
            block_size,
            num_kv_heads,
            group,
            head_dim,
            seqs,
            shared_blocks,
            window,
            softcap,
            seed,
        })
}

/// A built batch: the cache filled through `write_kv`, queries, metadata and
/// each sequence's logical K/V.
struct Batch {
    layout: KvCacheLayout,
    dtype: KvCacheDtype,
    scale: KvScale,
    cache: LayerKvCache,
    q: Vec<f32>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// `k`, `v` rounded to `dtype`: what the cache holds.
    k_stored: Vec<Vec<f32>>,
    v_stored: Vec<Vec<f32>>,
    query_start_loc: Vec<u32>,
    context_lens: Vec<u32>,
    block_tables: Vec<u32>,
    stride: usize,
    attn: AttentionShape,
}

impl Batch {
    fn build(c: &Case, dtype: KvCacheDtype) -> Self {
        let mut rng = Rng::new(c.seed);
        let (bs, kvh, hd) = (c.block_size, c.num_kv_heads, c.head_dim);
        let num_heads = kvh * c.group;
        let row = kvh * hd;
        let n_seqs = c.seqs.len();
        let blocks_of = |ctx: usize| ctx.div_ceil(bs);

        // Sequence 1 shares min(shared_blocks, full blocks of both) prefix blocks with 0.
        let shared = if n_seqs >= 2 { c.shared_blocks.min(c.seqs[0].0 / bs).min(c.seqs[1].0 / bs) } else { 0 };

        // Physical ids: a shuffled pool with spare blocks, handed out in order.
        let needed: usize = c.seqs.iter().map(|&(ctx, _)| blocks_of(ctx)).sum::<usize>() - shared;
        let num_blocks = needed + 3;
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        rng.shuffle(&mut free);
        let stride = c.seqs.iter().map(|&(ctx, _)| blocks_of(ctx)).max().unwrap_or(0) + 1;
        let mut block_tables = vec![0u32; n_seqs * stride];
        let mut next = 0;
        for (s, &(ctx, _)) in c.seqs.iter().enumerate() {
            for b in 0..blocks_of(ctx) {
                block_tables[s * stride + b] = if s == 1 && b < shared {
                    block_tables[b]
                } else {
                    next += 1;
                    free[next - 1]
                };
            }
        }

        // Logical K/V; sequence 1's shared prefix equals sequence 0's.
        let mut k: Vec<Vec<f32>> = c.seqs.iter().map(|&(ctx, _)| rng.signed_vec(ctx * row)).collect();
        let mut v: Vec<Vec<f32>> = c.seqs.iter().map(|&(ctx, _)| rng.signed_vec(ctx * row)).collect();
        if shared > 0 {
            let n = shared * bs * row;
            let (k0, v0) = (k[0][..n].to_vec(), v[0][..n].to_vec());
            k[1][..n].copy_from_slice(&k0);
            v[1][..n].copy_from_slice(&v0);
        }

        let layout = KvCacheLayout { num_blocks, block_size: bs, num_kv_heads: kvh, head_dim: hd };
        let mut cache = LayerKvCache::new(&layout, dtype);
        let scale = kv_scale(dtype);
        let slot = |s: usize, p: usize| block_tables[s * stride + p / bs] * bs as u32 + (p % bs) as u32;

        // Earlier steps wrote the context before this step's tokens; this step
        // writes its new tokens for the whole batch at once.
        let (mut new_k, mut new_v, mut new_slots) = (vec![], vec![], vec![]);
        for (s, &(ctx, q_len)) in c.seqs.iter().enumerate() {
            let old = ctx - q_len;
            let slots: Vec<u32> = (0..old).map(|p| slot(s, p)).collect();
            write_kv(&mut cache, &layout, &k[s][..old * row], &v[s][..old * row], &slots, scale);
            new_k.extend_from_slice(&k[s][old * row..]);
            new_v.extend_from_slice(&v[s][old * row..]);
            new_slots.extend((old..ctx).map(|p| slot(s, p)));
        }
        write_kv(&mut cache, &layout, &new_k, &new_v, &new_slots, scale);

        let mut query_start_loc = vec![0u32];
        for &(_, q_len) in &c.seqs {
            query_start_loc.push(query_start_loc.last().copied().unwrap_or(0) + q_len as u32);
        }
        let num_tokens = *query_start_loc.last().unwrap_or(&0) as usize;
        let q = rng.signed_vec(num_tokens * num_heads * hd);
        let context_lens = c.seqs.iter().map(|&(ctx, _)| ctx as u32).collect();
        let k_stored = k.iter().map(|x| rounded(dtype, scale.k, x)).collect();
        let v_stored = v.iter().map(|x| rounded(dtype, scale.v, x)).collect();
        Batch {
            layout,
            dtype,
            scale,
            cache,
            q,
            k,
            v,
            k_stored,
            v_stored,
            query_start_loc,
            context_lens,
            block_tables,
            stride,
            attn: AttentionShape { sliding_window: c.window, logit_softcap: c.softcap, ..AttentionShape::new(num_heads, kvh, hd) },
        }
    }

    fn meta(&self) -> AttentionMetadata<'_> {
        AttentionMetadata {
            block_size: self.layout.block_size,
            slot_mapping: &[],
            query_start_loc: &self.query_start_loc,
            context_lens: &self.context_lens,
            block_tables: &self.block_tables,
            block_table_stride: self.stride,
        }
    }

    fn paged(&self) -> Vec<f32> {
        let mut out = vec![f32::NAN; self.q.len()];
        paged_attention(&mut out, &self.q, &self.cache, &self.layout, &self.meta(), &self.attn, self.scale);
        out
    }

    fn contiguous(&self) -> Vec<f32> {
        let mut out = vec![f32::NAN; self.q.len()];
        let k: Vec<&[f32]> = self.k.iter().map(Vec::as_slice).collect();
        let v: Vec<&[f32]> = self.v.iter().map(Vec::as_slice).collect();
        let l = &self.layout;
        contiguous_attention(
            &mut out,
            &self.q,
            &k,
            &v,
            &self.query_start_loc,
            self.attn.num_heads,
            l.num_kv_heads,
            l.head_dim,
            self.attn.scale,
        );
        out
    }

    /// The reference on the exact inputs.
    fn reference(&self) -> Vec<f32> {
        self.reference_of(&self.k, &self.v)
    }

    /// The reference on the K/V as stored (rounded to the dtype).
    fn reference_stored(&self) -> Vec<f32> {
        self.reference_of(&self.k_stored, &self.v_stored)
    }

    /// Paged attention against both references (see the module doc).
    fn check_paged(&self) {
        let paged = self.paged();
        let what = format!("paged ({:?}) vs reference", self.dtype);
        assert_close(&paged, &self.reference_stored(), &format!("{what} on stored K/V"));
        let tol = rounding_bound(self.dtype, self.layout.head_dim, self.attn.scale);
        assert_within(&paged, &self.reference(), tol, &format!("{what} on exact K/V"));
    }

    fn reference_of(&self, k: &[Vec<f32>], v: &[Vec<f32>]) -> Vec<f32> {
        reference_attention(&self.q, k, v, &self.query_start_loc, &self.attn)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    /// Paged attention over out-of-order, partly shared blocks equals the
    /// naive reference for mixed decode / prefill-chunk batches.
    #[test]
    fn paged_matches_reference(c in case_strategy()) {
        for dtype in DTYPES {
            Batch::build(&c, dtype).check_paged();
        }
    }

    /// The contiguous kernel (the benchmark's baseline; full causal
    /// attention only) equals the reference.
    #[test]
    fn contiguous_matches_reference(c in case_strategy()) {
        let c = Case { window: None, softcap: None, ..c };
        let b = Batch::build(&c, KvCacheDtype::F32);
        assert_close(&b.contiguous(), &b.reference(), "contiguous vs reference");
    }

    /// Every token written by `write_kv` reads back from its slot (rounded to
    /// the storage dtype); every other slot stays zero.
    #[test]
    fn write_kv_reads_back_through_slots(
        block_size in prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        num_kv_heads in 1usize..=3,
        head_dim in 1usize..=64,
        num_blocks in 1usize..12,
        fill in 0.0f64..=1.0,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let layout = KvCacheLayout { num_blocks, block_size, num_kv_heads, head_dim };
        let row = layout.slot_elems();
        let mut slots: Vec<u32> = (0..layout.num_slots() as u32).collect();
        rng.shuffle(&mut slots);
        slots.truncate((slots.len() as f64 * fill) as usize);
        let (k, v) = (rng.signed_vec(slots.len() * row), rng.signed_vec(slots.len() * row));
        for dtype in DTYPES {
            let mut cache = LayerKvCache::new(&layout, dtype);
            let scale = kv_scale(dtype);
            write_kv(&mut cache, &layout, &k, &v, &slots, scale);
            prop_assert_eq!(cache.dtype(), dtype);
            let (ck, cv) = (cache.k.to_f32_vec(), cache.v.to_f32_vec());
            for (t, &slot) in slots.iter().enumerate() {
                let s = slot as usize;
                prop_assert_eq!(&ck[s * row..(s + 1) * row], &stored(dtype, scale.k, &k[t * row..(t + 1) * row])[..]);
                prop_assert_eq!(&cv[s * row..(s + 1) * row], &stored(dtype, scale.v, &v[t * row..(t + 1) * row])[..]);
            }
            let written: std::collections::HashSet<u32> = slots.iter().copied().collect();
            for s in (0..layout.num_slots()).filter(|s| !written.contains(&(*s as u32))) {
                prop_assert!(ck[s * row..(s + 1) * row].iter().all(|&x| x == 0.0));
                prop_assert!(cv[s * row..(s + 1) * row].iter().all(|&x| x == 0.0));
            }
        }
    }

    /// Prefill in three chunks (write the chunk, attend) equals one whole
    /// prefill, row for row.
    #[test]
    fn chunked_prefill_equals_whole_prefill(
        len in 3usize..80,
        cut_a in 0.0f64..1.0,
        cut_b in 0.0f64..1.0,
        block_size in prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        head_dim in prop::sample::select(vec![8usize, 17, 64]),
        seed in any::<u64>(),
    ) {
        let (kvh, heads) = (3, 9);
        let mut rng = Rng::new(seed);
        let row = kvh * head_dim;
        // Three non-empty chunks [0, a), [a, b), [b, len).
        let a = 1 + ((len - 2) as f64 * cut_a) as usize;
        let b = a + 1 + ((len - a - 1) as f64 * cut_b) as usize;
        let b = b.min(len - 1);
        prop_assert!(0 < a && a < b && b < len);
        let n_blocks = len.div_ceil(block_size);
        let mut table: Vec<u32> = (0..n_blocks as u32 + 2).collect();
        rng.shuffle(&mut table);
        let layout = KvCacheLayout { num_blocks: n_blocks + 2, block_size, num_kv_heads: kvh, head_dim };
        let (k, v, q) = (rng.signed_vec(len * row), rng.signed_vec(len * row), rng.signed_vec(len * heads * head_dim));
        let slots: Vec<u32> =
            (0..len).map(|p| table[p / block_size] * block_size as u32 + (p % block_size) as u32).collect();
        let scale = 0.125;
        let qrow = heads * head_dim;
        let attend = |cache: &LayerKvCache, from: usize, to: usize| {
            let qsl = [0, (to - from) as u32];
            let ctx = [to as u32];
            let meta = AttentionMetadata {
                block_size,
                slot_mapping: &slots[from..to],
                query_start_loc: &qsl,
                context_lens: &ctx,
                block_tables: &table,
                block_table_stride: table.len(),
            };
            let mut out = vec![f32::NAN; (to - from) * qrow];
            let attn = AttentionShape { scale, ..AttentionShape::new(heads, kvh, head_dim) };
            paged_attention(&mut out, &q[from * qrow..to * qrow], cache, &layout, &meta, &attn, kv_scale(cache.dtype()));
            out
        };

        for dtype in DTYPES {
            let mut whole_cache = LayerKvCache::new(&layout, dtype);
            write_kv(&mut whole_cache, &layout, &k, &v, &slots, kv_scale(dtype));
            let whole = attend(&whole_cache, 0, len);

            let mut cache = LayerKvCache::new(&layout, dtype);
            let mut chunked = Vec::new();
            for (from, to) in [(0, a), (a, b), (b, len)] {
                write_kv(&mut cache, &layout, &k[from * row..to * row], &v[from * row..to * row], &slots[from..to], kv_scale(dtype));
                chunked.extend(attend(&cache, from, to));
            }
            assert_close(&chunked, &whole, &format!("chunked vs whole prefill ({dtype:?})"));
        }
    }
}

fn random_cache(rng: &mut Rng, layout: KvCacheLayout, layers: usize, host_blocks: usize, dtype: KvCacheDtype) -> KvCache {
    let mut cache = KvCache::new(layout, layers, host_blocks, dtype);
    for l in cache.layers.iter_mut().chain(cache.host_layers.iter_mut()) {
        let (k, v) = (rng.signed_vec(l.k.len()), rng.signed_vec(l.v.len()));
        l.k.write_f32(0, &k);
        l.v.write_f32(0, &v);
    }
    cache
}

/// Block `b` of `pool`, widened to f32 (exact, so equal blocks compare equal).
fn block(pool: &KvPool, layout: &KvCacheLayout, b: usize) -> Vec<f32> {
    let mut out = vec![0.0; layout.block_elems()];
    pool.read_f32(b * out.len(), &mut out);
    out
}

#[test]
fn copy_blocks_moves_every_layer_k_and_v() {
    for dtype in DTYPES {
        copy_blocks_moves_every_layer_k_and_v_in(dtype);
    }
}

fn copy_blocks_moves_every_layer_k_and_v_in(dtype: KvCacheDtype) {
    let mut rng = Rng::new(7);
    let layout = KvCacheLayout { num_blocks: 8, block_size: 4, num_kv_heads: 3, head_dim: 5 };
    let mut cache = random_cache(&mut rng, layout, 3, 2, dtype);
    let before = cache.clone();
    let copies = [BlockCopy { src: BlockId(1), dst: BlockId(6) }, BlockCopy { src: BlockId(5), dst: BlockId(0) }];
    cache.copy_blocks(&copies);
    for (l, (after, before)) in cache.layers.iter().zip(&before.layers).enumerate() {
        for b in 0..layout.num_blocks {
            let src = match b {
                6 => 1,
                0 => 5,
                b => b,
            };
            assert_eq!(block(&after.k, &layout, b), block(&before.k, &layout, src), "{dtype:?} layer {l} K block {b}");
            assert_eq!(block(&after.v, &layout, b), block(&before.v, &layout, src), "{dtype:?} layer {l} V block {b}");
        }
    }
    assert_eq!(cache.host_layers, before.host_layers, "copy_blocks touched the host pool");
}

#[test]
fn swap_out_then_in_round_trips_every_layer_k_and_v() {
    for dtype in DTYPES {
        swap_out_then_in_round_trips_every_layer_k_and_v_in(dtype);
    }
}

fn swap_out_then_in_round_trips_every_layer_k_and_v_in(dtype: KvCacheDtype) {
    let mut rng = Rng::new(11);
    let layout = KvCacheLayout { num_blocks: 6, block_size: 2, num_kv_heads: 2, head_dim: 3 };
    let mut cache = random_cache(&mut rng, layout, 4, 3, dtype);
    let before = cache.clone();

    // Out: device 4 -> host 2, device 1 -> host 0.
    let out = [BlockSwap { device: BlockId(4), host: HostBlockId(2) }, BlockSwap { device: BlockId(1), host: HostBlockId(0) }];
    cache.swap_blocks(&out, true);
    let host = cache.host_layout();
    for (l, (h, d)) in cache.host_layers.iter().zip(&before.layers).enumerate() {
        for (hb, db) in [(2, 4), (0, 1)] {
            assert_eq!(block(&h.k, &host, hb), block(&d.k, &layout, db), "{dtype:?} layer {l} K host {hb}");
            assert_eq!(block(&h.v, &host, hb), block(&d.v, &layout, db), "{dtype:?} layer {l} V host {hb}");
        }
        assert_eq!(block(&h.k, &host, 1), block(&before.host_layers[l].k, &host, 1), "host block 1 changed");
    }
    assert_eq!(cache.layers, before.layers, "swap-out changed the device pool");

    // The device blocks are reused meanwhile; in: host 2 -> device 0, host 0 -> device 5.
    for l in &mut cache.layers {
        let fill = vec![-7.0; l.k.len()];
        l.k.write_f32(0, &fill);
        l.v.write_f32(0, &fill);
    }
    let back = [BlockSwap { device: BlockId(0), host: HostBlockId(2) }, BlockSwap { device: BlockId(5), host: HostBlockId(0) }];
    cache.swap_blocks(&back, false);
    for (l, (d, orig)) in cache.layers.iter().zip(&before.layers).enumerate() {
        for (db, ob) in [(0, 4), (5, 1)] {
            assert_eq!(block(&d.k, &layout, db), block(&orig.k, &layout, ob), "{dtype:?} layer {l} K device {db}");
            assert_eq!(block(&d.v, &layout, db), block(&orig.v, &layout, ob), "{dtype:?} layer {l} V device {db}");
        }
        assert!(block(&d.k, &layout, 2).iter().all(|&x| x == -7.0), "swap-in touched device block 2");
    }
}

#[test]
fn gqa_decode_batch_of_64_runs_in_parallel_and_matches_reference() {
    // Big enough to take the rayon path: 64 decodes × 9 heads, ctx up to 300.
    let c = Case {
        block_size: 16,
        num_kv_heads: 3,
        group: 3,
        head_dim: 64,
        seqs: (0..64).map(|i| (1 + (i * 37) % 300, 1)).collect(),
        shared_blocks: 2,
        window: None,
        softcap: None,
        seed: 3,
    };
    for dtype in DTYPES {
        Batch::build(&c, dtype).check_paged();
    }
    let b = Batch::build(&c, KvCacheDtype::F32);
    assert_close(&b.contiguous(), &b.reference(), "contiguous vs reference");
}

#[test]
fn single_long_decode_matches_reference() {
    // One row with a long context: the parallel path with one kv head per item.
    let c = Case {
        block_size: 16,
        num_kv_heads: 3,
        group: 3,
        head_dim: 64,
        seqs: vec![(2000, 1)],
        shared_blocks: 0,
        window: None,
        softcap: None,
        seed: 9,
    };
    for dtype in DTYPES {
        Batch::build(&c, dtype).check_paged();
    }
    let b = Batch::build(&c, KvCacheDtype::F32);
    assert_close(&b.contiguous(), &b.reference(), "contiguous vs reference");
}

#[test]
fn long_prefill_matches_reference() {
    let c = Case {
        block_size: 8,
        num_kv_heads: 2,
        group: 2,
        head_dim: 32,
        seqs: vec![(400, 300), (50, 1)],
        shared_blocks: 0,
        window: None,
        softcap: None,
        seed: 5,
    };
    for dtype in DTYPES {
        Batch::build(&c, dtype).check_paged();
    }
    // The same with a window shorter than a tile and a soft-cap (Gemma's
    // local layers): only the last `window` keys of each query count.
    for dtype in DTYPES {
        Batch::build(&Case { window: Some(37), softcap: Some(20.0), ..c.clone() }, dtype).check_paged();
    }
}

#[test]
#[should_panic(expected = "block_table_stride")]
fn block_table_too_short_is_a_broken_invariant() {
    let layout = KvCacheLayout { num_blocks: 4, block_size: 2, num_kv_heads: 1, head_dim: 4 };
    let cache = LayerKvCache::new(&layout, KvCacheDtype::F32);
    let meta = AttentionMetadata {
        block_size: 2,
        slot_mapping: &[],
        query_start_loc: &[0, 1],
        context_lens: &[5],
        block_tables: &[0, 1],
        block_table_stride: 2,
    };
    let mut out = vec![0.0; 4];
    paged_attention(&mut out, &[0.0; 4], &cache, &layout, &meta, &AttentionShape::new(1, 1, 4), KvScale::ONE);
}

#[test]
#[should_panic(expected = "outside the pool")]
fn slot_outside_the_pool_is_a_broken_invariant() {
    let layout = KvCacheLayout { num_blocks: 2, block_size: 2, num_kv_heads: 1, head_dim: 2 };
    let mut cache = LayerKvCache::new(&layout, KvCacheDtype::F16);
    write_kv(&mut cache, &layout, &[1.0, 2.0], &[3.0, 4.0], &[4], KvScale::ONE);
}

/// A NaN key stored in an FP8 cache (the NaN code) comes back out of
/// attention as NaN, as it does from a 16-bit cache, for the queries that
/// see it and only for them.
#[test]
fn a_nan_key_in_an_fp8_cache_reads_back_as_nan() {
    let layout = KvCacheLayout { num_blocks: 2, block_size: 4, num_kv_heads: 1, head_dim: 16 };
    let mut cache = LayerKvCache::new(&layout, KvCacheDtype::Fp8E4m3);
    let mut k: Vec<f32> = (0..6 * 16).map(|i| (i % 7) as f32 * 0.1).collect();
    k[3 * 16 + 5] = f32::NAN;
    let v: Vec<f32> = (0..6 * 16).map(|i| (i % 5) as f32 * 0.2).collect();
    let slots: Vec<u32> = (0..6).collect();
    write_kv(&mut cache, &layout, &k, &v, &slots, KvScale::ONE);
    // Six query rows of one sequence: rows 0..3 see positions before the NaN key.
    let q: Vec<f32> = (0..6 * 16).map(|i| (i % 3) as f32 * 0.3).collect();
    let meta = AttentionMetadata {
        block_size: 4,
        slot_mapping: &slots,
        query_start_loc: &[0, 6],
        context_lens: &[6],
        block_tables: &[0, 1],
        block_table_stride: 2,
    };
    let mut out = vec![0.0; q.len()];
    paged_attention(&mut out, &q, &cache, &layout, &meta, &AttentionShape::new(1, 1, 16), KvScale::ONE);
    for (row, o) in out.chunks(16).enumerate() {
        assert_eq!(o.iter().all(|x| x.is_nan()), row >= 3, "row {row}: {o:?}");
    }
}
