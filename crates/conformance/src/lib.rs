//! # vellum-conformance — one suite for every backend
//!
//! Runs a backend's [`Ops`] and `AttentionBackend` calls, the ones model
//! code makes, against the CPU backend's float32 path (the reference) on
//! seeded random shapes. A backend instantiates it in a few lines:
//!
//! ```ignore
//! #[test]
//! fn conformance() {
//!     vellum_conformance::Suite::new("wgpu").run(&WgpuOps::new().unwrap());
//! }
//! ```
//!
//! What it checks, with tolerances relative to `max(1, |reference|)`:
//! - `linear` for each weight format the suite is given (1e-4: both sides
//!   compute in f32 on the same dequantized values; a backend that rounds
//!   the inputs to 16 bits for a weight type, as its
//!   `Ops::linear_input_dtype` says, gets one rounding of every term on
//!   top, `u · Σ|w||x|`);
//! - `embed`, `add_assign`, `logits_rows`, block copies and swaps (exact),
//!   `rms_norm` (rows and per-head groups), `rope` (Llama 3 scaling,
//!   scattered positions), `silu_mul` (1e-5);
//! - paged attention over shuffled, shared and partial blocks for mixed
//!   prefill/decode batches (GQA, sliding windows, soft-caps) at every head
//!   size, block size and KV element type the backend declares in its
//!   `capabilities()`: 1e-4 on an f32 cache, and on f16/bf16 caches the bound
//!   one rounding of the stored K/V implies, plus one rounding of the
//!   queries and weights of the sequences `Ops::attention_operand_dtype`
//!   says the backend multiplies in 16 bits; the pools themselves too;
//! - an FP8 cache (where declared) allocated after a calibration pass over
//!   keys and values past its range: the scales it took applied, the pools
//!   equal to the reference's, attention within 1e-4;
//! - the fused products (`Ops::norm_linear`, `Ops::linear_add`) against the
//!   same backend's separate ops (1e-4);
//! - shapes that do not fit are errors, not panics.
//!
//! The golden prompts (`tests/golden.rs` at the workspace root) are the
//! end-to-end half of conformance: they run through `Llm` with any
//! `--device`.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

use half::{bf16, f16};
use vellum_backend_cpu::{CpuOps, WeightFormat};
use vellum_base::SeededRng as Rng;
use vellum_base::{
    AttentionBackend, AttentionShape, BlockCopy, BlockId, BlockSwap, ForwardBatch, HostBlockId, KvCacheDtype, KvCacheSpec, ModelConfig,
};
use vellum_ops::quant::GgmlType;
use vellum_ops::rope::RopeTable;
use vellum_ops::{ActivationDtype, GatedActivation, HostIo, Norm, Ops, WeightView};

/// The suite, configured for one backend.
#[derive(Clone, Debug)]
pub struct Suite {
    name: String,
    weight_formats: Vec<GgmlType>,
}

