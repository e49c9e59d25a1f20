//! Chained block hashes for automatic prefix caching.
//!
//! A full block is named by a hash over its parent block's hash, its token ids
//! and optional extra keys (e.g. an adapter id). Chaining makes the hash of
//! block `i` identify the whole prefix `0..=i`, so one hash-map probe per block
//! finds the longest cached prefix.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::OnceLock;
use vellum_base::TokenId;

/// Identity of a full block's prefix. 128 bits, so that a collision (which
/// would hand a request someone else's KV) is not a practical concern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Hashes one full block of `tokens` after the block hashed `parent`
/// (`None` for the first block). `extra_key` separates caches that must not
/// share KV even for equal tokens (LoRA adapters, multimodal inputs).
pub fn hash_block_tokens(parent: Option<BlockHash>, tokens: &[TokenId], extra_key: Option<u64>) -> BlockHash {
    // Two SipHash streams with different prefixes give 128 independent-ish
    // bits. The keys are drawn once per process: with keys anyone knows, a
    // client could search for a block of tokens whose hash equals another
    // client's prefix and be handed that client's KV (vLLM's
    // GHSA-rm76-4mrf-v9r8). Hashes are never persisted, so per-process keys
    // cost nothing.
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    let keys = KEYS.get_or_init(RandomState::new);
    let mut lo = keys.build_hasher();
    let mut hi = keys.build_hasher();
    hi.write_u64(0x9e37_79b9_7f4a_7c15);
    for h in [&mut lo, &mut hi] {
        parent.hash(h);
        tokens.hash(h);
        extra_key.hash(h);
    }
    BlockHash(((hi.finish() as u128) << 64) | lo.finish() as u128)
}

/// The name of block hash `h` in KV-cache group `group`: the same tokens
/// hold different layers' KV in each group, so each group caches its own
/// blocks. Group 0 uses the block hash itself.
pub fn group_block_hash(h: BlockHash, group: usize) -> BlockHash {
    if group == 0 {
        h
    } else {
        hash_block_tokens(Some(h), &[], Some(group as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chaining_distinguishes_prefixes() {
        let a = hash_block_tokens(None, &[1, 2, 3, 4], None);
        let b = hash_block_tokens(None, &[9, 9, 9, 9], None);
        let a2 = hash_block_tokens(Some(a), &[5, 6, 7, 8], None);
        let b2 = hash_block_tokens(Some(b), &[5, 6, 7, 8], None);
        assert_ne!(a2, b2, "same tokens after a different prefix");
        assert_eq!(a2, hash_block_tokens(Some(a), &[5, 6, 7, 8], None), "deterministic");
        assert_ne!(a, hash_block_tokens(None, &[1, 2, 3, 4], Some(7)), "extra keys separate");
    }
}
