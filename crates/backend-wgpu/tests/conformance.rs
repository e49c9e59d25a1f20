//! Every WGSL kernel against the CPU backend (the reference), on random
//! shapes, through the same `Ops` / `AttentionBackend` calls the model makes.
//!
//! These run on a real Vulkan device: in CI that is lavapipe, Mesa's CPU
//! driver (`apt-get install mesa-vulkan-drivers libvulkan1`). Without any
//! adapter they fail with that hint rather than skip.
//!
//! Tolerances (relative to `max(1, |reference|)`):
//! - `linear` 1e-4 for every weight format (both sides compute in f32 on
//!   the same dequantized values; only the summation order differs);
//! - `embed`, `gather_rows`, `add`, `copy_blocks`, swaps: exact;
//! - `rms_norm`, `rope`, `silu_mul` 1e-5;
//! - paged attention 1e-4 on an f32 cache, and on f16/bf16 caches the bound
//!   that rounding the stored K/V to the cache type implies (the two
//!   backends may round a value differently: WGSL leaves the f16 rounding to
//!   the implementation).

use half::{bf16, f16};
use proptest::prelude::*;
use std::sync::{Arc, OnceLock};
use vellum_backend_cpu::{CpuOps, HostTensor, WeightFormat};
use vellum_backend_wgpu::{GpuContext, WgpuOps};
use vellum_base::SeededRng as Rng;
use vellum_base::{AttentionBackend, AttentionShape, BlockCopy, BlockId, BlockSwap, ForwardBatch, HostBlockId, KvCacheDtype, KvCacheSpec};
use vellum_models::gguf::GgmlType;
use vellum_models::ops::Ops;
use vellum_models::rope::RopeTable;
use vellum_models::WeightView;

/// One device for the whole test binary (opening lavapipe costs ~0.1 s).
fn device() -> Arc<GpuContext> {
    static CTX: OnceLock<Arc<GpuContext>> = OnceLock::new();
    CTX.get_or_init(|| GpuContext::new().unwrap_or_else(|e| panic!("these tests need a wgpu adapter: {e}"))).clone()
}

fn gpu() -> WgpuOps {
    WgpuOps::with_context(device()).expect("ops on the device")
}

fn cpu() -> CpuOps {
    CpuOps::new(WeightFormat::F32)
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}: element {i}: wgpu {g}, cpu {w} (tolerance {tol})");
    }
}

fn host(rows: usize, cols: usize, data: Vec<f32>) -> HostTensor {
    HostTensor { rows, cols, data }
}

/// A weight `[n, k]` of file type `ty` with random contents.
fn weight(ty: GgmlType, n: usize, k: usize, rng: &mut Rng) -> WeightView<'static> {
    let mut bytes = Vec::new();
    match ty {
        GgmlType::F32 => return WeightView::from_f32("w", vec![n, k], &rng.signed_vec(n * k)),
        GgmlType::F16 => bytes.extend((0..n * k).flat_map(|_| f16::from_f32(rng.signed_f32()).to_le_bytes())),
        GgmlType::BF16 => bytes.extend((0..n * k).flat_map(|_| bf16::from_f32(rng.signed_f32()).to_le_bytes())),
        _ => {
            for _ in 0..n * k / 32 {
                bytes.extend_from_slice(&f16::from_f32(rng.signed_f32().abs() * 0.1 + 0.01).to_le_bytes());
                match ty {
                    GgmlType::Q8_0 => bytes.extend((0..32).map(|_| rng.next_u64() as u8)),
                    GgmlType::Q4_1 => {
                        bytes.extend_from_slice(&f16::from_f32(rng.signed_f32() * 0.5).to_le_bytes());
                        bytes.extend((0..16).map(|_| rng.next_u64() as u8));
                    }
                    GgmlType::Q4_0 => bytes.extend((0..16).map(|_| rng.next_u64() as u8)),
                    other => panic!("no generator for {other:?}"),
                }
            }
        }
    }
    WeightView::new("w", vec![n, k], ty, bytes.into()).expect("whole blocks")
}

