//! The device block pool: reference counts, the free queue and the
//! hash → block map of the prefix cache.
//!
//! A block is in exactly one of three states:
//!
//! ```text
//!   used     ref_cnt > 0, not in the free queue (held by block tables)
//!   cached   ref_cnt = 0, in the free queue, hash set (reusable prefix)
//!   free     ref_cnt = 0, in the free queue, no hash
//! ```
//!
//! Allocation takes the free queue's head; if that block is cached, its hash
//! is dropped (eviction, least recently freed first).

use crate::block_hash::BlockHash;
use crate::free_queue::FreeBlockQueue;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use vellum_base::BlockId;

/// Per-block bookkeeping.
#[derive(Clone, Copy, Debug, Default)]
struct BlockMeta {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    /// Slots holding (or about to hold, this step) a token.
    num_filled: u16,
}

/// `BlockHash` values are already uniformly distributed: hash them by their
/// low bits instead of hashing them again.
#[derive(Default)]
pub(crate) struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(buf);
        }
    }
    fn write_u128(&mut self, i: u128) {
        self.0 = i as u64;
    }
}

type HashToBlock = HashMap<BlockHash, BlockId, BuildHasherDefault<PassThroughHasher>>;

/// Physical blocks of the device pool.
#[derive(Clone, Debug)]
pub struct BlockPool {
    meta: Vec<BlockMeta>,
    free_queue: FreeBlockQueue,
    cached: HashToBlock,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self { meta: vec![BlockMeta::default(); num_blocks], free_queue: FreeBlockQueue::new(num_blocks), cached: HashToBlock::default() }
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks an allocation may take (free plus cached).
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len()
    }

    /// Free blocks that still hold a cached prefix.
    pub fn num_cached_free_blocks(&self) -> usize {
        self.free_queue.iter().filter(|&b| self.meta[b as usize].hash.is_some()).count()
    }

    /// Takes the head of the free queue (evicting its cached prefix, if any)
    /// with a reference count of one.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free_queue.pop_front()?;
        let meta = &mut self.meta[b as usize];
        if let Some(h) = meta.hash.take() {
            if self.cached.get(&h) == Some(&BlockId(b)) {
                self.cached.remove(&h);
            }
        }
        *meta = BlockMeta { ref_cnt: 1, hash: None, num_filled: 0 };
        Some(BlockId(b))
    }

    /// One more holder of `block`; a cached free block leaves the free queue.
    pub fn touch(&mut self, block: BlockId) {
        let meta = &mut self.meta[block.index()];
        if meta.ref_cnt == 0 {
            self.free_queue.remove(block.0);
        }
        meta.ref_cnt += 1;
    }

    /// One holder fewer. At zero the block becomes free: a cached block goes
    /// to the tail (kept longest), an uncached one to the head (reused first).
    pub fn release(&mut self, block: BlockId) {
        let meta = &mut self.meta[block.index()];
        assert!(meta.ref_cnt > 0, "{block} released with reference count 0 (double free)");
        meta.ref_cnt -= 1;
        if meta.ref_cnt == 0 {
            if meta.hash.is_some() {
                self.free_queue.push_back(block.0);
            } else {
                self.free_queue.push_front(block.0);
            }
        }
    }

    /// Registers a full, used block under `hash` unless another block already
    /// holds that prefix.
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) {
        let meta = &mut self.meta[block.index()];
        assert!(meta.ref_cnt > 0, "only used blocks are registered in the prefix cache");
        if meta.hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            meta.hash = Some(hash);
        }
    }

    /// Registers a used block under `hash`, taking the name over from a
    /// free block that held the same prefix (e.g. the stale device copy of a
    /// block that was swapped out and is now swapped back in elsewhere).
    pub fn recache_block(&mut self, block: BlockId, hash: BlockHash) {
        if let Some(&old) = self.cached.get(&hash) {
            if old != block && self.meta[old.index()].ref_cnt == 0 {
                self.uncache_block(old);
            }
        }
        self.cache_block(block, hash);
    }

    /// Drops `block`'s prefix-cache registration (its KV was never computed).
    pub fn uncache_block(&mut self, block: BlockId) {
        if let Some(h) = self.meta[block.index()].hash.take() {
            if self.cached.get(&h) == Some(&block) {
                self.cached.remove(&h);
            }
        }
    }

    /// The block holding the prefix named `hash`, if cached.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Drops every cached prefix of free blocks (e.g. after a weight reload).
    pub fn reset_prefix_cache(&mut self) {
        let free: Vec<u32> = self.free_queue.iter().collect();
        for b in free {
            if let Some(h) = self.meta[b as usize].hash.take() {
                self.cached.remove(&h);
            }
        }
    }

    /// Holders of `block`.
    pub fn ref_cnt(&self, block: BlockId) -> u32 {
        self.meta[block.index()].ref_cnt
    }

    /// The prefix hash of `block`, if registered.
    pub fn hash(&self, block: BlockId) -> Option<BlockHash> {
        self.meta[block.index()].hash
    }

    /// Slots of `block` holding a token.
    pub fn num_filled(&self, block: BlockId) -> usize {
        self.meta[block.index()].num_filled as usize
    }

    /// Records that `block` holds `n` tokens.
    pub fn set_num_filled(&mut self, block: BlockId, n: usize) {
        self.meta[block.index()].num_filled = n as u16;
    }

    /// Whether `block` is in the free queue.
    pub fn is_free(&self, block: BlockId) -> bool {
        self.free_queue.contains(block.0)
    }

    /// Used blocks (reference count above zero) and their filled slots.
    pub fn used_blocks(&self) -> impl Iterator<Item = (BlockId, usize)> + '_ {
        self.meta.iter().enumerate().filter(|(_, m)| m.ref_cnt > 0).map(|(i, m)| (BlockId(i as u32), m.num_filled as usize))
    }

    /// Checks the pool's own invariants; panics with a message on a breach.
    pub fn assert_consistent(&self) {
        let mut used = 0;
        for (i, m) in self.meta.iter().enumerate() {
            let free = self.free_queue.contains(i as u32);
            assert_eq!(free, m.ref_cnt == 0, "block {i}: in free queue = {free} but ref_cnt = {}", m.ref_cnt);
            used += (m.ref_cnt > 0) as usize;
            if let Some(h) = m.hash {
                assert_eq!(self.cached.get(&h), Some(&BlockId(i as u32)), "block {i} has a hash the map does not know");
            }
        }
        assert_eq!(used + self.free_queue.len(), self.meta.len(), "free + used != total");
        for (h, b) in &self.cached {
            assert_eq!(self.meta[b.index()].hash, Some(*h), "map entry for {b} is stale");
        }
    }
}
