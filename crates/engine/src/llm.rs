//! The offline API: `Llm::new(EngineArgs::default())?.generate(...)`.

use crate::backend::{make_executor, ComputeDtype, CpuOptions, CpuPrecision, CudaGraphs, Device, ExecutorOptions};
use crate::calibration::calibration_token_ids;
use crate::client::EngineClient;
use crate::engine_core::EngineCore;
use crate::error::Error;
use crate::output_processor::{OutputPiece, OutputProcessor};
use crate::outputs::{RequestOutput, StepOutputs};
use crate::pooling::{DeclaredPooling, EmbeddingSpec, PoolerConfig, Task};
use crate::speculative::{DraftModelProposer, NgramProposer, Proposer};
use vellum_base::{
    AutoKvLimit, KvCacheDtype, KvCacheSize, ModelExecutor, SamplingParams, SchedulerConfig, TokenId, AUTO_KV_CACHE_CAP_BYTES,
};
use vellum_base::{SpeculativeConfig, SpeculativeMethod};
use vellum_models::{resolve_model, ChatMessage, ChatTemplate, RunnerOptions, Tokenizer};
use vellum_scheduler::FinishReason;

/// The KV-cache element type `auto` means: bfloat16 where a GPU multiplies
/// in bfloat16 (`--device cuda`'s default: the model's 16-bit type, as
/// vLLM's `auto`; half the bytes a decode step reads), float16 on the CPU's
/// default int8 path, float32 elsewhere.
///
/// The int8 path already quantizes activations as llama.cpp does, and
/// stores keys and values in float16 as llama.cpp does by default (vLLM's
/// `auto` is the model's 16-bit dtype): decode reads the cache once per
/// step, so half the bytes bought a 64-sequence Gemma 3 decode 9%
/// (docs/benchmarks.md) for 0.005 nats on the float64 references
/// (`kv_dtype_golden`), while the golden tests keep the int8 path within
/// llama.cpp's own gaps. The exact paths (`--cpu-precision int16|float32`)
/// and the float32 GPU paths keep float32.
pub fn auto_kv_cache_dtype(device: Device, precision: CpuPrecision, dtype: ComputeDtype) -> KvCacheDtype {
    match (device, precision) {
        _ if dtype.is_bf16_on(device) => KvCacheDtype::Bf16,
        (Device::Cpu, CpuPrecision::Int8) => KvCacheDtype::F16,
        _ => KvCacheDtype::F32,
    }
}

