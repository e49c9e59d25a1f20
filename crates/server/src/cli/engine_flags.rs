//! The engine's flags, declared once and flattened into every subcommand
//! that builds an engine (`serve`, `generate`, `chat`, `bench throughput`,
//! `bench latency`), named and defaulted like vLLM's.

use anyhow::{anyhow, bail, Result};
use clap::Args;
use vellum_base::{
    CompilationConfig, CudaGraphMode, KvCacheDtype, KvCacheSize, PreemptionMode, SchedulerConfig, SchedulingPolicy, SpeculativeConfig,
    WeightCopies,
};
use vellum_engine::{ComputeDtype, CpuPrecision, CudaGraphs, Device, EngineArgs, PoolerConfig, Task};

/// Engine options shared by every subcommand that loads a model.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Engine options")]
pub struct EngineFlags {
    /// Where the model runs: cpu, wgpu (Vulkan/Metal/DX12; build with
    /// `--features wgpu`) or cuda (`--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Longest prompt + output in tokens (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most sequences running in one engine step (default 256; bench
    /// latency: its batch size).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget of one engine step (default 2048; `serve` on the CPU
    /// 1024; bench latency: the whole batch's prompts). Left out, `serve` on
    /// a GPU also caps a step's prompt tokens by the model's size (512 for
    /// an 8B model; docs/serving.md).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size: bytes with a unit (`512MiB`, `4GiB`) or a fraction of
    /// the memory the device has free once the weights are loaded (`0.5`).
    /// Default on the CPU and wgpu: what --max-num-seqs × --max-model-len
    /// can use, at most 4 GiB and half the free memory.
    #[arg(long, conflicts_with = "gpu_memory_utilization")]
    pub kv_cache_memory: Option<String>,
    /// Fraction of the GPU's memory for weights, activations (measured by a
    /// profile run of --max-num-batched-tokens) and the KV cache together
    /// (vLLM's flag; `--device cuda` only; default 0.9 there).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f32>,
    /// Element type of the KV cache: auto (bfloat16 where --dtype is bfloat16
    /// on --device cuda, float16 on the CPU's default int8 path, float32
    /// otherwise), float32, float16, bfloat16, fp8 (fp8_e4m3: a byte an
    /// element, each layer's keys and values divided by scales a
    /// calibration pass takes at start; every --device).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// GiB of host memory for KV blocks swapped out by `--preemption-mode
    /// swap` (vLLM's --swap-space; reserved only in swap mode).
    #[arg(long, default_value_t = 4.0)]
    pub swap_space: f64,
    /// Reuse the KV blocks of shared prompt prefixes (on by default).
    #[arg(long, default_value_t = true, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn automatic prefix caching off.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Keep one block table and every KV block for models that mix
    /// sliding-window and global layers (Gemma 3), instead of a block table
    /// per layer group that frees the local layers' blocks as they slide out.
    #[arg(long)]
    pub disable_hybrid_kv_cache_manager: bool,
    /// Split long prompts across steps and mix them with decodes (on by
    /// default; vLLM's flag).
    #[arg(long, default_value_t = true, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,
    /// Compute each prompt in one step (needs --max-num-batched-tokens of at
    /// least --max-model-len).
    #[arg(long, overrides_with = "enable_chunked_prefill")]
    pub no_enable_chunked_prefill: bool,
    /// Most tokens one prompt takes in a step (vLLM's flag; 0: only the
    /// step budget). Lower values keep a long prompt from stretching the
    /// decode steps beside it, at the cost of its time to first token.
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// fcfs, two-level (thesis §4.5.3) or priority (lower `priority` first).
    #[arg(long, default_value = "fcfs")]
    pub scheduling_policy: String,
    /// recompute or swap.
    #[arg(long, default_value = "recompute")]
    pub preemption_mode: String,
    /// CPU backend: int8 (the file's blocks × int8 activations as llama.cpp,
    /// each weight's outlier channels in f32: closer to float64 than
    /// llama.cpp), int16 (× int16 activations: within 0.002 nats of
    /// float64, slower in batches) or float32 (every weight widened: the
    /// reference).
    #[arg(long, default_value = "int8")]
    pub cpu_precision: String,
    /// What a GPU multiplies in (vLLM's flag): auto (bfloat16 on --device
    /// cuda: tensor cores, activations rounded to bfloat16, f32
    /// accumulation; float32 on wgpu), bfloat16, or float32 (f32 arithmetic
    /// throughout, the reference path).
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Speculative decoding, as vLLM's JSON: `{"method": "ngram",
    /// "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    /// "prompt_lookup_min": 2}` (prompt lookup, no extra model) or
    /// `{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}`
    /// (a smaller model with the same tokenizer). Same tokens as without it.
    #[arg(long)]
    pub speculative_config: Option<String>,
    /// What the engine serves (vLLM's flag): generate (completions, chat),
    /// embed (`/v1/embeddings`: prompts pooled into vectors), or auto (embed
    /// for a checkpoint that declares itself an embedding model — a base
    /// model without LM head, or a sentence-transformers pooling
    /// configuration — else generate).
    #[arg(long, default_value = "auto", value_parser = ["auto", "generate", "embed"])]
    pub task: String,
    /// An embedding model's pooling over what its checkpoint declares, as
    /// vLLM's JSON: `{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize":
    /// true|false}` (default: the checkpoint's sentence-transformers
    /// configuration, else LAST and normalized).
    #[arg(long)]
    pub pooler_config: Option<String>,
    /// Split the model over N ranks (vLLM's flag): each holds its
    /// share of every layer's attention heads and MLP and of the
    /// vocabulary, with an all-reduce after each row-parallel linear; one
    /// scheduler and KV cache for all. On --device cpu the ranks are
    /// threads of this process; N must divide the attention heads and the
    /// MLP width (fewer KV heads than N are replicated).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Launch every op of every step on --device cuda (vLLM's flag): no CUDA
    /// graphs. By default a decode step (one new token per sequence) is
    /// padded to a capture size and replayed from a graph recorded at start.
    #[arg(long)]
    pub enforce_eager: bool,
    /// The token counts steps are padded to and recorded at on --device
    /// cuda (vLLM's flag), comma-separated; default 1, 2, 4, then every
    /// multiple of 8 up to 512. A larger step runs eagerly.
    #[arg(long, value_delimiter = ',')]
    pub cuda_graph_sizes: Option<Vec<usize>>,
    /// vLLM's JSON for which steps --device cuda records as CUDA graphs:
    /// `{"cudagraph_mode": "FULL_DECODE_ONLY"}` (the default: uniform decode
    /// steps), `"FULL"` (mixed steps too: prompt chunks beside decodes and
    /// speculative verifications, each recorded once its shape has recurred)
    /// or `"NONE"`; `cudagraph_capture_sizes` and
    /// `max_cudagraph_capture_size` as vLLM's. Its torch.compile keys are
    /// accepted and ignored, with a warning.
    #[arg(long)]
    pub compilation_config: Option<String>,
    /// Which quantized linear weights --device cuda also keeps as bf16 for
    /// cuBLAS: auto (while the copies fit in a quarter of the GPU and leave
    /// half of it free), all, or
    /// none. A batch of 3+ rows then multiplies the copy instead of
    /// dequantizing the weight for every product (0.39–0.61× the time at
    /// 4–256 rows on an H100, Llama 3 8B's Q8_0 FFN weights); two bytes a
    /// weight that the KV cache does not get.
    #[arg(long, default_value = "auto", value_parser = ["auto", "all", "none"])]
    pub cuda_bf16_weight_copies: String,
    /// Schedule the next step while the current one runs (vLLM's flag):
    /// a helper thread schedules and builds the next batch while the engine
    /// thread runs the forward pass; a token still being sampled is filled
    /// in just before that batch runs. Same outputs; it pays where the
    /// device leaves the host idle (--device cuda), not on the CPU (13–14%
    /// slower at 1–8 sequences there). Ignored with --speculative-config.
    #[arg(long)]
    pub async_scheduling: bool,
}

