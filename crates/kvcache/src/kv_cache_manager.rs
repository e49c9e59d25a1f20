//! The paged KV-cache manager: block tables over a shared block pool.
//!
//! ```text
//!  seq A  block table: [ 7 ][ 1 ][ 3 ]      logical block i holds tokens
//!  seq B  block table: [ 7 ][ 1 ][ 5 ]      i*block_size .. (i+1)*block_size
//!                         \    \
//!  pool:  block 7 ref 2, block 1 ref 2, block 3 ref 1, block 5 ref 1
//! ```
//!
//! * Sharing: `fork` copies a block table and bumps reference counts;
//!   prefix caching hands a new sequence the blocks of an equal prefix.
//! * Copy-on-write: a write into a block with more than one holder first
//!   copies it to a fresh block; the copies of a step are handed to the
//!   backend in one batch ([`BlockAllocator::take_block_copies`]).
//! * Waste: a sequence holds `ceil(tokens / block_size)` blocks, so at most
//!   one partially filled block.
//! * Sliding window (a group of layers attends to the last `W` positions:
//!   every layer of Mistral, the local layers of Gemma 3): a block whose
//!   tokens all lie before the first position any future query sees
//!   (`num_computed + 1 − W`) is released and its entry becomes
//!   [`BlockId::NULL`], so the group holds about `W / block_size + 1` blocks
//!   per sequence however long it grows. Its hash stays registered while the
//!   block waits in the free queue, so prefix hits still find it.
//! * KV-cache groups (vLLM's hybrid manager; see
//!   [`KvCacheGroups`](vellum_base::KvCacheGroups)): a model that mixes
//!   local and global layers keeps a block table per group of layers over
//!   the one pool, interleaved in one table (entry `i·G + g` is logical
//!   block `i` of group `g`). Each group slides by its own window; a prefix
//!   hit is the longest prefix that every group can serve (the global
//!   groups from the first token, a local group only over its window).
//!
//! Complexity: `allocate_slots` is O(new blocks + newly full blocks) plus one
//! hash-map probe; `free` is O(blocks held); `get_computed_blocks` is one hash
//! and one probe per full prompt block.

use crate::block_hash::{group_block_hash, hash_block_tokens, BlockHash};
use crate::block_pool::BlockPool;
use crate::host_pool::HostPool;
use std::collections::BTreeMap;
use vellum_base::{
    AllocatedSlots, BlockAllocator, BlockCopy, BlockId, BlockSwap, ComputedBlocks, HostBlockId, KvCacheStats, LengthHint, SeqId, SeqTokens,
};
use vellum_base::{IdMap, IdSet, IdSlab};

/// Sizes and switches of a [`KvCacheManager`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCacheManagerConfig {
    /// Blocks in the device pool.
    pub num_blocks: usize,
    /// Blocks in the host swap pool; clamped to `num_blocks`.
    pub num_host_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Automatic prefix caching.
    pub enable_prefix_caching: bool,
    /// The window of each KV-cache group, in block-table order (`None`:
    /// full attention): a group's blocks that slid out of its window are
    /// released. At least one group.
    pub group_windows: Vec<Option<usize>>,
}

impl KvCacheManagerConfig {
    /// `num_blocks` blocks of `block_size`, prefix caching on, no swap
    /// space, one full-attention group.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self { num_blocks, num_host_blocks: 0, block_size, enable_prefix_caching: true, group_windows: vec![None] }
    }

    /// One group whose every layer attends to the last `window` positions.
    pub fn with_sliding_window(self, window: usize) -> Self {
        self.with_group_windows(vec![Some(window)])
    }

    /// One block table per group, each with its window.
    pub fn with_group_windows(mut self, windows: Vec<Option<usize>>) -> Self {
        self.group_windows = windows;
        self
    }
}

