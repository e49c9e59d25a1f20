//! The KV-cache manager on its own, as a project that depends on
//! `vellum-kvcache` (and `vellum-base` for the contract) would use it: no
//! model, no backend, only block ids.
//!
//!     cargo run -p vellum-kvcache --example paged_memory
//!
//! A prompt of 40 tokens is stored in blocks of 16; a second request with
//! the same first 32 tokens finds them in the prefix cache; the first
//! request forks into two samples that share its blocks, and the first
//! token each sample writes into the shared last block copies it (the
//! copy-on-write of paper §4.4). The manager never touches KV bytes: it
//! returns the copies for the backend to make.

use vellum_base::{BlockAllocator, ComputedBlocks, LengthHint, SeqId, SeqTokens};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig};

fn tokens<'a>(seq: u64, ids: &'a [u32], prompt: usize, computed: usize) -> SeqTokens<'a> {
    SeqTokens {
        seq_id: SeqId(seq),
        token_ids: ids,
        num_prompt_tokens: prompt,
        num_computed_tokens: computed,
        hint: LengthHint { max_total_tokens: ids.len() + 16, true_total_tokens: None },
    }
}

fn main() {
    let mut kv = KvCacheManager::new(KvCacheManagerConfig::new(64, 16));
    let prompt: Vec<u32> = (0..40).collect();

    // Request A: its whole prompt in one step (prefill).
    let a = tokens(1, &prompt, prompt.len(), 0);
    let hit = kv.get_computed_blocks(&a);
    kv.allocate_slots(&a, prompt.len(), hit).expect("room for the prompt");
    println!("A holds {:?} ({} of 64 blocks free)", kv.block_table(SeqId(1)).unwrap_or_default(), kv.num_free_blocks());

    // Request B shares A's first 32 tokens: two full blocks come from the prefix cache.
    let mut other = prompt[..32].to_vec();
    other.extend([900, 901, 902]);
    let b = tokens(2, &other, other.len(), 0);
    let hit: ComputedBlocks = kv.get_computed_blocks(&b);
    println!("B finds {} tokens cached in {:?}", hit.num_computed_tokens, hit.block_ids);
    let skipped = hit.num_computed_tokens;
    kv.allocate_slots(&tokens(2, &other, other.len(), skipped), other.len() - skipped, hit).expect("room for B");
    println!("B holds {:?}", kv.block_table(SeqId(2)).unwrap_or_default());

    // A forks into two samples (parallel sampling): the child shares every block.
    assert!(kv.fork(SeqId(1), SeqId(3)));
    println!("sample 3 shares A's table {:?}", kv.block_table(SeqId(3)).unwrap_or_default());

    // Each sample decodes its first token into the shared, half-full last block:
    // the first writer gets a copy of it.
    for (seq, token) in [(1, 7000u32), (3, 8000)] {
        let mut ids = prompt.clone();
        ids.push(token);
        kv.allocate_slots(&tokens(seq, &ids, prompt.len(), prompt.len()), 1, ComputedBlocks::default()).expect("room");
    }
    let copies = kv.take_block_copies();
    println!("copy-on-write: {copies:?} for the backend to make");
    println!("A {:?}, sample 3 {:?}", kv.block_table(SeqId(1)).unwrap_or_default(), kv.block_table(SeqId(3)).unwrap_or_default());

    for seq in [1, 2, 3] {
        kv.free(SeqId(seq));
    }
    println!("all freed: {} of 64 blocks free (cached prefixes stay reusable until evicted)", kv.num_free_blocks());
}
