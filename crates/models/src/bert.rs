//! BERT (`BertModel`): the encoder behind most sentence-embedding models
//! (bge, e5, all-MiniLM, …) — written once against [`Ops`], like the
//! decoders, and run for embeddings only (it has no LM head).
//!
//! ```text
//!  ids ─ word emb + (position emb + token type 0) ─ LayerNorm ─┐
//!  ┌───────────────────────────────────────────────────────────┘
//!  ├─ q,k,v (+bias) ─ attention over the whole prompt ─ o (+bias) ─(+)─ LayerNorm ─┐
//!  │  ┌──────────────────────────────────────────────────────────────────────────────┘
//!  └─ ├─ up (+bias) ─ GELU (erf) ─ down (+bias) ─(+)─ LayerNorm ─▶ next layer      × num_hidden_layers
//!  rows of logits_indices: the final hidden states (pooled CLS or MEAN by the engine)
//! ```
//!
//! What sets it apart from the decoders: post-norm LayerNorm with bias
//! after each sublayer, learned absolute positions (no RoPE), the exact GELU,
//! and bidirectional attention ([`AttentionShape::causal`] false): every
//! token sees the whole prompt, so the engine computes a prompt in one step
//! and never from a cached prefix. One segment: token type 0 throughout,
//! its embedding folded into the position table at load. Checkpoints name
//! their tensors with or without a `bert.` prefix (`BertForMaskedLM` and
//! `BertModel` files); the pooler and any head are not read.

use crate::ops::{OpResult, Ops};
use crate::registry::CausalLm;
use crate::tensor_parallel::TensorParallel;
use crate::{Result, WeightSource, WeightView};
use vellum_base::{AttentionShape, ModelConfig};

struct Layer<O: Ops> {
    q: (O::Weight, O::Vector),
    k: (O::Weight, O::Vector),
    v: (O::Weight, O::Vector),
    o: (O::Weight, O::Vector),
    attention_norm: (O::Vector, O::Vector),
    up: (O::Weight, O::Vector),
    down: (O::Weight, O::Vector),
    output_norm: (O::Vector, O::Vector),
}

/// A loaded BERT encoder on backend `O`.
pub struct BertModel<O: Ops> {
    config: ModelConfig,
    word_embeddings: O::Weight,
    /// Position embeddings plus token type 0's row.
    positions: O::Weight,
    embedding_norm: (O::Vector, O::Vector),
    layers: Vec<Layer<O>>,
    attention: AttentionShape,
}

