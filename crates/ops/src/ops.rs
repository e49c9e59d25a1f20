//! The operations model code needs from a backend.
//!
//! A model definition (`vellum-models`' `LlamaModel`, `Gemma3Model`) is written once against
//! [`Ops`]; each backend implements it for its own storage: host vectors on
//! the CPU, device buffers on a GPU. [`Ops`] extends the core
//! [`AttentionBackend`] (the paged KV cache, the per-step inputs and the
//! attention kernels) with the dense operations of a transformer.
//!
//! The contract, as a GPU backend meets it:
//! - **Weights** arrive as [`WeightView`]s, the bytes the file stores with
//!   their type (f32/f16/bf16 or GGUF blocks), so each backend picks its own
//!   layout (the CPU keeps Q4_1 blocks for its integer kernels; a GPU
//!   uploads the blocks and dequantizes in its shaders).
//! - **Per-step inputs** (token ids, positions, slot mapping, block tables,
//!   query offsets, context lengths, logits rows) reach the backend once, in
//!   [`AttentionBackend::prepare_step`]; ops read the prepared step.
//! - **Every op can fail**: a lost device or an allocation that does not fit
//!   is a [`vellum_base::Error`], never a panic. Preparing a weight fails
//!   with this crate's [`crate::Error`].

use crate::quant::GgmlType;
use crate::rope::RopeTable;
use crate::{Result, WeightView};
use vellum_base::{AttentionBackend, AttentionShape, DeviceSample, KvCacheDtype, PenaltyEntry, RowSampling};

/// An RMSNorm: its weight, epsilon and the width of the rows it norms
/// ([`Ops::norm_linear`]).
#[derive(Debug)]
pub struct Norm<'a, V> {
    /// The norm's weight (`cols` values).
    pub w: &'a V,
    /// Added to the mean square.
    pub eps: f32,
    /// Row width.
    pub cols: usize,
}

impl<V> Clone for Norm<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V> Copy for Norm<'_, V> {}

/// The element type a backend rounds an activation to before a product
/// reads it: what [`Ops::linear_input_dtype`] reports, so that a test (the
/// conformance suite) knows which rounding error to allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ActivationDtype {
    /// IEEE single precision: no rounding before the product.
    F32,
    /// IEEE half precision (10 mantissa bits).
    F16,
    /// bfloat16 (7 mantissa bits), as tensor-core GEMMs of bf16 weights take it.
    Bf16,
}

impl ActivationDtype {
    /// The largest relative error of one rounding to this type (half a unit
    /// in the last place, round to nearest) for a value within its normal
    /// range: 0 for f32 inputs, 2⁻¹¹ for f16 (whose range ends at ±65504),
    /// 2⁻⁸ for bf16 (f32's range).
    pub fn unit_roundoff(self) -> f32 {
        match self {
            ActivationDtype::F32 => 0.0,
            ActivationDtype::F16 => 1.0 / 2048.0,
            ActivationDtype::Bf16 => 1.0 / 256.0,
        }
    }
}

/// The activation of a gated MLP (`act(gate) · up`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatedActivation {
    /// SwiGLU: `silu(gate) · up` (Llama).
    Silu,
    /// GeGLU with the tanh approximation (Gemma).
    GeluTanh,
}

/// The error of a stacked-projection op a backend that never stacks is
/// asked for (a model only asks after [`Ops::stacked_weight`] gave a weight).
fn not_stacked(backend: &str, op: &str) -> vellum_base::Error {
    vellum_base::Error::Backend(format!("{op}: the {backend} backend does not stack projections"))
}

/// The message a collective fails with when another rank of its group
/// failed the step (so that a runner reports the rank's own error instead).
pub const GROUP_FAILED: &str = "another rank of the tensor-parallel group failed its step";

/// The error of an encoder op a backend does not have.
fn encoder_op_unsupported(backend: &str, op: &str) -> vellum_base::Error {
    vellum_base::Error::Unsupported(Box::new(vellum_base::Unsupported {
        backend: backend.to_string(),
        what: "encoder models' op".into(),
        value: op.into(),
        supported: "none on this backend (encoder models run on --device cpu)".into(),
    }))
}

/// `Result` of an op at run time.
pub type OpResult<T> = vellum_base::Result<T>;