impl Suite {
    /// The whole suite for the backend called `name` (in messages): every
    /// weight format the WGSL and CUDA backends take (F32, F16, BF16, Q4_0,
    /// Q4_1, Q8_0), 24 random attention cases, swaps to host blocks.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            weight_formats: vec![GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0],
        }
    }

    /// Only these weight formats for `linear` and `embed`.
    pub fn weight_formats(mut self, formats: &[GgmlType]) -> Self {
        self.weight_formats = formats.to_vec();
        self
    }

    /// Runs every check on `ops`; panics with the first difference.
    pub fn run<O: HostIo>(&self, ops: &O) {
        self.linear(ops);
        self.embed(ops);
        self.norms_rope_and_elementwise(ops);
        self.shape_mismatches_are_errors(ops);
        self.paged_attention(ops);
        self.copy_blocks_and_swaps(ops);
        self.stacked_projections(ops);
        self.fused_products(ops);
        self.attention_of_a_stacked_product(ops);
        // Last: the scales a calibration takes stay with the backend and
        // apply to every FP8 cache it allocates after.
        self.fp8_scales_from_calibration(ops);
    }

    /// Where the backend takes FP8 KV caches: a calibration pass
    /// ([`vellum_ops::Ops::set_calibrating`]) writes keys up to ±3000 and
    /// values up to ±1200, far past E4M3's ±448, into an f32 cache; an FP8
    /// cache allocated after it stores them divided by the scales it took
    /// ([`vellum_base::KvScale::from_absmax`]). Its pools must read back as
    /// the CPU reference's after the same pass (the same codes times the
    /// same scales: exact) and hold values past 448 (an unscaled cache
    /// would clip every one there), and attention must agree with the
    /// reference's (1e-4 relative). Run it on a backend instance last: the
    /// scales stay with it.
    pub fn fp8_scales_from_calibration<O: HostIo>(&self, ops: &O) {
        let caps = ops.capabilities();
        if !caps.kv_dtypes.contains(&KvCacheDtype::Fp8E4m3) {
            return;
        }
        let case = AttnCase::small(&caps, vec![(40, 1), (30, 12)], 77);
        let mut built = case.build();
        let times = |x: &mut Vec<f32>, m: f32| x.iter_mut().for_each(|v| *v *= m);
        for (k, v) in [&mut built.kv_early, &mut built.kv_late].map(|(k, v)| (k, v)) {
            times(k, 3000.0);
            times(v, 1200.0);
        }
        // A small query: the scores stay in a range where softmax is not one-hot.
        times(&mut built.q, 1e-3);
        let (want_out, want_k, want_v) = fp8_after_calibration(&reference(), &case, &built);
        let (got_out, got_k, got_v) = fp8_after_calibration(ops, &case, &built);
        self.close(&got_k, &want_k, 0.0, "FP8 K pool after calibration");
        self.close(&got_v, &want_v, 0.0, "FP8 V pool after calibration");
        let largest = |x: &[f32]| x.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
        assert!(
            largest(&got_k) > 1000.0 && largest(&got_v) > 448.0,
            "{}: an FP8 cache allocated after calibration clips its values (largest |k| {}, |v| {})",
            self.name,
            largest(&got_k),
            largest(&got_v)
        );
        self.close(&got_out, &want_out, 1e-4, "FP8 attention after calibration");
    }

    /// Where the backend stacks projections ([`vellum_ops::Ops::stacked_weight`]):
    /// q, k and v multiplied as one weight and split (with and without
    /// RoPE), and gate and up with each gated activation, against the same
    /// backend's separate products and ops, for F32 and Q8_0 weights. A
    /// backend that keeps projections apart has nothing to check.
    pub fn stacked_projections<O: HostIo>(&self, ops: &O) {
        let (rows, k, hd) = (5, 128, 64);
        let (nq, nk, inter) = (4 * hd, 2 * hd, 96);
        let config = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":256,"intermediate_size":8,"num_hidden_layers":1,
                "num_attention_heads":4,"max_position_embeddings":512,"rope_theta":10000.0}"#,
            "conformance",
        )
        .expect("a valid config");
        let table = ops.rope_table(&RopeTable::new(&config)).expect("rope_table");
        let batch = ForwardBatch { positions: vec![0, 9, 301, 5, 77], ..one_sequence_batch(rows) };
        let step = ops.prepare_step(&batch, 4).expect("prepare_step");
        for (i, ty) in [GgmlType::F32, GgmlType::Q8_0].into_iter().enumerate() {
            let mut rng = Rng::new(40 + i as u64);
            let parts = [random_weight(ty, nq, k, &mut rng), random_weight(ty, nk, k, &mut rng), random_weight(ty, nk, k, &mut rng)];
            let Some(stacked) = ops.stacked_weight("qkv", &parts).expect("stacked_weight") else {
                return;
            };
            let x = ops.upload(rows, k, &rng.signed_vec(rows * k)).expect("upload");
            let apart: Vec<O::Tensor> = parts
                .iter()
                .map(|w| ops.linear(&x, &ops.linear_weight(w.clone()).expect("linear_weight"), None).expect("linear"))
                .collect();
            let host = |t: &O::Tensor| ops.to_host(t).expect("to_host");
            let product = ops.linear(&x, &stacked, None).expect("stacked linear");
            let (q, kk, v) = ops.split_qkv(&product, [nq, nk, nk], None).expect("split_qkv");
            for (got, want, what) in [(&q, &apart[0], "q"), (&kk, &apart[1], "k"), (&v, &apart[2], "v")] {
                self.close(&host(got), &host(want), 1e-4, &format!("stacked {ty:?} {what}"));
            }
            let (q, kk, v) = ops.split_qkv(&product, [nq, nk, nk], Some((&table, &step))).expect("split_qkv with rope");
            let (mut wq, mut wk) =
                (ops.upload(rows, nq, &host(&apart[0])).expect("upload"), ops.upload(rows, nk, &host(&apart[1])).expect("upload"));
            ops.rope_qk(&mut wq, &mut wk, &table, &step).expect("rope_qk");
            self.close(&host(&q), &host(&wq), 1e-4, &format!("stacked {ty:?} q rotated"));
            self.close(&host(&kk), &host(&wk), 1e-4, &format!("stacked {ty:?} k rotated"));
            self.close(&host(&v), &host(&apart[2]), 1e-4, &format!("stacked {ty:?} v beside the rotation"));
            let gate_up = [random_weight(ty, inter, k, &mut rng), random_weight(ty, inter, k, &mut rng)];
            let stacked = ops.stacked_weight("gate_up", &gate_up).expect("stacked_weight").expect("stacks gate and up too");
            let product = ops.linear(&x, &stacked, None).expect("stacked linear");
            let [g, u] = gate_up.map(|w| ops.linear(&x, &ops.linear_weight(w).expect("linear_weight"), None).expect("linear"));
            for act in [GatedActivation::Silu, GatedActivation::GeluTanh] {
                let want = match act {
                    GatedActivation::Silu => ops.silu_mul(&g, &u),
                    GatedActivation::GeluTanh => ops.gelu_tanh_mul(&g, &u),
                }
                .expect("gated activation");
                let got = ops.gated_mul(&product, act).expect("gated_mul");
                self.close(&host(&got), &host(&want), 1e-4, &format!("stacked {ty:?} {act:?}"));
            }
        }
    }

    /// The products with what comes before and after them fused
    /// ([`vellum_ops::Ops::norm_linear`]: with and without a pending
    /// residual add, a bias, the gated activation of a stacked gate/up
    /// weight; [`vellum_ops::Ops::linear_add`]: added or left pending)
    /// against the same backend's separate ops, within 1e-4: 1, 2, 3, 5
    /// and 8 rows (a GPU fuses a decode step's few rows and runs the others
    /// apart), F32, Q8_0 and Q4_1 weights of 97 outputs (a GEMV's last
    /// column group cut short, gated or not), k = 576 (one warp stride and a
    /// part).
    pub fn fused_products<O: HostIo>(&self, ops: &O) {
        let (n, k, eps) = (97, 576, 1e-5);
        let host = |t: &O::Tensor| ops.to_host(t).expect("to_host");
        for (i, ty) in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1].into_iter().enumerate() {
            if !self.weight_formats.contains(&ty) {
                continue;
            }
            let mut rng = Rng::new(70 + i as u64);
            let w = ops.linear_weight(random_weight(ty, n, k, &mut rng)).expect("linear_weight");
            let bias = ops.vector("bias", &rng.signed_vec(n)).expect("vector");
            let norm_w = ops.vector("norm", &rng.signed_vec(k).iter().map(|v| 1.0 + 0.5 * v).collect::<Vec<_>>()).expect("vector");
            let norm = Norm { w: &norm_w, eps, cols: k };
            let gate_up = [random_weight(ty, n, k, &mut rng), random_weight(ty, n, k, &mut rng)];
            let stacked = ops.stacked_weight("gate_up", &gate_up).expect("stacked_weight");
            for rows in [1, 2, 3, 5, 8] {
                let what = |op: &str| format!("{op}, {ty:?}, {rows} rows");
                // A residual stream's scale (the norm takes any), and a
                // pending block output.
                let base = rng.signed_vec(rows * k).iter().map(|v| 4.0 * v).collect::<Vec<_>>();
                let out = rng.signed_vec(rows * k);
                for with_pending in [false, true] {
                    for b in [None, Some(&bias)] {
                        let mut want_h = ops.upload(rows, k, &base).expect("upload");
                        let x = match with_pending {
                            true => ops.add_rms_norm(&mut want_h, ops.upload(rows, k, &out).expect("upload"), &norm_w, eps, k),
                            false => ops.rms_norm(&want_h, &norm_w, eps, k),
                        }
                        .expect("norm");
                        let want = ops.linear(&x, &w, b).expect("linear");
                        let mut h = ops.upload(rows, k, &base).expect("upload");
                        let pending = with_pending.then(|| ops.upload(rows, k, &out).expect("upload"));
                        let got = ops.norm_linear(&mut h, pending, norm, &w, b, None).expect("norm_linear");
                        let tag = format!("norm_linear (pending: {with_pending}, bias: {})", b.is_some());
                        self.close(&host(&got), &host(&want), 1e-4, &what(&tag));
                        self.close(&host(&h), &host(&want_h), 1e-6, &what(&format!("{tag}: the residual")));
                    }
                    let Some(gu) = &stacked else { continue };
                    for act in [GatedActivation::Silu, GatedActivation::GeluTanh] {
                        let mut want_h = ops.upload(rows, k, &base).expect("upload");
                        let x = match with_pending {
                            true => ops.add_rms_norm(&mut want_h, ops.upload(rows, k, &out).expect("upload"), &norm_w, eps, k),
                            false => ops.rms_norm(&want_h, &norm_w, eps, k),
                        }
                        .expect("norm");
                        let want = ops.gated_mul(&ops.linear(&x, gu, None).expect("linear"), act).expect("gated_mul");
                        let mut h = ops.upload(rows, k, &base).expect("upload");
                        let pending = with_pending.then(|| ops.upload(rows, k, &out).expect("upload"));
                        let got = ops.norm_linear(&mut h, pending, norm, gu, None, Some(act)).expect("norm_linear gated");
                        self.close(&host(&got), &host(&want), 1e-4, &what(&format!("norm_linear {act:?} (pending: {with_pending})")));
                    }
                }
                // The product closing a block: added into the residual, or
                // left pending (then the residual is as it was).
                let x = ops.upload(rows, k, &rng.signed_vec(rows * k)).expect("upload");
                let residual = rng.signed_vec(rows * n);
                let product = host(&ops.linear(&x, &w, None).expect("linear"));
                let mut h = ops.upload(rows, n, &residual).expect("upload");
                let left = ops.linear_add(&x, &w, &mut h).expect("linear_add");
                let want: Vec<f32> = match &left {
                    None => residual.iter().zip(&product).map(|(r, p)| r + p).collect(),
                    Some(y) => {
                        self.close(&host(y), &product, 1e-4, &what("linear_add's product left pending"));
                        residual.clone()
                    }
                };
                self.close(&host(&h), &want, 1e-4, &what("linear_add's residual"));
            }
        }
    }

    /// Where the backend stacks projections: attention of one stacked q/k/v
    /// product ([`vellum_ops::Ops::attention_stacked`], RoPE on the way: a
    /// backend may write the keys and values into the cache as it splits
    /// them) against the same backend's split, rotation, `write_kv` and
    /// paged attention, on every KV element type it takes: the same outputs
    /// and the same pools (prefill chunks and decodes in one batch, over a
    /// cache written by an earlier step).
    pub fn attention_of_a_stacked_product<O: HostIo>(&self, ops: &O) {
        let caps = ops.capabilities();
        let case = AttnCase::small(&caps, vec![(40, 1), (30, 12), (9, 9)], 23);
        let (heads, row, head_dim) = (case.kv_heads * case.group, case.kv_heads * case.head_dim, case.head_dim);
        let widths = [heads * head_dim, row, row];
        let mut rng = Rng::new(61);
        let probe = [widths[0], row, row].map(|n| random_weight(GgmlType::F32, n, 32, &mut rng));
        // The setup runs on every backend; the comparison where q/k/v stack.
        let stacks = ops.stacked_weight("qkv", &probe).expect("stacked_weight").is_some();
        let config = ModelConfig::from_json_str(
            &format!(
                r#"{{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":{},"intermediate_size":8,"num_hidden_layers":1,
                    "num_attention_heads":{heads},"num_key_value_heads":{},"max_position_embeddings":512,"rope_theta":10000.0}}"#,
                heads * head_dim,
                case.kv_heads
            ),
            "conformance",
        )
        .expect("a valid config");
        let table = ops.rope_table(&RopeTable::new(&config)).expect("rope_table");
        let Built { num_blocks, early, late, kv_early: (ke, ve), .. } = case.build();
        let shape = case.shape();
        let layer = 1;
        let t = late.num_tokens();
        let product = rng.signed_vec(t * (widths[0] + 2 * row));
        for &dtype in caps.kv_dtypes {
            let spec = KvCacheSpec::uniform(2, case.kv_heads, case.head_dim, case.block_size, dtype);
            let mut caches = [(); 2].map(|_| ops.allocate_kv_cache(&spec, num_blocks, 0).expect("allocate_kv_cache"));
            let step = ops.prepare_step(&early, case.block_size).expect("prepare_step");
            let n = early.num_tokens();
            for cache in &mut caches {
                let (k, v) = (ops.upload(n, row, &ke).expect("upload"), ops.upload(n, row, &ve).expect("upload"));
                ops.write_kv(cache, layer, &k, &v, &step).expect("write_kv");
            }
            let step = ops.prepare_step(&late, case.block_size).expect("prepare_step");
            let qkv = ops.upload(t, widths.iter().sum(), &product).expect("upload");
            if !stacks {
                continue;
            }
            let [split, stacked] = &mut caches;
            let (q, k, v) = ops.split_qkv(&qkv, widths, Some((&table, &step))).expect("split_qkv");
            let want = ops.attention(split, layer, &q, &k, &v, &step, &shape).expect("attention");
            let got = ops.attention_stacked(stacked, layer, &qkv, widths, Some(&table), &step, &shape).expect("attention_stacked");
            let what = format!("attention of a stacked product, {dtype:?} cache");
            self.close(&ops.to_host(&got).expect("to_host"), &ops.to_host(&want).expect("to_host"), 1e-5, &what);
            for value in [false, true] {
                let (got, want) =
                    (ops.read_kv(stacked, layer, value).expect("read_kv"), ops.read_kv(split, layer, value).expect("read_kv"));
                self.close(&got, &want, pool_tolerance(dtype), &format!("{what}: {} pool", if value { "V" } else { "K" }));
            }
        }
    }

    /// `linear` with a bias, for each weight format and 1–40 rows.
    pub fn linear<O: HostIo>(&self, ops: &O) {
        let c = reference();
        for (i, &ty) in self.weight_formats.iter().enumerate() {
            let odd_k = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
            for (j, &m) in [1usize, 3, 8, 13, 40].iter().enumerate() {
                let (n, k) = (70 + 13 * j, if odd_k && j % 2 == 1 { 75 } else { 160 });
                let mut rng = Rng::new((i * 10 + j) as u64);
                let w = random_weight(ty, n, k, &mut rng);
                let (x, bias) = (rng.signed_vec(m * k), rng.signed_vec(n));
                let want = run_linear(&c, &w, m, k, &x, &bias);
                let got = run_linear(ops, &w, m, k, &x, &bias);
                let what = format!("linear {ty:?} [{m}x{k}]·[{n}x{k}]ᵀ");
                let input = ops.linear_input_dtype(ty);
                if input == ActivationDtype::F32 {
                    self.close(&got, &want, 1e-4, &what);
                } else {
                    // Inputs rounded to `input` before the product: each
                    // output may move by one rounding of every term,
                    // u · Σ|w||x|, and by each side's f32 summation,
                    // k · 2⁻²⁴ · Σ|w||x|, on top of the f32 bound.
                    let abs_w = WeightView::from_f32(
                        "|w|",
                        vec![n, k],
                        &w.to_f32().expect("dequantize").iter().map(|v| v.abs()).collect::<Vec<_>>(),
                    );
                    let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
                    let bound = run_linear(&c, &abs_w, m, k, &abs_x, &vec![0.0; n]);
                    let u = input.unit_roundoff();
                    assert_eq!(got.len(), want.len(), "{}: {what}: lengths differ", self.name);
                    for (i, ((g, w), b)) in got.iter().zip(&want).zip(&bound).enumerate() {
                        // Plus each side's f32 summation over k terms.
                        let tol = (u + 2.0 * k as f32 * f32::EPSILON / 2.0) * b + 1e-4 * w.abs().max(1.0);
                        assert!(
                            (g - w).abs() <= tol,
                            "{}: {what} with {input:?} inputs: element {i}: {g}, the reference {w} (bound {tol})",
                            self.name
                        );
                    }
                }
            }
        }
    }

    /// `embed` of every weight format (ids at both ends of the vocabulary).
    pub fn embed<O: HostIo>(&self, ops: &O) {
        let c = reference();
        let mut rng = Rng::new(3);
        for &ty in &self.weight_formats {
            let (vocab, hidden) = (300, 64);
            let w = random_weight(ty, vocab, hidden, &mut rng);
            let ids: Vec<u32> = (0..20).map(|_| rng.below(vocab) as u32).chain([0, vocab as u32 - 1]).collect();
            let batch = ForwardBatch { token_ids: ids.clone(), ..one_sequence_batch(ids.len()) };
            let reference_table = c.embedding_weight(w.clone()).expect("cpu");
            let want = c.to_host(&c.embed(&reference_table, &c.prepare_step(&batch, 4).expect("cpu")).expect("cpu")).expect("cpu");
            let table = ops.embedding_weight(w).unwrap_or_else(|e| panic!("{}: embedding_weight {ty:?}: {e}", self.name));
            let got = ops.embed(&table, &ops.prepare_step(&batch, 4).expect("prepare_step")).expect("embed");
            self.close(&ops.to_host(&got).expect("to_host"), &want, 0.0, &format!("embed {ty:?}"));
        }
    }

    /// `rms_norm` (whole rows and per-head groups), `silu_mul`,
    /// `add_assign`, `rope` and `rope_qk` at scattered positions with Llama
    /// 3 scaling, `add_rms_norm`, `logits_rows` in the step's order.
    pub fn norms_rope_and_elementwise<O: HostIo>(&self, ops: &O) {
        let c = reference();
        let mut rng = Rng::new(5);
        let (rows, heads, hd) = (19, 5, 64);
        let cols = heads * hd;
        let (x, y) = (rng.signed_vec(rows * cols), rng.signed_vec(rows * cols));
        let up = |o: &O, d: &[f32]| o.upload(rows, cols, d).expect("upload");
        let (cx, cy, gx, gy) = (c.upload(rows, cols, &x).expect("cpu"), c.upload(rows, cols, &y).expect("cpu"), up(ops, &x), up(ops, &y));
        for group in [cols, hd] {
            let w = rng.signed_vec(group);
            let want = c.to_host(&c.rms_norm(&cx, &c.vector("w", &w).expect("cpu"), 1e-5, group).expect("cpu")).expect("cpu");
            let got = ops.rms_norm(&gx, &ops.vector("w", &w).expect("vector"), 1e-5, group).expect("rms_norm");
            self.close(&ops.to_host(&got).expect("to_host"), &want, 1e-5, &format!("rms_norm group {group}"));
        }
        let want = c.to_host(&c.silu_mul(&cx, &cy).expect("cpu")).expect("cpu");
        self.close(&ops.to_host(&ops.silu_mul(&gx, &gy).expect("silu_mul")).expect("to_host"), &want, 1e-5, "silu_mul");

        let mut csum = c.upload(rows, cols, &x).expect("cpu");
        c.add_assign(&mut csum, &cy).expect("cpu");
        let mut gsum = up(ops, &x);
        ops.add_assign(&mut gsum, &gy).expect("add_assign");
        self.close(&ops.to_host(&gsum).expect("to_host"), &c.to_host(&csum).expect("cpu"), 0.0, "add_assign");

        let config = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":320,"intermediate_size":8,"num_hidden_layers":1,
                "num_attention_heads":5,"max_position_embeddings":4096,"rope_theta":500000.0,
                "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":1024}}"#,
            "conformance",
        )
        .expect("a valid config");
        let table = RopeTable::new(&config);
        let batch = ForwardBatch { positions: (0..rows as u32).map(|i| i * 211 % 4096).collect(), ..one_sequence_batch(rows) };
        let mut cq = c.upload(rows, cols, &x).expect("cpu");
        c.rope(&mut cq, &c.rope_table(&table).expect("cpu"), &c.prepare_step(&batch, 4).expect("cpu")).expect("cpu");
        let mut gq = up(ops, &x);
        ops.rope(&mut gq, &ops.rope_table(&table).expect("rope_table"), &ops.prepare_step(&batch, 4).expect("prepare_step")).expect("rope");
        self.close(&ops.to_host(&gq).expect("to_host"), &c.to_host(&cq).expect("cpu"), 1e-5, "rope");

        // Queries and keys (fewer heads) rotated together.
        let kx = rng.signed_vec(rows * 2 * hd);
        let (c_table, c_step) = (c.rope_table(&table).expect("cpu"), c.prepare_step(&batch, 4).expect("cpu"));
        let (mut cq, mut ck) = (c.upload(rows, cols, &x).expect("cpu"), c.upload(rows, 2 * hd, &kx).expect("cpu"));
        c.rope_qk(&mut cq, &mut ck, &c_table, &c_step).expect("cpu");
        let (g_table, g_step) = (ops.rope_table(&table).expect("rope_table"), ops.prepare_step(&batch, 4).expect("prepare_step"));
        let (mut gq, mut gk) = (up(ops, &x), ops.upload(rows, 2 * hd, &kx).expect("upload"));
        ops.rope_qk(&mut gq, &mut gk, &g_table, &g_step).expect("rope_qk");
        self.close(&ops.to_host(&gq).expect("to_host"), &c.to_host(&cq).expect("cpu"), 1e-5, "rope_qk queries");
        self.close(&ops.to_host(&gk).expect("to_host"), &c.to_host(&ck).expect("cpu"), 1e-5, "rope_qk keys");

        // The residual add fused with the next norm: the residual exactly,
        // the norm within rounding.
        let w = rng.signed_vec(cols);
        let mut cres = c.upload(rows, cols, &x).expect("cpu");
        let cnorm = c.add_rms_norm(&mut cres, c.upload(rows, cols, &y).expect("cpu"), &c.vector("w", &w).expect("cpu"), 1e-5, cols);
        let mut gres = up(ops, &x);
        let gnorm = ops.add_rms_norm(&mut gres, up(ops, &y), &ops.vector("w", &w).expect("vector"), 1e-5, cols).expect("add_rms_norm");
        self.close(&ops.to_host(&gres).expect("to_host"), &c.to_host(&cres).expect("cpu"), 0.0, "add_rms_norm residual");
        self.close(&ops.to_host(&gnorm).expect("to_host"), &c.to_host(&cnorm.expect("cpu")).expect("cpu"), 1e-5, "add_rms_norm");

        let batch = ForwardBatch { logits_indices: vec![18, 0, 7, 7], ..one_sequence_batch(rows) };
        let want = c.to_host(&c.logits_rows(&cx, &c.prepare_step(&batch, 4).expect("cpu")).expect("cpu")).expect("cpu");
        let got = ops.logits_rows(&gx, &ops.prepare_step(&batch, 4).expect("prepare_step")).expect("logits_rows");
        self.close(&ops.to_host(&got).expect("to_host"), &want, 0.0, "logits_rows");
    }

    /// Operands whose shapes do not fit are errors, not panics.
    pub fn shape_mismatches_are_errors<O: HostIo>(&self, ops: &O) {
        let x = ops.upload(2, 3, &[0.0; 6]).expect("upload");
        let w = ops.linear_weight(WeightView::from_f32("w", vec![4, 5], &[0.0; 20])).expect("linear_weight");
        assert!(ops.linear(&x, &w, None).is_err(), "{}: linear of width 3 by a weight of width 5", self.name);
        let y = ops.upload(3, 2, &[0.0; 6]).expect("upload");
        assert!(ops.silu_mul(&x, &y).is_err(), "{}: silu_mul of [2, 3] and [3, 2]", self.name);
        let mut x2 = ops.upload(2, 3, &[0.0; 6]).expect("upload");
        assert!(ops.add_assign(&mut x2, &y).is_err(), "{}: add_assign of [2, 3] and [3, 2]", self.name);
        let v = ops.vector("w", &[1.0; 4]).expect("vector");
        assert!(ops.rms_norm(&x, &v, 1e-5, 3).is_err(), "{}: rms_norm of width 3 by 4 weights", self.name);
        assert!(ops.upload(2, 2, &[0.0; 3]).is_err(), "{}: upload of 3 values as [2, 2]", self.name);
    }

    /// Seeded random attention cases over what the backend declares it
    /// supports, and two long-context ones.
    pub fn paged_attention<O: HostIo>(&self, ops: &O) {
        let caps = ops.capabilities();
        let head_dims: Vec<usize> = [8usize, 32, 64, 128, 256].into_iter().filter(|&d| caps.head_dims.allows(d)).collect();
        let block_sizes: Vec<usize> = [1usize, 4, 8, 16, 32].into_iter().filter(|&b| caps.block_sizes.allows(b)).collect();
        assert!(!head_dims.is_empty() && !block_sizes.is_empty(), "{}: no head size or block size to test", self.name);
        // The smallest case first (one token in a block of one, where allowed:
        // it once caught the WGSL kernel), then seeded random ones.
        let smallest = AttnCase {
            block_size: block_sizes[0],
            kv_heads: 1,
            group: 1,
            head_dim: head_dims[0],
            seqs: vec![(1, 1)],
            shared_blocks: 0,
            window: None,
            softcap: None,
            seed: 91864,
        };
        for &dtype in caps.kv_dtypes {
            self.check_attention(ops, &smallest, dtype);
        }
        let mut rng = Rng::new(0x5eed);
        for i in 0..ATTENTION_CASES {
            let seqs = (0..1 + rng.below(5))
                .map(|_| {
                    let ctx = 1 + rng.below(89);
                    (ctx, if rng.below(2) == 0 { 1 } else { 1 + rng.below(ctx) })
                })
                .collect();
            let case = AttnCase {
                block_size: block_sizes[rng.below(block_sizes.len())],
                kv_heads: 1 + rng.below(3),
                group: 1 + rng.below(3),
                head_dim: head_dims[rng.below(head_dims.len())],
                seqs,
                shared_blocks: rng.below(4),
                window: (rng.below(4) == 0).then(|| 1 + rng.below(49)),
                softcap: (rng.below(4) == 0).then_some(20.0),
                seed: i as u64,
            };
            for &dtype in caps.kv_dtypes {
                self.check_attention(ops, &case, dtype);
            }
        }
        // A long context: ten key tiles of 64, the widest head, prefill and decode together.
        let head_dim = *head_dims.last().unwrap_or(&64);
        let block_size = if block_sizes.contains(&16) { 16 } else { block_sizes[0] };
        let long = AttnCase {
            block_size,
            kv_heads: 1,
            group: 4,
            head_dim,
            seqs: vec![(600, 1), (300, 120)],
            shared_blocks: 0,
            window: None,
            softcap: None,
            seed: 11,
        };
        for &dtype in caps.kv_dtypes {
            self.check_attention(ops, &long, dtype);
            self.check_attention(ops, &AttnCase { window: Some(100), ..long.clone() }, dtype);
        }
    }

    /// Block copies, then swaps out to host blocks and back into other
    /// device blocks, on every layer; a block outside the pool is an error.
    pub fn copy_blocks_and_swaps<O: HostIo>(&self, ops: &O) {
        let c = reference();
        let caps = ops.capabilities();
        let block_size = if caps.block_sizes.allows(4) { 4 } else { 8 };
        let head_dim = [8usize, 64, 128].into_iter().find(|&d| caps.head_dims.allows(d)).unwrap_or(64);
        for &dtype in caps.kv_dtypes {
            let spec = KvCacheSpec::uniform(3, 2, head_dim, block_size, dtype);
            let (num_blocks, host_blocks) = (8, 3);
            let row = spec.num_kv_heads * spec.head_dim;
            let mut rng = Rng::new(13);
            let mut cc = c.allocate_kv_cache(&spec, num_blocks, host_blocks).expect("cpu");
            let mut gc = ops.allocate_kv_cache(&spec, num_blocks, host_blocks).expect("allocate_kv_cache");
            let t = num_blocks * block_size;
            let batch = ForwardBatch {
                slot_mapping: (0..t as u32).collect(),
                block_tables: (0..num_blocks as u32).collect(),
                block_table_stride: num_blocks,
                ..one_sequence_batch(t)
            };
            let (cstep, gstep) =
                (c.prepare_step(&batch, block_size).expect("cpu"), ops.prepare_step(&batch, block_size).expect("prepare_step"));
            for l in 0..spec.num_slots() {
                let (k, v) = (rng.signed_vec(t * row), rng.signed_vec(t * row));
                c.write_kv(&mut cc, l, &c.upload(t, row, &k).expect("cpu"), &c.upload(t, row, &v).expect("cpu"), &cstep).expect("cpu");
                ops.write_kv(&mut gc, l, &ops.upload(t, row, &k).expect("upload"), &ops.upload(t, row, &v).expect("upload"), &gstep)
                    .expect("write_kv");
            }
            let copies = [BlockCopy { src: BlockId(1), dst: BlockId(6) }, BlockCopy { src: BlockId(5), dst: BlockId(0) }];
            c.copy_blocks(&mut cc, &copies).expect("cpu");
            ops.copy_blocks(&mut gc, &copies).expect("copy_blocks");
            let out = [BlockSwap { device: BlockId(4), host: HostBlockId(2) }, BlockSwap { device: BlockId(1), host: HostBlockId(0) }];
            let back = [BlockSwap { device: BlockId(7), host: HostBlockId(2) }, BlockSwap { device: BlockId(3), host: HostBlockId(0) }];
            for (swaps, to_host) in [(&out, true), (&back, false)] {
                c.swap_blocks(&mut cc, swaps, to_host).expect("cpu");
                ops.swap_blocks(&mut gc, swaps, to_host).expect("swap_blocks");
            }
            for l in 0..spec.num_slots() {
                for value in [false, true] {
                    let want = c.read_kv(&cc, l, value).expect("cpu");
                    let got = ops.read_kv(&gc, l, value).expect("read_kv");
                    self.close(&got, &want, pool_tolerance(dtype), &format!("{dtype:?} layer {l} {} pool", if value { "V" } else { "K" }));
                }
            }
            let bad = [BlockCopy { src: BlockId(99), dst: BlockId(0) }];
            assert!(ops.copy_blocks(&mut gc, &bad).is_err(), "{}: a block outside the pool is an error", self.name);
        }
    }

    /// Both backends: write the earlier context, then this step's K/V,
    /// then attend; compare the outputs and the pools.
    fn check_attention<O: HostIo>(&self, ops: &O, case: &AttnCase, dtype: KvCacheDtype) {
        let c = reference();
        let Built { num_blocks, early, late, q, kv_early: (ke, ve), kv_late: (kl, vl) } = case.build();
        let spec = KvCacheSpec::uniform(2, case.kv_heads, case.head_dim, case.block_size, dtype);
        let row = case.kv_heads * case.head_dim;
        let shape = case.shape();
        let mut cc = c.allocate_kv_cache(&spec, num_blocks, 0).expect("cpu");
        let mut gc =
            ops.allocate_kv_cache(&spec, num_blocks, 0).unwrap_or_else(|e| panic!("{}: allocate_kv_cache ({case:?}): {e}", self.name));
        let layer = 1;
        for (b, k, v) in [(&early, &ke, &ve), (&late, &kl, &vl)] {
            let t = b.num_tokens();
            if t == 0 {
                continue;
            }
            let cstep = c.prepare_step(b, case.block_size).expect("cpu");
            c.write_kv(&mut cc, layer, &c.upload(t, row, k).expect("cpu"), &c.upload(t, row, v).expect("cpu"), &cstep).expect("cpu");
            let step = ops.prepare_step(b, case.block_size).expect("prepare_step");
            ops.write_kv(&mut gc, layer, &ops.upload(t, row, k).expect("upload"), &ops.upload(t, row, v).expect("upload"), &step)
                .expect("write_kv");
        }
        let t = late.num_tokens();
        let cols = q.len() / t;
        let cstep = c.prepare_step(&late, case.block_size).expect("cpu");
        let want =
            c.to_host(&c.paged_attention(&cc, layer, &c.upload(t, cols, &q).expect("cpu"), &cstep, &shape).expect("cpu")).expect("cpu");
        let step = ops.prepare_step(&late, case.block_size).expect("prepare_step");
        let got = ops.paged_attention(&gc, layer, &ops.upload(t, cols, &q).expect("upload"), &step, &shape).expect("paged_attention");
        let stored = match dtype {
            KvCacheDtype::F32 => 1e-4,
            // One rounding of the type on |k|, |v| <= 1: the two backends may round a value differently.
            KvCacheDtype::F16 => 2.0 * (shape.scale * case.head_dim as f32 * 2f32.powi(-11)).exp_m1() + 2f32.powi(-10) + 1e-4,
            KvCacheDtype::Bf16 => 2.0 * (shape.scale * case.head_dim as f32 * 2f32.powi(-8)).exp_m1() + 2f32.powi(-7) + 1e-4,
            // Both round x · (1 / scale) to nearest even, so they store the
            // same codes (checked below) and differ only in the arithmetic.
            KvCacheDtype::Fp8E4m3 => 1e-4,
        };
        // A backend that attends a sequence on 16-bit matrix units rounds its
        // queries (each score moves by at most scale · d · u for |q|, |k| <= 1)
        // and attention weights (u each, against an unrounded sum) once more.
        let row_tols: Vec<f32> = case
            .seqs
            .iter()
            .flat_map(|&(_, q_len)| {
                let u = ops.attention_operand_dtype(dtype, q_len).unit_roundoff();
                std::iter::repeat_n(stored + 2.0 * (shape.scale * case.head_dim as f32 * u).exp_m1() + 2.0 * u, q_len)
            })
            .collect();
        let got = ops.to_host(&got).expect("to_host");
        let width = got.len() / row_tols.len().max(1);
        for (r, &tol) in row_tols.iter().enumerate() {
            let at = r * width..(r + 1) * width;
            self.close(&got[at.clone()], &want[at], tol, &format!("paged attention {dtype:?} ({case:?}), row {r}"));
        }
        for value in [false, true] {
            let (got, want) = (ops.read_kv(&gc, layer, value).expect("read_kv"), c.read_kv(&cc, layer, value).expect("cpu"));
            self.close(&got, &want, pool_tolerance(dtype), &format!("{} pool after attention ({case:?})", if value { "V" } else { "K" }));
        }
    }

    fn close(&self, got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{}: {what}: lengths differ", self.name);
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * w.abs().max(1.0),
                "{}: {what}: element {i}: {g}, the reference {w} (tolerance {tol})",
                self.name
            );
        }
    }
}

