//! [`ModelRunner`]: the one [`ModelExecutor`], generic over the backend.
//!
//! ```text
//! execute(batch) ─ swap_blocks(out) ─ swap_blocks(in) ─ copy_blocks
//!                ─ prepare_step(batch)            (per-step inputs, once)
//!                ─ model.forward(ops, cache, step) (every layer's ops)
//!                ─ take_host(logits), or argmax_rows(logits) when the
//!                  batch is argmax_only and the backend computes it
//! ```

use crate::ops::Ops;
use crate::registry::{load_model, CausalLm};
use crate::{Result, WeightSource};
use vellum_base::{
    AttentionRequirements, Error, ForwardBatch, KvCacheDtype, KvCacheSpec, KvMemory, ModelConfig, ModelExecutor, StepOutput,
};

/// A model loaded on backend `O`, with the paged KV cache `O` allocates.
pub struct ModelRunner<O: Ops> {
    ops: O,
    model: Box<dyn CausalLm<O>>,
    kv_cache_dtype: KvCacheDtype,
    /// KV-cache groups for models that mix local and global layers.
    hybrid_kv_cache: bool,
    /// The cache and its block size, once allocated.
    cache: Option<(O::KvCache, usize)>,
    /// What the profile run measured (bytes of activations at the peak).
    activation_peak: u64,
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
        Ok(Self { ops, model, kv_cache_dtype: KvCacheDtype::F32, hybrid_kv_cache: true, cache: None, activation_peak: 0 })
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
}

/// Whether `ops` runs `config` with `options` ([`ModelRunner::load_with`]).
pub fn check_supported<O: Ops>(ops: &O, config: &ModelConfig, options: &RunnerOptions) -> vellum_base::Result<()> {
    let wanted = AttentionRequirements { head_dim: config.head_dim, block_size: options.block_size, kv_dtype: options.kv_cache_dtype };
    ops.capabilities().check(ops.name(), &wanted)
}

impl<O: Ops> ModelRunner<O> {
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

    /// The backend's operations.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// Whether this runner gives local and global layers KV-cache groups.
    fn kv_groups(&self) -> bool {
        self.hybrid_kv_cache && self.ops.capabilities().kv_groups
    }

    /// The cache's geometry, KV-cache groups included.
    pub fn kv_cache_spec(&self, block_size: usize) -> KvCacheSpec {
        self.model.kv_cache_spec(block_size, self.kv_cache_dtype, self.kv_groups())
    }
}

