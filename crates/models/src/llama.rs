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

use crate::ops::{OpResult, Ops};
use crate::registry::CausalLm;
use crate::rope::RopeTable;
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

/// A loaded Llama-family model on backend `O`.
pub struct LlamaModel<O: Ops> {
    config: ModelConfig,
    embed_tokens: O::Weight,
    lm_head: Option<O::Weight>,
    norm: O::Vector,
    layers: Vec<Layer<O>>,
    rope: O::Rope,
    attention: AttentionShape,
}

impl<O: Ops> LlamaModel<O> {
    /// Loads every weight through `ops`, checking shapes against `config`.
    /// `progress(done, total)` is called after each layer.
    pub fn load(ops: &O, weights: &dyn WeightSource, config: ModelConfig, mut progress: impl FnMut(usize, usize)) -> Result<Self> {
        let (h, hd) = (config.hidden_size, config.head_dim);
        let (nq, nkv) = (config.num_attention_heads * hd, config.num_key_value_heads * hd);
        let im = config.intermediate_size;
        let mat = |name: &str, shape: [usize; 2]| -> Result<O::Weight> { Ok(ops.linear_weight(weights.tensor_shaped(name, &shape)?)?) };
        let vec = |name: &str, len: usize| -> Result<O::Vector> { Ok(ops.vector(name, &weights.tensor_f32_shaped(name, &[len])?.data)?) };
        let embed_tokens = ops.embedding_weight(weights.tensor_shaped("model.embed_tokens.weight", &[config.vocab_size, h])?)?;
        let lm_head = if config.tie_word_embeddings || !weights.contains("lm_head.weight") {
            None
        } else {
            Some(mat("lm_head.weight", [config.vocab_size, h])?)
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let qkv_bias = if config.attention_bias {
                Some([
                    vec(&p("self_attn.q_proj.bias"), nq)?,
                    vec(&p("self_attn.k_proj.bias"), nkv)?,
                    vec(&p("self_attn.v_proj.bias"), nkv)?,
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
                q_proj: mat(&p("self_attn.q_proj.weight"), [nq, h])?,
                k_proj: mat(&p("self_attn.k_proj.weight"), [nkv, h])?,
                v_proj: mat(&p("self_attn.v_proj.weight"), [nkv, h])?,
                o_proj: mat(&p("self_attn.o_proj.weight"), [h, nq])?,
                qkv_bias,
                qk_norm,
                gate_proj: mat(&p("mlp.gate_proj.weight"), [im, h])?,
                up_proj: mat(&p("mlp.up_proj.weight"), [im, h])?,
                down_proj: mat(&p("mlp.down_proj.weight"), [h, im])?,
            });
            progress(i + 1, config.num_hidden_layers);
        }
        let norm = vec("model.norm.weight", h)?;
        let rope = ops.rope_table(&RopeTable::new(&config))?;
        let attention = AttentionShape::new(config.num_attention_heads, config.num_key_value_heads, hd);
        Ok(Self { config, embed_tokens, lm_head, norm, layers, rope, attention })
    }
}

impl<O: Ops> CausalLm<O> for LlamaModel<O> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward_hidden(&self, ops: &O, cache: &mut O::KvCache, step: &O::Step) -> OpResult<O::Tensor> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let mut h = ops.embed(&self.embed_tokens, step)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = ops.rms_norm(&h, &layer.input_norm, eps, c.hidden_size)?;
            let bias = layer.qkv_bias.as_ref();
            let mut q = ops.linear(&x, &layer.q_proj, bias.map(|b| &b[0]))?;
            let mut k = ops.linear(&x, &layer.k_proj, bias.map(|b| &b[1]))?;
            let v = ops.linear(&x, &layer.v_proj, bias.map(|b| &b[2]))?;
            if let Some([qn, kn]) = &layer.qk_norm {
                q = ops.rms_norm(&q, qn, eps, c.head_dim)?;
                k = ops.rms_norm(&k, kn, eps, c.head_dim)?;
            }
            ops.rope(&mut q, &self.rope, step)?;
            ops.rope(&mut k, &self.rope, step)?;
            // Each layer's own window (Qwen's `layer_types` mix full and
            // sliding layers; Mistral slides everywhere).
            let shape = AttentionShape { sliding_window: c.layer_window(l), ..self.attention };
            let attn = ops.attention(cache, l, &q, &k, &v, step, &shape)?;
            ops.add_assign(&mut h, &ops.linear(&attn, &layer.o_proj, None)?)?;
            let x = ops.rms_norm(&h, &layer.post_attention_norm, eps, c.hidden_size)?;
            let act = ops.silu_mul(&ops.linear(&x, &layer.gate_proj, None)?, &ops.linear(&x, &layer.up_proj, None)?)?;
            ops.add_assign(&mut h, &ops.linear(&act, &layer.down_proj, None)?)?;
        }
        let last = ops.logits_rows(&h, step)?;
        ops.rms_norm(&last, &self.norm, eps, c.hidden_size)
    }

    fn lm_head(&self, ops: &O, hidden: &O::Tensor) -> OpResult<O::Tensor> {
        ops.linear(hidden, self.lm_head.as_ref().unwrap_or(&self.embed_tokens), None)
    }
}
