//! Tensor parallelism on the CPU (`--tensor-parallel-size N`, ranks as
//! threads meeting in an in-process all-reduce): the same model split over
//! N ranks computes what it computes whole, on the golden prompts of both
//! real models, where the heads divide (SmolLM2: 9 query and 3 KV heads,
//! N = 3; Gemma 3 270M: 4 query heads and 1 KV head, replicated, N = 2
//! and 4).
//!
//! The bound is float32 rounding: on the float32 path
//! (`--cpu-precision float32`) the only change is the order in which a
//! row-parallel linear's partial sums are added, so greedy tokens must be
//! the same and every top-5 logprob within 1e-4 of the whole model's.

use serde::Deserialize;
use vellum::core::{BlockAllocator, KvCacheSize, SamplingParams, SchedulerConfig};
use vellum::engine::{CpuPrecision, EngineArgs, Llm};

#[derive(Deserialize)]
struct Golden {
    prompt_ids: Vec<u32>,
}

fn golden_prompts(file: &str) -> Vec<Vec<u32>> {
    let dir = std::env::var("VELLUM_GOLDEN_DIR").unwrap_or_else(|_| format!("{}/../shared/golden", env!("CARGO_MANIFEST_DIR")));
    let path = format!("{dir}/{file}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let cases: Vec<Golden> = serde_json::from_str(&text).expect("golden file parses");
    cases.into_iter().map(|c| c.prompt_ids).collect()
}

/// Greedy tokens and, per position, the top-5 (token, logprob).
type Greedy = (Vec<u32>, Vec<Vec<(u32, f32)>>);

fn engine(model: Option<&str>, tp: usize, budget: usize) -> Llm {
    Llm::new(EngineArgs {
        model: model.map(str::to_string),
        cpu_precision: CpuPrecision::Float32,
        kv_cache: KvCacheSize::MemoryBytes(256 << 20),
        scheduler: SchedulerConfig { max_num_batched_tokens: budget, max_model_len: 2048, ..SchedulerConfig::default() },
        tensor_parallel_size: tp,
        ..EngineArgs::default()
    })
    .unwrap_or_else(|e| panic!("{model:?} loads at --tensor-parallel-size {tp}: {e}"))
}

fn run(llm: &mut Llm, prompts: &[Vec<u32>], tokens: usize) -> Vec<Greedy> {
    let params = SamplingParams { logprobs: Some(5), ..SamplingParams::greedy(tokens) };
    let outs = llm.generate_ids(prompts, &params).expect("generation runs");
    let st = llm.engine().scheduler().allocator().stats();
    assert_eq!(st.num_used_blocks, 0, "every block is returned");
    outs.into_iter().map(|o| (o.outputs[0].token_ids.clone(), o.outputs[0].logprobs.clone())).collect()
}

/// Same greedy tokens; every logprob of a top-5 token both sides list
/// within `bound`; returns the largest difference.
fn assert_same(whole: &[Greedy], split: &[Greedy], what: &str, bound: f32) -> f32 {
    let mut worst = 0f32;
    assert_eq!(whole.len(), split.len(), "{what}: outputs");
    for (i, (a, b)) in whole.iter().zip(split).enumerate() {
        assert_eq!(a.0, b.0, "{what}: prompt {i}: greedy tokens differ");
        assert_eq!(a.1.len(), b.1.len(), "{what}: prompt {i}: logprob positions");
        for (j, (p, q)) in a.1.iter().zip(&b.1).enumerate() {
            // Near-ties may swap places in the top-5; a token both list must agree.
            for (token, lp) in p {
                if let Some((_, other)) = q.iter().find(|(t, _)| t == token) {
                    let d = (lp - other).abs();
                    worst = worst.max(d);
                    assert!(d <= bound, "{what}: prompt {i} step {j} token {token}: logprob {lp} whole, {other} split (|Δ| {d})");
                }
            }
            assert!(q.iter().any(|(t, _)| *t == p[0].0), "{what}: prompt {i} step {j}: the top token is in the split model's top-5");
        }
    }
    worst
}

/// SmolLM2-135M (the default model) at TP 3: 3 query heads and 1 KV head per
/// rank, vocabulary 49,152 in three shards.
#[test]
fn smollm2_at_tp3_computes_what_it_computes_whole_on_the_golden_prompts() {
    let prompts = golden_prompts("smollm2-135m-instruct-q4_1.json");
    let whole = run(&mut engine(None, 1, 512), &prompts, 16);
    let split = run(&mut engine(None, 3, 512), &prompts, 16);
    let worst = assert_same(&whole, &split, "SmolLM2 TP 3", 1e-4);
    eprintln!("SmolLM2 TP 3 vs TP 1: same greedy tokens, largest logprob difference {worst:.2e}");
}

/// Gemma 3 270M at TP 2 and 4: its one KV head replicated on every rank,
/// its sliding-window and global layers in KV-cache groups; the 828-token
/// prompt decodes past the 512-token window.
#[test]
fn gemma3_at_tp2_and_tp4_computes_what_it_computes_whole_on_the_golden_prompts() {
    let prompts = golden_prompts("gemma3-270m-q4_k_m.json");
    let whole = run(&mut engine(Some("gemma3-270m"), 1, 512), &prompts, 16);
    for tp in [2, 4] {
        let split = run(&mut engine(Some("gemma3-270m"), tp, 512), &prompts, 16);
        let worst = assert_same(&whole, &split, &format!("Gemma 3 TP {tp}"), 1e-4);
        eprintln!("Gemma 3 TP {tp} vs TP 1: same greedy tokens, largest logprob difference {worst:.2e}");
    }
}

/// The per-rank KV caches follow the one block manager: chunked prefill
/// (a 23-token budget), a prefix-cache hit, and parallel samples that fork
/// and copy a shared last block on write give the whole model's results.
#[test]
fn chunked_prefill_prefix_hits_and_forked_samples_at_tp3_match_one_rank() {
    let prompts = golden_prompts("smollm2-135m-instruct-q4_1.json");
    let long: Vec<u32> = prompts.iter().flatten().copied().take(150).collect();
    let mut whole = engine(None, 1, 23);
    let mut split = engine(None, 3, 23);
    let a = run(&mut whole, std::slice::from_ref(&long), 8);
    let hits = split.engine().scheduler().allocator().stats().prefix_cache_hits;
    let b = run(&mut split, std::slice::from_ref(&long), 8);
    assert_same(&a, &b, "chunked prefill", 1e-4);
    // Again: the full blocks now come from the prefix cache.
    let c = run(&mut split, std::slice::from_ref(&long), 8);
    assert!(split.engine().scheduler().allocator().stats().prefix_cache_hits >= hits + 144, "9 blocks hit");
    assert_same(&a, &c, "prefix-cache hit", 1e-4);
    // n = 3 seeded samples fork the sequence: same seeds, same tokens.
    let params = SamplingParams { n: 3, temperature: 0.8, seed: Some(7), ..SamplingParams::greedy(8) };
    let one = whole.generate_ids(std::slice::from_ref(&long), &params).expect("samples");
    let three = split.generate_ids(std::slice::from_ref(&long), &params).expect("samples");
    let ids = |o: &[vellum::engine::RequestOutput]| o[0].outputs.iter().map(|s| s.token_ids.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&one), ids(&three), "forked samples");
    assert_eq!(split.engine().scheduler().allocator().stats().num_used_blocks, 0);
}

