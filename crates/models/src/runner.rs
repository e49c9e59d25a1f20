//! [`ModelRunner`]: the one [`ModelExecutor`], generic over the backend.
//!
//! ```text
//! execute(batch) ─ swap_blocks(out) ─ swap_blocks(in) ─ copy_blocks
//!                ─ prepare_step(batch)            (per-step inputs, once)
//!                ─ model.forward(ops, cache, step) (every layer's ops,
//!                  or run_graph's replay of a recorded decode step)
//!                ─ take_host(logits), or argmax_rows(logits) when the
//!                  batch is argmax_only and the backend computes it, or
//!                  sample_rows(logits) when the batch carries sampling
//!                  and the backend samples on its device
//! ```
//!
//! Under tensor parallelism (`--tensor-parallel-size N`) the runner holds N
//! ranks, each a backend instance of one group with its part of the model
//! and its own paged KV cache of its heads (the same blocks on every rank:
//! one scheduler, one KV-cache manager). A step is SPMD, as the thesis's
//! workers are: every rank runs the same batch on a thread of its own (rank
//! 0 on the caller's), meeting in the all-reduces the model code calls; the
//! logits of each rank's vocabulary rows are then gathered into one row per
//! sequence on the host.

use crate::ops::Ops;
use crate::registry::{load_model, load_model_shard, CausalLm};
use crate::tensor_parallel::TensorParallel;
use crate::{Result, WeightSource};
use vellum_base::{
    AttentionRequirements, Error, ForwardBatch, GraphCapture, KvCacheDtype, KvCacheSpec, KvMemory, ModelConfig, ModelExecutor, StepOutput,
};

/// A model loaded on backend `O`, with the paged KV cache `O` allocates:
/// whole on one backend instance, or split over a tensor-parallel group.
pub struct ModelRunner<O: Ops> {
    /// One per tensor-parallel rank, rank 0 first (one for a whole model).
    ranks: Vec<Rank<O>>,
    kv_cache_dtype: KvCacheDtype,
    /// KV-cache groups for models that mix local and global layers.
    hybrid_kv_cache: bool,
    /// Tokens per block of the caches, once allocated.
    block_size: Option<usize>,
    /// Blocks of the caches, once allocated.
    num_blocks: usize,
    /// What the profile run measured (bytes of activations at the peak, the
    /// largest rank's).
    activation_peak: u64,
    /// What an eager decode step of the most rows a recorded graph has took
    /// in the profile run: the memory reserved for recorded decode steps.
    graph_reserve: u64,
}

/// One rank: a backend instance, its part of the model, its KV cache.
struct Rank<O: Ops> {
    ops: O,
    model: Box<dyn CausalLm<O>>,
    cache: Option<O::KvCache>,
}

/// What one rank's step returns before the ranks' outputs are combined.
enum RankOutput {
    Hidden(Vec<f32>),
    Logits(Vec<f32>),
    Argmax(Vec<u32>),
    Samples(Vec<vellum_base::DeviceSample>),
}

/// How a [`ModelRunner`] keeps its KV cache, fixed at load so that the
/// backend's [`Capabilities`](vellum_base::Capabilities) are checked before a
/// weight is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunnerOptions {
    /// Element type of the stored keys and values.
    pub kv_cache_dtype: KvCacheDtype,
    /// A block table per KV-cache group for models that mix local and
    /// global layers (see [`ModelRunner::with_hybrid_kv_cache`]).
    pub hybrid_kv_cache: bool,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self { kv_cache_dtype: KvCacheDtype::F32, hybrid_kv_cache: true, block_size: 16 }
    }
}

