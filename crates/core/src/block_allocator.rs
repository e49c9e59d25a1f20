//! The contract between the scheduler and whatever hands out KV memory.
//!
//! The paged KV-cache manager and the Orca baselines of `vellum-kvcache` both
//! implement [`BlockAllocator`], so the scheduler and the simulator run
//! unchanged over either. Every allocator speaks in physical [`BlockId`]s of
//! the backend's pool: a contiguous Orca reservation is simply a run of
//! consecutive block ids.
//!
//! The regions `allocate_slots` deals with, for one sequence:
//!
//! ```text
//!  |<- computed (cached) ->|<- computed ->|<- new tokens ->|<- not yet ->|
//!  | prefix-cache hit      | earlier steps| this step      |             |
//!  0                                      num_computed     num_computed
//!                                                          + num_new
//!  block table: [b7][b2][b9][b4]...  one entry per block_size tokens
//! ```

use crate::{BlockCopy, BlockId, BlockSwap, SeqId, TokenId};

/// What an allocator knows about a sequence's eventual length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LengthHint {
    /// Prompt plus the most tokens the sequence may generate
    /// (`max_tokens`, capped by `max_model_len`).
    pub max_total_tokens: usize,
    /// The length the sequence will really reach, when known in advance —
    /// only a simulator knows it (Orca Oracle / Pow2 use it).
    pub true_total_tokens: Option<usize>,
}

/// One sequence as an allocator sees it: its tokens and progress.
#[derive(Clone, Copy, Debug)]
pub struct SeqTokens<'a> {
    /// Which sequence.
    pub seq_id: SeqId,
    /// Every known token id (prompt and output) — the prefix hash reads them.
    /// Under asynchronous scheduling the slots asked for may run past the
    /// known tokens by the samples still in flight.
    pub token_ids: &'a [TokenId],
    /// How many of `token_ids` are the prompt.
    pub num_prompt_tokens: usize,
    /// Tokens whose KV is already stored.
    pub num_computed_tokens: usize,
    /// Eventual length, for reservation-based allocators and accounting.
    pub hint: LengthHint,
}

/// Blocks found in the prefix cache, to be handed to
/// [`BlockAllocator::allocate_slots`] right away (before any other call that
/// may allocate, or they may be evicted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    /// Physical blocks, in logical order, each holding `block_size` tokens
    /// (groups interleaved as in a block table; an entry a sliding-window
    /// group no longer needs is [`BlockId::NULL`]).
    pub block_ids: Vec<BlockId>,
    /// `block_ids.len() / G * block_size`: tokens whose KV can be skipped.
    pub num_computed_tokens: usize,
}

/// Success of [`BlockAllocator::allocate_slots`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocatedSlots {
    /// Index of the first block-table entry that is new or replaced since
    /// the previous call (for incremental block-table updates, thesis
    /// §4.6.2). Equals the table's length when nothing changed.
    pub first_changed_block_idx: usize,
    /// Length of the block table after the call.
    pub num_blocks: usize,
}

/// Memory accounting, in blocks and token slots (paper Fig. 2 categories).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvCacheStats {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the device pool.
    pub num_blocks: usize,
    /// Blocks held by at least one live sequence.
    pub num_used_blocks: usize,
    /// Free blocks that still hold a reusable cached prefix.
    pub num_cached_free_blocks: usize,
    /// Sum of block-table lengths over live sequences: what would be used
    /// without sharing.
    pub num_logical_blocks: usize,
    /// Slots (of used blocks) holding a token's KV; shared slots count once.
    pub num_filled_slots: usize,
    /// Empty slots reserved for tokens the sequence will still produce.
    pub num_reserved_slots: usize,
    /// Empty slots that no token will ever fill (over-provisioning).
    pub num_internal_frag_slots: usize,
    /// Slots lost to the allocator itself (e.g. buddy rounding).
    pub num_external_frag_slots: usize,
    /// Blocks in the host swap pool.
    pub num_host_blocks: usize,
    /// Host blocks holding swapped-out KV.
    pub num_used_host_blocks: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits: u64,
}

impl KvCacheStats {
    /// Slots in used blocks.
    pub fn num_used_slots(&self) -> usize {
        self.num_used_blocks * self.block_size
    }

    /// Filled slots over used (allocated or reserved) slots; 1 when empty.
    pub fn utilization(&self) -> f64 {
        let used = self.num_used_slots();
        if used == 0 {
            1.0
        } else {
            self.num_filled_slots as f64 / used as f64
        }
    }

