//! The scheduler over an allocator of your own: `Scheduler<A: BlockAllocator>`
//! needs nothing else from the KV memory, so a project can bring its own
//! (here a plain free list of blocks, no sharing and no prefix cache, with a
//! pool too small for every request at once) and keep the unified scheduler:
//! chunked prefill, continuous batching, preemption by recompute.
//!
//!     cargo run -p vellum-scheduler --example custom_allocator
//!
//! Each step prints what was scheduled (a request's computed tokens chasing
//! its total, thesis §4.4) and the pool's free blocks; the fake model
//! "samples" token 7 for every sampling row.

use std::collections::HashMap;
use vellum_base::{
    AllocatedSlots, BlockAllocator, BlockCopy, BlockId, ComputedBlocks, KvCacheStats, RequestId, SamplingParams, SchedulerConfig, SeqId,
    SeqTokens,
};
use vellum_scheduler::{NewRequest, RequestSamples, Scheduler, StepSamples};

/// Blocks from a free list; a fork copies the parent's blocks.
struct FreeList {
    block_size: usize,
    num_blocks: usize,
    free: Vec<BlockId>,
    tables: HashMap<SeqId, Vec<BlockId>>,
    copies: Vec<BlockCopy>,
}

impl FreeList {
    fn new(num_blocks: usize, block_size: usize) -> Self {
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        Self { block_size, num_blocks, free, tables: HashMap::new(), copies: Vec::new() }
    }
}

impl BlockAllocator for FreeList {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    fn get_computed_blocks(&mut self, _seq: &SeqTokens<'_>) -> ComputedBlocks {
        ComputedBlocks::default() // no prefix cache
    }

    fn allocate_slots(&mut self, seq: &SeqTokens<'_>, num_new_tokens: usize, _computed: ComputedBlocks) -> Option<AllocatedSlots> {
        let held = self.tables.get(&seq.seq_id).map_or(0, Vec::len);
        let needed = (seq.num_computed_tokens + num_new_tokens).div_ceil(self.block_size);
        let more = needed.saturating_sub(held);
        if more > self.free.len() {
            return None; // the scheduler preempts and retries
        }
        let table = self.tables.entry(seq.seq_id).or_default();
        for _ in 0..more {
            table.push(self.free.pop()?);
        }
        Some(AllocatedSlots { first_changed_block_idx: held, num_blocks: table.len() })
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        let Some(src) = self.tables.get(&parent).cloned() else { return false };
        if src.len() > self.free.len() {
            return false;
        }
        let dst: Vec<BlockId> = src.iter().map(|_| self.free.pop().unwrap_or(BlockId::NULL)).collect();
        self.copies.extend(src.iter().zip(&dst).map(|(&src, &dst)| BlockCopy { src, dst }));
        self.tables.insert(child, dst);
        true
    }

    fn free(&mut self, seq: SeqId) {
        if let Some(table) = self.tables.remove(&seq) {
            self.free.extend(table);
        }
    }

    fn block_table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.tables.get(&seq).map(Vec::as_slice)
    }

    fn take_block_copies(&mut self) -> Vec<BlockCopy> {
        std::mem::take(&mut self.copies)
    }

    fn stats(&self) -> KvCacheStats {
        let used = self.num_blocks - self.free.len();
        KvCacheStats { block_size: self.block_size, num_blocks: self.num_blocks, num_used_blocks: used, ..KvCacheStats::default() }
    }
}

fn main() {
    // 10 blocks of 4 tokens: room for 40 tokens, and three requests that
    // will want 20–28 each. A step takes at most 12 tokens.
    let config = SchedulerConfig { max_num_seqs: 8, max_num_batched_tokens: 12, max_model_len: 64, ..SchedulerConfig::default() };
    let mut scheduler = Scheduler::new(config, FreeList::new(10, 4)).expect("a valid configuration");
    for (id, prompt_len, max_tokens) in [(0u64, 14usize, 6usize), (1, 9, 12), (2, 20, 8)] {
        let prompt = (0..prompt_len as u32).map(|t| t + 100 * id as u32).collect();
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
        scheduler.add_request(NewRequest::new(RequestId(id), prompt, params)).expect("accepted");
    }
    let mut step = 0;
    while scheduler.num_running() + scheduler.num_waiting() > 0 && step < 100 {
        let out = scheduler.schedule();
        let rows: Vec<String> =
            out.scheduled.iter().map(|s| format!("r{}: {}+{}", s.request_id.0, s.num_computed_tokens, s.num_scheduled_tokens)).collect();
        let preempted: Vec<u64> = out.preempted_requests.iter().map(|r| r.0).collect();
        let requests: Vec<RequestSamples> =
            out.scheduled.iter().filter(|s| s.samples).map(|s| RequestSamples::tokens(s.request_id, vec![(s.seq_id, 7)])).collect();
        let update = scheduler.update_from_output(&StepSamples { requests });
        let finished: Vec<u64> = update.finished_requests.iter().map(|(r, _)| r.0).collect();
        println!(
            "step {step:2}: {:<34} free blocks {:2}{}{}",
            rows.join(", "),
            scheduler.allocator().num_free_blocks(),
            if preempted.is_empty() { String::new() } else { format!("  preempted {preempted:?}") },
            if finished.is_empty() { String::new() } else { format!("  finished {finished:?}") },
        );
        step += 1;
    }
    assert_eq!(scheduler.allocator().num_free_blocks(), 10, "every block is back");
}
