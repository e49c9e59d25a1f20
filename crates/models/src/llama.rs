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
//! Where the backend stacks projections ([`Ops::stacked_weight`]), q, k
//! and v are one product split by [`Ops::split_qkv`] (RoPE on the way when
//! no q/k norm comes between; then [`Ops::attention_stacked`] takes the
//! product whole, so that a backend can write the keys and values into the
//! cache as it splits them), gate and up one product under
//! [`Ops::gated_mul`]; each block opens with [`Ops::norm_linear`] (its
//! norm, and the residual add of the block before where that is still
//! pending: [`Ops::add_rms_norm`]) and closes with [`Ops::linear_add`] (the
//! product added into the residual where the backend fuses it).
//!
//! Under tensor parallelism a rank holds its heads, its MLP columns and its
//! vocabulary rows ([`TensorParallel`]); the outputs of `o` and `down` (and
//! the embedding) are summed over the ranks, the logits gathered.

use crate::ops::{GatedActivation, Norm, OpResult, Ops};
use crate::registry::CausalLm;
use crate::rope::RopeTable;
use crate::tensor_parallel::{embed, ShardLoader, TensorParallel};
use crate::{Result, WeightSource};
use vellum_base::{AttentionShape, ModelConfig};

struct Layer<O: Ops> {
    input_norm: O::Vector,
    post_attention_norm: O::Vector,
    qkv: Qkv<O>,
    o_proj: O::Weight,
    qk_norm: Option<[O::Vector; 2]>,
    gate_up: GateUp<O>,
    down_proj: O::Weight,
}

/// The q, k and v projections: one stacked product where the backend
/// multiplies them so ([`Ops::stacked_weight`]), else three.
pub(crate) enum Qkv<O: Ops> {
    /// `[q; k; v]` as one weight (and bias).
    Stacked { w: O::Weight, bias: Option<O::Vector> },
    /// Apart.
    Apart { w: [O::Weight; 3], bias: Option<[O::Vector; 3]> },
}

/// The gate and up projections, stacked or apart as [`Qkv`].
pub(crate) enum GateUp<O: Ops> {
    /// `[gate; up]` as one weight.
    Stacked(O::Weight),
    /// Apart.
    Apart([O::Weight; 2]),
}

/// A layer's queries, keys and values.
pub(crate) struct Projected<O: Ops> {
    pub(crate) q: O::Tensor,
    pub(crate) k: O::Tensor,
    pub(crate) v: O::Tensor,
    /// q and k are rotated already (RoPE in the split).
    pub(crate) rotated: bool,
}

impl<O: Ops> Qkv<O> {
    /// q, k and v of `x` (`widths` wide); `rope` rotates q and k where the
    /// split can (stacked).
    pub(crate) fn project(&self, ops: &O, x: &O::Tensor, widths: [usize; 3], rope: Option<(&O::Rope, &O::Step)>) -> OpResult<Projected<O>> {
        match self {
            Qkv::Stacked { w, bias } => {
                let (q, k, v) = ops.split_qkv(&ops.linear(x, w, bias.as_ref())?, widths, rope)?;
                Ok(Projected { q, k, v, rotated: rope.is_some() })
            }
            Qkv::Apart { w: [q, k, v], bias } => {
                let b = |i: usize| bias.as_ref().map(|b| &b[i]);
                Ok(Projected { q: ops.linear(x, q, b(0))?, k: ops.linear(x, k, b(1))?, v: ops.linear(x, v, b(2))?, rotated: false })
            }
        }
    }
}

impl<O: Ops> GateUp<O> {
    /// `act(gate(x)) · up(x)`.
    pub(crate) fn act(&self, ops: &O, x: &O::Tensor, act: GatedActivation) -> OpResult<O::Tensor> {
        match self {
            GateUp::Stacked(w) => ops.gated_mul(&ops.linear(x, w, None)?, act),
            GateUp::Apart([gate, up]) => {
                let (g, u) = (ops.linear(x, gate, None)?, ops.linear(x, up, None)?);
                match act {
                    GatedActivation::Silu => ops.silu_mul(&g, &u),
                    GatedActivation::GeluTanh => ops.gelu_tanh_mul(&g, &u),
                }
            }
        }
    }
}

/// A layer's q, k, v (`[nq | nkv | nkv]` whole, rows of this rank's shard)
/// and their bias, stacked where the backend takes them so.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_qkv<O: Ops>(
    load: &ShardLoader<'_, O>,
    prefix: &str,
    h: usize,
    [nq, nkv]: [usize; 2],
    [q_rows, kv_rows]: [std::ops::Range<usize>; 2],
    bias: bool,
) -> Result<Qkv<O>> {
    let projections = [("q", nq, &q_rows), ("k", nkv, &kv_rows), ("v", nkv, &kv_rows)];
    let parts = projections.map(|(s, n, rows)| (format!("{prefix}.{s}_proj.weight"), [n, h], rows.clone()));
    // This rank's rows of each bias, on the host until the weights decide
    // whether they go as one vector or three.
    let mut biases = Vec::new();
    if bias {
        for (s, n, rows) in projections {
            biases.push(load.vector_part(&format!("{prefix}.{s}_proj.bias"), n, rows.clone())?);
        }
    }
    if let Some(w) = load.stacked(&format!("{prefix}.qkv_proj.weight"), &parts)? {
        let bias = if bias { Some(load.ops.vector(&format!("{prefix}.qkv_proj.bias"), &biases.concat())?) } else { None };
        return Ok(Qkv::Stacked { w, bias });
    }
    let bias = match &biases[..] {
        [q, k, v] => Some([
            load.ops.vector(&format!("{prefix}.q_proj.bias"), q)?,
            load.ops.vector(&format!("{prefix}.k_proj.bias"), k)?,
            load.ops.vector(&format!("{prefix}.v_proj.bias"), v)?,
        ]),
        _ => None,
    };
    let [(qn, qs, qr), (kn, ks, kr), (vn, vs, vr)] = parts;
    Ok(Qkv::Apart { w: [load.column(&qn, qs, qr)?, load.column(&kn, ks, kr)?, load.column(&vn, vs, vr)?], bias })
}

