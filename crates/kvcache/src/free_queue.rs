//! The free-block queue: an intrusive doubly linked list over block indices.
//!
//! ```text
//!   head (evicted / reused first)                      tail (kept longest)
//!   [uncached freed blocks] ... [cached blocks, least recently used first]
//! ```
//!
//! `pop_front`, `push_front`, `push_back` and `remove` (a prefix-cache hit on
//! a free block) are all O(1): the links live in two flat `Vec<u32>`s indexed
//! by block id, with `NIL` as the end marker. No allocation after `new`.

const NIL: u32 = u32::MAX;

/// Free blocks in eviction order.
#[derive(Clone, Debug)]
pub struct FreeBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    in_queue: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeBlockQueue {
    /// A queue holding blocks `0..num_blocks` in order.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks for u32 links");
        let n = num_blocks as u32;
        let prev = (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect();
        let next = (0..n).map(|i| if i + 1 == n { NIL } else { i + 1 }).collect();
        Self {
            prev,
            next,
            in_queue: vec![true; num_blocks],
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            len: num_blocks,
        }
    }

    /// Blocks in the queue.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is free.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `block` is in the queue.
    pub fn contains(&self, block: u32) -> bool {
        self.in_queue[block as usize]
    }

    /// Takes the block at the head.
    pub fn pop_front(&mut self) -> Option<u32> {
        if self.head == NIL {
            return None;
        }
        let b = self.head;
        self.remove(b);
        Some(b)
    }

    /// Puts `block` at the head (to be reused first).
    pub fn push_front(&mut self, block: u32) {
        assert!(!self.in_queue[block as usize], "block {block} freed twice");
        self.prev[block as usize] = NIL;
        self.next[block as usize] = self.head;
        if self.head == NIL {
            self.tail = block;
        } else {
            self.prev[self.head as usize] = block;
        }
        self.head = block;
        self.in_queue[block as usize] = true;
        self.len += 1;
    }

    /// Puts `block` at the tail (to be evicted last).
    pub fn push_back(&mut self, block: u32) {
        assert!(!self.in_queue[block as usize], "block {block} freed twice");
        self.next[block as usize] = NIL;
        self.prev[block as usize] = self.tail;
        if self.tail == NIL {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.in_queue[block as usize] = true;
        self.len += 1;
    }

    /// Unlinks `block`, wherever it is.
    pub fn remove(&mut self, block: u32) {
        assert!(self.in_queue[block as usize], "block {block} is not free");
        let (p, n) = (self.prev[block as usize], self.next[block as usize]);
        if p == NIL {
            self.head = n
        } else {
            self.next[p as usize] = n
        }
        if n == NIL {
            self.tail = p
        } else {
            self.prev[n as usize] = p
        }
        self.in_queue[block as usize] = false;
        self.len -= 1;
    }

    /// Blocks from head to tail (for tests and invariant checks).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let b = cur;
                cur = self.next[b as usize];
                b
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_removal() {
        let mut q = FreeBlockQueue::new(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(q.pop_front(), Some(0));
        q.remove(2);
        assert_eq!(q.iter().collect::<Vec<_>>(), [1, 3]);
        q.push_back(2);
        q.push_front(0);
        assert_eq!(q.iter().collect::<Vec<_>>(), [0, 1, 3, 2]);
        assert_eq!(q.len(), 4);
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        q.push_back(3);
        assert_eq!(q.iter().collect::<Vec<_>>(), [3]);
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn double_free_is_caught() {
        let mut q = FreeBlockQueue::new(2);
        q.push_back(1);
    }
}