/// How to build an engine. `Default` serves the default model.
#[derive(Clone, Debug)]
pub struct EngineArgs {
    /// A `.gguf` path, a Hugging Face directory, a hub id in the local cache,
    /// or `None` for the default model (fetched on first use).
    pub model: Option<String>,
    /// The backend that runs the model.
    pub device: Device,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Size of the KV pool: what the scheduler's budgets can use within
    /// limits ([`KvCacheSize::Auto`], the default), blocks, bytes, or a
    /// fraction of the memory available once the weights are loaded (the
    /// profiling step of thesis §4.2.1).
    pub kv_cache: KvCacheSize,
    /// Element type of the stored keys and values; `None` (vLLM's `auto`)
    /// picks per device and precision ([`auto_kv_cache_dtype`]).
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// Scheduler budgets and policy.
    pub scheduler: SchedulerConfig,
    /// Automatic prefix caching (vLLM's `--enable-prefix-caching`).
    pub enable_prefix_caching: bool,
    /// One block table for every layer even when local and global layers
    /// differ (vLLM's `--disable-hybrid-kv-cache-manager`).
    pub disable_hybrid_kv_cache_manager: bool,
    /// Bytes of host memory for KV blocks swapped out on preemption
    /// (vLLM's `--swap-space`); 0 = none, swap preemption then recomputes.
    pub swap_space_bytes: u64,
    /// How the CPU backend multiplies integer-block weights
    /// (`--cpu-precision`; other devices ignore it).
    pub cpu_precision: CpuPrecision,
    /// What a GPU backend multiplies in (vLLM's `--dtype`; `auto`: bfloat16
    /// on `--device cuda`).
    pub dtype: ComputeDtype,
    /// Speculative decoding (vLLM's `--speculative-config`); `None`: off.
    pub speculative_config: Option<SpeculativeConfig>,
    /// Generation or embeddings (vLLM's `--task`).
    pub task: Task,
    /// An embedding model's pooling, over what its checkpoint declares
    /// (vLLM's `--pooler-config`).
    pub pooler_config: PoolerConfig,
    /// Ranks the model is split over (vLLM's `--tensor-parallel-size`):
    /// each holds its share of every layer's heads and MLP and of the
    /// vocabulary, with an all-reduce after each row-parallel linear; one
    /// scheduler and KV-cache manager for all. 1: the whole model on one.
    pub tensor_parallel_size: usize,
    /// Decode steps recorded and replayed as CUDA graphs on `--device cuda`
    /// (vLLM's `--enforce-eager` turns them off, `--cuda-graph-sizes` picks
    /// the batch sizes).
    pub cuda_graphs: CudaGraphs,
    /// Which quantized weights keep a bf16 copy for cuBLAS on `--device
    /// cuda` (`--cuda-bf16-weight-copies`).
    pub cuda_weight_copies: vellum_base::WeightCopies,
    /// vLLM's `--async-scheduling`: the next step is scheduled and built
    /// while the last one runs ([`EngineCore::set_async_scheduling`]); the
    /// outputs are the same. Ignored with speculative decoding.
    pub async_scheduling: bool,
    /// When set (and `scheduler.max_num_prefill_tokens` is not), a step's
    /// prefill budget is chosen once the model is known: the largest power
    /// of two of prompt tokens that take at most this many FLOPs in the
    /// model's linears on each tensor-parallel GPU
    /// ([`vellum_base::prefill_budget_for`]); only with chunked prefill,
    /// and never for embeddings (no decodes to keep going). `vellum serve`
    /// on a GPU sets it when `--max-num-batched-tokens` is not given, so
    /// that a prompt chunk stretches the decodes beside it by about as much
    /// on an 8B model as on a small one.
    pub step_flop_budget: Option<f64>,
}

impl Default for EngineArgs {
    fn default() -> Self {
        Self {
            model: None,
            device: Device::default(),
            block_size: 16,
            kv_cache: KvCacheSize::Auto,
            kv_cache_dtype: None,
            scheduler: SchedulerConfig::default(),
            enable_prefix_caching: true,
            disable_hybrid_kv_cache_manager: false,
            swap_space_bytes: 0,
            cpu_precision: CpuPrecision::default(),
            dtype: ComputeDtype::default(),
            speculative_config: None,
            task: Task::Auto,
            pooler_config: PoolerConfig::default(),
            tensor_parallel_size: 1,
            cuda_graphs: CudaGraphs::default(),
            cuda_weight_copies: vellum_base::WeightCopies::default(),
            async_scheduling: false,
            step_flop_budget: None,
        }
    }
}

/// A draft model must map text to the same token ids as the target: the
/// same vocabulary size and the same id for every piece of a sample.
fn check_same_vocabulary(target: &Tokenizer, draft: &Tokenizer, model: &str) -> Result<(), Error> {
    let sample = "The quick brown fox, 123 — naïve café! <|im_start|>\n\tdef f(x): return x**2";
    let (a, b) = (target.encode(sample, false)?, draft.encode(sample, false)?);
    if target.vocab_size() != draft.vocab_size() || a != b {
        return Err(Error::Backend(vellum_base::Error::InvalidConfig {
            field: "speculative_config",
            message: format!(
                "the draft model {model} does not share the target's tokenizer ({} and {} tokens; a sample encodes {})",
                draft.vocab_size(),
                target.vocab_size(),
                if a == b { "alike" } else { "differently" }
            ),
        }));
    }
    Ok(())
}

/// An engine with its tokenizer.
pub struct Llm {
    engine: EngineCore<Box<dyn ModelExecutor + Send>>,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    kv_sharing: KvSharing,
    /// An embedding engine's pooling (`None`: it generates).
    embedding: Option<EmbeddingSpec>,
}

