//! Gemma 3 (text): `Gemma3ForCausalLM`, GGUF architecture `gemma3` —
//! written once against [`Ops`], like the Llama family.
//!
//! ```text
//!  ids ─ embed ·√hidden ─┬─ norm ─ q,k,v ─ q/k norm ─ RoPE(local|global) ─ paged attention ─ o ─ norm ─(+)─┐
//!                        └─────────────────────────────────────────────────────────────────────────────────┘
//!                        ┌─ norm ─ gate,up ─ gelu_tanh·mul ─ down ─ norm ─(+)─┐   × num_hidden_layers
//!                        └────────────────────────────────────────────────────┘
//!  rows of logits_indices ─ norm ─ embedᵀ (tied) ─ (soft-cap) ─ logits
//! ```
//!
//! What sets it apart from Llama, as the published architecture and the GGUF
//! file's metadata state it:
//! - the embedding is multiplied by √hidden (the tied LM head is not);
//! - RMSNorm multiplies by `1 + w`: Hugging Face checkpoints store `w`,
//!   llama.cpp's converter stores `1 + w` ([`WeightSource::norms_hold_one_plus_w`]);
//! - four norms per layer: before and after the attention, before and after
//!   the MLP, plus per-head RMSNorm of queries and keys;
//! - GeGLU with the tanh approximation of GELU;
//! - layers are local (sliding window, RoPE base `rope_local_base_freq`) or
//!   global (full causal, RoPE base `rope_theta` with `rope_scaling`) as
//!   [`ModelConfig::layer_types`] says: every sixth layer is global;
//! - attention scores scaled by `query_pre_attn_scalar^-½` (for GGUF files,
//!   which do not store it, llama.cpp's rule: hidden / heads for the 27B,
//!   head_dim otherwise);
//! - a soft-cap of the attention scores when the config sets one; a final
//!   logit soft-cap (Gemma 2's; Gemma 3 has none) is refused at load.

use crate::llama::{load_gate_up, load_qkv, GateUp, Projected, Qkv};
use crate::ops::{GatedActivation, OpResult, Ops};
use crate::registry::CausalLm;
use crate::rope::RopeTable;
use crate::tensor_parallel::{embed, ShardLoader, TensorParallel};
use crate::{Result, WeightSource};
use vellum_base::{AttentionShape, ModelConfig};

struct Layer<O: Ops> {
    input_norm: O::Vector,
    post_attention_norm: O::Vector,
    pre_feedforward_norm: O::Vector,
    post_feedforward_norm: O::Vector,
    q_norm: O::Vector,
    k_norm: O::Vector,
    qkv: Qkv<O>,
    o_proj: O::Weight,
    gate_up: GateUp<O>,
    down_proj: O::Weight,
    /// Local (sliding-window) layer: the local RoPE table and the window.
    local: bool,
}

/// A loaded Gemma 3 model on backend `O`: the whole model, or one rank's
/// part of it under tensor parallelism.
pub struct Gemma3Model<O: Ops> {
    config: ModelConfig,
    tp: TensorParallel,
    /// The first vocabulary row of this rank's embedding and LM head.
    vocab_start: usize,
    embed_tokens: O::Weight,
    /// A separate LM head when the checkpoint has one (Gemma ties them).
    lm_head: Option<O::Weight>,
    norm: O::Vector,
    layers: Vec<Layer<O>>,
    rope_global: O::Rope,
    rope_local: O::Rope,
    global_attention: AttentionShape,
    local_attention: AttentionShape,
}

impl<O: Ops> Gemma3Model<O> {
    /// Loads every weight through `ops`, checking shapes against `config`.
    /// `progress(done, total)` is called after each layer.
    pub fn load(ops: &O, weights: &dyn WeightSource, config: ModelConfig, progress: impl FnMut(usize, usize)) -> Result<Self> {
        Self::load_shard(ops, weights, config, TensorParallel::SINGLE, progress)
    }

