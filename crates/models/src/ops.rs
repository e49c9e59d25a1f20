//! The operations model code needs from a backend.
//!
//! A model definition (e.g. [`crate::LlamaModel`]) is written once against
//! [`Ops`]; each backend implements it for its own storage: host vectors on
//! the CPU, device buffers on a GPU. Attention goes through the backend's
//! paged KV cache and is addressed by the per-step metadata of
//! [`vellum_core::ForwardBatch`].

use crate::rope::RopeTable;
use crate::{Result, Tensor};
use vellum_core::AttentionMetadata;

/// Shape of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

/// Backend operations over activations `[rows, cols]` (one row per token).
pub trait Ops: Send + Sync {
    /// Activations.
    type Tensor;
    /// A linear layer's weight, in whatever layout (or quantization) the
    /// backend computes fastest with.
    type Weight: Send + Sync;
    /// A 1-D parameter (norm weight, bias).
    type Vector: Send + Sync;
    /// The paged KV cache of every layer.
    type KvCache;

    /// Prepares a `[out, in]` weight for [`Ops::linear`].
    fn linear_weight(&self, name: &str, w: Tensor) -> Result<Self::Weight>;
    /// Prepares an embedding table `[vocab, hidden]` (also usable as a tied
    /// LM head through [`Ops::linear`]).
    fn embedding_weight(&self, name: &str, w: Tensor) -> Result<Self::Weight>;
    /// Uploads a 1-D parameter.
    fn vector(&self, data: Vec<f32>) -> Self::Vector;

    /// Rows of the embedding table for `ids`.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Self::Tensor;
    /// `x · Wᵀ (+ bias)`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Vector>) -> Self::Tensor;
    /// RMSNorm over each row (`group` = row width), or over each `group`-wide
    /// slice of a row (per-head norms, Qwen3).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32, group: usize) -> Self::Tensor;
    /// Half-split RoPE on `[rows, heads · head_dim]`, row i at `positions[i]`.
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, positions: &[u32], table: &RopeTable);
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor);
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
        meta: &AttentionMetadata<'_>,
        shape: AttentionShape,
    ) -> Self::Tensor;
    /// The listed rows.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[u32]) -> Self::Tensor;
    /// Copies activations to the host, row-major.
    fn to_host(&self, x: &Self::Tensor) -> Vec<f32>;
}
