//! Accuracy cost of a half-precision KV cache on the real default model:
//! greedy decoding of SmolLM2-135M-Instruct (Q4_1 GGUF) with the cache stored
//! as `f32`, `f16` and `bf16`, against the independent float64 reference of
//! `shared/golden/` (the engine-level golden test is `tests/golden.rs`).
//!
//! The model is driven directly through `ModelRunner::<CpuOps>::execute` with
//! hand-built batches — one sequence at a time, a prefill then one decode per
//! step, blocks `0..n` as its block table — so this test needs neither the
//! engine nor the scheduler.
//!
//! Rule (vLLM's model tests, as the golden README states): walk the
//! positions; where both pick the same token its logprob must be within
//! tolerance of the reference; at the first position where the tokens
//! differ, each side's token must be in the other's top-5, and the
//! comparison of that prompt stops there.

use serde_json::Value;
use vellum_backend_cpu::{ActBits, CpuOps};
use vellum_base::{ForwardBatch, KvCacheDtype, ModelExecutor};
use vellum_models::ModelRunner;

const BLOCK_SIZE: usize = 16;
const NUM_BLOCKS: usize = 16;

/// `f32` cache: the tolerance of `tests/golden.rs` (float32 accumulation
/// drifts a little over 30 layers).
const F32_TOLERANCE: f64 = 0.02;

/// Half-precision caches: measured on the 9 golden prompts (x86-64, this
/// kernel), the largest |Δlogprob| on agreeing tokens was 0.0032 nats with
/// an `f16` cache and 0.0242 with `bf16` (`f32`: below 5e-5), and all three
/// agreed with the reference on all 141 greedy tokens. The tolerances give
/// about 3× (`f16`) and 2× (`bf16`) margin. `f16` keeps 11 significant bits;
/// `bf16` keeps 8, and its error is plainly visible.
const F16_TOLERANCE: f64 = 0.01;
const BF16_TOLERANCE: f64 = 0.05;

struct Golden {
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    /// Per step: the reference's top-5 `(token, logprob)`, best first.
    top_logprobs: Vec<Vec<(u32, f64)>>,
}

fn golden() -> Vec<Golden> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden/smollm2-135m-instruct-q4_1.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let json: Value = serde_json::from_str(&text).expect("golden file parses");
    let ids =
        |v: &Value| -> Vec<u32> { v.as_array().expect("an id list").iter().map(|x| x.as_u64().expect("a token id") as u32).collect() };
    json.as_array()
        .expect("a list of prompts")
        .iter()
        .map(|c| Golden {
            prompt_ids: ids(&c["prompt_ids"]),
            greedy_ids: ids(&c["greedy_ids"]),
            top_logprobs: c["top_logprobs"]
                .as_array()
                .expect("top_logprobs")
                .iter()
                .map(|step| {
                    step.as_array()
                        .expect("a step")
                        .iter()
                        .map(|p| (p[0].as_u64().expect("a token id") as u32, p[1].as_f64().expect("a logprob")))
                        .collect()
                })
                .collect(),
        })
        .collect()
}

/// One step of one sequence: `tokens` at positions `start..`, blocks
/// `0..NUM_BLOCKS` as its table (slot = position), logits of the last row.
fn batch(tokens: &[u32], start: usize) -> ForwardBatch {
    let n = tokens.len();
    let end = start + n;
    assert!(end <= NUM_BLOCKS * BLOCK_SIZE, "sequence of {end} tokens outgrows the cache");
    ForwardBatch {
        token_ids: tokens.to_vec(),
        positions: (start as u32..end as u32).collect(),
        slot_mapping: (start as u32..end as u32).collect(),
        query_start_loc: vec![0, n as u32],
        context_lens: vec![end as u32],
        block_tables: (0..NUM_BLOCKS as u32).collect(),
        block_table_stride: NUM_BLOCKS,
        num_kv_groups: 1,
        logits_indices: vec![n as u32 - 1],
        block_ops: Default::default(),
        argmax_only: false,
        hidden_states: false,
        ..ForwardBatch::default()
    }
}

/// Log-softmax of one row of logits, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// The 5 most likely tokens, best first.
fn top5(lp: &[f64]) -> Vec<(u32, f64)> {
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
    idx.into_iter().take(5).map(|i| (i as u32, lp[i])).collect()
}