/// Random attention cases, each at every KV element type the backend takes.
const ATTENTION_CASES: usize = 24;

/// The reference: the CPU backend's float32 path.
fn reference() -> CpuOps {
    CpuOps::new(WeightFormat::F32)
}

/// `b`'s calibration pass over `built`'s keys and values (written to an f32
/// cache while calibrating), then an FP8 cache allocated after it, filled
/// with the same keys and values: the late step's attention output and
/// layer 1's K and V pools, read back with their scales.
fn fp8_after_calibration<B: HostIo>(b: &B, case: &AttnCase, built: &Built) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let spec = KvCacheSpec::uniform(2, case.kv_heads, case.head_dim, case.block_size, KvCacheDtype::F32);
    let row = case.kv_heads * case.head_dim;
    let layer = 1;
    let write = |cache: &mut B::KvCache| {
        for (batch, (k, v)) in [(&built.early, &built.kv_early), (&built.late, &built.kv_late)] {
            let t = batch.num_tokens();
            if t == 0 {
                continue;
            }
            let step = b.prepare_step(batch, case.block_size).expect("prepare_step");
            let (k, v) = (b.upload(t, row, k).expect("upload"), b.upload(t, row, v).expect("upload"));
            b.write_kv(cache, layer, &k, &v, &step).expect("write_kv");
        }
    };
    let mut scratch = b.allocate_kv_cache(&spec, built.num_blocks, 0).expect("allocate_kv_cache");
    b.set_calibrating(true);
    write(&mut scratch);
    b.set_calibrating(false);
    drop(scratch);
    let fp8 = KvCacheSpec { dtype: KvCacheDtype::Fp8E4m3, ..spec };
    let mut cache = b.allocate_kv_cache(&fp8, built.num_blocks, 0).expect("allocate_kv_cache");
    write(&mut cache);
    let t = built.late.num_tokens();
    let step = b.prepare_step(&built.late, case.block_size).expect("prepare_step");
    let q = b.upload(t, built.q.len() / t, &built.q).expect("upload");
    let out = b.paged_attention(&cache, layer, &q, &step, &case.shape()).expect("paged_attention");
    let (k, v) = (b.read_kv(&cache, layer, false).expect("read_kv"), b.read_kv(&cache, layer, true).expect("read_kv"));
    (b.to_host(&out).expect("to_host"), k, v)
}