/// A layer's gate and up (`[im, h]`, rows `rows`), stacked where the backend
/// takes them so.
pub(crate) fn load_gate_up<O: Ops>(
    load: &ShardLoader<'_, O>,
    prefix: &str,
    h: usize,
    im: usize,
    rows: std::ops::Range<usize>,
) -> Result<GateUp<O>> {
    let parts = [(format!("{prefix}.gate_proj.weight"), [im, h], rows.clone()), (format!("{prefix}.up_proj.weight"), [im, h], rows)];
    if let Some(w) = load.stacked(&format!("{prefix}.gate_up_proj.weight"), &parts)? {
        return Ok(GateUp::Stacked(w));
    }
    let [(gn, gs, gr), (un, us, ur)] = parts;
    Ok(GateUp::Apart([load.column(&gn, gs, gr)?, load.column(&un, us, ur)?]))
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
            let qk_norm = if config.qk_norm {
                Some([vec(&p("self_attn.q_norm.weight"), hd)?, vec(&p("self_attn.k_norm.weight"), hd)?])
            } else {
                None
            };
            layers.push(Layer {
                input_norm: vec(&p("input_layernorm.weight"), h)?,
                post_attention_norm: vec(&p("post_attention_layernorm.weight"), h)?,
                qkv: load_qkv(&load, &p("self_attn"), h, [nq, nkv], [shard.q_cols.clone(), shard.kv_cols.clone()], config.attention_bias)?,
                o_proj: load.row(&p("self_attn.o_proj.weight"), [h, nq], shard.q_cols.clone())?,
                qk_norm,
                gate_up: load_gate_up(&load, &p("mlp"), h, im, shard.mlp.clone())?,
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
        // A block's output, added to the residual stream by the next block's
        // norm (one fused op where the backend has it): after its all-reduce
        // under tensor parallelism, else where the backend does not add it
        // as the product is written (`Ops::linear_add`: one launch with the
        // product on a GPU's decode steps, as `Ops::norm_linear` norms as
        // the next product reads).
        let mut pending: Option<O::Tensor> = None;
        let single = self.tp.size == 1;
        let a = &self.attention;
        let widths = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim];
        let norm = |w| Norm { w, eps, cols: c.hidden_size };
        let normed = |h: &mut O::Tensor, pending: Option<O::Tensor>, w| match pending {
            Some(out) => ops.add_rms_norm(h, out, w, eps, c.hidden_size),
            None => ops.rms_norm(h, w, eps, c.hidden_size),
        };
        // The product closing a block: added into the residual, or pending.
        let close = |x: &O::Tensor, w: &O::Weight, h: &mut O::Tensor| -> OpResult<Option<O::Tensor>> {
            if single {
                return ops.linear_add(x, w, h);
            }
            let mut out = ops.linear(x, w, None)?;
            ops.all_reduce(&mut out)?;
            Ok(Some(out))
        };
        for (l, layer) in self.layers.iter().enumerate() {
            // Each layer's own window (Qwen's `layer_types` mix full and
            // sliding layers; Mistral slides everywhere).
            let shape = AttentionShape { sliding_window: c.layer_window(l), ..self.attention };
            let attn = match (&layer.qkv, &layer.qk_norm) {
                // One stacked product, rotated as it is split, its keys and
                // values written to the cache on the way where the backend can.
                (Qkv::Stacked { w, bias }, None) => {
                    let qkv = ops.norm_linear(&mut h, pending.take(), norm(&layer.input_norm), w, bias.as_ref(), None)?;
                    ops.attention_stacked(cache, l, &qkv, widths, Some(&self.rope), step, &shape)?
                }
                _ => {
                    let x = normed(&mut h, pending.take(), &layer.input_norm)?;
                    // RoPE in the split where no q/k norm comes between.
                    let rope = layer.qk_norm.is_none().then_some((&self.rope, step));
                    let Projected { mut q, mut k, v, rotated } = layer.qkv.project(ops, &x, widths, rope)?;
                    if let Some([qn, kn]) = &layer.qk_norm {
                        q = ops.rms_norm(&q, qn, eps, c.head_dim)?;
                        k = ops.rms_norm(&k, kn, eps, c.head_dim)?;
                    }
                    if !rotated {
                        ops.rope_qk(&mut q, &mut k, &self.rope, step)?;
                    }
                    ops.attention(cache, l, &q, &k, &v, step, &shape)?
                }
            };
            pending = close(&attn, &layer.o_proj, &mut h)?;
            let act = match &layer.gate_up {
                GateUp::Stacked(w) => {
                    ops.norm_linear(&mut h, pending.take(), norm(&layer.post_attention_norm), w, None, Some(GatedActivation::Silu))?
                }
                GateUp::Apart(_) => {
                    let x = normed(&mut h, pending.take(), &layer.post_attention_norm)?;
                    layer.gate_up.act(ops, &x, GatedActivation::Silu)?
                }
            };
            pending = close(&act, &layer.down_proj, &mut h)?;
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