/// A live sequence's blocks.
#[derive(Clone, Debug)]
struct SeqBlocks {
    /// Groups interleaved: entry `i·G + g` is logical block `i` of group `g`.
    block_table: Vec<BlockId>,
    /// A copy of the table's last entry ([`BlockId::NULL`] while it is
    /// empty): a decode step that writes into the last block reads this
    /// instead of the table, whose allocation lies elsewhere in the heap
    /// (a cache miss per running sequence per step: docs/benchmarks.md).
    /// The table is still read once per block, when a write fills it and
    /// prefix caching registers it.
    tail: BlockId,
    /// Chained hashes of the leading full logical blocks (may lag the table).
    block_hashes: Vec<BlockHash>,
    /// Tokens with a reserved slot.
    num_tokens: usize,
    hint: LengthHint,
}

/// A swapped-out sequence: the same, in host blocks.
#[derive(Clone, Debug)]
struct SwappedSeq {
    host_table: Vec<HostBlockId>,
    block_hashes: Vec<BlockHash>,
    num_tokens: usize,
    hint: LengthHint,
}

/// Block size, group windows and the prefix-caching switch of a manager,
/// borrowed apart from its pool and sequences for [`KvCacheManager::grow`]
/// and [`KvCacheManager::slide`].
#[derive(Clone, Copy)]
struct Geometry<'a> {
    block_size: usize,
    windows: &'a [Option<usize>],
    enable_prefix_caching: bool,
}

/// Paged KV-cache manager (paper §4.2–4.5, thesis Listing 4.2).
#[derive(Clone, Debug)]
pub struct KvCacheManager {
    block_size: usize,
    enable_prefix_caching: bool,
    /// One entry per KV-cache group.
    windows: Vec<Option<usize>>,
    pool: BlockPool,
    host: HostPool,
    seqs: IdSlab<SeqId, SeqBlocks>,
    swapped: IdMap<SeqId, SwappedSeq>,
    pending_copies: Vec<BlockCopy>,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
}

impl KvCacheManager {
    /// Drops the pending copies-on-write into blocks now free (their
    /// sequence was freed or trimmed before the step ran): a free block may
    /// go to another sequence in this very step, which the copy would
    /// overwrite after its swap-in or its own copy.
    fn drop_copies_into_free_blocks(&mut self) {
        let pool = &self.pool;
        self.pending_copies.retain(|c| pool.ref_cnt(c.dst) > 0);
    }

    /// An empty manager.
    pub fn new(config: KvCacheManagerConfig) -> Self {
        assert!(config.block_size > 0 && config.block_size <= u16::MAX as usize, "block size out of range");
        let mut windows: Vec<Option<usize>> = config.group_windows.iter().map(|w| w.filter(|&w| w > 0)).collect();
        if windows.is_empty() {
            windows.push(None);
        }
        Self {
            block_size: config.block_size,
            enable_prefix_caching: config.enable_prefix_caching,
            windows,
            pool: BlockPool::new(config.num_blocks),
            host: HostPool::new(config.num_host_blocks.min(config.num_blocks)),
            seqs: IdSlab::default(),
            swapped: IdMap::default(),
            pending_copies: Vec::new(),
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
        }
    }

    /// The block pool (read-only), e.g. for reference counts in tests.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Whether `seq` is swapped out to the host pool.
    pub fn is_swapped(&self, seq: SeqId) -> bool {
        self.swapped.contains_key(&seq)
    }