impl<O: Ops> ModelExecutor for ModelRunner<O> {
    fn describe(&self) -> String {
        self.ops.describe()
    }

    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        self.kv_cache_spec(block_size).block_bytes()
    }

    fn kv_memory(&self, block_size: usize) -> KvMemory {
        let mut memory = self.ops.kv_memory(&self.kv_cache_spec(block_size));
        if let Some(device) = &mut memory.device {
            device.activation_peak_bytes = self.activation_peak;
        }
        memory
    }

    fn profile_run(&mut self, num_tokens: usize, num_seqs: usize, max_model_len: usize, block_size: usize) -> vellum_base::Result<u64> {
        // Within the model's positions; one sequence at least, a token each.
        let num_tokens = num_tokens.min(self.config().max_position_embeddings).max(1);
        let num_seqs = num_seqs.clamp(1, num_tokens);
        let batch = profile_batch(num_tokens, num_seqs, block_size, self.kv_cache_spec(block_size).groups.num_groups());
        let blocks = batch.block_tables.iter().copied().max().map_or(1, |b| b as usize + 1);
        // A cache just big enough for the batch; the real one replaces it.
        self.initialize_kv_cache(blocks, 0, block_size)?;
        let Some(before) = self.ops.begin_memory_profile() else {
            self.cache = None;
            return Ok(0);
        };
        let out = self.execute(&batch);
        // The dummy cache goes before the peak is read: the read waits for
        // the device and hands the pool's free memory back, this cache's
        // included, so that the free memory the KV cache is sized from does
        // not count it (the high-water mark keeps what the run took).
        self.cache = None;
        let peak = self.ops.memory_profile_peak();
        out?;
        let c = self.config();
        let workspace = self.ops.attention_workspace_bytes(num_tokens, c.num_attention_heads, c.head_dim, max_model_len);
        self.activation_peak = peak.unwrap_or(before).saturating_sub(before) + workspace;
        Ok(self.activation_peak)
    }

    fn calibrate(&mut self, token_ids: &[u32]) -> vellum_base::Result<()> {
        let n = token_ids.len().min(self.config().max_position_embeddings);
        if !self.ops.wants_calibration() || n == 0 {
            return Ok(());
        }
        let block_size = self.cache.as_ref().map_or(16, |c| c.1);
        let mut batch = profile_batch(n, 1, block_size, self.kv_cache_spec(block_size).groups.num_groups());
        batch.token_ids.copy_from_slice(&token_ids[..n]);
        // Up to 64 rows, spread over the text, reach the LM head.
        let every = n.div_ceil(CALIBRATION_LOGIT_ROWS);
        batch.logits_indices = (0..n as u32).rev().step_by(every).collect::<Vec<_>>().into_iter().rev().collect();
        // A cache of its own; the engine's, if any, is put back after.
        let saved = self.cache.take();
        self.initialize_kv_cache(n.div_ceil(block_size), 0, block_size)?;
        self.ops.set_calibrating(true);
        let recorded = self.execute(&batch);
        self.ops.set_calibrating(false);
        // The second pass fixes every weight's choice now, not in the first request.
        let fixed = recorded.and_then(|_| self.execute(&batch));
        self.cache = saved;
        fixed.map(|_| ())
    }

    fn kv_group_windows(&self) -> Vec<Option<usize>> {
        self.model.kv_cache_groups(self.kv_groups()).windows()
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> vellum_base::Result<()> {
        // Drop the old cache first so its memory is free for the new one.
        self.cache = None;
        let spec = self.kv_cache_spec(block_size);
        self.ops.capabilities().check(self.ops.name(), &AttentionRequirements::of(&spec))?;
        let cache = self.ops.allocate_kv_cache(&spec, num_blocks, num_host_blocks)?;
        self.cache = Some((cache, block_size));
        Ok(())
    }

    fn execute(&mut self, batch: &ForwardBatch) -> vellum_base::Result<StepOutput> {
        let (cache, block_size) = self.cache.as_mut().ok_or_else(|| Error::Backend("execute before initialize_kv_cache".into()))?;
        let ops = &self.ops;
        ops.swap_blocks(cache, &batch.block_ops.swap_out, true)?;
        ops.swap_blocks(cache, &batch.block_ops.swap_in, false)?;
        ops.copy_blocks(cache, &batch.block_ops.copies)?;
        let step = ops.prepare_step(batch, *block_size)?;
        let model = &*self.model;
        let vocab_size = model.config().vocab_size;
        if batch.hidden_states {
            let hidden = ops.run_forward(|| model.forward_hidden(ops, cache, &step))?;
            let hidden_size = model.config().hidden_size;
            return Ok(StepOutput { vocab_size, hidden_states: ops.take_host(hidden)?, hidden_size, ..StepOutput::default() });
        }
        let logits = ops.run_forward(|| model.forward(ops, cache, &step))?;
        if batch.argmax_only {
            if let Some(argmax) = ops.argmax_rows(&logits)? {
                return Ok(StepOutput { vocab_size, argmax, ..StepOutput::default() });
            }
        }
        Ok(StepOutput { logits: ops.take_host(logits)?, vocab_size, ..StepOutput::default() })
    }

    fn recycle_logits(&mut self, logits: Vec<f32>) {
        self.ops.reuse_host_buffer(logits);
    }
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