/// KV blocks of the last `generate` call at its peak: physical blocks held
/// against the blocks the sequences' tables reference (shared blocks count
/// once per table). The gap is what sharing saved (paper §4.4, Fig. 15).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvSharing {
    /// Most physical blocks held at once.
    pub peak_used_blocks: usize,
    /// Logical blocks (sum of block-table lengths) at that step.
    pub logical_blocks_at_peak: usize,
}

impl KvSharing {
    /// `1 - physical / logical` at the peak.
    pub fn saved_fraction_at_peak(&self) -> f64 {
        if self.logical_blocks_at_peak == 0 {
            0.0
        } else {
            1.0 - self.peak_used_blocks as f64 / self.logical_blocks_at_peak as f64
        }
    }
}

impl Llm {
    /// Resolves and loads the model on `args.device`.
    pub fn new(args: EngineArgs) -> Result<Self, Error> {
        Self::new_with_progress(args, |_, _| {})
    }

    /// As [`Llm::new`], calling `progress(layers_done, layers)` while the
    /// weights load.
    pub fn new_with_progress(args: EngineArgs, progress: impl FnMut(usize, usize)) -> Result<Self, Error> {
        // Before any file is read: a backend this build lacks is the user's first error.
        args.device.ensure_compiled()?;
        let source = resolve_model(args.model.as_deref())?;
        let loaded = vellum_models::LoadedModel::open(&source)?;
        let declared = match &source {
            vellum_formats::ModelSource::HfDir(dir) => DeclaredPooling::read(dir)?,
            vellum_formats::ModelSource::Gguf(_) => DeclaredPooling::default(),
        };
        // An encoder (BERT) sees its whole prompt at once: it embeds on the
        // CPU backend, a prompt in one step, never from a cached prefix,
        // CLS-pooled unless its checkpoint says otherwise (vLLM's default).
        let encoder = loaded.config.arch().is_some_and(|a| a.family.is_encoder());
        let embed = match args.task {
            Task::Embed => true,
            Task::Generate => false,
            Task::Auto => declared.is_embedding_model() || encoder,
        };
        if encoder && args.device != Device::Cpu {
            return Err(Error::Backend(vellum_base::Error::InvalidConfig {
                field: "device",
                message: format!("encoder models ({}) run on --device cpu, not --device {}", loaded.config.architecture, args.device),
            }));
        }
        let embedding = embed.then(|| declared.spec(args.pooler_config, loaded.config.hidden_size, encoder));
        if embed && args.speculative_config.is_some() {
            return Err(Error::Task("--speculative-config applies to generation, not to an embedding model (--task embed)".into()));
        }
        if !embed && (declared.base_model || encoder) {
            return Err(Error::Task(
                "this checkpoint is a base model without an LM head (an embedding model): serve it with --task embed".into(),
            ));
        }
        if !embed && args.pooler_config != PoolerConfig::default() {
            tracing::warn!("--pooler-config applies to embeddings (--task embed); this engine generates, so it is ignored");
        }
        let proposer = match &args.speculative_config {
            None => None,
            Some(spec) => Some(match &spec.method {
                SpeculativeMethod::Ngram { prompt_lookup_min, prompt_lookup_max } => {
                    Box::new(NgramProposer { min: *prompt_lookup_min, max: *prompt_lookup_max }) as Box<dyn Proposer>
                }
                SpeculativeMethod::DraftModel { model } => {
                    // The draft runs on an engine of its own (same device and
                    // scheduler settings, its own paged KV cache and prefix
                    // cache), loaded first: a GPU share given to the target
                    // then counts the draft's memory as used. Its cache is
                    // sized as `--kv-cache-memory`'s default sizes one.
                    let draft = Llm::new(EngineArgs {
                        model: Some(model.clone()),
                        speculative_config: None,
                        kv_cache: KvCacheSize::Auto,
                        swap_space_bytes: 0,
                        // Its steps run inside one of the target's: no decodes of its own to keep going.
                        step_flop_budget: None,
                        scheduler: SchedulerConfig { max_num_prefill_tokens: 0, ..args.scheduler.clone() },
                        ..args.clone()
                    })?;
                    check_same_vocabulary(&loaded.tokenizer, &draft.tokenizer, model)?;
                    Box::new(DraftModelProposer::new(draft.engine, model.clone()))
                }
            }),
        };
        let config = loaded.config.clone();
        // The config's EOS, then the tokenizer's (generation_config.json's
        // list; Gemma's <end_of_turn>).
        let mut eos = config.eos_token_ids.clone();
        for &id in loaded.tokenizer.eos_token_ids() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let mut max_model_len = args.scheduler.max_model_len.min(config.max_position_embeddings);
        if embed {
            // The length the embedding model was trained for, as vLLM reads it.
            max_model_len = max_model_len.min(declared.max_seq_length.unwrap_or(usize::MAX));
        }
        let mut scheduler = SchedulerConfig { max_model_len, ..args.scheduler };
        if encoder {
            // A prompt in one step: no chunks, no cap per prompt.
            scheduler.enable_chunked_prefill = false;
            scheduler.long_prefill_token_threshold = 0;
        }
        // (Pooling has no decodes for a prefill budget to keep going.)
        if let Some(step_flops) =
            args.step_flop_budget.filter(|_| scheduler.enable_chunked_prefill && scheduler.max_num_prefill_tokens == 0 && !embed)
        {
            // Each of the tensor-parallel GPUs computes its share of a token.
            let flops_per_token = 2.0 * config.layer_parameters() as f64 / args.tensor_parallel_size.max(1) as f64;
            let tokens = vellum_base::prefill_budget_for(flops_per_token, step_flops, scheduler.max_num_batched_tokens);
            tracing::info!(
                max_num_prefill_tokens = tokens,
                gflop_per_token_per_gpu = format!("{:.2}", flops_per_token / 1e9),
                step_tflop = format!("{:.1}", step_flops / 1e12),
                "prefill budget from the model's size (0: the step's whole budget; giving --max-num-batched-tokens turns it off)"
            );
            scheduler.max_num_prefill_tokens = tokens;
        }
        // The budgets against the model's context, before any weight is read.
        scheduler.validate()?;
        let max_batched = scheduler.max_num_batched_tokens;
        let kv_dtype = args.kv_cache_dtype.unwrap_or_else(|| auto_kv_cache_dtype(args.device, args.cpu_precision, args.dtype));
        let options = ExecutorOptions {
            runner: RunnerOptions {
                kv_cache_dtype: kv_dtype,
                hybrid_kv_cache: !args.disable_hybrid_kv_cache_manager,
                block_size: args.block_size,
            },
            cpu: CpuOptions { precision: args.cpu_precision },
            dtype: args.dtype,
            tensor_parallel_size: args.tensor_parallel_size,
            cuda_graphs: args.cuda_graphs.clone(),
            cuda_weight_copies: args.cuda_weight_copies,
        };
        let load_started = std::time::Instant::now();
        let mut executor = make_executor(args.device, &*loaded.weights, config, options, progress)?;
        tracing::info!(
            model = %source.path().display(),
            backend = %executor.describe(),
            seconds = format!("{:.2}", load_started.elapsed().as_secs_f64()),
            "weights loaded"
        );
        let started = std::time::Instant::now();
        executor.calibrate(&calibration_token_ids(&loaded.tokenizer, loaded.chat_template.as_ref()))?;
        tracing::debug!(elapsed_ms = started.elapsed().as_millis() as u64, "calibration");
        if let KvCacheSize::DeviceFraction(f) = args.kv_cache {
            // Memory profiling (thesis §4.2.1): the largest step's activations
            // come out of the same budget as the weights and the KV cache.
            let peak = executor.profile_run(max_batched, scheduler.max_num_seqs, max_model_len, args.block_size)?;
            let graphs = executor.kv_memory(args.block_size).device.map_or(0, |d| d.graph_reserve_bytes);
            tracing::info!(
                gpu_memory_utilization = f,
                tokens = max_batched,
                activation_peak_mib = peak >> 20,
                cuda_graph_reserve_mib = graphs >> 20,
                "profile run"
            );
        }
        let block_bytes = executor.kv_block_bytes(args.block_size).max(1);
        let (size, why) = match args.kv_cache {
            KvCacheSize::Auto => {
                let windows = executor.kv_group_windows();
                let per_request = vellum_kvcache::max_blocks_held(&windows, args.block_size, max_model_len, max_batched).max(1);
                let wanted = (scheduler.max_num_seqs * per_request) as u64 * block_bytes;
                let available = executor.kv_memory(args.block_size).available_bytes;
                let (bytes, limit) = KvCacheSize::resolve_auto(wanted, available);
                let why = match limit {
                    AutoKvLimit::Configuration => {
                        format!("what --max-num-seqs {} × --max-model-len {max_model_len} can use", scheduler.max_num_seqs)
                    }
                    AutoKvLimit::Cap => format!(
                        "--max-num-seqs {} × --max-model-len {max_model_len} could use {} MiB; capped at {} MiB",
                        scheduler.max_num_seqs,
                        wanted >> 20,
                        AUTO_KV_CACHE_CAP_BYTES >> 20
                    ),
                    AutoKvLimit::FreeMemory => format!(
                        "--max-num-seqs {} × --max-model-len {max_model_len} could use {} MiB; capped at half the {} MiB free",
                        scheduler.max_num_seqs,
                        wanted >> 20,
                        available >> 20
                    ),
                };
                (KvCacheSize::MemoryBytes(bytes.max(block_bytes)), why)
            }
            other => (other, "as asked".to_string()),
        };
        let num_blocks = executor.num_kv_blocks(size, args.block_size)?;
        tracing::info!(
            backend = %executor.describe(),
            dtype = ?kv_dtype,
            num_blocks,
            block_size = args.block_size,
            mib = (num_blocks as u64 * block_bytes) >> 20,
            sized_by = %why,
            "KV cache (--kv-cache-memory sets its size)"
        );
        let num_host_blocks = (args.swap_space_bytes / executor.kv_block_bytes(args.block_size).max(1)) as usize;
        let mut engine = EngineCore::with_prefix_caching(
            executor,
            scheduler,
            num_blocks,
            num_host_blocks,
            args.block_size,
            eos,
            args.enable_prefix_caching && !encoder,
        )?;
        // Decode steps recorded as CUDA graphs now rather than on a request's
        // time (vLLM captures at start too); not for embeddings.
        if !embed && !encoder {
            if let Some(c) = engine.capture_graphs()? {
                tracing::info!(
                    graphs = c.graphs,
                    seconds = format!("{:.2}", c.seconds),
                    graph_memory_mib = c.memory_bytes >> 20,
                    "decode steps recorded as CUDA graphs (--enforce-eager: none)"
                );
                if matches!(args.kv_cache, KvCacheSize::DeviceFraction(_)) && c.memory_bytes > c.reserved_bytes {
                    tracing::warn!(
                        graph_memory_mib = c.memory_bytes >> 20,
                        reserved_mib = c.reserved_bytes >> 20,
                        "the recorded CUDA graphs hold more memory than the KV cache's sizing left for them; \
                         lower --gpu-memory-utilization if the GPU runs out of memory"
                    );
                }
            }
        }
        // Structured outputs need every token's bytes (the trie over them is
        // built by the first constraint).
        // (An embedding engine samples nothing: no trie, and no warning.)
        if !embed {
            match crate::structured::StructuredOutputs::from_tokenizer(&loaded.tokenizer) {
                Ok(s) => engine.set_structured_outputs(std::sync::Arc::new(s)),
                Err(e) => tracing::warn!(error = %e, "structured outputs are unavailable for this tokenizer"),
            }
        }
        // vLLM's capacity line: how many requests of max_model_len fit at
        // once (a sliding-window group holds only its window). `tokens`: the
        // context every group can hold at once (a block serves one group).
        let allocator = engine.scheduler().allocator();
        let per_request = vellum_base::BlockAllocator::max_blocks_held(allocator, max_model_len, max_batched).max(1);
        let groups = vellum_base::BlockAllocator::num_kv_groups(allocator);
        tracing::info!(
            tokens = num_blocks * args.block_size / groups,
            kv_cache_groups = groups,
            max_model_len,
            blocks_per_request = per_request,
            max_concurrency = format!("{:.2}", num_blocks as f64 / per_request as f64),
            "KV cache capacity"
        );
        if let (Some(spec), Some(proposer)) = (&args.speculative_config, proposer) {
            engine.set_proposer(proposer, spec.num_speculative_tokens);
        }
        if args.async_scheduling {
            if args.speculative_config.is_some() {
                tracing::warn!("--async-scheduling is ignored with --speculative-config: drafts need each step's last token");
            }
            engine.set_async_scheduling(true);
        }
        if let Some(spec) = &embedding {
            engine.set_pooling(true);
            tracing::info!(
                pooling_type = ?spec.defaults.pooling_type,
                normalize = spec.defaults.normalize,
                dimensions = spec.hidden_size,
                matryoshka = spec.matryoshka,
                "serving embeddings (--task embed; --pooler-config overrides the pooling)"
            );
        }
        Ok(Self { engine, tokenizer: loaded.tokenizer, chat_template: loaded.chat_template, kv_sharing: KvSharing::default(), embedding })
    }

