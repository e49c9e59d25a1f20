//! [`ModelRunner`]: the one [`ModelExecutor`], generic over the backend.
//!
//! ```text
//! execute(batch) ─ swap_blocks(out) ─ swap_blocks(in) ─ copy_blocks
//!                ─ prepare_step(batch)            (per-step inputs, once)
//!                ─ model.forward(ops, cache, step) (every layer's ops)
//!                ─ take_host(logits)
//! ```

use crate::ops::Ops;
use crate::registry::{load_model, CausalLm};
use crate::{Result, WeightSource};
use vellum_core::{Error, ForwardBatch, KvCacheDtype, KvCacheSpec, KvMemory, ModelConfig, ModelExecutor, StepOutput};

/// A model loaded on backend `O`, with the paged KV cache `O` allocates.
pub struct ModelRunner<O: Ops> {
    ops: O,
    model: Box<dyn CausalLm<O>>,
    kv_cache_dtype: KvCacheDtype,
    /// KV-cache groups for models that mix local and global layers.
    hybrid_kv_cache: bool,
    /// The cache and its block size, once allocated.
    cache: Option<(O::KvCache, usize)>,
}

impl<O: Ops + 'static> ModelRunner<O> {
    /// Loads `weights` (shapes checked against `config`) on `ops`, choosing
    /// the model definition from the architecture registry.
    pub fn load(ops: O, weights: &dyn WeightSource, config: ModelConfig, progress: impl FnMut(usize, usize)) -> Result<Self> {
        let model = load_model(&ops, weights, config, progress)?;
        Ok(Self { ops, model, kv_cache_dtype: KvCacheDtype::F32, hybrid_kv_cache: true, cache: None })
    }
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
        self.hybrid_kv_cache && self.ops.supports_kv_groups()
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
        self.ops.kv_memory(&self.kv_cache_spec(block_size))
    }

    fn kv_group_windows(&self) -> Vec<Option<usize>> {
        self.model.kv_cache_groups(self.kv_groups()).windows()
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> vellum_core::Result<()> {
        // Drop the old cache first so its memory is free for the new one.
        self.cache = None;
        let cache = self.ops.allocate_kv_cache(&self.kv_cache_spec(block_size), num_blocks, num_host_blocks)?;
        self.cache = Some((cache, block_size));
        Ok(())
    }

    fn execute(&mut self, batch: &ForwardBatch) -> vellum_core::Result<StepOutput> {
        let (cache, block_size) = self.cache.as_mut().ok_or_else(|| Error::Backend("execute before initialize_kv_cache".into()))?;
        let ops = &self.ops;
        ops.swap_blocks(cache, &batch.block_ops.swap_out, true)?;
        ops.swap_blocks(cache, &batch.block_ops.swap_in, false)?;
        ops.copy_blocks(cache, &batch.block_ops.copies)?;
        let step = ops.prepare_step(batch, *block_size)?;
        let model = &*self.model;
        let logits = ops.run_forward(|| model.forward(ops, cache, &step))?;
        Ok(StepOutput { logits: ops.take_host(logits)?, vocab_size: model.config().vocab_size })
    }

    fn recycle_logits(&mut self, logits: Vec<f32>) {
        self.ops.reuse_host_buffer(logits);
    }
}
