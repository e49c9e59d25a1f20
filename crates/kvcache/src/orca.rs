//! The Orca baselines of the paper's evaluation (§6.1), as real allocators.
//!
//! Each sequence gets one contiguous reservation when it is admitted, placed
//! by a [`BuddyAllocator`] over the block pool:
//!
//! | mode     | tokens reserved                                  |
//! |----------|--------------------------------------------------|
//! | `Max`    | `max_model_len`                                  |
//! | `Pow2`   | prompt + next power of two of the true output    |
//! | `Oracle` | prompt + true output                             |
//!
//! A reservation is a run of consecutive block ids, so its block table works
//! with a paged backend unchanged. Nothing is shared: a fork reserves again
//! and copies the parent's filled blocks.

use crate::buddy_allocator::BuddyAllocator;
use vellum_base::{AllocatedSlots, BlockAllocator, BlockCopy, BlockId, ComputedBlocks, IdMap, KvCacheStats, LengthHint, SeqId, SeqTokens};

/// How much an Orca baseline over-reserves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrcaMode {
    /// Up to the model's maximum length.
    Max,
    /// Output rounded up to the next power of two.
    Pow2,
    /// Exactly the length the sequence will reach.
    Oracle,
}

#[derive(Clone, Debug)]
struct Reservation {
    block_table: Vec<BlockId>,
    start: u32,
    order: u8,
    /// Tokens the reservation was asked for.
    requested_tokens: usize,
    /// Tokens with a slot in use.
    num_tokens: usize,
    hint: LengthHint,
}

/// A contiguous-reservation allocator (Orca Max / Pow2 / Oracle).
#[derive(Clone, Debug)]
pub struct OrcaAllocator {
    mode: OrcaMode,
    block_size: usize,
    max_model_len: usize,
    buddy: BuddyAllocator,
    seqs: IdMap<SeqId, Reservation>,
    pending_copies: Vec<BlockCopy>,
}

impl OrcaAllocator {
    /// `num_blocks` blocks of `block_size` tokens.
    pub fn new(mode: OrcaMode, num_blocks: usize, block_size: usize, max_model_len: usize) -> Self {
        Self { mode, block_size, max_model_len, buddy: BuddyAllocator::new(num_blocks), seqs: IdMap::default(), pending_copies: Vec::new() }
    }

    /// Tokens this mode reserves for a sequence.
    fn tokens_to_reserve(&self, seq: &SeqTokens<'_>, needed: usize) -> usize {
        let truth = seq.hint.true_total_tokens.unwrap_or(seq.hint.max_total_tokens);
        let want = match self.mode {
            OrcaMode::Max => self.max_model_len,
            OrcaMode::Oracle => truth,
            OrcaMode::Pow2 => {
                let output = truth.saturating_sub(seq.num_prompt_tokens).max(1);
                seq.num_prompt_tokens + output.next_power_of_two()
            }
        };
        want.max(needed)
    }

    fn reserve(&mut self, tokens: usize) -> Option<(Vec<BlockId>, u32, u8)> {
        let blocks = tokens.div_ceil(self.block_size).max(1);
        let (start, order) = self.buddy.allocate(blocks)?;
        Some(((start..start + blocks as u32).map(BlockId).collect(), start, order))
    }

    /// Checks that no two live reservations overlap and the buddy's count
    /// adds up; panics with a message otherwise.
    pub fn assert_invariants(&self) {
        let mut spans: Vec<(u32, u32)> = self.seqs.values().map(|r| (r.start, r.start + (1u32 << r.order))).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "reservations {:?} and {:?} overlap", w[0], w[1]);
        }
        let used: usize = spans.iter().map(|(a, b)| (b - a) as usize).sum();
        assert_eq!(used + self.buddy.num_free_units(), self.buddy.num_units(), "free + used != total");
    }
}

impl BlockAllocator for OrcaAllocator {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.buddy.num_units()
    }

    fn num_free_blocks(&self) -> usize {
        self.buddy.num_free_units()
    }

    fn get_computed_blocks(&mut self, _seq: &SeqTokens<'_>) -> ComputedBlocks {
        ComputedBlocks::default()
    }

    fn allocate_slots(&mut self, seq: &SeqTokens<'_>, num_new_tokens: usize, computed: ComputedBlocks) -> Option<AllocatedSlots> {
        assert!(computed.block_ids.is_empty(), "Orca has no prefix cache");
        let total = seq.num_computed_tokens + num_new_tokens;
        if let Some(r) = self.seqs.get_mut(&seq.seq_id) {
            if total > r.block_table.len() * self.block_size {
                // Outgrew its reservation (a mispredicted length): Orca cannot grow in place.
                return None;
            }
            r.num_tokens = r.num_tokens.max(total);
            r.hint = seq.hint;
            return Some(AllocatedSlots { first_changed_block_idx: r.block_table.len(), num_blocks: r.block_table.len() });
        }
        let requested_tokens = self.tokens_to_reserve(seq, total);
        let (block_table, start, order) = self.reserve(requested_tokens)?;
        let num_blocks = block_table.len();
        self.seqs.insert(seq.seq_id, Reservation { block_table, start, order, requested_tokens, num_tokens: total, hint: seq.hint });
        Some(AllocatedSlots { first_changed_block_idx: 0, num_blocks })
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        assert!(!self.seqs.contains_key(&child), "fork onto live {child}");
        let p = self.seqs.get(&parent).unwrap_or_else(|| panic!("fork of unknown {parent}")).clone();
        let Some((block_table, start, order)) = self.reserve(p.requested_tokens) else { return false };
        let filled_blocks = p.num_tokens.div_ceil(self.block_size);
        for (&src, &dst) in p.block_table.iter().zip(&block_table).take(filled_blocks) {
            self.pending_copies.push(BlockCopy { src, dst });
        }
        self.seqs.insert(child, Reservation { block_table, start, order, ..p });
        true
    }

    fn free(&mut self, seq: SeqId) {
        if let Some(r) = self.seqs.remove(&seq) {
            self.buddy.free(r.start, r.order);
        }
    }

    fn block_table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.seqs.get(&seq).map(|r| r.block_table.as_slice())
    }

    fn take_block_copies(&mut self) -> Vec<BlockCopy> {
        std::mem::take(&mut self.pending_copies)
    }

    fn stats(&self) -> KvCacheStats {
        let bs = self.block_size;
        let mut s = KvCacheStats { block_size: bs, num_blocks: self.buddy.num_units(), ..KvCacheStats::default() };
        for r in self.seqs.values() {
            let allocated = (1usize << r.order) * bs;
            let requested = r.block_table.len() * bs;
            let end = r.hint.true_total_tokens.unwrap_or(r.hint.max_total_tokens).max(r.num_tokens);
            let reserved = end.min(requested) - r.num_tokens;
            s.num_used_blocks += 1 << r.order;
            s.num_logical_blocks += 1 << r.order;
            s.num_filled_slots += r.num_tokens;
            s.num_reserved_slots += reserved;
            s.num_internal_frag_slots += requested - r.num_tokens - reserved;
            s.num_external_frag_slots += allocated - requested;
        }
        s
    }
}