    /// Blocks saved by sharing over blocks needed without it (paper Fig. 15).
    pub fn sharing_savings(&self) -> f64 {
        if self.num_logical_blocks == 0 {
            0.0
        } else {
            1.0 - self.num_used_blocks as f64 / self.num_logical_blocks as f64
        }
    }

    /// Blocks neither held by a live sequence nor lost: free or evictable.
    pub fn num_free_blocks(&self) -> usize {
        self.num_blocks - self.num_used_blocks
    }
}

/// Hands out KV memory to sequences, in blocks of the backend's pool.
///
/// Running out of memory is not an error: `allocate_slots` returns `None` and
/// the scheduler preempts. A broken contract (an unknown sequence, a fork onto
/// a live id) is a bug in the caller and panics with a message.
pub trait BlockAllocator {
    /// Tokens per block.
    fn block_size(&self) -> usize;

    /// Blocks in the device pool.
    fn num_blocks(&self) -> usize;

    /// KV-cache groups `G`: a block table holds `G` entries per logical
    /// block, interleaved (entry `i·G + g` is logical block `i` of group
    /// `g`; see [`KvCacheGroups`](crate::KvCacheGroups)). 1 for most models.
    fn num_kv_groups(&self) -> usize {
        1
    }

    /// Blocks an allocation could use right now (free, including evictable
    /// cached blocks).
    fn num_free_blocks(&self) -> usize;

    /// The most blocks one sequence of `num_tokens` tokens holds at once
    /// when it is computed `max_chunk` tokens at a time at most, over all
    /// groups: all of them, unless the allocator releases blocks that slid
    /// out of an attention window.
    fn max_blocks_held(&self, num_tokens: usize, max_chunk: usize) -> usize {
        let _ = max_chunk;
        num_tokens.div_ceil(self.block_size())
    }

    /// The longest run of full, already-computed blocks that starts the
    /// sequence (prefix caching). Never covers the whole sequence: the last
    /// token must be computed to produce logits. Counts a query.
    fn get_computed_blocks(&mut self, seq: &SeqTokens<'_>) -> ComputedBlocks;

    /// Reserves slots for `num_new_tokens` tokens after
    /// `seq.num_computed_tokens` (plus `computed` blocks from the prefix cache
    /// for a sequence that holds nothing yet). `None` means no room; then
    /// nothing has changed.
    fn allocate_slots(&mut self, seq: &SeqTokens<'_>, num_new_tokens: usize, computed: ComputedBlocks) -> Option<AllocatedSlots>;

    /// `child` gets `parent`'s blocks (parallel sampling, beam candidates).
    /// A paged allocator shares them; a contiguous one copies.
    /// Returns `false` when there is no room for the child.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool;

    /// Releases everything `seq` holds (no-op for an unknown sequence).
    fn free(&mut self, seq: SeqId);

    /// Forgets every slot of `seq` past its first `num_computed_tokens`:
    /// slots reserved for a step that will not run (a group that could not
    /// be scheduled whole, a preemption in the same step) or for rejected
    /// speculative tokens. Blocks no longer needed are released, and no block
    /// whose tokens were not all computed stays in the prefix cache.
    /// Reservation-based allocators keep their reservation. With a sliding
    /// window, `num_computed_tokens` is at least the value the last
    /// `allocate_slots` saw (blocks before that window are gone).
    fn trim(&mut self, _seq: SeqId, _num_computed_tokens: usize) {}

    /// The sequence's block table (groups interleaved), or `None` if it
    /// holds nothing.
    fn block_table(&self, seq: SeqId) -> Option<&[BlockId]>;

    /// Copies the backend must make before the next forward pass
    /// (copy-on-write, contiguous forks), drained in one batch per step.
    fn take_block_copies(&mut self) -> Vec<BlockCopy>;

    /// Moves every block of `seqs` (one sequence group) to the host pool,
    /// all or nothing. `None`: not enough host blocks, or no swap support.
    fn swap_out(&mut self, _seqs: &[SeqId]) -> Option<Vec<BlockSwap>> {
        None
    }

    /// Brings a swapped-out group back, all or nothing. `None`: no room.
    fn swap_in(&mut self, _seqs: &[SeqId]) -> Option<Vec<BlockSwap>> {
        None
    }

    /// Memory accounting.
    fn stats(&self) -> KvCacheStats;
}