/// `linear` on both backends, for a weight format, a shape and a binding
/// limit (small limits split the weight and the rows).
fn check_linear(ty: GgmlType, m: usize, n: usize, k: usize, seed: u64, limit: Option<u64>) {
    let mut rng = Rng::new(seed);
    let w = weight(ty, n, k, &mut rng);
    let x = rng.signed_vec(m * k);
    let bias = rng.signed_vec(n);
    let (c, mut g) = (cpu(), gpu());
    if let Some(l) = limit {
        g = g.with_binding_limit(l);
    }
    let want = c.linear(&host(m, k, x.clone()), &c.linear_weight(w.clone()).unwrap(), Some(&bias)).unwrap().into_data();
    let gw = g.linear_weight(w).unwrap();
    let gb = g.vector("bias", &bias).unwrap();
    let gx = g.upload(m, k, &x).unwrap();
    let got = g.to_host(&g.linear(&gx, &gw, Some(&gb)).unwrap()).unwrap();
    assert_close(&got, &want, 1e-4, &format!("linear {ty:?} [{m}x{k}]·[{n}x{k}]ᵀ limit {limit:?}"));
}

#[test]
fn linear_matches_cpu_for_every_weight_format() {
    for (i, ty) in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0].into_iter().enumerate() {
        let odd_k = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        for (j, &m) in [1usize, 3, 8, 13, 40].iter().enumerate() {
            let k = if odd_k && j % 2 == 1 { 75 } else { 160 };
            check_linear(ty, m, 70 + 13 * j, k, (i * 10 + j) as u64, None);
        }
    }
}

#[test]
fn linear_splits_weights_and_rows_past_the_binding_limit() {
    // 4 KiB bindings: a [300, 64] Q8_0 weight (21.6 KB) becomes 6 chunks,
    // and 40 output rows of 300 floats (48 KB) run in row ranges.
    check_linear(GgmlType::Q8_0, 40, 300, 64, 7, Some(4096));
    check_linear(GgmlType::F32, 17, 130, 96, 8, Some(4096));
}

#[test]
fn embed_gathers_rows_of_every_format_and_chunk() {
    let mut rng = Rng::new(3);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q4_1, GgmlType::Q8_0] {
        for limit in [None, Some(8192)] {
            let (vocab, hidden) = (300, 64);
            let w = weight(ty, vocab, hidden, &mut rng);
            let ids: Vec<u32> = (0..20).map(|_| rng.below(vocab) as u32).chain([0, vocab as u32 - 1]).collect();
            let batch = ForwardBatch { token_ids: ids.clone(), ..one_sequence_batch(ids.len()) };
            let c = cpu();
            let want = c.embed(&c.embedding_weight(w.clone()).unwrap(), &c.prepare_step(&batch, 4).unwrap()).unwrap().into_data();
            let mut g = gpu();
            if let Some(l) = limit {
                g = g.with_binding_limit(l);
            }
            let table = g.embedding_weight(w).unwrap();
            if limit.is_some() {
                assert!(table.chunks.len() > 1, "{ty:?}: the table was not split");
            }
            let got = g.to_host(&g.embed(&table, &g.prepare_step(&batch, 4).unwrap()).unwrap()).unwrap();
            assert_close(&got, &want, 0.0, &format!("embed {ty:?} limit {limit:?}"));
            let bad = ForwardBatch { token_ids: vec![vocab as u32; ids.len()], ..batch };
            assert!(g.embed(&table, &g.prepare_step(&bad, 4).unwrap()).is_err(), "a token id past the vocabulary is an error");
        }
    }
}

/// One sequence of `t` new tokens at positions 0.. (a prefill) in blocks
/// 0, 1, … of 4 tokens.
fn one_sequence_batch(t: usize) -> ForwardBatch {
    ForwardBatch {
        token_ids: vec![1; t],
        positions: (0..t as u32).collect(),
        slot_mapping: (0..t as u32).collect(),
        query_start_loc: vec![0, t as u32],
        context_lens: vec![t as u32],
        block_tables: (0..t.div_ceil(4) as u32).collect(),
        block_table_stride: t.div_ceil(4),
        num_kv_groups: 1,
        logits_indices: vec![t as u32 - 1],
        ..ForwardBatch::default()
    }
}