    /// The structured-output compiler (the server checks a request's
    /// constraint with it before queueing it), if the tokenizer allows one.
    pub fn structured_outputs(&self) -> Option<std::sync::Arc<crate::structured::StructuredOutputs>> {
        self.engine.structured_outputs().cloned()
    }

    /// An embedding engine's pooling; `None` when it generates.
    pub fn embedding(&self) -> Option<EmbeddingSpec> {
        self.embedding
    }

    /// Embeds token-id prompts, all batched together (each a prefill-only
    /// request that frees its blocks in the step that completes it): one
    /// vector per prompt, in prompt order, of `dimensions` entries if given
    /// (a Matryoshka model) else the hidden size.
    pub fn embed_ids(&mut self, prompts: &[Vec<TokenId>], dimensions: Option<usize>) -> Result<Vec<Vec<f32>>, Error> {
        let spec =
            self.embedding.ok_or_else(|| Error::Task("this engine generates text; load the model with Task::Embed to embed".into()))?;
        let pooling = spec.request(dimensions).map_err(Error::Task)?;
        // Prefill only: the one "token" a request must allow is never sampled.
        let params = SamplingParams { pooling: Some(pooling), max_tokens: Some(1), ..SamplingParams::default() };
        let outputs = self.generate_ids(prompts, &params)?;
        outputs
            .into_iter()
            .map(|o| o.embedding.ok_or(Error::Task(format!("request {} ended before its prompt was computed", o.request_id))))
            .collect()
    }