/// What a subcommand would pick for the flags a user left out.
#[derive(Clone, Copy, Debug)]
pub struct EngineDefaults {
    /// `--max-num-seqs`.
    pub max_num_seqs: usize,
    /// `--max-num-batched-tokens`.
    pub max_num_batched_tokens: usize,
    /// `--max-model-len` (the model's context caps it).
    pub max_model_len: usize,
    /// Without `--max-num-batched-tokens`: the FLOPs a step's prompt tokens
    /// may take, from which the engine picks a prefill budget once the model
    /// is known (`EngineArgs::step_flop_budget`; the step's budget stays the
    /// one above); `None`: no prefill budget of its own.
    pub step_flop_budget: Option<f64>,
}

impl Default for EngineDefaults {
    fn default() -> Self {
        Self { max_num_seqs: 256, max_num_batched_tokens: 2048, max_model_len: usize::MAX / 4, step_flop_budget: None }
    }
}

impl EngineDefaults {
    /// `vellum serve`'s defaults for `device`: on the CPU a step budget of
    /// [`CPU_SERVING_BATCHED_TOKENS`] instead of 2048.
    ///
    /// A GPU needs large steps to turn memory-bound into compute-bound work;
    /// two CPU cores are compute-bound from a few rows on, and prefill runs
    /// as fast in steps of 512 tokens as of 8,192 (docs/benchmarks.md). A
    /// smaller step lets the first requests of a burst finish their prefill
    /// sooner: 64 concurrent clients on SmolLM2 (64 tokens in and out) had a
    /// median time to first token of 3.8 s at 2048, 1.9 s at 1024 and 1.2 s
    /// at 512, for the same output tokens/s and a median time per output
    /// token of 87, 113 and 129 ms.
    ///
    /// On a GPU the prompt tokens of a step get a budget of their own, by
    /// the model's size: the largest power of two whose compute stays
    /// within [`GPU_SERVING_STEP_FLOPS`] (512 tokens for an 8B model, 1024
    /// for 3B, none below the step's 2048 for 1B and smaller;
    /// `vellum_base::prefill_budget_for`), the decodes beside them as many
    /// as run. A step with a prompt chunk lasts its decodes plus the chunk's
    /// compute, and the decodes wait for all of it: for Llama 3 8B at 64
    /// clients the simulated p99 inter-token latency is 4.7× its median
    /// without the budget and 2.0× with it, for the same output tokens/s
    /// (docs/benchmarks.md, "A prefill budget from the model's size").
    pub fn serving(device: &str) -> Self {
        let base = Self::default();
        if device.parse::<Device>().is_ok_and(|d| d == Device::Cpu) {
            Self { max_num_batched_tokens: CPU_SERVING_BATCHED_TOKENS, ..base }
        } else {
            Self { step_flop_budget: Some(GPU_SERVING_STEP_FLOPS), ..base }
        }
    }
}

