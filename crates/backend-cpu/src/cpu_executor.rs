//! [`ModelExecutor`] on the CPU: a Llama-family model over a host KV cache.

use crate::cpu_ops::CpuOps;
use crate::kv_cache::{KvCache, KvCacheLayout};
use crate::quant::WeightFormat;
use vellum_core::{AttentionBackend, Error, ForwardBatch, KvCacheDtype, ModelConfig, ModelExecutor, Result, StepOutput};
use vellum_models::ops::Ops;
use vellum_models::{LlamaModel, WeightSource};

/// A model ready to run on the CPU.
pub struct CpuExecutor {
    ops: CpuOps,
    model: LlamaModel<CpuOps>,
    cache: Option<KvCache>,
    kv_cache_dtype: KvCacheDtype,
}

impl CpuExecutor {
    /// Loads `weights` (shapes checked against `config`) in the default
    /// weight format ([`WeightFormat::Auto`], or `VELLUM_CPU_WEIGHTS`).
    pub fn load(weights: &dyn WeightSource, config: ModelConfig, progress: impl FnMut(usize, usize)) -> vellum_models::Result<Self> {
        Self::load_with_format(weights, config, WeightFormat::from_env(), progress)
    }

    /// Loads `weights` with linear layers stored as `format` (the default,
    /// [`WeightFormat::Auto`], keeps a Q4_1 file's 4-bit blocks and runs
    /// integer kernels; [`WeightFormat::F32`] is the f32 reference).
    pub fn load_with_format(
        weights: &dyn WeightSource,
        config: ModelConfig,
        format: WeightFormat,
        progress: impl FnMut(usize, usize),
    ) -> vellum_models::Result<Self> {
        let ops = CpuOps::new(format);
        let model = LlamaModel::load(&ops, weights, config, progress)?;
        Ok(Self { ops, model, cache: None, kv_cache_dtype: KvCacheDtype::F32 })
    }

    /// Stores the KV cache as `dtype` (default `F32`): `f16`/`bf16` halve its
    /// memory (twice the blocks for the same budget) at some accuracy cost;
    /// attention still computes in `f32`. Applies to [`ModelExecutor::kv_block_bytes`]
    /// and to the next [`ModelExecutor::initialize_kv_cache`].
    pub fn with_kv_cache_dtype(mut self, dtype: KvCacheDtype) -> Self {
        self.kv_cache_dtype = dtype;
        self
    }

    /// The element type the KV cache is (or will be) stored in.
    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.kv_cache_dtype
    }

    /// The weight format requested at load.
    pub fn weight_format(&self) -> WeightFormat {
        self.ops.weight_format()
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn layout(&self, num_blocks: usize, block_size: usize) -> KvCacheLayout {
        let c = self.model.config();
        KvCacheLayout { num_blocks, block_size, num_kv_heads: c.num_key_value_heads, head_dim: c.head_dim }
    }
}

impl ModelExecutor for CpuExecutor {
    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        KvCache::block_bytes(&self.layout(1, block_size), self.model.config().num_hidden_layers, self.kv_cache_dtype)
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> Result<()> {
        let layout = self.layout(num_blocks, block_size);
        self.cache = Some(KvCache::new(layout, self.model.config().num_hidden_layers, num_host_blocks, self.kv_cache_dtype));
        Ok(())
    }

    fn execute(&mut self, batch: &ForwardBatch) -> Result<StepOutput> {
        let cache = self.cache.as_mut().ok_or_else(|| Error::Backend("execute before initialize_kv_cache".into()))?;
        self.ops.swap_blocks(cache, &batch.block_ops.swap_out, true)?;
        self.ops.swap_blocks(cache, &batch.block_ops.swap_in, false)?;
        self.ops.copy_blocks(cache, &batch.block_ops.copies)?;
        let block_size = cache.layout.block_size;
        // The pass runs on a rayon worker, so each op's parallel section
        // starts from the pool (one hand-off per step instead of one per op).
        let (model, ops) = (&self.model, &self.ops);
        let logits = rayon::scope(|_| model.forward(ops, cache, batch, block_size));
        Ok(StepOutput { logits: self.ops.to_host(&logits), vocab_size: self.model.config().vocab_size })
    }
}