#[test]
fn norms_rope_and_elementwise_ops_match_cpu() {
    let mut rng = Rng::new(5);
    let (c, g) = (cpu(), gpu());
    let (rows, heads, hd) = (19, 5, 64);
    let cols = heads * hd;
    let x = rng.signed_vec(rows * cols);
    let y = rng.signed_vec(rows * cols);
    let (hx, gx, gy) = (host(rows, cols, x.clone()), g.upload(rows, cols, &x).unwrap(), g.upload(rows, cols, &y).unwrap());
    for group in [cols, hd] {
        let w = rng.signed_vec(group);
        let want = c.rms_norm(&hx, &c.vector("w", &w).unwrap(), 1e-5, group).unwrap().into_data();
        let got = g.to_host(&g.rms_norm(&gx, &g.vector("w", &w).unwrap(), 1e-5, group).unwrap()).unwrap();
        assert_close(&got, &want, 1e-5, &format!("rms_norm group {group}"));
    }
    let want = c.silu_mul(&hx, &host(rows, cols, y.clone())).unwrap().into_data();
    assert_close(&g.to_host(&g.silu_mul(&gx, &gy).unwrap()).unwrap(), &want, 1e-5, "silu_mul");

    let mut hsum = hx.clone();
    c.add_assign(&mut hsum, &host(rows, cols, y.clone())).unwrap();
    let mut gsum = g.upload(rows, cols, &x).unwrap();
    g.add_assign(&mut gsum, &gy).unwrap();
    assert_close(&g.to_host(&gsum).unwrap(), &hsum.data, 0.0, "add");

    // RoPE at scattered positions, with Llama 3 scaling in the table.
    let config = vellum_base::ModelConfig::from_json_str(
        r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":320,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":5,"max_position_embeddings":4096,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":1024}}"#,
        "test",
    )
    .unwrap();
    let table = RopeTable::new(&config);
    let batch = ForwardBatch { positions: (0..rows as u32).map(|i| i * 211 % 4096).collect(), ..one_sequence_batch(rows) };
    let mut hq = hx.clone();
    c.rope(&mut hq, &c.rope_table(&table).unwrap(), &c.prepare_step(&batch, 4).unwrap()).unwrap();
    let mut gq = g.upload(rows, cols, &x).unwrap();
    let gstep = g.prepare_step(&batch, 4).unwrap();
    g.rope(&mut gq, &g.rope_table(&table).unwrap(), &gstep).unwrap();
    assert_close(&g.to_host(&gq).unwrap(), &hq.data, 1e-5, "rope");

    // The logits rows, in the order the step lists them.
    let batch = ForwardBatch { logits_indices: vec![18, 0, 7, 7], ..one_sequence_batch(rows) };
    let want = c.logits_rows(&hx, &c.prepare_step(&batch, 4).unwrap()).unwrap().into_data();
    let got = g.to_host(&g.logits_rows(&gx, &g.prepare_step(&batch, 4).unwrap()).unwrap()).unwrap();
    assert_close(&got, &want, 0.0, "logits_rows");
}

#[test]
fn no_op_panics_on_mismatched_shapes() {
    let g = gpu();
    let x = g.upload(2, 3, &[0.0; 6]).unwrap();
    let w = g.linear_weight(WeightView::from_f32("w", vec![4, 5], &[0.0; 20])).unwrap();
    assert!(g.linear(&x, &w, None).is_err());
    let y = g.upload(3, 2, &[0.0; 6]).unwrap();
    assert!(g.silu_mul(&x, &y).is_err());
    let mut x2 = g.upload(2, 3, &[0.0; 6]).unwrap();
    assert!(g.add_assign(&mut x2, &y).is_err());
    let v = g.vector("w", &[1.0; 4]).unwrap();
    assert!(g.rms_norm(&x, &v, 1e-5, 3).is_err());
    assert!(g.upload(2, 2, &[0.0; 3]).is_err());
}

/// A random mixed batch over a shuffled pool: per sequence (context after
/// the step, queries this step); sequence 1 shares its first full blocks
/// with sequence 0.
struct AttnCase {
    block_size: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    seqs: Vec<(usize, usize)>,
    shared_blocks: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    seed: u64,
}

