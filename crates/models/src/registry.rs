//! From a checkpoint to a runnable model: the [`CausalLm`] contract and the
//! loader that picks a model definition from the architecture registry
//! ([`vellum_base::ARCHITECTURES`]).

use crate::ops::{OpResult, Ops};
use crate::tensor_parallel::TensorParallel;
use crate::{Gemma3Model, LlamaModel, Result, WeightSource};
use vellum_base::{KvCacheDtype, KvCacheGroups, KvCacheSpec, ModelConfig, ModelFamily};

/// A causal language model loaded on backend `O`.
pub trait CausalLm<O: Ops>: Send + Sync {
    /// The model's configuration (the whole model's, on a rank too).
    fn config(&self) -> &ModelConfig;

    /// Whether the model has an LM head (an encoder such as BERT has none:
    /// it only embeds, and a calibration pass stops at its hidden states).
    fn has_lm_head(&self) -> bool {
        true
    }

    /// Which part of the model this is: the whole model, or one rank's
    /// heads, MLP columns and vocabulary rows.
    fn tensor_parallel(&self) -> TensorParallel {
        TensorParallel::SINGLE
    }

    /// Which layers share a block table. Layers that attend alike share
    /// one; local and global layers get KV-cache groups of their own when
    /// the backend supports them (`kv_groups`), else one group that keeps
    /// every block (the window is then only a mask).
    fn kv_cache_groups(&self, kv_groups: bool) -> KvCacheGroups {
        let c = self.config();
        let windows: Vec<Option<usize>> = (0..c.num_hidden_layers).map(|l| c.layer_window(l)).collect();
        let groups = KvCacheGroups::hybrid(&windows);
        if groups.num_groups() > 1 && !kv_groups {
            KvCacheGroups::single(c.num_hidden_layers, None)
        } else {
            groups
        }
    }

    /// The KV cache this model needs, in blocks of `block_size` tokens, of
    /// this rank's KV heads, grouped as [`CausalLm::kv_cache_groups`] says.
    fn kv_cache_spec(&self, block_size: usize, dtype: KvCacheDtype, kv_groups: bool) -> KvCacheSpec {
        let c = self.config();
        KvCacheSpec {
            groups: self.kv_cache_groups(kv_groups),
            num_kv_heads: self.tensor_parallel().kv_heads(c).len(),
            head_dim: c.head_dim,
            block_size,
            dtype,
        }
    }

    /// One forward pass over the step's mixed batch; returns the final
    /// hidden states of the step's logits rows after the model's last norm,
    /// `[rows, hidden_size]` (what pooling reads).
    fn forward_hidden(&self, ops: &O, cache: &mut O::KvCache, step: &O::Step) -> OpResult<O::Tensor>;

    /// The LM head over rows of [`CausalLm::forward_hidden`]: logits,
    /// `[rows, vocab]` (a rank's: the columns of its vocabulary rows).
    fn lm_head(&self, ops: &O, hidden: &O::Tensor) -> OpResult<O::Tensor>;

    /// One forward pass over the step's mixed batch; returns the logits of
    /// the step's logits rows, `[rows, vocab]`.
    fn forward(&self, ops: &O, cache: &mut O::KvCache, step: &O::Step) -> OpResult<O::Tensor> {
        self.lm_head(ops, &self.forward_hidden(ops, cache, step)?)
    }
}

/// Loads the model definition of `config.architecture` on `ops`.
/// `progress(done, total)` is called as layers load.
pub fn load_model<O: Ops + 'static>(
    ops: &O,
    weights: &dyn WeightSource,
    config: ModelConfig,
    progress: impl FnMut(usize, usize),
) -> Result<Box<dyn CausalLm<O>>> {
    load_model_shard(ops, weights, config, TensorParallel::SINGLE, progress)
}

/// [`load_model`] of rank `tp`'s part of the model ([`TensorParallel`]).
pub fn load_model_shard<O: Ops + 'static>(
    ops: &O,
    weights: &dyn WeightSource,
    config: ModelConfig,
    tp: TensorParallel,
    progress: impl FnMut(usize, usize),
) -> Result<Box<dyn CausalLm<O>>> {
    let arch = config.arch().ok_or_else(|| vellum_formats::Error::UnsupportedArchitecture {
        path: Default::default(),
        architecture: config.architecture.clone(),
    })?;
    match arch.family {
        ModelFamily::Llama => Ok(Box::new(LlamaModel::load_shard(ops, weights, config, tp, progress)?)),
        ModelFamily::Gemma3 => Ok(Box::new(Gemma3Model::load_shard(ops, weights, config, tp, progress)?)),
        ModelFamily::Bert => Ok(Box::new(crate::BertModel::load(ops, weights, config, tp, progress)?)),
    }
}