    /// Tokens `seq` has slots for.
    pub fn num_tokens(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.num_tokens)
    }

    /// Live (device-resident) sequences.
    pub fn num_live_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Forgets every cached prefix held by free blocks.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset_prefix_cache();
    }

    /// Block-table entries (all groups) needed to hold `num_tokens` tokens.
    fn entries_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size) * self.windows.len()
    }

    /// The first logical block of a group with `window` that a query at
    /// `position` (or later) still sees.
    fn first_visible_block(window: Option<usize>, position: usize, bs: usize) -> usize {
        window.map_or(0, |w| (position + 1).saturating_sub(w) / bs)
    }

    /// Appends `num_new_blocks` logical blocks (a block per group each) to
    /// `s`, records the slots this step fills, and registers the blocks it
    /// completes in the prefix cache.
    fn grow(g: Geometry<'_>, pool: &mut BlockPool, s: &mut SeqBlocks, seq: &SeqTokens<'_>, total: usize, num_new_blocks: usize) {
        let (bs, groups) = (g.block_size, g.windows.len());
        for _ in 0..num_new_blocks * groups {
            s.block_table.push(pool.allocate().expect("room checked by the caller"));
        }
        let write_block_idx = seq.num_computed_tokens / bs;
        for (j, &b) in s.block_table.iter().enumerate().skip(write_block_idx * groups) {
            if j < (write_block_idx + 1) * groups && !b.is_null() {
                assert_eq!(pool.ref_cnt(b), 1, "{}: write into shared {b}", seq.seq_id);
            }
            let filled = total.saturating_sub(j / groups * bs).min(bs);
            if !b.is_null() && filled > pool.num_filled(b) {
                pool.set_num_filled(b, filled);
            }
        }
        s.tail = s.block_table.last().copied().unwrap_or(BlockId::NULL);
        Self::finish_write(g, pool, s, seq, total);
    }

    /// The end of every allocation up to `total` tokens: the counters, then
    /// the prefix-cache registration of the blocks the step fills
    /// completely and whose tokens are all known (under asynchronous
    /// scheduling the last sampled token may still be in flight; its block
    /// is registered on a later call).
    fn finish_write(g: Geometry<'_>, pool: &mut BlockPool, s: &mut SeqBlocks, seq: &SeqTokens<'_>, total: usize) {
        s.num_tokens = s.num_tokens.max(total);
        s.hint = seq.hint;
        let (bs, groups) = (g.block_size, g.windows.len());
        if g.enable_prefix_caching {
            let num_full = total.min(seq.token_ids.len()) / bs;
            while s.block_hashes.len() < num_full {
                let i = s.block_hashes.len();
                let h = hash_block_tokens(s.block_hashes.last().copied(), &seq.token_ids[i * bs..(i + 1) * bs], None);
                s.block_hashes.push(h);
                for group in 0..groups {
                    let b = s.block_table[i * groups + group];
                    if !b.is_null() {
                        pool.cache_block(b, group_block_hash(h, group));
                    }
                }
            }
        }
    }

    /// Releases, in every group with a window, the blocks before the first
    /// one a query at `position` sees; returns the first entry that became
    /// [`BlockId::NULL`], if any.
    fn slide(geo: Geometry<'_>, pool: &mut BlockPool, s: &mut SeqBlocks, position: usize) -> Option<usize> {
        let groups = geo.windows.len();
        let mut first_released = None;
        for (g, &w) in geo.windows.iter().enumerate().filter(|(_, w)| w.is_some()) {
            let visible = Self::first_visible_block(w, position, geo.block_size);
            for i in 0..visible.min(s.block_table.len() / groups) {
                let b = &mut s.block_table[i * groups + g];
                if !b.is_null() {
                    pool.release(*b);
                    *b = BlockId::NULL;
                    let j = i * groups + g;
                    first_released = Some(first_released.map_or(j, |f: usize| f.min(j)));
                }
            }
        }
        first_released
    }

    /// Blocks [`Self::slide`] would return to the pool (held by `s` alone).
    fn releasable(geo: Geometry<'_>, pool: &BlockPool, s: &SeqBlocks, position: usize) -> usize {
        let groups = geo.windows.len();
        let mut n = 0;
        for (g, &w) in geo.windows.iter().enumerate().filter(|(_, w)| w.is_some()) {
            let visible = Self::first_visible_block(w, position, geo.block_size);
            n += (0..visible.min(s.block_table.len() / groups))
                .map(|i| s.block_table[i * groups + g])
                .filter(|b| !b.is_null() && pool.ref_cnt(*b) == 1)
                .count();
        }
        n
    }

    /// Checks every invariant of the manager; panics with a message on a
    /// breach. Used after each operation by the property tests.
    ///
    /// * each block's reference count equals the block-table entries that
    ///   point at it (cached free blocks have count zero);
    /// * a block is in the free queue iff its count is zero; free + used = total;
    /// * each table has exactly `G · ceil(num_tokens / block_size)` entries,
    ///   released ones only in groups with a window;
    /// * host reference counts equal the host-table entries.
    pub fn assert_invariants(&self) {
        self.pool.assert_consistent();
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (id, s) in &self.seqs {
            assert_eq!(s.block_table.len(), self.entries_for(s.num_tokens), "{id}: table length vs tokens");
            assert_eq!(s.tail, s.block_table.last().copied().unwrap_or(BlockId::NULL), "{id}: tail vs the table's last entry");
            assert!(s.block_hashes.len() * self.windows.len() <= s.block_table.len(), "{id}: more hashes than blocks");
            for b in s.block_table.iter().filter(|b| !b.is_null()) {
                refs[b.index()] += 1;
            }
            for (j, b) in s.block_table.iter().enumerate() {
                let w = self.windows[j % self.windows.len()];
                assert!(w.is_some() || !b.is_null(), "{id}: entry {j} released in a group without a window");
            }
        }
        for (i, &r) in refs.iter().enumerate() {
            assert_eq!(self.pool.ref_cnt(BlockId(i as u32)), r, "block {i}: ref_cnt vs table entries");
        }
        let mut host_refs = vec![0u32; self.host.num_blocks()];
        for s in self.swapped.values() {
            for b in s.host_table.iter().filter(|b| **b != HostBlockId::NULL) {
                host_refs[b.index()] += 1;
            }
        }
        let mut used_host = 0;
        for (i, &r) in host_refs.iter().enumerate() {
            assert_eq!(self.host.ref_cnt(HostBlockId(i as u32)), r, "host block {i}: ref_cnt vs tables");
            used_host += (r > 0) as usize;
        }
        assert_eq!(used_host + self.host.num_free_blocks(), self.host.num_blocks(), "host free + used != total");
    }
}

