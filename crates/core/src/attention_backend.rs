//! The attention contract: paged attention over block tables.

use crate::{BlockCopy, BlockSwap, Result};

/// Per-step attention metadata, borrowed from a [`crate::ForwardBatch`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionMetadata<'a> {
    /// Tokens per block.
    pub block_size: usize,
    /// KV slot of each new token.
    pub slot_mapping: &'a [u32],
    /// Offsets of each sequence's queries (length S + 1).
    pub query_start_loc: &'a [u32],
    /// Tokens in the cache per sequence, including this step's.
    pub context_lens: &'a [u32],
    /// Row-major block tables.
    pub block_tables: &'a [u32],
    /// Entries per block-table row.
    pub block_table_stride: usize,
}

/// Attention through a paged KV cache that the backend owns.
///
/// The model code calls these per layer: first [`write_kv`] stores the new
/// keys and values of the whole batch in their slots ("fused reshape and block
/// write", paper §5.1), then [`paged_attention`] lets every query attend to
/// its sequence's context through the block table. Because all writes of a
/// layer precede its attention, a sequence may read blocks that another
/// sequence of the same batch fills in the same step (a prefix-cache hit on a
/// block being computed).
///
/// [`write_kv`]: AttentionBackend::write_kv
/// [`paged_attention`]: AttentionBackend::paged_attention
pub trait AttentionBackend {
    /// Activations as the backend stores them (host slice, device buffer…).
    type Tensor;
    /// The K/V pools of every layer, device and host.
    type KvCache;

    /// Bytes one block takes across all layers, K and V.
    fn kv_block_bytes(&self, cache: &Self::KvCache) -> u64;

    /// Stores `k`, `v` (`[tokens, kv_heads, head_dim]`) of `layer` in the
    /// slots of `meta.slot_mapping`.
    fn write_kv(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        meta: &AttentionMetadata<'_>,
    ) -> Result<()>;

    /// Causal attention of `q` (`[tokens, heads, head_dim]`) over the cached
    /// context of each sequence, written to `out`.
    fn paged_attention(
        &self,
        cache: &Self::KvCache,
        layer: usize,
        q: &Self::Tensor,
        meta: &AttentionMetadata<'_>,
        scale: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// One batched copy for copy-on-write.
    fn copy_blocks(&self, cache: &mut Self::KvCache, copies: &[BlockCopy]) -> Result<()>;

    /// Device → host (`to_host`) or host → device.
    fn swap_blocks(&self, cache: &mut Self::KvCache, swaps: &[BlockSwap], to_host: bool) -> Result<()>;
}