/// A built case: pool size, the earlier and the current step, the queries,
/// and each step's new K and V.
struct Built {
    num_blocks: usize,
    early: ForwardBatch,
    late: ForwardBatch,
    q: Vec<f32>,
    kv_early: (Vec<f32>, Vec<f32>),
    kv_late: (Vec<f32>, Vec<f32>),
}

impl AttnCase {
    /// The two steps (earlier context, then this step) and the queries.
    fn build(&self) -> Built {
        let mut rng = Rng::new(self.seed);
        let bs = self.block_size;
        let row = self.kv_heads * self.head_dim;
        let n = self.seqs.len();
        let shared = if n >= 2 { self.shared_blocks.min(self.seqs[0].0 / bs).min(self.seqs[1].0 / bs) } else { 0 };
        let needed: usize = self.seqs.iter().map(|&(ctx, _)| ctx.div_ceil(bs)).sum::<usize>() - shared;
        let num_blocks = needed + 3;
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        rng.shuffle(&mut free);
        let stride = self.seqs.iter().map(|&(ctx, _)| ctx.div_ceil(bs)).max().unwrap_or(0) + 1;
        let mut tables = vec![0u32; n * stride];
        let mut next = 0;
        for (s, &(ctx, _)) in self.seqs.iter().enumerate() {
            for b in 0..ctx.div_ceil(bs) {
                tables[s * stride + b] = if s == 1 && b < shared {
                    tables[b]
                } else {
                    next += 1;
                    free[next - 1]
                };
            }
        }
        let slot = |s: usize, p: usize| tables[s * stride + p / bs] * bs as u32 + (p % bs) as u32;
        let mut k: Vec<Vec<f32>> = self.seqs.iter().map(|&(ctx, _)| rng.signed_vec(ctx * row)).collect();
        let mut v: Vec<Vec<f32>> = self.seqs.iter().map(|&(ctx, _)| rng.signed_vec(ctx * row)).collect();
        if shared > 0 {
            let len = shared * bs * row;
            let (k0, v0) = (k[0][..len].to_vec(), v[0][..len].to_vec());
            k[1][..len].copy_from_slice(&k0);
            v[1][..len].copy_from_slice(&v0);
        }
        let mut steps = Vec::new();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for earlier in [true, false] {
            let mut b =
                ForwardBatch { block_tables: tables.clone(), block_table_stride: stride, query_start_loc: vec![0], ..Default::default() };
            let (mut kk, mut vv) = (Vec::new(), Vec::new());
            for (s, &(ctx, q_len)) in self.seqs.iter().enumerate() {
                let range = if earlier { 0..ctx - q_len } else { ctx - q_len..ctx };
                let len = range.len() as u32;
                b.token_ids.extend(range.clone().map(|_| 1));
                b.positions.extend(range.clone().map(|p| p as u32));
                b.slot_mapping.extend(range.clone().map(|p| slot(s, p)));
                b.query_start_loc.push(b.query_start_loc.last().copied().unwrap_or(0) + len);
                b.context_lens.push(range.end as u32);
                kk.extend_from_slice(&k[s][range.start * row..range.end * row]);
                vv.extend_from_slice(&v[s][range.start * row..range.end * row]);
            }
            steps.push(b);
            ks.push(kk);
            vs.push(vv);
        }
        let tokens = steps[1].num_tokens();
        let q = rng.signed_vec(tokens * self.kv_heads * self.group * self.head_dim);
        let (late, early) = (steps.pop().unwrap_or_default(), steps.pop().unwrap_or_default());
        let (kl, ke, vl, ve) =
            (ks.pop().unwrap_or_default(), ks.pop().unwrap_or_default(), vs.pop().unwrap_or_default(), vs.pop().unwrap_or_default());
        Built { num_blocks, early, late, q, kv_early: (ke, ve), kv_late: (kl, vl) }
    }

    fn shape(&self) -> AttentionShape {
        AttentionShape {
            sliding_window: self.window,
            logit_softcap: self.softcap,
            ..AttentionShape::new(self.kv_heads * self.group, self.kv_heads, self.head_dim)
        }
    }