impl BlockAllocator for KvCacheManager {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    fn num_kv_groups(&self) -> usize {
        self.windows.len()
    }

    fn max_blocks_held(&self, num_tokens: usize, max_chunk: usize) -> usize {
        max_blocks_held(&self.windows, self.block_size, num_tokens, max_chunk)
    }

    fn get_computed_blocks(&mut self, seq: &SeqTokens<'_>) -> ComputedBlocks {
        if !self.enable_prefix_caching || seq.token_ids.is_empty() {
            return ComputedBlocks::default();
        }
        let (bs, groups) = (self.block_size, self.windows.len());
        // Never the whole sequence: the last token must be computed.
        let max_blocks = (seq.token_ids.len() - 1) / bs;
        // found[i·G + g]: logical block i of group g is cached. A group with
        // a window needs, for a hit of n blocks, only the blocks its first
        // computed query (at n·bs) still sees; `run[g]` counts its cached
        // blocks in a row ending at the current one.
        let mut found = Vec::new();
        let mut run = vec![0usize; groups];
        let (mut parent, mut best) = (None, 0);
        for (i, chunk) in seq.token_ids.chunks_exact(bs).take(max_blocks).enumerate() {
            let h = hash_block_tokens(parent, chunk, None);
            parent = Some(h);
            let mut full_groups_hit = true;
            for (g, w) in self.windows.iter().enumerate() {
                let b = self.pool.lookup(group_block_hash(h, g));
                found.push(b.unwrap_or(BlockId::NULL));
                run[g] = if b.is_some() { run[g] + 1 } else { 0 };
                full_groups_hit &= w.is_some() || b.is_some();
            }
            if !full_groups_hit {
                break;
            }
            let n = i + 1;
            let windows_hit =
                self.windows.iter().zip(&run).all(|(&w, &r)| w.is_none() || r >= n - Self::first_visible_block(w, n * bs, bs));
            if windows_hit {
                best = n;
            }
        }
        found.truncate(best * groups);
        for (g, &w) in self.windows.iter().enumerate() {
            for i in 0..Self::first_visible_block(w, best * bs, bs).min(best) {
                found[i * groups + g] = BlockId::NULL;
            }
        }
        ComputedBlocks { block_ids: found, num_computed_tokens: best * bs }
    }

