//! A binary buddy allocator over a range of block ids, as the Orca baselines
//! of the paper assume (§6.1): requests are rounded up to a power of two and
//! placed at an offset aligned to their size, so external fragmentation is real.
//!
//! A pool whose size is not a power of two is split into maximal aligned
//! power-of-two chunks at start (e.g. 13 = 8 + 4 + 1).

use std::collections::BTreeSet;

/// A buddy allocator of `num_units` units.
#[derive(Clone, Debug)]
pub struct BuddyAllocator {
    num_units: usize,
    /// `free[k]`: start offsets of free chunks of `2^k` units.
    free: Vec<BTreeSet<u32>>,
    num_free_units: usize,
}

fn order_of(units: usize) -> usize {
    units.next_power_of_two().trailing_zeros() as usize
}

impl BuddyAllocator {
    /// All of `0..num_units` free.
    pub fn new(num_units: usize) -> Self {
        let max_order = if num_units == 0 { 0 } else { usize::BITS as usize - 1 - num_units.leading_zeros() as usize };
        let mut free = vec![BTreeSet::new(); max_order + 1];
        let mut offset = 0usize;
        while offset < num_units {
            let align = if offset == 0 { max_order } else { offset.trailing_zeros() as usize };
            let mut k = align.min(max_order);
            while offset + (1 << k) > num_units {
                k -= 1;
            }
            free[k].insert(offset as u32);
            offset += 1 << k;
        }
        Self { num_units, free, num_free_units: num_units }
    }

    /// Units managed.
    pub fn num_units(&self) -> usize {
        self.num_units
    }

    /// Units not allocated.
    pub fn num_free_units(&self) -> usize {
        self.num_free_units
    }

    /// The largest chunk that one allocation could get.
    pub fn largest_free_chunk(&self) -> usize {
        self.free.iter().rposition(|s| !s.is_empty()).map_or(0, |k| 1 << k)
    }

    /// Units an allocation of `units` really takes.
    pub fn rounded(units: usize) -> usize {
        units.max(1).next_power_of_two()
    }

    /// Allocates `units` rounded up to a power of two; returns the start
    /// offset and the order. `None` when no chunk is large enough.
    pub fn allocate(&mut self, units: usize) -> Option<(u32, u8)> {
        let k = order_of(units.max(1));
        let j = (k..self.free.len()).find(|&j| !self.free[j].is_empty())?;
        let start = *self.free[j].iter().next().expect("non-empty");
        self.free[j].remove(&start);
        // Split down to order k, returning the upper halves.
        for level in (k..j).rev() {
            self.free[level].insert(start + (1u32 << level));
        }
        self.num_free_units -= 1 << k;
        Some((start, k as u8))
    }

    /// Returns a chunk, merging it with its free buddies.
    pub fn free(&mut self, start: u32, order: u8) {
        let mut start = start;
        let mut k = order as usize;
        self.num_free_units += 1 << k;
        while k + 1 < self.free.len() {
            let buddy = start ^ (1u32 << k);
            if !self.free[k].remove(&buddy) {
                break;
            }
            start = start.min(buddy);
            k += 1;
        }
        assert!(self.free[k].insert(start), "chunk at {start} of order {k} freed twice");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_power_of_two_pool_and_merging() {
        let mut b = BuddyAllocator::new(13);
        assert_eq!(b.largest_free_chunk(), 8);
        // Smallest fitting chunk first: the 4-unit chunk at 8 is used whole.
        let (a, ka) = b.allocate(3).unwrap();
        assert_eq!((a, ka), (8, 2));
        // Then the 8-unit chunk is split.
        let (c, kc) = b.allocate(4).unwrap();
        assert_eq!((c, kc), (0, 2));
        assert_eq!(b.num_free_units(), 5);
        assert!(b.allocate(8).is_none(), "only 4 + 1 remain");
        b.free(a, ka);
        b.free(c, kc);
        assert_eq!(b.largest_free_chunk(), 8, "buddies merged back");
        assert_eq!(b.num_free_units(), 13);
    }

    #[test]
    fn external_fragmentation_is_real() {
        let mut b = BuddyAllocator::new(16);
        let chunks: Vec<_> = (0..4).map(|_| b.allocate(4).unwrap()).collect();
        b.free(chunks[0].0, chunks[0].1);
        b.free(chunks[2].0, chunks[2].1);
        assert_eq!(b.num_free_units(), 8);
        assert!(b.allocate(8).is_none(), "8 free units, but not contiguous");
    }
}
