//! The Llama family: `LlamaForCausalLM` (Llama 2/3.x, SmolLM2, TinyLlama),
//! `MistralForCausalLM`, `Qwen2ForCausalLM` (q/k/v bias) and
//! `Qwen3ForCausalLM` (per-head q/k RMSNorm) — one definition, any backend.
//!
//! ```text
//!  token ids ─ embed ─┬─ RMSNorm ─ q,k,v ─ (q/k norm) ─ RoPE ─ paged attention ─ o ─(+)─┐
//!                     └──────────────────────────────────────────────────────────────────┘
//!                     ┌─ RMSNorm ─ gate,up ─ silu·mul ─ down ─(+)─┐   × num_hidden_layers
//!                     └───────────────────────────────────────────┘
//!  rows of logits_indices ─ RMSNorm ─ lm_head (tied: embed) ─ logits
//! ```
//!
//! Under tensor parallelism a rank holds its heads, its MLP columns and its
//! vocabulary rows ([`TensorParallel`]); the outputs of `o` and `down` (and
//! the embedding) are summed over the ranks, the logits gathered.

use crate::ops::{OpResult, Ops};
use crate::registry::CausalLm;
use crate::rope::RopeTable;
use crate::tensor_parallel::{embed, ShardLoader, TensorParallel};
use crate::{Result, WeightSource};
use vellum_base::{AttentionShape, ModelConfig};

struct Layer<O: Ops> {
    input_norm: O::Vector,
    post_attention_norm: O::Vector,
    q_proj: O::Weight,
    k_proj: O::Weight,
    v_proj: O::Weight,
    o_proj: O::Weight,
    qkv_bias: Option<[O::Vector; 3]>,
    qk_norm: Option<[O::Vector; 2]>,
    gate_proj: O::Weight,
    up_proj: O::Weight,
    down_proj: O::Weight,
}

/// A loaded Llama-family model on backend `O`: the whole model, or one
/// rank's part of it under tensor parallelism.
pub struct LlamaModel<O: Ops> {
    config: ModelConfig,
    tp: TensorParallel,
    /// The first vocabulary row of this rank's embedding and LM head.
    vocab_start: usize,
    embed_tokens: O::Weight,
    lm_head: Option<O::Weight>,
    norm: O::Vector,
    layers: Vec<Layer<O>>,
    rope: O::Rope,
    /// This rank's heads.
    attention: AttentionShape,
}

impl<O: Ops> LlamaModel<O> {
    /// Loads every weight through `ops`, checking shapes against `config`.
    /// `progress(done, total)` is called after each layer.
    pub fn load(ops: &O, weights: &dyn WeightSource, config: ModelConfig, progress: impl FnMut(usize, usize)) -> Result<Self> {
        Self::load_shard(ops, weights, config, TensorParallel::SINGLE, progress)
    }