impl<O: Ops + 'static> ModelRunner<O> {
    /// Loads `weights` (shapes checked against `config`) on `ops`, choosing
    /// the model definition from the architecture registry, with the
    /// default [`RunnerOptions`] (f32 KV cache, KV-cache groups).
    pub fn load(ops: O, weights: &dyn WeightSource, config: ModelConfig, progress: impl FnMut(usize, usize)) -> Result<Self> {
        let model = load_model(&ops, weights, config, progress)?;
        Ok(Self::from_ranks(vec![Rank { ops, model, cache: None }]))
    }

    /// [`load`](Self::load) with `options`, after checking that the
    /// backend supports the model's head size, the block size and the KV
    /// element type: an unsupported one is [`vellum_base::Error::Unsupported`]
    /// before any weight is read.
    pub fn load_with(
        ops: O,
        weights: &dyn WeightSource,
        config: ModelConfig,
        options: RunnerOptions,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        check_supported(&ops, &config, &options)?;
        Ok(Self::load(ops, weights, config, progress)?
            .with_kv_cache_dtype(options.kv_cache_dtype)
            .with_hybrid_kv_cache(options.hybrid_kv_cache))
    }

    /// Loads the model split over a tensor-parallel group: `group[r]` is the
    /// backend instance of rank `r` (instances whose
    /// [`all_reduce`](Ops::all_reduce) sums over exactly these ranks, e.g.
    /// the CPU backend's `CpuOps::tensor_parallel_group`), and takes rank
    /// `r`'s part of every weight ([`TensorParallel`]). A group of one is
    /// [`load_with`](Self::load_with). A size that does not divide the
    /// model's heads or MLP is [`vellum_base::Error::InvalidConfig`] before
    /// any weight is read. `progress(done, total)` counts the layers of
    /// every rank.
    pub fn load_tensor_parallel(
        group: Vec<O>,
        weights: &dyn WeightSource,
        config: ModelConfig,
        options: RunnerOptions,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let size = group.len();
        TensorParallel::check(size, &config)?;
        for ops in &group {
            check_supported(ops, &config, &options)?;
        }
        let layers = config.num_hidden_layers;
        let mut ranks = Vec::with_capacity(size);
        for (ops, tp) in group.into_iter().zip(TensorParallel::ranks(size)) {
            let done = tp.rank * layers;
            let model = load_model_shard(&ops, weights, config.clone(), tp, |i, _| progress(done + i, layers * size))?;
            ranks.push(Rank { ops, model, cache: None });
        }
        Ok(Self::from_ranks(ranks).with_kv_cache_dtype(options.kv_cache_dtype).with_hybrid_kv_cache(options.hybrid_kv_cache))
    }
}

/// Whether `ops` runs `config` with `options` ([`ModelRunner::load_with`]).
pub fn check_supported<O: Ops>(ops: &O, config: &ModelConfig, options: &RunnerOptions) -> vellum_base::Result<()> {
    let wanted = AttentionRequirements { head_dim: config.head_dim, block_size: options.block_size, kv_dtype: options.kv_cache_dtype };
    ops.capabilities().check(ops.name(), &wanted)
}

impl<O: Ops> ModelRunner<O> {
    fn from_ranks(ranks: Vec<Rank<O>>) -> Self {
        Self {
            ranks,
            kv_cache_dtype: KvCacheDtype::F32,
            hybrid_kv_cache: true,
            block_size: None,
            num_blocks: 0,
            activation_peak: 0,
            graph_reserve: 0,
        }
    }

    /// Stores the KV cache as `dtype` (default `F32`): `f16`/`bf16` halve its
    /// memory (twice the blocks for the same budget) at some accuracy cost;
    /// attention still computes in `f32`. Applies to the next
    /// [`ModelExecutor::initialize_kv_cache`].
    pub fn with_kv_cache_dtype(mut self, dtype: KvCacheDtype) -> Self {
        self.kv_cache_dtype = dtype;
        self
    }

    /// With `false`, a model that mixes local and global layers keeps one
    /// block table and every block, the window being only a mask (vLLM's
    /// `--disable-hybrid-kv-cache-manager`); default `true`: a block table
    /// per KV-cache group, local blocks released as they slide out. Applies
    /// to the next [`ModelExecutor::initialize_kv_cache`].
    pub fn with_hybrid_kv_cache(mut self, enable: bool) -> Self {
        self.hybrid_kv_cache = enable;
        self
    }