/// Sizes that do not split the model are refused before any weight is read,
/// naming what does not divide.
#[test]
fn a_size_that_does_not_divide_the_heads_is_a_clear_error() {
    for (tp, what) in [(2, "does not divide the model's 9 attention heads"), (0, "at least 1")] {
        let e = Llm::new(EngineArgs { tensor_parallel_size: tp, ..EngineArgs::default() }).err().expect("refused").to_string();
        assert!(e.contains(what), "TP {tp}: {e}");
    }
}

/// Preemption under a cache too small for the load, by swapping blocks to
/// host memory and back (every rank swaps its own heads' part of each
/// block) and by recomputing: the split model's tokens and logprobs are the
/// whole model's under the same schedule.
#[test]
fn preemption_by_swap_and_recompute_at_tp3_matches_one_rank() {
    let prompts: Vec<Vec<u32>> = golden_prompts("smollm2-135m-instruct-q4_1.json")
        .iter()
        .cycle()
        .take(4)
        .enumerate()
        .map(|(k, p)| p.iter().copied().chain((0..40).map(|i| 300 + (i * 37 + k as u32 * 11) % 5000)).take(40).collect())
        .collect();
    for mode in [vellum::core::PreemptionMode::Swap, vellum::core::PreemptionMode::Recompute] {
        let tight = |tp: usize| {
            Llm::new(EngineArgs {
                cpu_precision: CpuPrecision::Float32,
                // Four sequences of 64 tokens need 16 blocks; they get 10.
                kv_cache: KvCacheSize::NumBlocks(10),
                swap_space_bytes: 64 << 20,
                scheduler: SchedulerConfig {
                    max_num_batched_tokens: 256,
                    max_model_len: 256,
                    preemption_mode: mode,
                    ..SchedulerConfig::default()
                },
                tensor_parallel_size: tp,
                ..EngineArgs::default()
            })
            .expect("loads")
        };
        let (mut whole, mut split) = (tight(1), tight(3));
        let a = run(&mut whole, &prompts, 24);
        let b = run(&mut split, &prompts, 24);
        assert!(split.engine().queue_stats().num_preemptions > 0, "{mode:?}: the load did preempt");
        assert_eq!(whole.engine().queue_stats().num_preemptions, split.engine().queue_stats().num_preemptions, "{mode:?}: same schedule");
        assert_same(&a, &b, &format!("{mode:?} preemption"), 1e-4);
    }
}

