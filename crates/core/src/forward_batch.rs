//! Per-step input of a backend: plain host data, uploaded as is.
//!
//! For a batch of sequences `s = 0..S` with `q_s` new tokens each:
//!
//! ```text
//! token_ids / positions / slot_mapping:  [ s0: q0 tokens | s1: q1 tokens | ... ]
//! query_start_loc:                       [0, q0, q0+q1, ..., Σq]       (S + 1)
//! context_lens[s]:                       tokens in KV after the step (computed + new)
//! block_tables:                          S rows of `block_table_stride` entries,
//!                                        row s lists the physical blocks of s
//! slot = block_id * block_size + (position % block_size)
//! ```
//!
//! A model with several KV-cache groups (local and global layers, see
//! [`KvCacheGroups`](crate::KvCacheGroups)) has a slot mapping and a set of
//! block tables per group, stored group after group: `slot_mapping` is
//! `[G, tokens]`, `block_tables` is `[G, S, block_table_stride]`.

use crate::{BlockId, HostBlockId, TokenId};

/// Copy one block's K/V (every layer) onto another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockCopy {
    /// Source block.
    pub src: BlockId,
    /// Destination block.
    pub dst: BlockId,
}

/// A block moving between the device pool and the host pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSwap {
    /// The block in the device pool.
    pub device: BlockId,
    /// The block in the host pool.
    pub host: HostBlockId,
}

/// Block movements of one step, applied in field order before the forward
/// pass: swap-outs, swap-ins, then copies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockOps {
    /// Device → host.
    pub swap_out: Vec<BlockSwap>,
    /// Host → device.
    pub swap_in: Vec<BlockSwap>,
    /// Device → device (copy-on-write).
    pub copies: Vec<BlockCopy>,
}

impl BlockOps {
    /// True when there is nothing to move.
    pub fn is_empty(&self) -> bool {
        self.swap_out.is_empty() && self.swap_in.is_empty() && self.copies.is_empty()
    }
}

/// Everything a backend needs to run one forward pass over a mixed batch of
/// prefill chunks and decodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForwardBatch {
    /// New tokens, sequence after sequence.
    pub token_ids: Vec<TokenId>,
    /// Position of each new token in its sequence.
    pub positions: Vec<u32>,
    /// KV slot each new token's K/V is written to, `[G, tokens]`.
    pub slot_mapping: Vec<u32>,
    /// Offsets of each sequence's tokens in `token_ids` (length S + 1).
    pub query_start_loc: Vec<u32>,
    /// Per sequence: tokens in the KV cache once this step wrote its own.
    pub context_lens: Vec<u32>,
    /// Row-major `[G, S, block_table_stride]` physical block ids (padding,
    /// and entries that slid out of a window: 0).
    pub block_tables: Vec<u32>,
    /// Entries per row of `block_tables`.
    pub block_table_stride: usize,
    /// KV-cache groups `G` (`0` reads as `1`).
    pub num_kv_groups: usize,
    /// Token rows whose logits are returned, in order.
    pub logits_indices: Vec<u32>,
    /// Block movements to apply first.
    pub block_ops: BlockOps,
}

impl ForwardBatch {
    /// Number of sequences in the batch.
    pub fn num_seqs(&self) -> usize {
        self.query_start_loc.len().saturating_sub(1)
    }

    /// Number of new tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// KV-cache groups: sets of slot mappings and block tables.
    pub fn kv_groups(&self) -> usize {
        self.num_kv_groups.max(1)
    }
}
