//! The attention contract: paged attention over block tables, on whatever
//! device holds the KV cache.

use crate::{BlockCopy, BlockSwap, Capabilities, ForwardBatch, KvCacheDtype, KvCacheGroups, Result};

/// Per-step attention metadata on the host, borrowed from a
/// [`ForwardBatch`] (see its module doc for the layout). Host backends read
/// it directly; device backends upload it once per step in
/// [`AttentionBackend::prepare_step`].
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

impl ForwardBatch {
    /// The batch's attention metadata for KV-cache group `group` (`0` for a
    /// model with one group) and blocks of `block_size` tokens.
    ///
    /// # Panics
    /// If `group` is not below [`ForwardBatch::kv_groups`], or the batch's
    /// tables are shorter than its groups imply (a bug in the engine).
    pub fn attention_metadata(&self, block_size: usize, group: usize) -> AttentionMetadata<'_> {
        let groups = self.kv_groups();
        assert!(group < groups, "KV group {group} of a batch with {groups}");
        let (t, rows) = (self.num_tokens(), self.num_seqs() * self.block_table_stride);
        AttentionMetadata {
            block_size,
            slot_mapping: &self.slot_mapping[group * t..(group + 1) * t],
            query_start_loc: &self.query_start_loc,
            context_lens: &self.context_lens,
            block_tables: &self.block_tables[group * rows..(group + 1) * rows],
            block_table_stride: self.block_table_stride,
        }
    }
}

/// What one attention layer computes, beyond the step's metadata.
///
/// Query row `i` at position `p` attends to the cached positions
/// `max(0, p + 1 - sliding_window) ..= p` of its sequence (all of `0..=p`
/// without a window); query head `h` reads kv head
/// `h / (num_heads / num_kv_heads)`. A score is `scale · q·k`, then
/// `cap · tanh(score / cap)` with a soft-cap (Gemma 2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Multiplies `q·k` (usually `1/√head_dim`; some models set their own).
    pub scale: f32,
    /// Keys visible to a query, its own included (Mistral, Gemma local
    /// layers); `None` is full causal attention.
    pub sliding_window: Option<usize>,
    /// Soft-cap of the attention logits, if any.
    pub logit_softcap: Option<f32>,
    /// A query sees the keys up to its own position (decoders); `false`:
    /// every key of its sequence's context (encoders, whose prompt is
    /// computed in one step).
    pub causal: bool,
}

impl AttentionShape {
    /// Full causal attention with the default scale `1/√head_dim`.
    pub fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            num_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: None,
            logit_softcap: None,
            causal: true,
        }
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads.max(1)
    }

    /// The first cached position a query at `position` sees.
    pub fn first_visible(&self, position: usize) -> usize {
        match self.sliding_window {
            Some(w) => (position + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// The geometry of a paged KV cache: `groups.layers_per_group()` K pools and
/// as many V pools of `[num_blocks, block_size, num_kv_heads, head_dim]`
/// elements of `dtype`. With one group (most models) slot `l` is layer `l`;
/// a hybrid model's layers share slots through their groups (see
/// [`KvCacheGroups`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    /// Which layers share a block table, and the slot of each layer.
    pub groups: KvCacheGroups,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Storage type of the elements.
    pub dtype: KvCacheDtype,
}

impl KvCacheSpec {
    /// A cache of one group of `num_layers` layers, no window.
    pub fn uniform(num_layers: usize, num_kv_heads: usize, head_dim: usize, block_size: usize, dtype: KvCacheDtype) -> Self {
        Self { groups: KvCacheGroups::single(num_layers, None), num_kv_heads, head_dim, block_size, dtype }
    }

    /// K pools (and as many V pools) a block spans: the layers of one group.
    pub fn num_slots(&self) -> usize {
        self.groups.layers_per_group()
    }

    /// Elements of one block in one pool (one layer's K, or its V).
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Bytes of one block in one pool.
    pub fn pool_block_bytes(&self) -> u64 {
        (self.block_elems() * self.dtype.size_bytes()) as u64
    }

    /// Bytes one block takes across its slots, K and V.
    pub fn block_bytes(&self) -> u64 {
        2 * self.num_slots() as u64 * self.pool_block_bytes()
    }
}

/// What a backend can give the KV cache (thesis §4.2.1: the pool is sized
/// from what is left once the weights are loaded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvMemory {
    /// Bytes free on the device that holds the cache, after the weights.
    pub available_bytes: u64,
    /// The most blocks the device can address, if it has a limit below its
    /// memory (a storage binding of at most 128 MiB per pool on lavapipe).
    pub max_blocks: Option<usize>,
    /// A device the engine has to itself (a GPU), for sizing the cache as a
    /// fraction of its whole memory (vLLM's `--gpu-memory-utilization`);
    /// `None` where the cache lives in host memory.
    pub device: Option<DeviceMemory>,
}

/// A GPU's memory as the profile run left it (thesis §4.2.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// All of the device's memory.
    pub total_bytes: u64,
    /// Free now: the weights and everything else allocated are not.
    pub free_bytes: u64,
    /// The most activation memory a forward pass of the step budget took
    /// (the profile run); 0 before it runs.
    pub activation_peak_bytes: u64,
    /// The memory recorded decode steps (CUDA graphs) hold beside it: what
    /// an eager decode step of the most rows a graph records took in the
    /// profile run (a graph allocates its own); 0 without graphs.
    pub graph_reserve_bytes: u64,
}