    /// Loads rank `tp`'s part of every weight ([`TensorParallel`]), shapes
    /// checked against `config`, which stays the whole model's.
    pub fn load_shard(
        ops: &O,
        weights: &dyn WeightSource,
        config: ModelConfig,
        tp: TensorParallel,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        TensorParallel::check(tp.size, &config)?;
        if let Some(cap) = config.final_logit_softcapping {
            return Err(crate::Error::Backend(vellum_base::Error::Backend(format!(
                "final_logit_softcapping = {cap} is not supported (Gemma 3 checkpoints do not set it)"
            ))));
        }
        let (h, hd) = (config.hidden_size, config.head_dim);
        let (nq, nkv) = (config.num_attention_heads * hd, config.num_key_value_heads * hd);
        let im = config.intermediate_size;
        let shard = tp.shard(&config);
        let load = ShardLoader { ops, weights };
        // Gemma's RMSNorm multiplies by (1 + w).
        let offset = if weights.norms_hold_one_plus_w() { 0.0 } else { 1.0 };
        let norm = |name: &str, len: usize| -> Result<O::Vector> {
            let mut w = weights.tensor_f32_shaped(name, &[len])?.data;
            w.iter_mut().for_each(|v| *v += offset);
            Ok(ops.vector(name, &w)?)
        };
        let embed_tokens = load.embedding("model.embed_tokens.weight", [config.vocab_size, h], shard.vocab.clone())?;
        let lm_head = if config.tie_word_embeddings || !weights.contains("lm_head.weight") {
            None
        } else {
            Some(load.column("lm_head.weight", [config.vocab_size, h], shard.vocab.clone())?)
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            layers.push(Layer {
                input_norm: norm(&p("input_layernorm.weight"), h)?,
                post_attention_norm: norm(&p("post_attention_layernorm.weight"), h)?,
                pre_feedforward_norm: norm(&p("pre_feedforward_layernorm.weight"), h)?,
                post_feedforward_norm: norm(&p("post_feedforward_layernorm.weight"), h)?,
                q_norm: norm(&p("self_attn.q_norm.weight"), hd)?,
                k_norm: norm(&p("self_attn.k_norm.weight"), hd)?,
                qkv: load_qkv(&load, &p("self_attn"), h, [nq, nkv], [shard.q_cols.clone(), shard.kv_cols.clone()], false)?,
                o_proj: load.row(&p("self_attn.o_proj.weight"), [h, nq], shard.q_cols.clone())?,
                gate_up: load_gate_up(&load, &p("mlp"), h, im, shard.mlp.clone())?,
                down_proj: load.row(&p("mlp.down_proj.weight"), [h, im], shard.mlp.clone())?,
                local: config.layer_window(i).is_some(),
            });
            progress(i + 1, config.num_hidden_layers);
        }
        let norm = norm("model.norm.weight", h)?;
        let rope_global = ops.rope_table(&RopeTable::with_base(&config, config.rope_theta, true))?;
        let local_theta = config.rope_local_theta.unwrap_or(config.rope_theta);
        let rope_local = ops.rope_table(&RopeTable::with_base(&config, local_theta, false))?;
        let global_attention = AttentionShape {
            scale: config.query_pre_attn_scalar.unwrap_or(hd as f32).powf(-0.5),
            logit_softcap: config.attn_logit_softcapping,
            ..AttentionShape::new(shard.q_heads.len(), shard.kv_heads.len(), hd)
        };
        let local_attention = AttentionShape { sliding_window: config.sliding_window, ..global_attention };
        Ok(Self {
            config,
            tp,
            vocab_start: shard.vocab.start,
            embed_tokens,
            lm_head,
            norm,
            layers,
            rope_global,
            rope_local,
            global_attention,
            local_attention,
        })
    }
}

impl<O: Ops> CausalLm<O> for Gemma3Model<O> {
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
        ops.scale(&mut h, (c.hidden_size as f32).sqrt())?;
        // The previous block's MLP output (post-normed), added to the
        // residual stream by the next block's input norm.
        let mut pending: Option<O::Tensor> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let (rope, shape) =
                if layer.local { (&self.rope_local, &self.local_attention) } else { (&self.rope_global, &self.global_attention) };
            let x = match pending.take() {
                Some(out) => ops.add_rms_norm(&mut h, out, &layer.input_norm, eps, c.hidden_size)?,
                None => ops.rms_norm(&h, &layer.input_norm, eps, c.hidden_size)?,
            };
            // q and k are normed before RoPE: the split rotates nothing.
            let widths = [shape.num_heads, shape.num_kv_heads, shape.num_kv_heads].map(|n| n * shape.head_dim);
            let Projected { q, k, v, .. } = layer.qkv.project(ops, &x, widths, None)?;
            let mut q = ops.rms_norm(&q, &layer.q_norm, eps, c.head_dim)?;
            let mut k = ops.rms_norm(&k, &layer.k_norm, eps, c.head_dim)?;
            ops.rope_qk(&mut q, &mut k, rope, step)?;
            let attn = ops.attention(cache, l, &q, &k, &v, step, shape)?;
            let mut out = ops.linear(&attn, &layer.o_proj, None)?;
            ops.all_reduce(&mut out)?;
            let out = ops.rms_norm(&out, &layer.post_attention_norm, eps, c.hidden_size)?;
            let x = ops.add_rms_norm(&mut h, out, &layer.pre_feedforward_norm, eps, c.hidden_size)?;
            let act = layer.gate_up.act(ops, &x, GatedActivation::GeluTanh)?;
            let mut out = ops.linear(&act, &layer.down_proj, None)?;
            ops.all_reduce(&mut out)?;
            pending = Some(ops.rms_norm(&out, &layer.post_feedforward_norm, eps, c.hidden_size)?);
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