/// `vellum serve`'s step budget on the CPU (see [`EngineDefaults::serving`]).
pub const CPU_SERVING_BATCHED_TOKENS: usize = 1024;

/// The prompt compute a step of `vellum serve` on a GPU may carry when
/// `--max-num-batched-tokens` is not given: 8 TFLOP, ~13 ms of an H100's
/// bf16 tensor cores, about an 8B model's decode step at 64 sequences (see
/// [`EngineDefaults::serving`]).
pub const GPU_SERVING_STEP_FLOPS: f64 = 8e12;

impl EngineFlags {
    /// `--enforce-eager`, `--cuda-graph-sizes` and `--compilation-config`
    /// together: `--enforce-eager` records nothing whatever the mode says
    /// (as in vLLM); sizes given twice must agree.
    fn cuda_graphs(&self) -> Result<CudaGraphs> {
        let config = match &self.compilation_config {
            Some(json) => CompilationConfig::from_json(json).map_err(|e| anyhow!("--compilation-config: {e}"))?,
            None => CompilationConfig::default(),
        };
        for ignored in &config.ignored {
            tracing::warn!("--compilation-config: {ignored}; ignored");
        }
        for note in &config.notes {
            tracing::warn!("--compilation-config: {note}");
        }
        if let Some(sizes) = &self.cuda_graph_sizes {
            if sizes.is_empty() || sizes.contains(&0) {
                bail!("--cuda-graph-sizes takes token counts of at least 1");
            }
        }
        let sorted = |v: &Vec<usize>| {
            let mut v = v.clone();
            v.sort_unstable();
            v.dedup();
            v
        };
        let mut capture_sizes = match (&self.cuda_graph_sizes, &config.cudagraph_capture_sizes) {
            (Some(a), Some(b)) if sorted(a) != sorted(b) => {
                bail!("--cuda-graph-sizes {a:?} and --compilation-config's cudagraph_capture_sizes {b:?} disagree: give one")
            }
            (a, b) => a.clone().or_else(|| b.clone()),
        };
        if let Some(max) = config.max_cudagraph_capture_size {
            capture_sizes = Some(match capture_sizes {
                Some(sizes) => sizes.into_iter().filter(|&s| s <= max).collect(),
                None => vellum_base::default_capture_sizes(max),
            });
            if capture_sizes.as_ref().is_some_and(|s| s.is_empty()) {
                bail!("--compilation-config: max_cudagraph_capture_size {max} leaves no capture size");
            }
        }
        let mode = if self.enforce_eager { CudaGraphMode::None } else { config.cudagraph_mode.unwrap_or_default() };
        Ok(CudaGraphs { mode, capture_sizes })
    }