/// Exact for f32 and FP8 (one rounding rule, the same codes); one rounding
/// step of bf16 (the coarser type) for the 16-bit types.
fn pool_tolerance(dtype: KvCacheDtype) -> f32 {
    match dtype {
        KvCacheDtype::F32 | KvCacheDtype::Fp8E4m3 => 0.0,
        KvCacheDtype::F16 | KvCacheDtype::Bf16 => 2f32.powi(-7),
    }
}

fn run_linear<O: HostIo>(ops: &O, w: &WeightView<'static>, m: usize, k: usize, x: &[f32], bias: &[f32]) -> Vec<f32> {
    let weight = ops.linear_weight(w.clone()).expect("linear_weight");
    let b = ops.vector("bias", bias).expect("vector");
    let y = ops.linear(&ops.upload(m, k, x).expect("upload"), &weight, Some(&b)).expect("linear");
    ops.to_host(&y).expect("to_host")
}

/// A weight `[n, k]` of file type `ty` (F32, F16, BF16, Q4_0, Q4_1, Q8_0)
/// with random contents, for a backend's own tests too.
pub fn random_weight(ty: GgmlType, n: usize, k: usize, rng: &mut Rng) -> WeightView<'static> {
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
                    other => panic!("the suite has no generator for {other:?}"),
                }
            }
        }
    }
    WeightView::new("w", vec![n, k], ty, bytes.into()).expect("whole blocks")
}