/// The WGSL backend has no collective: a group there is refused by name.
#[cfg(feature = "wgpu")]
#[test]
fn tensor_parallelism_on_wgpu_is_refused_by_name() {
    let e = Llm::new(EngineArgs { device: vellum::engine::Device::Wgpu, tensor_parallel_size: 3, ..EngineArgs::default() })
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("runs on --device cpu and --device cuda"), "{e}");
}

/// Embeddings (`--task embed`): the pooled final hidden states, which every
/// rank holds alike after the last all-reduce, are the whole model's.
#[test]
fn embeddings_at_tp3_are_the_whole_models() {
    let embedder = |tp: usize| {
        Llm::new(EngineArgs {
            cpu_precision: CpuPrecision::Float32,
            task: vellum::engine::Task::Embed,
            kv_cache: KvCacheSize::MemoryBytes(64 << 20),
            tensor_parallel_size: tp,
            ..EngineArgs::default()
        })
        .expect("loads for embeddings")
    };
    let texts = ["Paged attention stores the KV cache in blocks.", "A second, longer sentence about tensor parallelism and NCCL."];
    let whole = embedder(1).embed(&texts, None).expect("embeds");
    let split = embedder(3).embed(&texts, None).expect("embeds");
    for (a, b) in whole.iter().zip(&split) {
        assert_eq!(a.len(), b.len());
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "normalized vectors differ by up to {worst}");
    }
}

/// A step that fails on the ranks (here a token id outside the vocabulary,
/// which every rank refuses before any all-reduce) fails its requests, and
/// the group serves the next ones: the ranks' group is reset once they have
/// all left the step.
#[test]
fn a_failed_step_fails_its_requests_and_the_group_serves_the_next() {
    let mut split = engine(None, 3, 512);
    let vocab = split.tokenizer().vocab_size() as u32;
    let bad = split.generate_ids(&[vec![1, 2, vocab + 7]], &SamplingParams::greedy(4));
    let failed = match &bad {
        Err(e) => e.to_string(),
        Ok(outs) => format!("{:?}", outs[0].outputs[0].finish_reason),
    };
    assert!(bad.is_err() || failed.contains("Abort"), "the bad request fails: {failed}");
    let prompts = golden_prompts("smollm2-135m-instruct-q4_1.json");
    let whole = run(&mut engine(None, 1, 512), &prompts[..2], 8);
    let after = run(&mut split, &prompts[..2], 8);
    assert_same(&whole, &after, "after a failed step", 1e-4);
}