    fn allocate_slots(&mut self, seq: &SeqTokens<'_>, num_new_tokens: usize, computed: ComputedBlocks) -> Option<AllocatedSlots> {
        let (bs, groups) = (self.block_size, self.windows.len());
        let total = seq.num_computed_tokens + num_new_tokens;
        let write_block_idx = seq.num_computed_tokens / bs;
        let num_free = self.pool.num_free_blocks();
        let geo = Geometry { block_size: bs, windows: &self.windows, enable_prefix_caching: self.enable_prefix_caching };
        if let Some(s) = self.seqs.get_mut(&seq.seq_id) {
            assert!(computed.block_ids.is_empty(), "{}: computed blocks are only for a new sequence", seq.seq_id);
            // Most decode steps: one group without a window, the slots lie in
            // the last block, and no other table holds it. Only `tail` and
            // that block's metadata are read (the table too when the write
            // fills the block and it is registered): the same result as
            // below, where there is nothing to copy, slide or append.
            let num_entries = s.block_table.len();
            if groups == 1
                && self.windows[0].is_none()
                && num_new_tokens > 0
                && write_block_idx + 1 == num_entries
                && total <= num_entries * bs
                && self.pool.ref_cnt(s.tail) == 1
            {
                let filled = total - write_block_idx * bs;
                if filled > self.pool.num_filled(s.tail) {
                    self.pool.set_num_filled(s.tail, filled);
                }
                Self::finish_write(geo, &mut self.pool, s, seq, total);
                return Some(AllocatedSlots { first_changed_block_idx: num_entries, num_blocks: num_entries });
            }
            // Copy-on-write: the first slot written lies in blocks held by
            // others (entries of the written logical block, one per group).
            let write_entries = if num_new_tokens == 0 {
                0..0
            } else {
                write_block_idx * groups..((write_block_idx + 1) * groups).min(s.block_table.len())
            };
            let shared = |pool: &BlockPool, b: BlockId| !b.is_null() && pool.ref_cnt(b) > 1;
            let num_cow = s.block_table[write_entries.clone()].iter().filter(|&&b| shared(&self.pool, b)).count();
            let num_new_blocks = total.div_ceil(bs).saturating_sub(s.block_table.len() / groups);
            // With a window, the blocks wholly before the first position this
            // step's queries see are released first: they count as room.
            let releasable = Self::releasable(geo, &self.pool, s, seq.num_computed_tokens);
            if num_new_blocks * groups + num_cow > num_free + releasable {
                return None;
            }
            let mut first_changed = s.block_table.len();
            if let Some(j) = Self::slide(geo, &mut self.pool, s, seq.num_computed_tokens) {
                first_changed = j;
            }
            if num_cow > 0 {
                for j in write_entries {
                    let old = s.block_table[j];
                    if !shared(&self.pool, old) {
                        continue;
                    }
                    let new = self.pool.allocate().expect("room checked above");
                    self.pool.set_num_filled(new, self.pool.num_filled(old));
                    self.pool.release(old);
                    self.pending_copies.push(BlockCopy { src: old, dst: new });
                    s.block_table[j] = new;
                    first_changed = first_changed.min(j);
                }
            }
            Self::grow(geo, &mut self.pool, s, seq, total, num_new_blocks);
            return Some(AllocatedSlots { first_changed_block_idx: first_changed, num_blocks: s.block_table.len() });
        }
        assert!(!self.swapped.contains_key(&seq.seq_id), "{} is swapped out; swap it in first", seq.seq_id);
        assert_eq!(computed.num_computed_tokens, seq.num_computed_tokens, "{}: a new sequence starts at its prefix-cache hit", seq.seq_id);
        let num_hit = computed.block_ids.len() / groups;
        let num_new_blocks = total.div_ceil(bs).saturating_sub(num_hit);
        // Hit blocks before a window are not revived: their entries start released.
        let visible: Vec<usize> = self.windows.iter().map(|&w| Self::first_visible_block(w, seq.num_computed_tokens, bs)).collect();
        let kept = |j: usize| j / groups >= visible[j % groups];
        let num_revived = computed.block_ids.iter().enumerate().filter(|&(j, b)| kept(j) && !b.is_null() && self.pool.is_free(*b)).count();
        if num_new_blocks * groups + num_revived > num_free {
            return None;
        }
        let block_hashes = {
            let mut parent = None;
            seq.token_ids[..num_hit * bs]
                .chunks_exact(bs)
                .map(|chunk| {
                    let h = hash_block_tokens(parent, chunk, None);
                    parent = Some(h);
                    h
                })
                .collect()
        };
        let mut block_table = computed.block_ids;
        for (j, b) in block_table.iter_mut().enumerate() {
            if !kept(j) {
                *b = BlockId::NULL;
            } else {
                assert!(!b.is_null(), "{}: a prefix hit lacks block {j} that a query still sees", seq.seq_id);
                self.pool.touch(*b);
            }
        }
        self.prefix_cache_queries += seq.num_prompt_tokens as u64;
        self.prefix_cache_hits += computed.num_computed_tokens.min(seq.num_prompt_tokens) as u64;
        let mut s = SeqBlocks { block_table, tail: BlockId::NULL, block_hashes, num_tokens: computed.num_computed_tokens, hint: seq.hint };
        Self::grow(geo, &mut self.pool, &mut s, seq, total, num_new_blocks);
        let num_blocks = s.block_table.len();
        self.seqs.insert(seq.seq_id, s);
        Some(AllocatedSlots { first_changed_block_idx: 0, num_blocks })
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        assert!(!self.seqs.contains_key(&child) && !self.swapped.contains_key(&child), "fork onto live {child}");
        let p = self.seqs.get(&parent).unwrap_or_else(|| panic!("fork of unknown {parent}")).clone();
        for &b in p.block_table.iter().filter(|b| !b.is_null()) {
            self.pool.touch(b);
        }
        self.seqs.insert(child, p);
        true
    }

