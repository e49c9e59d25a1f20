//! Newtypes for the ids that cross crate boundaries.

use std::fmt;

/// A token id in the model's vocabulary.
pub type TokenId = u32;

/// A physical KV-cache block in the backend's (device) pool.
///
/// A block holds the keys and values of `block_size` consecutive tokens of one
/// sequence for every layer. Its slots are numbered
/// `block_id * block_size .. (block_id + 1) * block_size` in the slot mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// A block in the host-side swap pool (paper §4.5, "swapping").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostBlockId(pub u32);

/// A request: one prompt and its sampling parameters. A request with `n > 1`
/// or a beam search owns several sequences ([`SeqId`]), scheduled as a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// One sequence of tokens with its own block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl BlockId {
    /// A block-table entry whose tokens slid out of every layer's attention
    /// window: its block was released, and no kernel reads it (a batch
    /// carries it as block 0).
    pub const NULL: BlockId = BlockId(u32::MAX);

    /// Whether this is [`BlockId::NULL`].
    pub fn is_null(self) -> bool {
        self == Self::NULL
    }

    /// The block id as an index into a pool.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl HostBlockId {
    /// A swapped-out [`BlockId::NULL`] entry.
    pub const NULL: HostBlockId = HostBlockId(u32::MAX);

    /// The block id as an index into the host pool.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq {}", self.0)
    }
}