    /// Loads rank `tp`'s part of every weight ([`TensorParallel`]: its
    /// heads, its MLP columns, its vocabulary rows), shapes checked against
    /// `config`, which stays the whole model's.
    pub fn load_shard(
        ops: &O,
        weights: &dyn WeightSource,
        config: ModelConfig,
        tp: TensorParallel,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        TensorParallel::check(tp.size, &config)?;
        let (h, hd) = (config.hidden_size, config.head_dim);
        let (nq, nkv) = (config.num_attention_heads * hd, config.num_key_value_heads * hd);
        let im = config.intermediate_size;
        let shard = tp.shard(&config);
        let load = ShardLoader { ops, weights };
        let vec = |name: &str, len: usize| -> Result<O::Vector> { Ok(ops.vector(name, &weights.tensor_f32_shaped(name, &[len])?.data)?) };
        let embed_tokens = load.embedding("model.embed_tokens.weight", [config.vocab_size, h], shard.vocab.clone())?;
        let lm_head = if config.tie_word_embeddings || !weights.contains("lm_head.weight") {
            None
        } else {
            Some(load.column("lm_head.weight", [config.vocab_size, h], shard.vocab.clone())?)
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let qkv_bias = if config.attention_bias {
                Some([
                    load.vector(&p("self_attn.q_proj.bias"), nq, shard.q_cols.clone())?,
                    load.vector(&p("self_attn.k_proj.bias"), nkv, shard.kv_cols.clone())?,
                    load.vector(&p("self_attn.v_proj.bias"), nkv, shard.kv_cols.clone())?,
                ])
            } else {
                None
            };
            let qk_norm = if config.qk_norm {
                Some([vec(&p("self_attn.q_norm.weight"), hd)?, vec(&p("self_attn.k_norm.weight"), hd)?])
            } else {
                None
            };
            layers.push(Layer {
                input_norm: vec(&p("input_layernorm.weight"), h)?,
                post_attention_norm: vec(&p("post_attention_layernorm.weight"), h)?,
                q_proj: load.column(&p("self_attn.q_proj.weight"), [nq, h], shard.q_cols.clone())?,
                k_proj: load.column(&p("self_attn.k_proj.weight"), [nkv, h], shard.kv_cols.clone())?,
                v_proj: load.column(&p("self_attn.v_proj.weight"), [nkv, h], shard.kv_cols.clone())?,
                o_proj: load.row(&p("self_attn.o_proj.weight"), [h, nq], shard.q_cols.clone())?,
                qkv_bias,
                qk_norm,
                gate_proj: load.column(&p("mlp.gate_proj.weight"), [im, h], shard.mlp.clone())?,
                up_proj: load.column(&p("mlp.up_proj.weight"), [im, h], shard.mlp.clone())?,
                down_proj: load.row(&p("mlp.down_proj.weight"), [h, im], shard.mlp.clone())?,
            });
            progress(i + 1, config.num_hidden_layers);
        }
        let norm = vec("model.norm.weight", h)?;
        let rope = ops.rope_table(&RopeTable::new(&config))?;
        let attention = AttentionShape::new(shard.q_heads.len(), shard.kv_heads.len(), hd);
        Ok(Self { config, tp, vocab_start: shard.vocab.start, embed_tokens, lm_head, norm, layers, rope, attention })
    }
}

impl<O: Ops> CausalLm<O> for LlamaModel<O> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor_parallel(&self) -> TensorParallel {
        self.tp
    }

    fn forward_hidden(&self, ops: &O, cache: &mut O::KvCache, step: &O::Step) -> OpResult<O::Tensor> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let mut h = embed(ops, &self.embed_tokens, step, self.tp, self.vocab_start, c.vocab_size)?;
        // The previous block's MLP output, added to the residual stream by
        // the next block's input norm (one fused op where the backend has it).
        let mut pending: Option<O::Tensor> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = match pending.take() {
                Some(out) => ops.add_rms_norm(&mut h, out, &layer.input_norm, eps, c.hidden_size)?,
                None => ops.rms_norm(&h, &layer.input_norm, eps, c.hidden_size)?,
            };
            let bias = layer.qkv_bias.as_ref();
            let mut q = ops.linear(&x, &layer.q_proj, bias.map(|b| &b[0]))?;
            let mut k = ops.linear(&x, &layer.k_proj, bias.map(|b| &b[1]))?;
            let v = ops.linear(&x, &layer.v_proj, bias.map(|b| &b[2]))?;
            if let Some([qn, kn]) = &layer.qk_norm {
                q = ops.rms_norm(&q, qn, eps, c.head_dim)?;
                k = ops.rms_norm(&k, kn, eps, c.head_dim)?;
            }
            ops.rope_qk(&mut q, &mut k, &self.rope, step)?;
            // Each layer's own window (Qwen's `layer_types` mix full and
            // sliding layers; Mistral slides everywhere).
            let shape = AttentionShape { sliding_window: c.layer_window(l), ..self.attention };
            let attn = ops.attention(cache, l, &q, &k, &v, step, &shape)?;
            let mut out = ops.linear(&attn, &layer.o_proj, None)?;
            ops.all_reduce(&mut out)?;
            let x = ops.add_rms_norm(&mut h, out, &layer.post_attention_norm, eps, c.hidden_size)?;
            let act = ops.silu_mul(&ops.linear(&x, &layer.gate_proj, None)?, &ops.linear(&x, &layer.up_proj, None)?)?;
            let mut out = ops.linear(&act, &layer.down_proj, None)?;
            ops.all_reduce(&mut out)?;
            pending = Some(out);
        }
        if let Some(out) = pending {
            ops.add_assign(&mut h, &out)?;
        }
        let last = ops.logits_rows(&h, step)?;
        ops.rms_norm(&last, &self.norm, eps, c.hidden_size)
    }

    fn lm_head(&self, ops: &O, hidden: &O::Tensor) -> OpResult<O::Tensor> {
        ops.linear(hidden, self.lm_head.as_ref().unwrap_or(&self.embed_tokens), None)
    }
}