    fn free(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            // Reverse order: the tail of a sequence is the least likely to be
            // shared again, so it lands nearer the head and is evicted first.
            for &b in s.block_table.iter().rev().filter(|b| !b.is_null()) {
                self.pool.release(b);
            }
            self.drop_copies_into_free_blocks();
        }
        if let Some(s) = self.swapped.remove(&seq) {
            for &b in s.host_table.iter().filter(|b| **b != HostBlockId::NULL) {
                self.host.release(b);
            }
        }
    }

    fn trim(&mut self, seq: SeqId, num_computed_tokens: usize) {
        let (bs, groups) = (self.block_size, self.windows.len());
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        if num_computed_tokens >= s.num_tokens {
            return;
        }
        // Registrations of blocks not wholly computed are void.
        let num_full = num_computed_tokens / bs;
        for &b in s.block_table.iter().take(s.block_hashes.len() * groups).skip(num_full * groups).filter(|b| !b.is_null()) {
            self.pool.uncache_block(b);
        }
        s.block_hashes.truncate(num_full);
        let keep = num_computed_tokens.div_ceil(bs);
        for &b in s.block_table[keep * groups..].iter().rev().filter(|b| !b.is_null()) {
            self.pool.release(b);
        }
        s.block_table.truncate(keep * groups);
        s.tail = s.block_table.last().copied().unwrap_or(BlockId::NULL);
        s.num_tokens = num_computed_tokens;
        if keep > 0 {
            for &last in s.block_table[(keep - 1) * groups..].iter().filter(|b| !b.is_null()) {
                if self.pool.ref_cnt(last) == 1 {
                    self.pool.set_num_filled(last, num_computed_tokens - (keep - 1) * bs);
                }
            }
        }
        self.drop_copies_into_free_blocks();
    }

    fn block_table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.seqs.get(&seq).map(|s| s.block_table.as_slice())
    }

    fn take_block_copies(&mut self) -> Vec<BlockCopy> {
        std::mem::take(&mut self.pending_copies)
    }

    fn swap_out(&mut self, seqs: &[SeqId]) -> Option<Vec<BlockSwap>> {
        let tables = seqs.iter().filter_map(|id| self.seqs.get(id)).flat_map(|s| s.block_table.iter().copied()).filter(|b| !b.is_null());
        let (host, pool) = (&mut self.host, &self.pool);
        let mapping = map_distinct(tables, host.num_free_blocks(), |device| host.allocate(pool.num_filled(device)).expect("room checked"))?;
        // A copy-on-write of this step into a block that leaves now has not
        // run (a step's copies run after its swaps): the swap takes the
        // copy's source, which swap-outs still find as it was, and the copy
        // is dropped.
        let swaps = mapping
            .iter()
            .map(|(&device, &host)| {
                let source = self.pending_copies.iter().find(|c| c.dst == device).map_or(device, |c| c.src);
                BlockSwap { device: source, host }
            })
            .collect();
        self.pending_copies.retain(|c| !mapping.contains_key(&c.dst));
        let mut first_use = IdSet::default();
        for id in seqs {
            let Some(s) = self.seqs.remove(id) else { continue };
            let host_table = translate(&s.block_table, &mapping, &mut first_use, BlockId::NULL, HostBlockId::NULL, |h| self.host.incref(h));
            for &b in s.block_table.iter().filter(|b| !b.is_null()) {
                self.pool.release(b);
            }
            self.swapped.insert(*id, SwappedSeq { host_table, block_hashes: s.block_hashes, num_tokens: s.num_tokens, hint: s.hint });
        }
        Some(swaps)
    }

    fn swap_in(&mut self, seqs: &[SeqId]) -> Option<Vec<BlockSwap>> {
        let tables = seqs
            .iter()
            .filter_map(|id| self.swapped.get(id))
            .flat_map(|s| s.host_table.iter().copied())
            .filter(|h| *h != HostBlockId::NULL);
        let (host, pool) = (&self.host, &mut self.pool);
        let mapping = map_distinct(tables, pool.num_free_blocks(), |h| {
            let device = pool.allocate().expect("room checked");
            pool.set_num_filled(device, host.num_filled(h));
            device
        })?;
        let swaps = mapping.iter().map(|(&host, &device)| BlockSwap { device, host }).collect();
        let mut first_use = IdSet::default();
        for id in seqs {
            let Some(s) = self.swapped.remove(id) else { continue };
            let block_table = translate(&s.host_table, &mapping, &mut first_use, HostBlockId::NULL, BlockId::NULL, |b| self.pool.touch(b));
            for &h in s.host_table.iter().filter(|h| **h != HostBlockId::NULL) {
                self.host.release(h);
            }
            if self.enable_prefix_caching {
                // The restored blocks are the live copies of their prefixes.
                let groups = self.windows.len();
                for (j, &b) in block_table.iter().enumerate().take(s.block_hashes.len() * groups).filter(|(_, b)| !b.is_null()) {
                    self.pool.recache_block(b, group_block_hash(s.block_hashes[j / groups], j % groups));
                }
            }
            let tail = block_table.last().copied().unwrap_or(BlockId::NULL);
            self.seqs.insert(*id, SeqBlocks { block_table, tail, block_hashes: s.block_hashes, num_tokens: s.num_tokens, hint: s.hint });
        }
        Some(swaps)
    }

    fn stats(&self) -> KvCacheStats {
        let bs = self.block_size;
        let mut num_used_blocks = 0;
        let mut num_filled_slots = 0;
        for (_, filled) in self.pool.used_blocks() {
            num_used_blocks += 1;
            num_filled_slots += filled;
        }
        let empty = num_used_blocks * bs - num_filled_slots;
        // Empty slots past a sequence's eventual length will never be filled.
        let beyond_end: usize = self
            .seqs
            .values()
            .map(|s| {
                let end = s.hint.true_total_tokens.unwrap_or(s.hint.max_total_tokens).max(s.num_tokens);
                (s.block_table.len() / self.windows.len() * bs).saturating_sub(end) * self.windows.len()
            })
            .sum();
        let internal = beyond_end.min(empty);
        KvCacheStats {
            block_size: bs,
            num_blocks: self.pool.num_blocks(),
            num_used_blocks,
            num_cached_free_blocks: self.pool.num_cached_free_blocks(),
            num_logical_blocks: self.seqs.values().map(|s| s.block_table.iter().filter(|b| !b.is_null()).count()).sum(),
            num_filled_slots,
            num_reserved_slots: empty - internal,
            num_internal_frag_slots: internal,
            num_external_frag_slots: 0,
            num_host_blocks: self.host.num_blocks(),
            num_used_host_blocks: self.host.num_blocks() - self.host.num_free_blocks(),
            prefix_cache_queries: self.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits,
        }
    }
}