    /// The element type the KV cache is (or will be) stored in.
    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.kv_cache_dtype
    }

    /// The backend's operations (rank 0's under tensor parallelism).
    pub fn ops(&self) -> &O {
        &self.ranks[0].ops
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.ranks[0].model.config()
    }

    /// Ranks of the tensor-parallel group (1: the model is whole).
    pub fn tensor_parallel_size(&self) -> usize {
        self.ranks.len()
    }

    /// Whether this runner gives local and global layers KV-cache groups.
    fn kv_groups(&self) -> bool {
        self.hybrid_kv_cache && self.ops().capabilities().kv_groups
    }

    /// The cache's geometry, KV-cache groups included (one rank's: its KV
    /// heads).
    pub fn kv_cache_spec(&self, block_size: usize) -> KvCacheSpec {
        self.rank_spec(&self.ranks[0], block_size)
    }

    fn rank_spec(&self, rank: &Rank<O>, block_size: usize) -> KvCacheSpec {
        rank.model.kv_cache_spec(block_size, self.kv_cache_dtype, self.kv_groups())
    }
}

impl<O: Ops> Rank<O> {
    /// One step of the whole model ([`run_step`]).
    fn step(&mut self, batch: &ForwardBatch, block_size: usize, whole: bool) -> vellum_base::Result<RankOutput> {
        run_step(&self.ops, &*self.model, self.cache.as_mut(), batch, block_size, whole)
    }