/// What one dtype scored on one prompt.
struct PromptResult {
    agreed: usize,
    worst: f64,
}

/// Greedy decoding of one prompt, compared step by step with the reference.
fn compare(exec: &mut ModelRunner<CpuOps>, c: &Golden, dtype: KvCacheDtype, i: usize) -> PromptResult {
    let mut out = exec.execute(&batch(&c.prompt_ids, 0)).expect("prefill runs");
    let mut pos = c.prompt_ids.len();
    let (mut agreed, mut worst) = (0, 0.0f64);
    for (j, (&r, ref_top)) in c.greedy_ids.iter().zip(&c.top_logprobs).enumerate() {
        assert_eq!(out.logits.len(), out.vocab_size, "one row of logits");
        let lp = log_softmax(&out.logits);
        let our_top = top5(&lp);
        let t = our_top[0].0;
        if t != r {
            assert!(
                ref_top.iter().any(|x| x.0 == t),
                "{dtype:?} prompt {i} step {j}: our token {t} not in the reference top-5 {ref_top:?}"
            );
            assert!(our_top.iter().any(|x| x.0 == r), "{dtype:?} prompt {i} step {j}: reference token {r} not in our top-5 {our_top:?}");
            break;
        }
        worst = worst.max((lp[t as usize] - ref_top[0].1).abs());
        agreed += 1;
        if j + 1 < c.greedy_ids.len() {
            out = exec.execute(&batch(&[t], pos)).expect("decode runs");
            pos += 1;
        }
    }
    PromptResult { agreed, worst }
}

#[test]
fn kv_cache_dtypes_against_the_float64_reference() {
    let cases = golden();
    let loaded = vellum_models::resolve_model(None)
        .map_err(vellum_models::Error::from)
        .and_then(|m| vellum_models::LoadedModel::open(&m))
        .expect("the default model loads");
    let mut table = Vec::new();
    for (dtype, tolerance) in [(KvCacheDtype::F32, F32_TOLERANCE), (KvCacheDtype::F16, F16_TOLERANCE), (KvCacheDtype::Bf16, BF16_TOLERANCE)]
    {
        // int16 activations: the KV dtype's drift is judged by the float32
        // rule, which the int8 default path is not held to.
        let ops = CpuOps::default().with_activations(ActBits::I16);
        let mut exec = ModelRunner::load(ops, &*loaded.weights, loaded.config.clone(), |_, _| {})
            .expect("the weights load")
            .with_kv_cache_dtype(dtype);
        exec.initialize_kv_cache(NUM_BLOCKS, 0, BLOCK_SIZE).expect("the cache allocates");
        let (mut worst, mut agreed, mut total) = (0.0f64, 0, 0);
        let mut per_prompt = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let r = compare(&mut exec, c, dtype, i);
            worst = worst.max(r.worst);
            agreed += r.agreed;
            total += c.greedy_ids.len();
            per_prompt.push(r.agreed);
            // The reference's top-1 margin is at least 0.05 nats over the
            // first 8 steps except on prompt 2, step 5 (golden README): every
            // cache type must agree that far. (Past a near-tie, a rounding
            // difference of a half-precision cache may pick the other token
            // and the rest of the prompt diverges: bf16 does at that step of
            // prompt 2 since the attention's multiply-adds are fused.)
            let needed = if i == 2 { 5 } else { 8.min(c.greedy_ids.len()) };
            assert!(r.agreed >= needed, "{dtype:?} prompt {i}: only {} tokens agree (need {needed})", r.agreed);
        }
        eprintln!(
            "{dtype:?}: max |Δlogprob| {worst:.2e} nats on agreeing tokens; {agreed}/{total} tokens agree; per prompt {per_prompt:?}"
        );
        table.push((dtype, worst, agreed, total));
        assert!(worst <= tolerance, "{dtype:?}: largest logprob difference {worst:.4} nats exceeds {tolerance}");
    }
    // A half-precision cache must not lose whole stretches of agreement
    // beyond the near-tie above: measured, f16 agrees on all 141 tokens as
    // f32 does and bf16 on 130 (prompt 2 parts at its step 5); allow that
    // prompt's 11 and a few more.
    let f32_agreed = table[0].2;
    for &(dtype, _, agreed, _) in &table[1..] {
        assert!(agreed + 16 >= f32_agreed, "{dtype:?}: {agreed} agreeing tokens, f32 has {f32_agreed}");
    }
}