    /// Embeds text prompts (special tokens added as the tokenizer's
    /// configuration says).
    pub fn embed(&mut self, prompts: &[&str], dimensions: Option<usize>) -> Result<Vec<Vec<f32>>, Error> {
        let ids = prompts.iter().map(|p| self.tokenizer.encode(p, true)).collect::<Result<Vec<_>, _>>()?;
        self.embed_ids(&ids, dimensions)
    }

    /// Moves the engine onto its own thread: the client, the tokenizer and
    /// the chat template (for the server).
    pub fn into_client(self) -> (EngineClient, Tokenizer, Option<ChatTemplate>) {
        self.into_client_with_stream_buffer(crate::client::STREAM_BUFFER_EVENTS)
    }

    /// [`LLM::into_client`] whose request streams hold at most `events`
    /// unread events before their request is aborted
    /// ([`EngineClient::spawn_with_stream_buffer`]).
    pub fn into_client_with_stream_buffer(self, events: usize) -> (EngineClient, Tokenizer, Option<ChatTemplate>) {
        (EngineClient::spawn_with_stream_buffer(self.engine, events), self.tokenizer, self.chat_template)
    }

    /// KV sharing during the last `generate` call.
    pub fn kv_sharing(&self) -> KvSharing {
        self.kv_sharing
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The engine core.
    pub fn engine(&mut self) -> &mut EngineCore<Box<dyn ModelExecutor + Send>> {
        &mut self.engine
    }

    /// Generates for token-id prompts, all batched together. Outputs come
    /// in prompt order, with `text` detokenized incrementally and cut at the
    /// first stop string; a sequence ends as soon as its text holds one (its
    /// blocks freed at once).
    pub fn generate_ids(&mut self, prompts: &[Vec<TokenId>], params: &SamplingParams) -> Result<Vec<RequestOutput>, Error> {
        self.generate_ids_streaming(prompts, params, |_| {})
    }

    /// [`Llm::generate_ids`], calling `on_piece` with every piece of text as
    /// it is generated (beam search and `best_of` produce theirs at the end).
    pub fn generate_ids_streaming(
        &mut self,
        prompts: &[Vec<TokenId>],
        params: &SamplingParams,
        mut on_piece: impl FnMut(&OutputPiece),
    ) -> Result<Vec<RequestOutput>, Error> {
        let mut outputs = OutputProcessor::with_eos_token_ids(self.engine.eos_token_ids());
        let mut ids = Vec::with_capacity(prompts.len());
        for p in prompts {
            match self.engine.add_request(p.clone(), params.clone()) {
                Ok(id) => {
                    outputs.add_request(id, p, params, true);
                    ids.push(id);
                }
                Err(e) => {
                    // All or nothing: the prompts queued before go too.
                    for id in ids {
                        self.engine.finish_request(id, FinishReason::Abort);
                    }
                    let _ = self.engine.take_finished();
                    return Err(e);
                }
            }
        }
        let mut done = Vec::new();
        self.kv_sharing = KvSharing::default();
        while !outputs.is_empty() {
            let step = if self.engine.has_unfinished_requests() {
                match self.engine.step_streaming() {
                    Ok(step) => step,
                    Err(e) => {
                        // The failed step aborted its requests; this call's
                        // others go too, and none is left to a later call.
                        for &id in &ids {
                            self.engine.finish_request(id, FinishReason::Abort);
                        }
                        let _ = self.engine.take_finished();
                        return Err(e);
                    }
                }
            } else {
                StepOutputs { deltas: Vec::new(), finished: self.engine.take_finished() }
            };
            let kv = self.engine.kv_stats();
            if kv.num_used_blocks > self.kv_sharing.peak_used_blocks {
                self.kv_sharing = KvSharing { peak_used_blocks: kv.num_used_blocks, logical_blocks_at_peak: kv.num_logical_blocks };
            }
            let processed = outputs.process(&self.tokenizer, step)?;
            for (id, index) in processed.stopped {
                self.engine.finish_sequence(id, index, FinishReason::Stop);
            }
            processed.pieces.iter().for_each(&mut on_piece);
            done.extend(processed.finished);
        }
        done.sort_by_key(|r| r.request_id);
        Ok(done)
    }

    /// Generates for text prompts (no special tokens added beyond what the
    /// tokenizer's configuration says).
    pub fn generate(&mut self, prompts: &[&str], params: &SamplingParams) -> Result<Vec<RequestOutput>, Error> {
        let ids = prompts.iter().map(|p| self.tokenizer.encode(p, true)).collect::<Result<Vec<_>, _>>()?;
        self.generate_ids(&ids, params)
    }

    /// Renders a conversation with the model's chat template, ready for the
    /// assistant's turn.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, Error> {
        let template = self.chat_template.as_ref().ok_or(Error::Unsupported("chat: the model has no chat template"))?;
        Ok(template.render(messages, true)?)
    }

    /// Generates one reply per conversation.
    pub fn chat(&mut self, conversations: &[Vec<ChatMessage>], params: &SamplingParams) -> Result<Vec<RequestOutput>, Error> {
        let texts = conversations.iter().map(|m| self.render_chat(m)).collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        self.generate(&refs, params)
    }
}