    /// Both backends: write the earlier context, then this step's K/V, then
    /// attend; compare the outputs and the pools.
    fn check(&self, dtype: KvCacheDtype) {
        let Built { num_blocks, early, late, q, kv_early: (ke, ve), kv_late: (kl, vl) } = self.build();
        let spec = KvCacheSpec::uniform(2, self.kv_heads, self.head_dim, self.block_size, dtype);
        let row = self.kv_heads * self.head_dim;
        let shape = self.shape();
        let (c, g) = (cpu(), gpu());
        let mut hc = c.allocate_kv_cache(&spec, num_blocks, 0).unwrap();
        let mut gc = g.allocate_kv_cache(&spec, num_blocks, 0).unwrap();
        let layer = 1;
        for (b, k, v) in [(&early, &ke, &ve), (&late, &kl, &vl)] {
            let t = b.num_tokens();
            if t == 0 {
                continue;
            }
            c.write_kv(&mut hc, layer, &host(t, row, k.clone()), &host(t, row, v.clone()), &c.prepare_step(b, self.block_size).unwrap())
                .unwrap();
            let step = g.prepare_step(b, self.block_size).unwrap();
            g.write_kv(&mut gc, layer, &g.upload(t, row, k).unwrap(), &g.upload(t, row, v).unwrap(), &step).unwrap();
        }
        let t = late.num_tokens();
        let cols = q.len() / t;
        let want = c
            .paged_attention(&hc, layer, &host(t, cols, q.clone()), &c.prepare_step(&late, self.block_size).unwrap(), &shape)
            .unwrap()
            .into_data();
        let gstep = g.prepare_step(&late, self.block_size).unwrap();
        let got = g.to_host(&g.paged_attention(&gc, layer, &g.upload(t, cols, &q).unwrap(), &gstep, &shape).unwrap()).unwrap();
        let tol = match dtype {
            KvCacheDtype::F32 => 1e-4,
            // One rounding step of the type on |k|, |v| <= 1 (see the module doc).
            KvCacheDtype::F16 => 2.0 * (shape.scale * self.head_dim as f32 * 2f32.powi(-11)).exp_m1() + 2f32.powi(-10) + 1e-4,
            KvCacheDtype::Bf16 => 2.0 * (shape.scale * self.head_dim as f32 * 2f32.powi(-8)).exp_m1() + 2f32.powi(-7) + 1e-4,
        };
        assert_close(&got, &want, tol, &format!("paged attention {dtype:?} ({self:?})"));
        // The pools hold the same values (exact for f32).
        let pool_tol = if dtype == KvCacheDtype::F32 { 0.0 } else { 2f32.powi(-7) };
        assert_close(&g.read_kv_pool(&gc, layer, false).unwrap(), &hc.layers[layer].k.to_f32_vec(), pool_tol, "K pool");
        assert_close(&g.read_kv_pool(&gc, layer, true).unwrap(), &hc.layers[layer].v.to_f32_vec(), pool_tol, "V pool");
    }
}

impl std::fmt::Debug for AttnCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "bs {} kvh {} group {} hd {} seqs {:?} shared {} window {:?} softcap {:?} seed {}",
            self.block_size, self.kv_heads, self.group, self.head_dim, self.seqs, self.shared_blocks, self.window, self.softcap, self.seed
        )
    }
}