/// One sequence of `t` new tokens at positions 0.. (a prefill) in blocks
/// 0, 1, … of 4 tokens, for a backend's own tests too.
pub fn one_sequence_batch(t: usize) -> ForwardBatch {
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

/// A random mixed batch over a shuffled pool: per sequence (context after
/// the step, queries this step); sequence 1 shares its first full blocks
/// with sequence 0.
#[derive(Clone)]
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
    /// Two KV heads of two queries each at the first head and block sizes
    /// of a usual model the backend takes, over `seqs`, no window.
    fn small(caps: &vellum_base::Capabilities, seqs: Vec<(usize, usize)>, seed: u64) -> Self {
        Self {
            block_size: [16usize, 8, 4].into_iter().find(|&b| caps.block_sizes.allows(b)).unwrap_or(16),
            kv_heads: 2,
            group: 2,
            head_dim: [64usize, 128, 32, 8].into_iter().find(|&d| caps.head_dims.allows(d)).unwrap_or(64),
            seqs,
            shared_blocks: 0,
            window: None,
            softcap: None,
            seed,
        }
    }

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
            let mut b = ForwardBatch {
                block_tables: tables.clone(),
                block_table_stride: stride,
                query_start_loc: vec![0],
                num_kv_groups: 1,
                ..Default::default()
            };
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

#[cfg(test)]
mod tests {
    /// The CPU backend through the suite: its float32 path against itself
    /// checks the suite and the contract (errors on bad shapes, pools,
    /// swaps); its quantized paths are held by the golden prompts.
    #[test]
    fn the_cpu_float32_path_passes_the_suite() {
        super::Suite::new("cpu").run(&super::reference());
    }
}