/// Swapping, either way: each distinct block of the tables (a shared block
/// once) gets a block of the other pool from `allocate`, in block order;
/// `None` when fewer than that are `free`.
fn map_distinct<F: Copy + Ord + std::hash::Hash, T>(
    tables: impl Iterator<Item = F>,
    free: usize,
    allocate: impl FnMut(F) -> T,
) -> Option<BTreeMap<F, T>> {
    let mut distinct: Vec<F> = tables.collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() > free {
        return None;
    }
    let mut allocate = allocate;
    Some(distinct.into_iter().map(|b| (b, allocate(b))).collect())
}

/// A block table through a swap's mapping. Each new block was allocated
/// with one holder, the first table entry pointing at it (over all tables
/// of the swap, tracked in `first_use`); every later entry takes another
/// reference through `add_ref`. Released entries (`null_from`) stay
/// released (`null_to`).
fn translate<F: Ord + Copy, T: Copy + Eq + std::hash::Hash>(
    table: &[F],
    mapping: &BTreeMap<F, T>,
    first_use: &mut IdSet<T>,
    null_from: F,
    null_to: T,
    mut add_ref: impl FnMut(T),
) -> Vec<T> {
    table
        .iter()
        .map(|b| {
            if *b == null_from {
                return null_to;
            }
            let t = mapping[b];
            if !first_use.insert(t) {
                add_ref(t);
            }
            t
        })
        .collect()
}

/// The most blocks one sequence of `num_tokens` tokens holds at once, over
/// KV-cache groups with these `windows` (block-table order), when a step
/// computes at most `max_chunk` of its tokens: a full-attention group holds
/// every block; a sliding-window group only those its queries still see.
/// What [`BlockAllocator::max_blocks_held`] answers, for sizing a cache
/// before the manager exists.
pub fn max_blocks_held(windows: &[Option<usize>], block_size: usize, num_tokens: usize, max_chunk: usize) -> usize {
    let all = num_tokens.div_ceil(block_size);
    windows
        .iter()
        .map(|w| match w {
            // A step's first query sees W − 1 earlier positions; its chunk
            // adds up to max_chunk; one more block for misalignment.
            Some(w) => all.min((w - 1 + max_chunk.max(1)).div_ceil(block_size) + 1),
            None => all,
        })
        .sum()
}
