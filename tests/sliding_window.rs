//! A model whose every layer slides (Mistral-style) releases the KV blocks
//! that left the window, and generates exactly what it generates when every
//! block is kept: a tiny random-weight Mistral (window 6, block size 4) on
//! the CPU backend, several long greedy sequences batched through the paged
//! engine, with the manager releasing blocks and with a wrapper that hides
//! the window from it.

#[path = "../crates/models/tests/common/tiny_checkpoint.rs"]
mod tiny_checkpoint;

use vellum::backend_cpu::{CpuOps, WeightFormat};
use vellum::core::{BlockAllocator, ForwardBatch, KvCacheSize, KvMemory, ModelExecutor, SamplingParams, SchedulerConfig, StepOutput};
use vellum::engine::CpuExecutor;
use vellum::engine::EngineCore;
use vellum::models::{SafetensorsWeights, WeightSource};

const WINDOW: usize = 6;

/// The executor with its window hidden: the manager keeps every block.
struct KeepEveryBlock(CpuExecutor);

impl ModelExecutor for KeepEveryBlock {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        self.0.kv_block_bytes(block_size)
    }
    fn kv_memory(&self, block_size: usize) -> KvMemory {
        self.0.kv_memory(block_size)
    }
    fn num_kv_blocks(&self, size: KvCacheSize, block_size: usize) -> vellum::core::Result<usize> {
        self.0.num_kv_blocks(size, block_size)
    }
    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> vellum::core::Result<()> {
        self.0.initialize_kv_cache(num_blocks, num_host_blocks, block_size)
    }
    fn execute(&mut self, batch: &ForwardBatch) -> vellum::core::Result<StepOutput> {
        self.0.execute(batch)
    }
}

/// Greedy tokens and the most blocks in use at once.
fn generate<E: ModelExecutor>(exec: E, prompts: &[Vec<u32>], num_blocks: usize) -> (Vec<Vec<u32>>, usize) {
    let config = SchedulerConfig { max_model_len: 256, max_num_batched_tokens: 16, ..SchedulerConfig::default() };
    let mut e = EngineCore::new(exec, config, num_blocks, 0, 4, vec![]).expect("engine");
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(60) };
    for p in prompts {
        e.add_request(p.clone(), params.clone()).expect("accepted");
    }
    let (mut outs, mut peak) = (Vec::new(), 0);
    while e.has_unfinished_requests() {
        outs.extend(e.step().expect("step"));
        peak = peak.max(e.scheduler().allocator().stats().num_used_blocks);
    }
    outs.sort_by_key(|o| o.request_id);
    assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0, "every block returned");
    (outs.into_iter().map(|o| o.outputs[0].token_ids.clone()).collect(), peak)
}

#[test]
fn released_window_blocks_change_no_token_and_bound_memory() {
    let dir = std::env::temp_dir().join(format!("vellum-sliding-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    tiny_checkpoint::write_tiny_hf_dir(&dir, &tiny_checkpoint::tiny_tensors());
    let config = tiny_checkpoint::TINY_CONFIG_JSON
        .replace(
            r#""architectures": ["LlamaForCausalLM"], "model_type": "llama""#,
            r#""architectures": ["MistralForCausalLM"], "model_type": "mistral""#,
        )
        .replace(r#""torch_dtype""#, &format!(r#""sliding_window": {WINDOW}, "torch_dtype""#));
    std::fs::write(dir.join("config.json"), config).unwrap();
    let weights = SafetensorsWeights::open(&dir).expect("opens");
    let load = || {
        let config = weights.model_config().expect("config");
        CpuExecutor::load(CpuOps::new(WeightFormat::F32), &weights, config, |_, _| {}).expect("loads")
    };
    let exec = load();
    assert_eq!(exec.kv_group_windows(), vec![Some(WINDOW)]);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| (0..(5 + 7 * i)).map(|t| ((t * 7 + i) % 29 + 3) as u32).collect()).collect();
    // 16 blocks: released blocks are reused by the other sequences within
    // a few steps, so a stale read would show in the tokens.
    let (released, peak_released) = generate(exec, &prompts, 16);
    let (kept, peak_kept) = generate(KeepEveryBlock(load()), &prompts, 128);
    assert_eq!(released, kept, "releasing out-of-window blocks changed the tokens");
    assert!(released.iter().all(|t| t.len() == 60));
    // Kept: the whole context (up to 86 tokens = 22 blocks per sequence).
    // Released: about window / block size + 2 blocks per sequence.
    eprintln!("peak blocks in use: {peak_released} released vs {peak_kept} kept");
    assert!(peak_kept >= 4 * 16, "{peak_kept}");
    assert!(peak_released <= 16, "{peak_released}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model that mixes a sliding-window layer and a global layer (Qwen-style
/// `layer_types`): with a block table per KV-cache group, the local layer's
/// blocks that slid out are released while the global layer keeps every
/// block; the tokens equal those of one table that keeps everything
/// (`with_hybrid_kv_cache(false)`, vLLM's --disable-hybrid-kv-cache-manager),
/// in less memory.
#[test]
fn kv_cache_groups_change_no_token_and_free_local_blocks() {
    let dir = std::env::temp_dir().join(format!("vellum-hybrid-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    tiny_checkpoint::write_tiny_hf_dir(&dir, &tiny_checkpoint::tiny_tensors());
    let config = tiny_checkpoint::TINY_CONFIG_JSON.replace(
        r#""torch_dtype""#,
        &format!(r#""sliding_window": {WINDOW}, "layer_types": ["sliding_attention", "full_attention"], "torch_dtype""#),
    );
    std::fs::write(dir.join("config.json"), config).unwrap();
    let weights = SafetensorsWeights::open(&dir).expect("opens");
    let load = |hybrid: bool| {
        let config = weights.model_config().expect("config");
        CpuExecutor::load(CpuOps::new(WeightFormat::F32), &weights, config, |_, _| {}).expect("loads").with_hybrid_kv_cache(hybrid)
    };
    let (hybrid, single) = (load(true), load(false));
    assert_eq!(hybrid.kv_group_windows(), vec![None, Some(WINDOW)]);
    assert_eq!(single.kv_group_windows(), vec![None]);
    let (hybrid_bytes, single_bytes) = (hybrid.kv_block_bytes(4), single.kv_block_bytes(4));
    assert_eq!(single_bytes, 2 * hybrid_bytes, "a hybrid block holds one layer of its group");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| (0..(5 + 7 * i)).map(|t| ((t * 5 + i) % 29 + 3) as u32).collect()).collect();
    // 4 sequences of up to 86 tokens: 22 global blocks + about 4 local ones
    // each; a pool barely above that makes released blocks come back fast.
    let (grouped, peak_grouped) = generate(hybrid, &prompts, 4 * 27);
    let (kept, peak_kept) = generate(single, &prompts, 128);
    assert_eq!(grouped, kept, "KV-cache groups changed the tokens");
    let (grouped_mem, kept_mem) = (peak_grouped as u64 * hybrid_bytes, peak_kept as u64 * single_bytes);
    eprintln!("peak KV bytes: {grouped_mem} with groups vs {kept_mem} with one table");
    assert!(grouped_mem * 10 < kept_mem * 7, "{grouped_mem} vs {kept_mem}");
    let _ = std::fs::remove_dir_all(&dir);
}