fn attn_case() -> impl Strategy<Value = AttnCase> {
    let seq = (1usize..90, any::<bool>(), any::<u32>()).prop_map(|(ctx, decode, r)| (ctx, if decode { 1 } else { 1 + r as usize % ctx }));
    (
        prop::sample::select(vec![1usize, 4, 16, 32]),
        1usize..=3,
        1usize..=3,
        prop::sample::select(vec![8usize, 32, 64, 128]),
        prop::collection::vec(seq, 1..=5),
        0usize..4,
        prop_oneof![3 => Just(None), 1 => (1usize..50).prop_map(Some)],
        prop_oneof![3 => Just(None), 1 => Just(Some(20.0f32))],
        any::<u64>(),
    )
        .prop_map(|(block_size, kv_heads, group, head_dim, seqs, shared_blocks, window, softcap, seed)| AttnCase {
            block_size,
            kv_heads,
            group,
            head_dim,
            seqs,
            shared_blocks,
            window,
            softcap,
            seed,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Paged attention over out-of-order, shared and partial blocks, for
    /// mixed prefill/decode batches with GQA, windows and soft-caps.
    #[test]
    fn paged_attention_matches_cpu(c in attn_case()) {
        for dtype in [KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Bf16] {
            c.check(dtype);
        }
    }
}

#[test]
fn long_context_decode_and_prefill_match_cpu() {
    // 600 positions: ten key tiles, a 256-wide head, prefill and decode together.
    let c = AttnCase {
        block_size: 16,
        kv_heads: 1,
        group: 4,
        head_dim: 256,
        seqs: vec![(600, 1), (300, 120)],
        shared_blocks: 0,
        window: None,
        softcap: None,
        seed: 11,
    };
    c.check(KvCacheDtype::F32);
    AttnCase { window: Some(100), ..c }.check(KvCacheDtype::F16);
}

#[test]
fn copy_blocks_and_swaps_move_every_layer() {
    for dtype in [KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Bf16] {
        let spec = KvCacheSpec::uniform(3, 2, 8, 4, dtype);
        let (num_blocks, host_blocks) = (8, 3);
        let row = spec.num_kv_heads * spec.head_dim;
        let mut rng = Rng::new(13);
        let (c, g) = (cpu(), gpu());
        let mut hc = c.allocate_kv_cache(&spec, num_blocks, host_blocks).unwrap();
        let mut gc = g.allocate_kv_cache(&spec, num_blocks, host_blocks).unwrap();
        // Fill every slot of every layer.
        let t = num_blocks * spec.block_size;
        let batch = ForwardBatch { slot_mapping: (0..t as u32).collect(), ..one_sequence_batch(t) };
        let (hstep, gstep) = (c.prepare_step(&batch, 4).unwrap(), g.prepare_step(&batch, 4).unwrap());
        for l in 0..spec.num_slots() {
            let (k, v) = (rng.signed_vec(t * row), rng.signed_vec(t * row));
            c.write_kv(&mut hc, l, &host(t, row, k.clone()), &host(t, row, v.clone()), &hstep).unwrap();
            g.write_kv(&mut gc, l, &g.upload(t, row, &k).unwrap(), &g.upload(t, row, &v).unwrap(), &gstep).unwrap();
        }
        let copies = [BlockCopy { src: BlockId(1), dst: BlockId(6) }, BlockCopy { src: BlockId(5), dst: BlockId(0) }];
        let out = [BlockSwap { device: BlockId(4), host: HostBlockId(2) }, BlockSwap { device: BlockId(1), host: HostBlockId(0) }];
        let back = [BlockSwap { device: BlockId(7), host: HostBlockId(2) }, BlockSwap { device: BlockId(3), host: HostBlockId(0) }];
        c.copy_blocks(&mut hc, &copies).unwrap();
        g.copy_blocks(&mut gc, &copies).unwrap();
        c.swap_blocks(&mut hc, &out, true).unwrap();
        g.swap_blocks(&mut gc, &out, true).unwrap();
        c.swap_blocks(&mut hc, &back, false).unwrap();
        g.swap_blocks(&mut gc, &back, false).unwrap();
        for l in 0..spec.num_slots() {
            let tol = if dtype == KvCacheDtype::F32 { 0.0 } else { 2f32.powi(-7) };
            assert_close(&g.read_kv_pool(&gc, l, false).unwrap(), &hc.layers[l].k.to_f32_vec(), tol, &format!("{dtype:?} layer {l} K"));
            assert_close(&g.read_kv_pool(&gc, l, true).unwrap(), &hc.layers[l].v.to_f32_vec(), tol, &format!("{dtype:?} layer {l} V"));
            assert_close(&g.read_host_pool(&gc, l, false), &hc.host_layers[l].k.to_f32_vec(), tol, &format!("{dtype:?} layer {l} host K"));
        }
        assert!(
            g.copy_blocks(&mut gc, &[BlockCopy { src: BlockId(99), dst: BlockId(0) }]).is_err(),
            "a block outside the pool is an error"
        );
    }
}