    /// The engine arguments for `model`, with `defaults` for flags not given.
    pub fn engine_args(&self, model: Option<String>, defaults: EngineDefaults) -> Result<EngineArgs> {
        if self.block_size == 0 {
            bail!("--block-size must be at least 1");
        }
        if !(self.swap_space >= 0.0 && self.swap_space.is_finite()) {
            bail!("--swap-space must be a non-negative number of GiB");
        }
        let scheduler = SchedulerConfig {
            max_num_seqs: self.max_num_seqs.unwrap_or(defaults.max_num_seqs),
            max_num_batched_tokens: self.max_num_batched_tokens.unwrap_or(defaults.max_num_batched_tokens),
            max_model_len: self.max_model_len.unwrap_or(defaults.max_model_len),
            policy: parse_policy(&self.scheduling_policy)?,
            preemption_mode: parse_preemption(&self.preemption_mode)?,
            enable_chunked_prefill: !self.no_enable_chunked_prefill,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            max_num_prefill_tokens: 0,
        };
        // The model's context caps --max-model-len once it is loaded (and the
        // scheduler checks the budgets against it again then): an unset
        // length is not yet a reason to refuse --no-enable-chunked-prefill.
        let known_len = if self.max_model_len.is_some() { scheduler.max_model_len } else { scheduler.max_num_batched_tokens };
        SchedulerConfig { max_model_len: known_len, ..scheduler.clone() }.validate().map_err(|e| anyhow!("{e}"))?;
        let swap = scheduler.preemption_mode == PreemptionMode::Swap;
        Ok(EngineArgs {
            model,
            device: self.device.parse::<Device>().map_err(|e| anyhow!("{e}"))?,
            cpu_precision: self.cpu_precision.parse::<CpuPrecision>().map_err(|e| anyhow!("{e}"))?,
            dtype: self.dtype.parse::<ComputeDtype>().map_err(|e| anyhow!("{e}"))?,
            block_size: self.block_size,
            kv_cache: kv_cache_size(
                self.kv_cache_memory.as_deref(),
                self.gpu_memory_utilization,
                &self.device.parse::<Device>().map_err(|e| anyhow!("{e}"))?.to_string(),
            )?,
            kv_cache_dtype: parse_kv_cache_dtype(&self.kv_cache_dtype)?,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            disable_hybrid_kv_cache_manager: self.disable_hybrid_kv_cache_manager,
            swap_space_bytes: if swap { (self.swap_space * (1u64 << 30) as f64) as u64 } else { 0 },
            scheduler,
            speculative_config: match &self.speculative_config {
                Some(json) => Some(SpeculativeConfig::from_json(json).map_err(|e| anyhow!("--speculative-config: {e}"))?),
                None => None,
            },
            task: match self.task.as_str() {
                "generate" => Task::Generate,
                "embed" => Task::Embed,
                _ => Task::Auto,
            },
            pooler_config: match &self.pooler_config {
                Some(json) => PoolerConfig::from_json(json).map_err(|e| anyhow!("--pooler-config: {e}"))?,
                None => PoolerConfig::default(),
            },
            tensor_parallel_size: match self.tensor_parallel_size {
                0 => bail!("--tensor-parallel-size must be at least 1"),
                n => n,
            },
            cuda_graphs: self.cuda_graphs()?,
            cuda_weight_copies: self
                .cuda_bf16_weight_copies
                .parse::<WeightCopies>()
                .map_err(|e| anyhow!("--cuda-bf16-weight-copies: {e}"))?,
            async_scheduling: self.async_scheduling,
            step_flop_budget: if self.max_num_batched_tokens.is_some() { None } else { defaults.step_flop_budget },
        })
    }
}

