//! The host-side swap pool (paper §4.5 "swapping").
//!
//! Swapped-out blocks keep their sharing: a device block shared by three
//! sequences becomes one host block with a reference count of three.

use vellum_base::HostBlockId;

/// Blocks of host memory holding swapped-out KV.
#[derive(Clone, Debug)]
pub struct HostPool {
    ref_cnt: Vec<u32>,
    num_filled: Vec<u16>,
    free: Vec<HostBlockId>,
}

impl HostPool {
    /// A pool of `num_blocks` host blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            ref_cnt: vec![0; num_blocks],
            num_filled: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().map(HostBlockId).collect(),
        }
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks not holding swapped-out KV.
    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Takes a free block holding `num_filled` tokens, with one holder.
    pub fn allocate(&mut self, num_filled: usize) -> Option<HostBlockId> {
        let b = self.free.pop()?;
        self.ref_cnt[b.index()] = 1;
        self.num_filled[b.index()] = num_filled as u16;
        Some(b)
    }

    /// One more holder.
    pub fn incref(&mut self, b: HostBlockId) {
        assert!(self.ref_cnt[b.index()] > 0, "host block {} is free", b.0);
        self.ref_cnt[b.index()] += 1;
    }

    /// One holder fewer; free at zero.
    pub fn release(&mut self, b: HostBlockId) {
        let r = &mut self.ref_cnt[b.index()];
        assert!(*r > 0, "host block {} released twice", b.0);
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        }
    }

    /// Tokens the block holds.
    pub fn num_filled(&self, b: HostBlockId) -> usize {
        self.num_filled[b.index()] as usize
    }

    /// Holders of `b`.
    pub fn ref_cnt(&self, b: HostBlockId) -> u32 {
        self.ref_cnt[b.index()]
    }
}