/// Backend operations over activations `[rows, cols]` (one row per token).
pub trait Ops: AttentionBackend<Tensor: Send + Sync, KvCache: Send, Step: Send + Sync> + Send + Sync {
    /// A linear layer's weight, in whatever layout (or quantization) the
    /// backend computes fastest with.
    type Weight: Send + Sync;
    /// A 1-D parameter (norm weight, bias).
    type Vector: Send + Sync;
    /// RoPE rotations for every position of the model's context.
    type Rope: Send + Sync;

    /// Prepares a `[out, in]` weight for [`Ops::linear`].
    fn linear_weight(&self, w: WeightView<'_>) -> Result<Self::Weight>;
    /// Prepares an embedding table `[vocab, hidden]` (also usable as a tied
    /// LM head through [`Ops::linear`]).
    fn embedding_weight(&self, w: WeightView<'_>) -> Result<Self::Weight>;
    /// Whether [`Ops::linear`] needs statistics of its inputs before it
    /// serves (the CPU backend's int8 path picks its outlier channels from
    /// them), gathered by a calibration pass over a fixed text
    /// (`vellum-models`' `ModelRunner`, in `ModelExecutor::calibrate`).
    fn wants_calibration(&self) -> bool {
        false
    }
    /// While `on`, [`Ops::linear`] records the statistics of its inputs;
    /// the first products after turning it off fix what they decided. A
    /// backend with FP8 KV caches also records, in `write_kv`, each layer's
    /// largest |key| and |value|: the caches it allocates afterwards store
    /// that layer divided by scales taken from them
    /// ([`vellum_base::KvScale::from_absmax`]). The runner makes this pass
    /// for an FP8 cache even where [`Ops::wants_calibration`] is false.
    fn set_calibrating(&self, on: bool) {
        let _ = on;
    }
    /// The element type [`Ops::linear`] rounds its input rows to before it
    /// multiplies a weight stored as `weight` (accumulating in f32 either
    /// way): f32 unless the backend feeds 16-bit weights to 16-bit matrix
    /// units with activations cast to match. A backend's choice, stated so
    /// that its results can be checked with the right bound.
    fn linear_input_dtype(&self, weight: GgmlType) -> ActivationDtype {
        let _ = weight;
        ActivationDtype::F32
    }
    /// The element type paged attention rounds the queries and attention
    /// weights of a sequence with `query_tokens` query tokens in a step to,
    /// over a cache of `kv` (accumulating in f32): f32 unless the backend
    /// attends such sequences (prompts) on 16-bit matrix units (flash
    /// prefill). Stated, as [`Ops::linear_input_dtype`], so that its results
    /// can be checked with the right bound.
    fn attention_operand_dtype(&self, kv: KvCacheDtype, query_tokens: usize) -> ActivationDtype {
        let _ = (kv, query_tokens);
        ActivationDtype::F32
    }
    /// Uploads a 1-D parameter.
    fn vector(&self, name: &str, data: &[f32]) -> Result<Self::Vector>;
    /// Prepares the rotations of `table` for [`Ops::rope`].
    fn rope_table(&self, table: &RopeTable) -> Result<Self::Rope>;

    /// Rows of the embedding table for the step's token ids.
    fn embed(&self, table: &Self::Weight, step: &Self::Step) -> OpResult<Self::Tensor>;
    /// `x · Wᵀ (+ bias)`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Vector>) -> OpResult<Self::Tensor>;
    /// RMSNorm over each row (`group` = row width), or over each `group`-wide
    /// slice of a row (per-head norms, Qwen3).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32, group: usize) -> OpResult<Self::Tensor>;
    /// Half-split RoPE on `[rows, heads · head_dim]`, row i at the step's
    /// position i.
    fn rope(&self, x: &mut Self::Tensor, rope: &Self::Rope, step: &Self::Step) -> OpResult<()>;
    /// `silu(gate) * up` (SwiGLU).
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> OpResult<Self::Tensor>;
    /// `gelu_tanh(gate) * up` (GeGLU with the tanh approximation,
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`).
    fn gelu_tanh_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> OpResult<Self::Tensor>;
    /// `x *= factor`.
    fn scale(&self, x: &mut Self::Tensor, factor: f32) -> OpResult<()>;

    // --- Fusions: one pass where a backend has the kernel, the composed ops otherwise ---

    /// One weight for `parts` stacked along their rows (the q, k and v
    /// projections, or gate and up), named `name`, where this backend
    /// multiplies them as one product and splits the result with
    /// [`split_qkv`](Self::split_qkv) or [`gated_mul`](Self::gated_mul):
    /// fewer, larger products and kernels a layer. `None` (the default, and
    /// where the parts differ in type): the model keeps them apart. A
    /// backend that returns a weight implements both splits.
    fn stacked_weight(&self, name: &str, parts: &[WeightView<'_>]) -> Result<Option<Self::Weight>> {
        let _ = (name, parts);
        Ok(None)
    }

    /// The rows of `qkv` (`[rows, q + k + v]`, a product by a stacked
    /// weight) split into q, k and v of `widths`; with `rope`, q and k come
    /// out rotated as [`rope_qk`](Self::rope_qk) rotates them.
    fn split_qkv(
        &self,
        qkv: &Self::Tensor,
        widths: [usize; 3],
        rope: Option<(&Self::Rope, &Self::Step)>,
    ) -> OpResult<(Self::Tensor, Self::Tensor, Self::Tensor)> {
        let _ = (qkv, widths, rope);
        Err(not_stacked(self.name(), "split_qkv"))
    }

    /// `act(gate) · up` of `x` (`[rows, 2·inter]`: the gate product, then
    /// the up product, from a stacked weight).
    fn gated_mul(&self, x: &Self::Tensor, act: GatedActivation) -> OpResult<Self::Tensor> {
        let _ = (x, act);
        Err(not_stacked(self.name(), "gated_mul"))
    }

    /// `residual += y`, then the RMSNorm of each row (`cols` wide) of the
    /// new residual: the add closing one block and the norm opening the
    /// next, as vLLM's fused add-RMSNorm; `y`'s storage may hold the
    /// result. The default runs [`add_assign`](Self::add_assign) then
    /// [`rms_norm`](Self::rms_norm).
    fn add_rms_norm(
        &self,
        residual: &mut Self::Tensor,
        y: Self::Tensor,
        w: &Self::Vector,
        eps: f32,
        cols: usize,
    ) -> OpResult<Self::Tensor> {
        self.add_assign(residual, &y)?;
        self.rms_norm(residual, w, eps, cols)
    }

    /// [`rope`](Self::rope) of the queries and of the keys of one step. The
    /// default rotates each in turn.
    fn rope_qk(&self, q: &mut Self::Tensor, k: &mut Self::Tensor, rope: &Self::Rope, step: &Self::Step) -> OpResult<()> {
        self.rope(q, rope, step)?;
        self.rope(k, rope, step)
    }

    // --- Encoders (BERT); a backend without them refuses the model by name ---

    /// Rows of `table` (`[positions, width]`, an encoder's learned absolute
    /// position embeddings) at the step's positions.
    fn embed_positions(&self, table: &Self::Weight, step: &Self::Step) -> OpResult<Self::Tensor> {
        let _ = (table, step);
        Err(encoder_op_unsupported(self.name(), "learned position embeddings"))
    }
    /// LayerNorm over each row: `(x - mean) / sqrt(var + eps) · w + b`.
    fn layer_norm(&self, x: &Self::Tensor, w: &Self::Vector, b: &Self::Vector, eps: f32) -> OpResult<Self::Tensor> {
        let _ = (x, w, b, eps);
        Err(encoder_op_unsupported(self.name(), "LayerNorm"))
    }
    /// The exact GELU, `0.5·x·(1 + erf(x/√2))`.
    fn gelu(&self, x: &Self::Tensor) -> OpResult<Self::Tensor> {
        let _ = x;
        Err(encoder_op_unsupported(self.name(), "exact GELU"))
    }
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> OpResult<()>;

    /// The product opening a block, normed: `RMSNorm(residual) · Wᵀ (+
    /// bias)`, after `residual += pending` where the block before left its
    /// output pending ([`linear_add`](Self::linear_add), or a product an
    /// all-reduce had to see first), then with `act` the gated activation of
    /// the product's gate and up halves (a stacked gate/up weight). One
    /// launch where the backend fuses it (a decode step's few rows on a
    /// GPU). The default runs [`add_rms_norm`](Self::add_rms_norm) (or
    /// [`rms_norm`](Self::rms_norm)), [`linear`](Self::linear) and
    /// [`gated_mul`](Self::gated_mul).
    fn norm_linear(
        &self,
        residual: &mut Self::Tensor,
        pending: Option<Self::Tensor>,
        norm: Norm<'_, Self::Vector>,
        w: &Self::Weight,
        bias: Option<&Self::Vector>,
        act: Option<GatedActivation>,
    ) -> OpResult<Self::Tensor> {
        let x = match pending {
            Some(y) => self.add_rms_norm(residual, y, norm.w, norm.eps, norm.cols)?,
            None => self.rms_norm(residual, norm.w, norm.eps, norm.cols)?,
        };
        let y = self.linear(&x, w, bias)?;
        match act {
            Some(act) => self.gated_mul(&y, act),
            None => Ok(y),
        }
    }

    /// The product closing a block, `x · Wᵀ`, added into `residual` where
    /// the backend fuses the add (`None`), else returned for the next
    /// [`norm_linear`](Self::norm_linear) to add with its norm (`Some`).
    /// Not for a product that an all-reduce must see before the add. The
    /// default returns the product.
    fn linear_add(&self, x: &Self::Tensor, w: &Self::Weight, residual: &mut Self::Tensor) -> OpResult<Option<Self::Tensor>> {
        let _ = residual;
        Ok(Some(self.linear(x, w, None)?))
    }
    /// The rows whose logits the step returns (its `logits_indices`).
    fn logits_rows(&self, x: &Self::Tensor, step: &Self::Step) -> OpResult<Self::Tensor>;
    /// Copies activations to the host, row-major.
    fn to_host(&self, x: &Self::Tensor) -> OpResult<Vec<f32>>;
    /// [`to_host`](Self::to_host) of a tensor no longer needed (a host
    /// backend hands its buffer over instead of copying it).
    fn take_host(&self, x: Self::Tensor) -> OpResult<Vec<f32>> {
        self.to_host(&x)
    }
    /// Each row's argmax (the lowest id among equal maxima), computed where
    /// `x` lives; `None` where the backend leaves it to the host sampler.
    fn argmax_rows(&self, x: &Self::Tensor) -> OpResult<Option<Vec<u32>>> {
        let _ = x;
        Ok(None)
    }
    /// Whether [`sample_rows`](Self::sample_rows) samples on the device
    /// (a backend whose logits live on the host leaves it to the engine).
    fn samples_on_device(&self) -> bool {
        false
    }
    /// A token for each row of logits `x`, drawn where `x` lives as the
    /// host sampler draws it (`rows`: one [`RowSampling`] a row; `penalties`:
    /// the entries they point into, one per token in increasing order);
    /// `None`, with `x` untouched, where the backend leaves the step to the
    /// host sampler. Rows with penalties may be overwritten with their
    /// scores: `x` is spent once this returns samples.
    fn sample_rows(&self, x: &Self::Tensor, rows: &[RowSampling], penalties: &[PenaltyEntry]) -> OpResult<Option<Vec<DeviceSample>>> {
        let _ = (x, rows, penalties);
        Ok(None)
    }
    /// Takes back a buffer [`take_host`](Self::take_host) returned (a
    /// step's logits, once sampled) to reuse for a later output of its size.
    fn reuse_host_buffer(&self, buffer: Vec<f32>) {
        drop(buffer);
    }

    /// Writes this step's K and V of `layer` into their slots, then causal
    /// paged attention of `q` over each sequence's cached context.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        step: &Self::Step,
        shape: &AttentionShape,
    ) -> OpResult<Self::Tensor> {
        self.write_kv(cache, layer, k, v, step)?;
        self.paged_attention(cache, layer, q, step, shape)
    }

    /// [`attention`](Self::attention) of one stacked q/k/v product (`qkv`,
    /// `widths` wide, as [`split_qkv`](Self::split_qkv) takes it), q and k
    /// rotated by `rope` on the way: a backend may write the keys and values
    /// into the cache as it splits them. The default splits, then attends.
    #[allow(clippy::too_many_arguments)]
    fn attention_stacked(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        qkv: &Self::Tensor,
        widths: [usize; 3],
        rope: Option<&Self::Rope>,
        step: &Self::Step,
        shape: &AttentionShape,
    ) -> OpResult<Self::Tensor> {
        let (q, k, v) = self.split_qkv(qkv, widths, rope.map(|r| (r, step)))?;
        self.attention(cache, layer, &q, &k, &v, step, shape)
    }

    /// Runs one forward pass `f` where the backend's ops run best (the CPU
    /// backend moves it onto its thread pool once per step).
    fn run_forward<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// The logits of `step`'s forward pass `forward`: `forward` itself, or
    /// a replay of the launches it made for an earlier step of the same
    /// shape (the CUDA backend's graphs), which the
    /// backend checks the step against first. The default runs `forward`.
    fn run_graph(&self, step: &Self::Step, forward: &mut dyn FnMut() -> OpResult<Self::Tensor>) -> OpResult<Self::Tensor> {
        let _ = step;
        forward()
    }

    /// The token counts of the steps [`run_graph`](Self::run_graph)
    /// records, ascending (the memory of recorded steps is reserved for a
    /// step of the largest that can run); empty for a backend that records
    /// none.
    fn graph_sizes(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Whether [`run_graph`](Self::run_graph) records mixed steps (prompt
    /// chunks, verifications) as well as uniform decode steps.
    fn graphs_record_mixed_steps(&self) -> bool {
        false
    }

    /// Device memory the recorded steps hold, in bytes.
    fn graph_memory(&self) -> u64 {
        0
    }

    /// Drops every recorded step and gives their memory back to the device.
    fn release_graphs(&self) {}

    // --- Tensor parallelism (Megatron-style; `vellum-models`' `TensorParallel`) ---

    /// Sums `x` element-wise over the tensor-parallel group this backend
    /// instance is a rank of, in place: every rank ends with the same values,
    /// bit for bit (the residual streams of the ranks never drift apart).
    /// Model code calls it after each row-parallel linear (attention's
    /// output projection, the MLP's down projection) and after a
    /// vocabulary-parallel embedding. An instance that is not part of a
    /// group is a group of one: the default does nothing.
    fn all_reduce(&self, x: &mut Self::Tensor) -> OpResult<()> {
        let _ = x;
        Ok(())
    }

    /// Tells the other ranks of this instance's group that this rank's step
    /// failed, so that their collectives return an error (one that says so:
    /// [`GROUP_FAILED`]) instead of waiting for it forever. Later
    /// collectives fail too until [`reset_group`](Self::reset_group).
    fn fail_group(&self) {}

    /// Makes a failed group usable again, called once every rank has left
    /// the failed step (none is inside a collective). A backend whose
    /// collectives cannot be restarted (NCCL's aborted communicators) leaves
    /// the group failed, and every later step fails with [`GROUP_FAILED`].
    fn reset_group(&self) {}

    /// [`embed`](Self::embed) from a shard of the embedding table that holds
    /// the rows `vocab_start..vocab_start + rows` of a vocabulary of
    /// `vocab_size` (a vocabulary-parallel embedding): a token inside the
    /// shard gets its row, any other a row of zeros, so that
    /// [`all_reduce`](Self::all_reduce) over the ranks gives every token its
    /// row. A token id outside the whole vocabulary is an error on every
    /// rank alike (before any collective). The default serves only a whole
    /// table.
    fn embed_vocab_shard(&self, table: &Self::Weight, step: &Self::Step, vocab_start: usize, vocab_size: usize) -> OpResult<Self::Tensor> {
        let _ = vocab_size;
        if vocab_start != 0 {
            return Err(vellum_base::Error::Unsupported(Box::new(vellum_base::Unsupported {
                backend: self.name().to_string(),
                what: "a vocabulary-parallel embedding shard starting at row".into(),
                value: vocab_start.to_string(),
                supported: "0 (a whole table)".into(),
            })));
        }
        self.embed(table, step)
    }
}

/// Host data in, KV pools out: what a conformance suite needs beyond [`Ops`]
/// to feed a backend's ops and read back its cache (`vellum-conformance`
/// runs every backend's ops against the CPU's float32 path through it).
pub trait HostIo: Ops {
    /// A `[rows, cols]` activation tensor holding `data` (row-major).
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> OpResult<Self::Tensor>;
    /// The device pool of `layer`'s keys (`value: false`) or values, as
    /// f32, in the pool's own order (`[num_blocks, block_size,
    /// num_kv_heads, head_dim]`).
    fn read_kv(&self, cache: &Self::KvCache, layer: usize, value: bool) -> OpResult<Vec<f32>>;
}