    /// [`step`](Self::step) as one rank of a group: a rank that fails or
    /// panics fails the group ([`Ops::fail_group`]) before it returns or
    /// unwinds, so that the others leave their collectives with an error
    /// instead of waiting for it.
    fn step_in_group(&mut self, batch: &ForwardBatch, block_size: usize) -> vellum_base::Result<RankOutput> {
        let Rank { ops, model, cache } = self;
        let run = std::panic::AssertUnwindSafe(|| run_step(&*ops, &**model, cache.as_mut(), batch, block_size, false));
        match std::panic::catch_unwind(run) {
            Ok(out) => {
                if out.is_err() {
                    ops.fail_group();
                }
                out
            }
            Err(panic) => {
                // Outside the unwind, where a backend may abort its
                // communicators; then the panic goes on to the caller.
                ops.fail_group();
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl<O: Ops> ModelExecutor for ModelRunner<O> {
    fn describe(&self) -> String {
        match self.ranks.len() {
            1 => self.ops().describe(),
            n => format!("{}, tensor parallel over {n} ranks", self.ops().describe()),
        }
    }

    /// A block's bytes on every rank together (each holds its KV heads).
    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        self.ranks.iter().map(|r| self.rank_spec(r, block_size).block_bytes()).sum()
    }

    /// The memory the cache can take, in bytes of the whole group's blocks
    /// ([`kv_block_bytes`](ModelExecutor::kv_block_bytes)). A cache in host
    /// memory is one budget the ranks share; on devices of their own, the
    /// rank that fits the fewest of its blocks sets the count (its figures
    /// are scaled from its block size to the group's).
    fn kv_memory(&self, block_size: usize) -> KvMemory {
        let group_bytes = self.kv_block_bytes(block_size).max(1);
        let mut fewest: Option<KvMemory> = None;
        for rank in &self.ranks {
            let spec = self.rank_spec(rank, block_size);
            let mut memory = rank.ops.kv_memory(&spec);
            let scale = group_bytes as f64 / spec.block_bytes().max(1) as f64;
            if let Some(device) = &mut memory.device {
                device.activation_peak_bytes = self.activation_peak;
                device.graph_reserve_bytes = self.graph_reserve;
                if self.ranks.len() > 1 {
                    let by = |bytes: u64| (bytes as f64 * scale) as u64;
                    memory.available_bytes = by(memory.available_bytes);
                    *device = vellum_base::DeviceMemory {
                        total_bytes: by(device.total_bytes),
                        free_bytes: by(device.free_bytes),
                        activation_peak_bytes: by(device.activation_peak_bytes),
                        graph_reserve_bytes: by(device.graph_reserve_bytes),
                    };
                }
            }
            fewest = Some(match fewest {
                None => memory,
                Some(f) => {
                    let max_blocks = match (f.max_blocks, memory.max_blocks) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    let pick = if memory.available_bytes < f.available_bytes { memory } else { f };
                    KvMemory { max_blocks, ..pick }
                }
            });
        }
        fewest.unwrap_or(KvMemory { available_bytes: 0, max_blocks: None, device: None })
    }

    fn profile_run(&mut self, num_tokens: usize, num_seqs: usize, max_model_len: usize, block_size: usize) -> vellum_base::Result<u64> {
        // Within the model's positions; one sequence at least, a token each.
        let num_tokens = num_tokens.min(self.config().max_position_embeddings).max(1);
        let num_seqs = num_seqs.clamp(1, num_tokens);
        self.activation_peak = self.profile(num_tokens, num_seqs, max_model_len, block_size)?;
        self.graph_reserve = self.profile_graphs(num_tokens, num_seqs, max_model_len, block_size)?;
        Ok(self.activation_peak)
    }

    fn calibrate(&mut self, token_ids: &[u32]) -> vellum_base::Result<()> {
        let n = token_ids.len().min(self.config().max_position_embeddings);
        // An FP8 cache takes its per-layer scales from the largest keys and
        // values of this pass (recorded by write_kv while calibrating).
        let scaled_kv = self.kv_cache_dtype.is_scaled();
        if !(self.ops().wants_calibration() || scaled_kv) || n == 0 {
            return Ok(());
        }
        let block_size = self.block_size.unwrap_or(16);
        let mut batch = profile_batch(n, 1, block_size, self.kv_cache_spec(block_size).groups.num_groups());
        batch.token_ids.copy_from_slice(&token_ids[..n]);
        // Up to 64 rows, spread over the text, reach the LM head.
        let every = n.div_ceil(CALIBRATION_LOGIT_ROWS);
        batch.logits_indices = (0..n as u32).rev().step_by(every).collect::<Vec<_>>().into_iter().rev().collect();
        batch.hidden_states = !self.ranks[0].model.has_lm_head();
        // Caches of their own; the engine's, if any, are put back after.
        let saved: Vec<_> = self.ranks.iter_mut().map(|r| r.cache.take()).collect();
        let (saved_block_size, saved_num_blocks) = (self.block_size, self.num_blocks);
        // The pass itself stores its keys and values exactly: the scales
        // it measures are not known yet.
        let dtype = self.kv_cache_dtype;
        if scaled_kv {
            self.kv_cache_dtype = KvCacheDtype::F32;
        }
        let allocated = self.initialize_kv_cache(n.div_ceil(block_size), 0, block_size);
        self.kv_cache_dtype = dtype;
        allocated?;
        self.ranks.iter().for_each(|r| r.ops.set_calibrating(true));
        let recorded = self.execute(&batch);
        self.ranks.iter().for_each(|r| r.ops.set_calibrating(false));
        // The second pass fixes every weight's choice now, not in the first
        // request (an FP8 cache alone needs none: its scales are taken when
        // it is allocated).
        let fixed = if self.ops().wants_calibration() { recorded.and_then(|_| self.execute(&batch)) } else { recorded };
        for (rank, cache) in self.ranks.iter_mut().zip(saved) {
            rank.cache = cache;
        }
        self.block_size = saved_block_size;
        self.num_blocks = saved_num_blocks;
        fixed.map(|_| ())
    }

    fn kv_group_windows(&self) -> Vec<Option<usize>> {
        self.ranks[0].model.kv_cache_groups(self.kv_groups()).windows()
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> vellum_base::Result<()> {
        // Drop the old caches first so their memory is free for the new ones.
        self.drop_caches();
        let specs: Vec<KvCacheSpec> = self.ranks.iter().map(|r| self.rank_spec(r, block_size)).collect();
        for (rank, spec) in self.ranks.iter_mut().zip(specs) {
            rank.ops.capabilities().check(rank.ops.name(), &AttentionRequirements::of(&spec))?;
            rank.cache = Some(rank.ops.allocate_kv_cache(&spec, num_blocks, num_host_blocks)?);
        }
        self.block_size = Some(block_size);
        self.num_blocks = num_blocks;
        Ok(())
    }

    fn capture_graphs(&mut self, max_num_seqs: usize) -> vellum_base::Result<Option<GraphCapture>> {
        let block_size = self.block_size.ok_or_else(|| Error::Backend("capture_graphs before initialize_kv_cache".into()))?;
        let groups = self.kv_cache_spec(block_size).groups.num_groups();
        let started = std::time::Instant::now();
        let mut graphs = 0;
        // As far as the cache has a block for each sequence.
        for rows in self.recorded_sizes(max_num_seqs).into_iter().rev() {
            // One token and one block of its own per sequence; the first run
            // warms the shape up, the second records it.
            let mut batch = profile_batch(rows, rows, block_size, groups);
            batch.argmax_only = true;
            if batch.block_tables.iter().any(|&b| b as usize >= self.num_blocks) {
                continue;
            }
            for _ in 0..2 {
                self.execute(&batch)?;
            }
            graphs += 1;
        }
        if graphs == 0 {
            return Ok(None);
        }
        Ok(Some(GraphCapture {
            graphs,
            seconds: started.elapsed().as_secs_f64(),
            memory_bytes: self.ops().graph_memory(),
            reserved_bytes: self.graph_reserve,
        }))
    }

    fn samples_on_device(&self) -> bool {
        // A tensor-parallel group's logits are gathered on the host.
        matches!(&self.ranks[..], [rank] if rank.ops.samples_on_device())
    }

    fn execute(&mut self, batch: &ForwardBatch) -> vellum_base::Result<StepOutput> {
        let block_size = self.block_size.ok_or_else(|| Error::Backend("execute before initialize_kv_cache".into()))?;
        let config = self.ranks[0].model.config();
        let (vocab_size, hidden_size) = (config.vocab_size, config.hidden_size);
        if let [rank] = &mut self.ranks[..] {
            return Ok(match rank.step(batch, block_size, true)? {
                RankOutput::Hidden(hidden_states) => StepOutput { vocab_size, hidden_states, hidden_size, ..StepOutput::default() },
                RankOutput::Argmax(argmax) => StepOutput { vocab_size, argmax, ..StepOutput::default() },
                RankOutput::Samples(samples) => StepOutput { vocab_size, samples, ..StepOutput::default() },
                RankOutput::Logits(logits) => StepOutput { logits, vocab_size, ..StepOutput::default() },
            });
        }
        let outputs = run_group(&mut self.ranks, batch, block_size);
        if outputs.iter().any(|o| o.is_err()) {
            // Every rank has left the step: the group can start over (where
            // the backend can), and the error is the failing rank's own,
            // not another rank's report that the group failed.
            self.ranks.iter().for_each(|r| r.ops.reset_group());
            let errors: Vec<Error> = outputs.into_iter().filter_map(|o| o.err()).collect();
            let own = errors.iter().position(|e| !e.to_string().contains(crate::ops::GROUP_FAILED)).unwrap_or(0);
            return Err(errors.into_iter().nth(own).unwrap_or_else(|| Error::Backend("tensor parallel: a rank failed".into())));
        }
        let mut shards = Vec::with_capacity(outputs.len());
        for (rank, output) in self.ranks.iter().zip(outputs) {
            match output? {
                // Every rank ends the pass with the same hidden states.
                RankOutput::Hidden(hidden_states) => {
                    return Ok(StepOutput { vocab_size, hidden_states, hidden_size, ..StepOutput::default() });
                }
                RankOutput::Logits(logits) => shards.push((rank.model.tensor_parallel().vocab(rank.model.config()), logits)),
                RankOutput::Argmax(_) | RankOutput::Samples(_) => {
                    return Err(Error::Backend("a rank of a tensor-parallel group returned sampled ids".into()))
                }
            }
        }
        let rows = batch.logits_indices.len();
        let mut logits = vec![0f32; rows * vocab_size];
        for (vocab, shard) in &shards {
            if shard.len() != rows * vocab.len() {
                return Err(Error::Backend(format!(
                    "tensor parallel: a rank returned {} logits for {rows} rows of its {} vocabulary rows",
                    shard.len(),
                    vocab.len()
                )));
            }
            for (row, part) in logits.chunks_exact_mut(vocab_size).zip(shard.chunks_exact(vocab.len().max(1))) {
                row[vocab.clone()].copy_from_slice(part);
            }
        }
        for ((_, shard), rank) in shards.into_iter().zip(&self.ranks) {
            rank.ops.reuse_host_buffer(shard);
        }
        Ok(StepOutput { logits, vocab_size, ..StepOutput::default() })
    }

    fn recycle_logits(&mut self, logits: Vec<f32>) {
        self.ops().reuse_host_buffer(logits);
    }
}

impl<O: Ops> ModelRunner<O> {
    /// The activation peak of one step of `num_tokens` prompt tokens in
    /// `num_seqs` sequences (thesis §4.2.1), on a cache just big enough for
    /// it, with the attention workspace of contexts up to `max_context`.
    fn profile(&mut self, num_tokens: usize, num_seqs: usize, max_context: usize, block_size: usize) -> vellum_base::Result<u64> {
        let mut batch = profile_batch(num_tokens, num_seqs, block_size, self.kv_cache_spec(block_size).groups.num_groups());
        batch.hidden_states = !self.ranks[0].model.has_lm_head();
        let blocks = batch.block_tables.iter().copied().max().map_or(1, |b| b as usize + 1);
        // A cache just big enough for the batch; the real one replaces it.
        self.initialize_kv_cache(blocks, 0, block_size)?;
        let before: Option<Vec<u64>> = self.ranks.iter().map(|r| r.ops.begin_memory_profile()).collect();
        let Some(before) = before else {
            self.drop_caches();
            return Ok(0);
        };
        let out = self.execute(&batch);
        // The dummy cache goes before the peak is read: the read waits for
        // the device and hands the pool's free memory back, this cache's
        // included, so that the free memory the KV cache is sized from does
        // not count it (the high-water mark keeps what the run took).
        self.drop_caches();
        let mut peak = 0;
        for (rank, before) in self.ranks.iter().zip(before) {
            let c = rank.model.config();
            let heads = rank.model.tensor_parallel().q_heads(c).len();
            let workspace = rank.ops.attention_workspace_bytes(num_tokens, heads, c.head_dim, max_context);
            let taken = rank.ops.memory_profile_peak().unwrap_or(before).saturating_sub(before);
            peak = peak.max(taken + workspace);
        }
        out?;
        Ok(peak)
    }

    /// The memory recorded steps (CUDA graphs) will hold beside the eager
    /// steps' pool: half again what an eager decode step of the most rows a
    /// graph has takes (its attention bounded by a power of two of the
    /// context); a backend that records mixed steps too has graphs of up to
    /// `num_tokens` (the step budget) tokens, within its capture sizes. The
    /// graphs of every size share most of their memory: on an H100 all 35
    /// sizes up to 256 rows held 1.43 times that step's peak for SmolLM2's
    /// shape and 1.04 times for Llama 3 8B's. 0 for a backend that records
    /// none.
    fn profile_graphs(&mut self, num_tokens: usize, num_seqs: usize, max_model_len: usize, block_size: usize) -> vellum_base::Result<u64> {
        let Some(mut rows) = self.recorded_sizes(num_seqs).last().copied() else {
            return Ok(0);
        };
        if self.ops().graphs_record_mixed_steps() {
            // A mixed step of the whole step budget, padded, or of the
            // largest capture size (a longer one runs eagerly).
            let sizes = self.ops().graph_sizes();
            if let Some(&mixed) = sizes.iter().find(|&&s| s >= num_tokens).or(sizes.last()) {
                rows = rows.max(mixed);
            }
        }
        // A decode step of `rows` sequences: every row reaches the LM head,
        // which bounds a mixed step of as many tokens.
        let eager = self.profile(rows, rows, max_model_len.next_power_of_two(), block_size)?;
        Ok(eager + eager / 2)
    }

    /// The batch sizes of the decode steps the backend records for batches
    /// of up to `num_seqs` sequences: every capture size up to the one such
    /// a batch pads to. None for a tensor-parallel group or a model without
    /// an LM head (its steps return hidden states).
    fn recorded_sizes(&self, num_seqs: usize) -> Vec<usize> {
        if self.ranks.len() > 1 || !self.ranks[0].model.has_lm_head() {
            return Vec::new();
        }
        let mut sizes = self.ops().graph_sizes();
        if let Some(padded) = sizes.iter().position(|&s| s >= num_seqs) {
            sizes.truncate(padded + 1);
        }
        sizes
    }

    fn drop_caches(&mut self) {
        for rank in &mut self.ranks {
            // Recorded steps address the cache's pools.
            rank.ops.release_graphs();
            rank.cache = None;
        }
    }
}

/// One step of one rank: block copies and swaps, the step's inputs, the
/// forward pass. `whole`: the model is not split, so the backend's own
/// thread pool may take the pass and its argmax may stand for the logits.
fn run_step<O: Ops>(
    ops: &O,
    model: &dyn CausalLm<O>,
    cache: Option<&mut O::KvCache>,
    batch: &ForwardBatch,
    block_size: usize,
    whole: bool,
) -> vellum_base::Result<RankOutput> {
    let cache = cache.ok_or_else(|| Error::Backend("execute before initialize_kv_cache".into()))?;
    ops.swap_blocks(cache, &batch.block_ops.swap_out, true)?;
    ops.swap_blocks(cache, &batch.block_ops.swap_in, false)?;
    ops.copy_blocks(cache, &batch.block_ops.copies)?;
    if batch.token_ids.is_empty() {
        // A step that only moves blocks (its preemptions' swap-outs).
        return Ok(if batch.hidden_states { RankOutput::Hidden(Vec::new()) } else { RankOutput::Logits(Vec::new()) });
    }
    let step = ops.prepare_step(batch, block_size)?;
    // A rank of a group runs on its own thread: handing the pass to a
    // shared pool could park a rank waiting in an all-reduce on a worker
    // another rank needs.
    if batch.hidden_states {
        let hidden =
            if whole { ops.run_forward(|| model.forward_hidden(ops, cache, &step)) } else { model.forward_hidden(ops, cache, &step) }?;
        return Ok(RankOutput::Hidden(ops.take_host(hidden)?));
    }
    let logits = if whole {
        ops.run_forward(|| ops.run_graph(&step, &mut || model.forward(ops, &mut *cache, &step)))
    } else {
        model.forward(ops, cache, &step)
    }?;
    if whole && batch.argmax_only {
        if let Some(argmax) = ops.argmax_rows(&logits)? {
            return Ok(RankOutput::Argmax(argmax));
        }
    }
    if whole && !batch.sampling.is_empty() {
        if let Some(samples) = ops.sample_rows(&logits, &batch.sampling, &batch.penalties)? {
            return Ok(RankOutput::Samples(samples));
        }
    }
    Ok(RankOutput::Logits(ops.take_host(logits)?))
}

/// One step on every rank of a group, each on a thread of its own (rank 0
/// on this one), returning each rank's output in rank order.
fn run_group<O: Ops>(ranks: &mut [Rank<O>], batch: &ForwardBatch, block_size: usize) -> Vec<vellum_base::Result<RankOutput>> {
    let Some((first, rest)) = ranks.split_first_mut() else {
        return Vec::new();
    };
    std::thread::scope(|s| {
        let others: Vec<_> = rest.iter_mut().map(|rank| s.spawn(move || rank.step_in_group(batch, block_size))).collect();
        let mut outputs = vec![first.step_in_group(batch, block_size)];
        for handle in others {
            outputs.push(handle.join().unwrap_or_else(|_| Err(Error::Backend("a tensor-parallel rank panicked".into()))));
        }
        outputs
    })
}

/// Rows of a calibration pass whose logits are computed (the LM head's
/// inputs for its statistics).
const CALIBRATION_LOGIT_ROWS: usize = 64;

/// The profile run's batch: `num_tokens` prompt tokens (id 0) in `num_seqs`
/// sequences of equal length (the last takes the remainder), each in blocks
/// of its own, the largest prefill step the scheduler can form; every
/// token's logits are computed (the worst case: a step of prompt logprobs),
/// and only their argmax comes back where the backend can do that; every
/// KV-cache group gets the same tables.
fn profile_batch(num_tokens: usize, num_seqs: usize, block_size: usize, groups: usize) -> ForwardBatch {
    let groups = groups.max(1);
    let per_seq = num_tokens / num_seqs;
    let lens: Vec<usize> = (0..num_seqs).map(|i| if i + 1 == num_seqs { num_tokens - per_seq * i } else { per_seq }).collect();
    let stride = lens.iter().map(|l| l.div_ceil(block_size)).max().unwrap_or(1);
    let mut b = ForwardBatch {
        block_table_stride: stride,
        num_kv_groups: groups,
        query_start_loc: vec![0],
        argmax_only: true,
        ..ForwardBatch::default()
    };
    let (mut tables, mut slots, mut next_block) = (vec![0u32; num_seqs * stride], Vec::new(), 0u32);
    for (s, &len) in lens.iter().enumerate() {
        for blk in 0..len.div_ceil(block_size) {
            tables[s * stride + blk] = next_block + blk as u32;
        }
        for pos in 0..len {
            b.logits_indices.push(b.token_ids.len() as u32);
            b.token_ids.push(0);
            b.positions.push(pos as u32);
            slots.push(next_block * block_size as u32 + pos as u32);
        }
        next_block += len.div_ceil(block_size) as u32;
        let end = b.query_start_loc[s] + len as u32;
        b.query_start_loc.push(end);
        b.context_lens.push(len as u32);
    }
    for _ in 0..groups {
        b.slot_mapping.extend_from_slice(&slots);
        b.block_tables.extend_from_slice(&tables);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::profile_batch;

    #[test]
    fn the_profile_batch_is_well_formed_for_every_split() {
        for (tokens, seqs, bs, groups) in [(2048, 256, 16, 1), (2048, 1, 16, 2), (100, 7, 16, 1), (5, 5, 8, 3)] {
            let b = profile_batch(tokens, seqs, bs, groups);
            assert_eq!((b.num_tokens(), b.num_seqs(), b.kv_groups()), (tokens, seqs, groups));
            let bounds = b.step_bounds(bs).expect("a valid batch");
            // Every slot lies in its sequence's own blocks, and no two tokens share one.
            let mut seen = std::collections::HashSet::new();
            for (t, &slot) in b.slot_mapping[..tokens].iter().enumerate() {
                assert!(seen.insert(slot), "slot {slot} used twice");
                let s = bounds.token_seq[t] as usize;
                let blk = (slot as usize) / bs;
                assert!(b.block_tables[s * b.block_table_stride..(s + 1) * b.block_table_stride].contains(&(blk as u32)));
            }
            assert_eq!(b.logits_indices.len(), tokens, "every token's logits");
        }
    }
}