/// Attention through a paged KV cache that the backend owns.
///
/// Per step, the engine's [`ForwardBatch`] is handed to the backend once
/// ([`prepare_step`]: a device backend uploads positions, slot mapping,
/// block tables, query offsets, context lengths and logits rows there);
/// every op of that step reads the prepared [`AttentionBackend::Step`].
/// Per layer, model code first calls [`write_kv`] to store the batch's new
/// keys and values in their slots ("fused reshape and block write", paper
/// §5.1), then [`paged_attention`] lets every query attend to its
/// sequence's context through the block table. Because all writes of a
/// layer precede its attention, a sequence may read blocks that another
/// sequence of the same batch fills in the same step (a prefix-cache hit on
/// a block being computed).
///
/// [`prepare_step`]: AttentionBackend::prepare_step
/// [`write_kv`]: AttentionBackend::write_kv
/// [`paged_attention`]: AttentionBackend::paged_attention
pub trait AttentionBackend {
    /// Activations as the backend stores them (host slice, device buffer…).
    type Tensor;
    /// The K/V pools of every layer, device and host.
    type KvCache;
    /// One step's inputs, where the backend's kernels read them.
    type Step;

    /// A short description for logs (`cpu (avx2)`, `wgpu: llvmpipe (Vulkan)`).
    fn describe(&self) -> String;

    /// The `--device` name of this backend, for messages (`cpu`, `wgpu`,
    /// `cuda`).
    fn name(&self) -> &'static str;

    /// What the backend's kernels support: head sizes, block sizes, KV
    /// element types, KV-cache groups (a slot mapping and block tables per
    /// group, layers sharing block slots; see [`KvCacheGroups`]). The
    /// runner checks a model and the engine's flags against it before it
    /// loads a weight ([`Capabilities::check`]).
    fn capabilities(&self) -> Capabilities;

    /// Memory the backend can give a cache of `spec`'s geometry.
    fn kv_memory(&self, spec: &KvCacheSpec) -> KvMemory;

    /// Memory profiling (thesis §4.2.1): starts watching the peak of the
    /// device memory in use and returns what is in use now; `None` where
    /// the backend cannot (its memory is the host's), and the profile run
    /// is skipped.
    fn begin_memory_profile(&self) -> Option<u64> {
        None
    }

    /// Device memory an attention call may take beyond its output, at most,
    /// for `num_tokens` queries of `num_heads` heads of `head_dim` over
    /// contexts up to `max_context` (a split-context kernel's partial
    /// results): what a profile run of short sequences does not see.
    fn attention_workspace_bytes(&self, num_tokens: usize, num_heads: usize, head_dim: usize, max_context: usize) -> u64 {
        let _ = (num_tokens, num_heads, head_dim, max_context);
        0
    }

    /// The most device memory in use since [`begin_memory_profile`]
    /// (after waiting for the device's queued work).
    ///
    /// [`begin_memory_profile`]: AttentionBackend::begin_memory_profile
    fn memory_profile_peak(&self) -> Option<u64> {
        None
    }

    /// Allocates `num_blocks` device blocks and `num_host_blocks` host
    /// (swap) blocks of `spec`'s geometry.
    fn allocate_kv_cache(&self, spec: &KvCacheSpec, num_blocks: usize, num_host_blocks: usize) -> Result<Self::KvCache>;

    /// Makes one step's inputs available to the kernels.
    fn prepare_step(&self, batch: &ForwardBatch, block_size: usize) -> Result<Self::Step>;

    /// Stores `k`, `v` (`[tokens, kv_heads · head_dim]`) of `layer` in the
    /// slots of the step's slot mapping.
    fn write_kv(&self, cache: &mut Self::KvCache, layer: usize, k: &Self::Tensor, v: &Self::Tensor, step: &Self::Step) -> Result<()>;

    /// Causal attention of `q` (`[tokens, heads · head_dim]`) over the
    /// cached context of each sequence, as `shape` describes.
    fn paged_attention(
        &self,
        cache: &Self::KvCache,
        layer: usize,
        q: &Self::Tensor,
        step: &Self::Step,
        shape: &AttentionShape,
    ) -> Result<Self::Tensor>;

    /// One batched copy for copy-on-write.
    fn copy_blocks(&self, cache: &mut Self::KvCache, copies: &[BlockCopy]) -> Result<()>;

    /// Device → host (`to_host`) or host → device.
    fn swap_blocks(&self, cache: &mut Self::KvCache, swaps: &[BlockSwap], to_host: bool) -> Result<()>;
}