/// The KV cache's size from `--kv-cache-memory` or `--gpu-memory-utilization`
/// (at most one is given), else the device's default: 0.9 of a GPU (vLLM's),
/// elsewhere what the configuration can use within limits
/// ([`KvCacheSize::Auto`]).
pub fn kv_cache_size(kv_cache_memory: Option<&str>, gpu_memory_utilization: Option<f32>, device: &str) -> Result<KvCacheSize> {
    match (kv_cache_memory, gpu_memory_utilization) {
        (Some(s), _) => parse_kv_cache_memory(s),
        (None, Some(f)) if !(f > 0.0 && f <= 1.0) => bail!("--gpu-memory-utilization must be in (0, 1], got {f}"),
        (None, Some(f)) if device != "cuda" => {
            bail!("--gpu-memory-utilization {f} applies to --device cuda; size the cache on {device} with --kv-cache-memory")
        }
        (None, Some(f)) => Ok(KvCacheSize::DeviceFraction(f)),
        (None, None) if device == "cuda" => Ok(KvCacheSize::DeviceFraction(0.9)),
        (None, None) => Ok(KvCacheSize::Auto),
    }
}

/// Parses `--kv-cache-memory`: `4GiB`, `512MiB`, `1000000` (bytes) or a
/// fraction of available memory such as `0.5`.
pub fn parse_kv_cache_memory(s: &str) -> Result<KvCacheSize> {
    let t = s.trim();
    if let Ok(f) = t.parse::<f32>() {
        if t.contains('.') || f <= 1.0 {
            if !(f > 0.0 && f <= 1.0) {
                bail!("--kv-cache-memory fraction must be in (0, 1], got {t}");
            }
            return Ok(KvCacheSize::FractionOfFree(f));
        }
    }
    let (num, mult) = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("GB", 1_000_000_000), ("MB", 1_000_000), ("B", 1)]
        .iter()
        .find_map(|(suffix, m)| t.strip_suffix(suffix).map(|n| (n.trim(), *m)))
        .unwrap_or((t, 1));
    let n: f64 = num.parse().map_err(|_| anyhow!("--kv-cache-memory: cannot read {s:?} (use e.g. 4GiB, 512MiB or 0.5)"))?;
    if n.is_nan() || n <= 0.0 {
        bail!("--kv-cache-memory must be positive, got {s:?}");
    }
    Ok(KvCacheSize::MemoryBytes((n * mult as f64) as u64))
}

fn parse_kv_cache_dtype(s: &str) -> Result<Option<KvCacheDtype>> {
    Ok(Some(match s {
        "auto" => return Ok(None),
        "float32" | "fp32" => KvCacheDtype::F32,
        "float16" | "fp16" | "half" => KvCacheDtype::F16,
        "bfloat16" | "bf16" => KvCacheDtype::Bf16,
        "fp8" | "fp8_e4m3" => KvCacheDtype::Fp8E4m3,
        "fp8_e5m2" => bail!("--kv-cache-dtype fp8_e5m2 is not supported: fp8 (fp8_e4m3, with per-layer scales) is"),
        other => bail!("--kv-cache-dtype must be auto, float32, float16, bfloat16 or fp8 (fp8_e4m3), got {other:?}"),
    }))
}