impl<O: Ops> BertModel<O> {
    /// Loads every weight through `ops`, checking shapes against `config`.
    /// `progress(done, total)` is called after each layer. Tensor
    /// parallelism is refused (`tp` must be the whole model).
    pub fn load(
        ops: &O,
        weights: &dyn WeightSource,
        config: ModelConfig,
        tp: TensorParallel,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        if tp.is_sharded() {
            return Err(vellum_base::Error::InvalidConfig {
                field: "tensor-parallel-size",
                message: "encoder models (BERT) run whole: --tensor-parallel-size 1".into(),
            }
            .into());
        }
        let (h, im) = (config.hidden_size, config.intermediate_size);
        let prefix = if weights.contains("bert.embeddings.word_embeddings.weight") { "bert." } else { "" };
        let name = |s: &str| format!("{prefix}{s}");
        let vec = |s: &str, len: usize| -> Result<O::Vector> {
            let n = name(s);
            Ok(ops.vector(&n, &weights.tensor_f32_shaped(&n, &[len])?.data)?)
        };
        let linear = |s: &str, shape: [usize; 2]| -> Result<(O::Weight, O::Vector)> {
            let n = name(&format!("{s}.weight"));
            Ok((ops.linear_weight(weights.tensor_shaped(&n, &shape)?)?, vec(&format!("{s}.bias"), shape[0])?))
        };
        let norm = |s: &str| -> Result<(O::Vector, O::Vector)> { Ok((vec(&format!("{s}.weight"), h)?, vec(&format!("{s}.bias"), h)?)) };
        let word_embeddings =
            ops.embedding_weight(weights.tensor_shaped(&name("embeddings.word_embeddings.weight"), &[config.vocab_size, h])?)?;
        let max_pos = config.max_position_embeddings;
        let mut positions = weights.tensor_f32_shaped(&name("embeddings.position_embeddings.weight"), &[max_pos, h])?.data;
        let types = config.type_vocab_size.max(1);
        let token_types = weights.tensor_f32_shaped(&name("embeddings.token_type_embeddings.weight"), &[types, h])?.data;
        for row in positions.chunks_exact_mut(h.max(1)) {
            row.iter_mut().zip(&token_types[..h]).for_each(|(p, t)| *p += t);
        }
        let positions =
            ops.embedding_weight(WeightView::from_f32(&name("embeddings.position_embeddings.weight"), vec![max_pos, h], &positions))?;
        let embedding_norm = norm("embeddings.LayerNorm")?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = |s: &str| format!("encoder.layer.{i}.{s}");
            layers.push(Layer {
                q: linear(&p("attention.self.query"), [h, h])?,
                k: linear(&p("attention.self.key"), [h, h])?,
                v: linear(&p("attention.self.value"), [h, h])?,
                o: linear(&p("attention.output.dense"), [h, h])?,
                attention_norm: norm(&p("attention.output.LayerNorm"))?,
                up: linear(&p("intermediate.dense"), [im, h])?,
                down: linear(&p("output.dense"), [h, im])?,
                output_norm: norm(&p("output.LayerNorm"))?,
            });
            progress(i + 1, config.num_hidden_layers);
        }
        let attention = AttentionShape {
            causal: false,
            ..AttentionShape::new(config.num_attention_heads, config.num_attention_heads, config.head_dim)
        };
        Ok(Self { config, word_embeddings, positions, embedding_norm, layers, attention })
    }
}

impl<O: Ops> CausalLm<O> for BertModel<O> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn has_lm_head(&self) -> bool {
        false
    }

    fn forward_hidden(&self, ops: &O, cache: &mut O::KvCache, step: &O::Step) -> OpResult<O::Tensor> {
        let eps = self.config.rms_norm_eps;
        let mut x = ops.embed(&self.word_embeddings, step)?;
        ops.add_assign(&mut x, &ops.embed_positions(&self.positions, step)?)?;
        let mut h = ops.layer_norm(&x, &self.embedding_norm.0, &self.embedding_norm.1, eps)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let q = ops.linear(&h, &layer.q.0, Some(&layer.q.1))?;
            let k = ops.linear(&h, &layer.k.0, Some(&layer.k.1))?;
            let v = ops.linear(&h, &layer.v.0, Some(&layer.v.1))?;
            let attn = ops.attention(cache, l, &q, &k, &v, step, &self.attention)?;
            let mut out = ops.linear(&attn, &layer.o.0, Some(&layer.o.1))?;
            ops.add_assign(&mut out, &h)?;
            h = ops.layer_norm(&out, &layer.attention_norm.0, &layer.attention_norm.1, eps)?;
            let act = ops.gelu(&ops.linear(&h, &layer.up.0, Some(&layer.up.1))?)?;
            let mut out = ops.linear(&act, &layer.down.0, Some(&layer.down.1))?;
            ops.add_assign(&mut out, &h)?;
            h = ops.layer_norm(&out, &layer.output_norm.0, &layer.output_norm.1, eps)?;
        }
        ops.logits_rows(&h, step)
    }

    fn lm_head(&self, ops: &O, hidden: &O::Tensor) -> OpResult<O::Tensor> {
        let _ = (ops, hidden);
        Err(vellum_base::Error::InvalidConfig { field: "task", message: "a BERT encoder has no LM head: it embeds (--task embed)".into() })
    }
}