fn parse_policy(s: &str) -> Result<SchedulingPolicy> {
    Ok(match s {
        "fcfs" => SchedulingPolicy::Fcfs,
        "two-level" | "two_level" => SchedulingPolicy::TwoLevel { staging_queue_size: 8 },
        "priority" => SchedulingPolicy::Priority,
        other => bail!("--scheduling-policy must be fcfs, two-level or priority, got {other:?}"),
    })
}

fn parse_preemption(s: &str) -> Result<PreemptionMode> {
    Ok(match s {
        "recompute" => PreemptionMode::Recompute,
        "swap" => PreemptionMode::Swap,
        other => bail!("--preemption-mode must be recompute or swap, got {other:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineFlags,
    }

    #[test]
    fn flags_become_engine_args() {
        let cli =
            Cli::parse_from(["x", "--device", "cpu", "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching", "--max-num-seqs", "3"]);
        let args = cli.engine.engine_args(None, EngineDefaults::default()).expect("valid flags");
        assert_eq!(args.kv_cache, KvCacheSize::MemoryBytes(64 << 20));
        assert!(!args.enable_prefix_caching);
        assert_eq!(args.scheduler.max_num_seqs, 3);
        assert_eq!(args.scheduler.max_num_batched_tokens, 2048);
        let bad = Cli::parse_from(["x", "--device", "tpu"]).engine.engine_args(None, EngineDefaults::default());
        assert!(bad.is_err_and(|e| e.to_string().contains("unknown device")));
    }

    #[test]
    fn cuda_graph_flags_are_vllms() {
        let args = Cli::parse_from(["x"]).engine.engine_args(None, EngineDefaults::default()).expect("valid flags");
        assert_eq!(args.cuda_graphs, CudaGraphs { mode: CudaGraphMode::FullDecodeOnly, capture_sizes: None });
        let cli = Cli::parse_from(["x", "--enforce-eager", "--cuda-graph-sizes", "1,2,8,64"]);
        let args = cli.engine.engine_args(None, EngineDefaults::default()).expect("valid flags");
        assert_eq!(args.cuda_graphs, CudaGraphs { mode: CudaGraphMode::None, capture_sizes: Some(vec![1, 2, 8, 64]) });
        let zero = Cli::parse_from(["x", "--cuda-graph-sizes", "0,8"]).engine.engine_args(None, EngineDefaults::default());
        assert!(zero.is_err_and(|e| e.to_string().contains("--cuda-graph-sizes")));
        let graphs = |flags: &[&str]| {
            let argv: Vec<&str> = std::iter::once("x").chain(flags.iter().copied()).collect();
            Cli::parse_from(argv).engine.engine_args(None, EngineDefaults::default()).map(|a| a.cuda_graphs)
        };
        // vLLM's --compilation-config: the mode, its sizes, a cap on the default sizes.
        let full = graphs(&["--compilation-config", r#"{"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 4, 16]}"#]);
        assert_eq!(full.expect("valid"), CudaGraphs { mode: CudaGraphMode::Full, capture_sizes: Some(vec![1, 4, 16]) });
        let capped = graphs(&["--compilation-config", r#"{"max_cudagraph_capture_size": 16, "level": 3}"#]).expect("valid");
        assert_eq!(capped.capture_sizes, Some(vec![1, 2, 4, 8, 16]));
        // The same sizes in another order agree.
        let same = graphs(&["--cuda-graph-sizes", "1,8", "--compilation-config", r#"{"cudagraph_capture_sizes": [8, 1]}"#]);
        assert_eq!(same.expect("the same sizes").capture_sizes, Some(vec![1, 8]));
        // --enforce-eager wins over a mode, as in vLLM.
        let eager = graphs(&["--enforce-eager", "--compilation-config", r#"{"cudagraph_mode": "FULL"}"#]).expect("valid");
        assert_eq!(eager.mode, CudaGraphMode::None);
        for (flags, says) in [
            (&["--compilation-config", r#"{"cudagraph_mode": "PIECEWISE"}"#][..], "PIECEWISE is not supported"),
            (&["--compilation-config", "{"][..], "--compilation-config"),
            (&["--cuda-graph-sizes", "8", "--compilation-config", r#"{"cudagraph_capture_sizes": [4]}"#][..], "disagree"),
            (
                &["--compilation-config", r#"{"cudagraph_capture_sizes": [8], "max_cudagraph_capture_size": 4}"#][..],
                "leaves no capture size",
            ),
        ] {
            let e = graphs(flags).expect_err(says).to_string();
            assert!(e.contains(says), "{flags:?}: {e}");
        }
    }

    #[test]
    fn serving_on_the_cpu_takes_smaller_steps_unless_told() {
        let cpu = Cli::parse_from(["x"]);
        let args = cpu.engine.engine_args(None, EngineDefaults::serving(&cpu.engine.device)).expect("valid flags");
        assert_eq!(args.scheduler.max_num_batched_tokens, CPU_SERVING_BATCHED_TOKENS);
        let told = Cli::parse_from(["x", "--max-num-batched-tokens", "4096"]);
        let args = told.engine.engine_args(None, EngineDefaults::serving(&told.engine.device)).expect("valid flags");
        assert_eq!(args.scheduler.max_num_batched_tokens, 4096);
        assert_eq!(args.step_flop_budget, None, "the CPU's budget is fixed");
        assert_eq!(EngineDefaults::serving("cuda").max_num_batched_tokens, 2048);
    }

    #[test]
    fn serving_on_a_gpu_sizes_its_steps_by_the_model_unless_told() {
        let gpu = Cli::parse_from(["x", "--device", "cuda"]);
        let args = gpu.engine.engine_args(None, EngineDefaults::serving(&gpu.engine.device)).expect("valid flags");
        assert_eq!(args.step_flop_budget, Some(GPU_SERVING_STEP_FLOPS));
        assert_eq!(args.scheduler.max_num_batched_tokens, 2048, "the cap the model's budget stays within");
        let told = Cli::parse_from(["x", "--device", "cuda", "--max-num-batched-tokens", "4096"]);
        let args = told.engine.engine_args(None, EngineDefaults::serving(&told.engine.device)).expect("valid flags");
        assert_eq!((args.scheduler.max_num_batched_tokens, args.step_flop_budget), (4096, None), "a given budget is kept");
        // Offline (generate, bench) the budget is fixed on every device.
        let offline = gpu.engine.engine_args(None, EngineDefaults::default()).expect("valid flags");
        assert_eq!(offline.step_flop_budget, None);
    }

    #[test]
    fn policies_parse() {
        assert_eq!(parse_policy("priority").ok(), Some(SchedulingPolicy::Priority));
        assert!(parse_policy("lifo").is_err());
        assert_eq!(parse_preemption("swap").ok(), Some(PreemptionMode::Swap));
        assert!(parse_preemption("x").is_err());
    }

    #[test]
    fn the_kv_cache_size_defaults_to_vllms_gpu_memory_utilization_on_cuda_only() {
        assert_eq!(kv_cache_size(None, None, "cuda").ok(), Some(KvCacheSize::DeviceFraction(0.9)));
        assert_eq!(kv_cache_size(None, None, "cpu").ok(), Some(KvCacheSize::Auto));
        assert_eq!(kv_cache_size(None, Some(0.8), "cuda").ok(), Some(KvCacheSize::DeviceFraction(0.8)));
        assert_eq!(kv_cache_size(Some("2GiB"), None, "cuda").ok(), Some(KvCacheSize::MemoryBytes(2 << 30)));
        let e = kv_cache_size(None, Some(0.9), "cpu").expect_err("cpu has no GPU memory").to_string();
        assert!(e.contains("--kv-cache-memory"), "{e}");
        assert!(kv_cache_size(None, Some(1.5), "cuda").is_err());
    }

    #[test]
    fn kv_cache_memory_parses_units_and_fractions() {
        assert_eq!(parse_kv_cache_memory("0.5").ok(), Some(KvCacheSize::FractionOfFree(0.5)));
        assert_eq!(parse_kv_cache_memory("2GiB").ok(), Some(KvCacheSize::MemoryBytes(2 << 30)));
        assert!(parse_kv_cache_memory("1.5").is_err());
        assert!(parse_kv_cache_memory("lots").is_err());
    }
}
