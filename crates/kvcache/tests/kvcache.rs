//! Integration tests of the KV-cache manager: the paper's worked examples
//! (Figs. 6–9) and property tests of its invariants after every operation.

use proptest::prelude::*;
use std::collections::HashMap;
use vellum_base::{BlockAllocator, BlockId, ComputedBlocks, HostBlockId, LengthHint, SeqId, SeqTokens};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig, OrcaAllocator, OrcaMode};

fn seq<'a>(id: u64, tokens: &'a [u32], num_computed: usize) -> SeqTokens<'a> {
    SeqTokens {
        seq_id: SeqId(id),
        token_ids: tokens,
        num_prompt_tokens: tokens.len(),
        num_computed_tokens: num_computed,
        hint: LengthHint { max_total_tokens: 64, true_total_tokens: None },
    }
}

fn manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(KvCacheManagerConfig::new(num_blocks, block_size))
}

/// Paper Fig. 6: a 7-token prompt in blocks of 4 takes two blocks; the first
/// generated token fills the last slot of block 1; the next one needs a third.
#[test]
fn fig6_block_table_grows_one_block_at_a_time() {
    let mut m = manager(8, 4);
    let mut toks: Vec<u32> = (1..=7).collect();
    m.allocate_slots(&seq(0, &toks, 0), 7, ComputedBlocks::default()).unwrap();
    assert_eq!(m.block_table(SeqId(0)).unwrap().len(), 2);
    assert_eq!(m.stats().num_filled_slots, 7);
    toks.push(8); // "fathers"
    m.allocate_slots(&seq(0, &toks, 7), 1, ComputedBlocks::default()).unwrap();
    assert_eq!(m.block_table(SeqId(0)).unwrap().len(), 2, "slot 4 of block 1 was free");
    toks.push(9); // "brought"
    let a = m.allocate_slots(&seq(0, &toks, 8), 1, ComputedBlocks::default()).unwrap();
    assert_eq!(m.block_table(SeqId(0)).unwrap().len(), 3);
    assert_eq!(a.first_changed_block_idx, 2, "only the new entry is reported");
    assert_eq!(m.stats().num_used_blocks, 3);
    m.assert_invariants();
}

/// Paper Fig. 7: two requests interleave their blocks; neither needs
/// contiguous memory, and the waste is under one block per sequence.
#[test]
fn fig7_two_requests_share_the_pool() {
    let mut m = manager(8, 4);
    let a: Vec<u32> = (1..=7).collect();
    let b: Vec<u32> = (100..106).collect();
    m.allocate_slots(&seq(0, &a, 0), 4, ComputedBlocks::default()).unwrap();
    m.allocate_slots(&seq(1, &b, 0), 6, ComputedBlocks::default()).unwrap();
    m.allocate_slots(&seq(0, &a, 4), 3, ComputedBlocks::default()).unwrap();
    let ta = m.block_table(SeqId(0)).unwrap().to_vec();
    let tb = m.block_table(SeqId(1)).unwrap().to_vec();
    assert_eq!((ta.len(), tb.len()), (2, 2));
    assert!(ta[1].0 > tb[0].0, "A's second block comes after B's first: not contiguous");
    let s = m.stats();
    assert_eq!(s.num_filled_slots, 13);
    assert!(s.num_used_slots() - s.num_filled_slots < 2 * 4, "waste under one block per sequence");
    m.free(SeqId(0));
    m.free(SeqId(1));
    assert_eq!(m.num_free_blocks(), 8);
    m.assert_invariants();
}

/// Paper Fig. 8: two samples share the prompt; the first write into the
/// shared partial block copies it, the second writes in place.
#[test]
fn fig8_parallel_sampling_copy_on_write() {
    let mut m = manager(8, 4);
    let prompt: Vec<u32> = (1..=7).collect();
    m.allocate_slots(&seq(0, &prompt, 0), 7, ComputedBlocks::default()).unwrap();
    assert!(m.fork(SeqId(0), SeqId(1)));
    let shared = m.block_table(SeqId(0)).unwrap().to_vec();
    assert_eq!(m.pool().ref_cnt(shared[0]), 2);
    assert_eq!(m.pool().ref_cnt(shared[1]), 2);
    assert_eq!(m.stats().num_used_blocks, 2);
    assert_eq!(m.stats().num_logical_blocks, 4);

    let mut a1 = prompt.clone();
    a1.push(50);
    let r = m.allocate_slots(&seq(0, &a1, 7), 1, ComputedBlocks::default()).unwrap();
    assert_eq!(r.first_changed_block_idx, 1, "the copied block replaced entry 1");
    let copies = m.take_block_copies();
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].src, shared[1]);
    let t0 = m.block_table(SeqId(0)).unwrap().to_vec();
    assert_eq!(t0[0], shared[0], "the full block stays shared");
    assert_eq!(t0[1], copies[0].dst);
    assert_eq!(m.pool().ref_cnt(shared[1]), 1);

    let mut a2 = prompt.clone();
    a2.push(60);
    m.allocate_slots(&seq(1, &a2, 7), 1, ComputedBlocks::default()).unwrap();
    assert!(m.take_block_copies().is_empty(), "sole holder writes in place");
    assert_eq!(m.block_table(SeqId(1)).unwrap()[1], shared[1]);
    assert!((m.stats().sharing_savings() - 0.25).abs() < 1e-9, "1 of 4 logical blocks saved");
    m.assert_invariants();
}

/// Paper Fig. 9: beam candidates fork from survivors; blocks no candidate
/// references are freed, shared ones stay.
#[test]
fn fig9_beam_search_fork_and_free() {
    let mut m = manager(16, 4);
    let prompt: Vec<u32> = (1..=8).collect();
    m.allocate_slots(&seq(0, &prompt, 0), 8, ComputedBlocks::default()).unwrap();
    for c in 1..4 {
        assert!(m.fork(SeqId(0), SeqId(c)));
    }
    // Each candidate extends by one block's worth of its own tokens.
    let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
    for c in 0..4u64 {
        let mut t = prompt.clone();
        t.extend((0..4).map(|i| 100 * (c as u32 + 1) + i));
        m.allocate_slots(&seq(c, &t, 8), 4, ComputedBlocks::default()).unwrap();
        toks.insert(c, t);
    }
    assert_eq!(m.stats().num_used_blocks, 2 + 4);
    // Candidates 2 and 3 are dropped; 0 and 1 each spawn a child.
    let dropped: Vec<BlockId> = [2u64, 3].iter().map(|c| m.block_table(SeqId(*c)).unwrap()[2]).collect();
    m.free(SeqId(2));
    m.free(SeqId(3));
    for b in &dropped {
        assert_eq!(m.pool().ref_cnt(*b), 0, "{b} referenced by no candidate is freed");
    }
    assert!(m.fork(SeqId(0), SeqId(4)));
    assert!(m.fork(SeqId(1), SeqId(5)));
    let t0 = m.block_table(SeqId(0)).unwrap().to_vec();
    assert_eq!(m.pool().ref_cnt(t0[0]), 4, "the prompt block is shared by all four beams");
    assert_eq!(m.pool().ref_cnt(t0[2]), 2);
    assert_eq!(m.stats().num_used_blocks, 4);
    for c in [0, 1, 4, 5] {
        m.free(SeqId(c));
    }
    assert_eq!(m.num_free_blocks(), 16);
    m.assert_invariants();
}

#[test]
fn prefix_cache_hit_skips_full_blocks_but_never_the_last_token() {
    let mut m = manager(16, 4);
    let p: Vec<u32> = (1..=12).collect();
    let computed = m.get_computed_blocks(&seq(0, &p, 0));
    assert_eq!(computed.num_computed_tokens, 0);
    m.allocate_slots(&seq(0, &p, 0), 12, computed).unwrap();
    let first = m.block_table(SeqId(0)).unwrap().to_vec();
    m.free(SeqId(0));
    assert_eq!(m.stats().num_cached_free_blocks, 3);

    // Same prompt: 2 of 3 blocks are reused (the last token must be computed).
    let hit = m.get_computed_blocks(&seq(1, &p, 0));
    assert_eq!(hit.block_ids, first[..2].to_vec());
    assert_eq!(hit.num_computed_tokens, 8);
    m.allocate_slots(&seq(1, &p, 8), 4, hit).unwrap();
    // A longer prompt sharing the first 8 tokens hits those 2 blocks too.
    let mut q: Vec<u32> = (1..=8).collect();
    q.extend([77, 78, 79, 80, 81]);
    let hit = m.get_computed_blocks(&seq(2, &q, 0));
    assert_eq!(hit.block_ids, first[..2].to_vec());
    m.allocate_slots(&seq(2, &q, 8), 5, hit).unwrap();
    assert_eq!(m.pool().ref_cnt(first[0]), 2);
    let s = m.stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (12 + 12 + 13, 16));
    m.assert_invariants();
}

#[test]
fn cached_blocks_are_evicted_least_recently_freed_first() {
    let mut m = manager(4, 2);
    let a = [1, 2, 3, 4];
    let b = [5, 6, 7, 8];
    m.allocate_slots(&seq(0, &a, 0), 4, ComputedBlocks::default()).unwrap();
    m.allocate_slots(&seq(1, &b, 0), 4, ComputedBlocks::default()).unwrap();
    m.free(SeqId(0));
    m.free(SeqId(1));
    // A new 4-token sequence needs 2 blocks: it evicts A's, freed first.
    let c = [9, 10, 11, 12];
    m.allocate_slots(&seq(2, &c, 0), 4, ComputedBlocks::default()).unwrap();
    let b_plus = [5, 6, 7, 8, 9];
    assert_eq!(m.get_computed_blocks(&seq(3, &b_plus, 0)).num_computed_tokens, 4, "B survived");
    let a_plus = [1, 2, 3, 4, 9];
    assert_eq!(m.get_computed_blocks(&seq(3, &a_plus, 0)).num_computed_tokens, 0, "A was evicted");
}

#[test]
fn a_sliding_window_keeps_a_long_sequence_in_a_few_blocks() {
    let (bs, w) = (16, 64);
    let mut m = KvCacheManager::new(KvCacheManagerConfig::new(12, bs).with_sliding_window(w));
    let tokens: Vec<u32> = (0..1000).collect();
    // A 100-token prefill, then one token per step up to 1,000 tokens.
    let first = m.allocate_slots(&seq(0, &tokens[..100], 0), 100, ComputedBlocks::default()).unwrap();
    assert_eq!(first.num_blocks, 7);
    for n in 100..1000 {
        let out = m.allocate_slots(&seq(0, &tokens[..=n], n), 1, ComputedBlocks::default()).expect("never runs out");
        assert_eq!(out.num_blocks, n / bs + 1);
        m.assert_invariants();
    }
    let table = m.block_table(SeqId(0)).unwrap();
    let held: Vec<usize> = (0..table.len()).filter(|&i| !table[i].is_null()).collect();
    // Positions 936..=999 are visible to the next query: blocks 58..=62.
    assert_eq!(held, (58..=62).collect::<Vec<_>>());
    assert_eq!(m.stats().num_used_blocks, 5);
    // The scheduler's admission bound agrees: one-token steps hold 5 blocks.
    assert_eq!(m.max_blocks_held(1000, 1), 5);
    assert_eq!(m.max_blocks_held(40, 1), 3);
    m.free(SeqId(0));
    assert_eq!(m.num_free_blocks(), 12);
}

/// vLLM's hybrid manager, Gemma-style: a global group (every block kept) and
/// a local group (window 8) over one pool, block size 4. The local group's
/// blocks that slid out are released while the global group keeps its own;
/// a later request with the same prompt gets a prefix hit whose local part
/// covers only the window.
#[test]
fn kv_cache_groups_slide_separately_and_share_prefixes() {
    let (bs, w) = (4, 8);
    let mut m = KvCacheManager::new(KvCacheManagerConfig::new(40, bs).with_group_windows(vec![None, Some(w)]));
    assert_eq!(m.num_kv_groups(), 2);
    let tokens: Vec<u32> = (100..140).collect();
    m.allocate_slots(&seq(0, &tokens[..10], 0), 10, ComputedBlocks::default()).unwrap();
    for n in 10..40 {
        m.allocate_slots(&seq(0, &tokens[..=n], n), 1, ComputedBlocks::default()).expect("room");
        m.assert_invariants();
    }
    // 40 tokens = 10 logical blocks; the last step's query (position 39)
    // sees positions 32..=39 of the local layers: blocks 8 and 9.
    let table = m.block_table(SeqId(0)).unwrap().to_vec();
    assert_eq!(table.len(), 20, "two entries per logical block");
    let global: Vec<bool> = table.iter().step_by(2).map(|b| !b.is_null()).collect();
    let local: Vec<bool> = table.iter().skip(1).step_by(2).map(|b| !b.is_null()).collect();
    assert!(global.iter().all(|&held| held), "the global group keeps every block");
    assert_eq!(local, [false, false, false, false, false, false, false, false, true, true]);
    assert_eq!(m.stats().num_used_blocks, 12);
    assert_eq!(m.max_blocks_held(40, 1), 10 + 3, "every global block plus a window and one");
    // The same prompt again: a hit on 9 logical blocks (the last token is
    // computed); global blocks 0..9, local ones only where the first
    // computed query (position 36) still looks: blocks 7 and 8. Local block
    // 7 was released but still waits, cached, in the free queue.
    let hit = m.get_computed_blocks(&seq(1, &tokens[..37], 0));
    assert_eq!(hit.num_computed_tokens, 36);
    let local_hit: Vec<bool> = hit.block_ids.iter().skip(1).step_by(2).map(|b| !b.is_null()).collect();
    assert_eq!(local_hit, [false, false, false, false, false, false, false, true, true]);
    assert!(hit.block_ids.iter().step_by(2).all(|b| !b.is_null()));
    let st = SeqTokens { num_computed_tokens: 36, ..seq(1, &tokens[..37], 0) };
    m.allocate_slots(&st, 1, hit).expect("room");
    m.assert_invariants();
    assert_eq!(m.stats().num_used_blocks, 12 + 1 + 2, "local block 7 revived, one new logical block of both groups");
    m.free(SeqId(0));
    m.free(SeqId(1));
    m.assert_invariants();
    assert_eq!(m.num_free_blocks(), 40);
}

#[test]
fn a_window_frees_its_blocks_before_asking_for_new_ones() {
    // Block size 4, window 5, a pool of exactly max_blocks_held blocks:
    // chunks of 3, 4, 4, 4 tokens fit because each step releases what slid
    // out before it allocates.
    let mut m = KvCacheManager::new(KvCacheManagerConfig::new(3, 4).with_sliding_window(5));
    assert_eq!(m.max_blocks_held(40, 4), 3);
    let tokens: Vec<u32> = (0..40).collect();
    let mut done = 0;
    for chunk in [3, 4, 4, 4, 4, 4] {
        let st = seq(0, &tokens[..done + chunk], done);
        assert!(m.allocate_slots(&st, chunk, ComputedBlocks::default()).is_some(), "chunk at {done} fits");
        m.assert_invariants();
        done += chunk;
    }
}

#[test]
fn trim_without_prefix_caching_or_with_lagging_hashes() {
    let mut m = KvCacheManager::new(KvCacheManagerConfig { enable_prefix_caching: false, ..KvCacheManagerConfig::new(8, 4) });
    let tokens: Vec<u32> = (0..10).collect();
    m.allocate_slots(&seq(0, &tokens, 0), 10, ComputedBlocks::default()).unwrap();
    m.trim(SeqId(0), 8);
    m.assert_invariants();
    assert_eq!(m.block_table(SeqId(0)).unwrap().len(), 2);
    // Slots reserved past the known tokens (asynchronous scheduling): the
    // hashes lag the table.
    let mut m = manager(8, 4);
    m.allocate_slots(&seq(1, &tokens[..5], 0), 10, ComputedBlocks::default()).unwrap();
    m.trim(SeqId(1), 8);
    m.assert_invariants();
}

#[test]
fn no_room_changes_nothing() {
    let mut m = manager(2, 4);
    let p: Vec<u32> = (0..12).collect();
    assert!(m.allocate_slots(&seq(0, &p, 0), 12, ComputedBlocks::default()).is_none());
    assert_eq!(m.num_free_blocks(), 2);
    assert!(m.block_table(SeqId(0)).is_none());
    m.assert_invariants();
}

#[test]
fn swap_out_and_in_keeps_sharing() {
    let mut m = KvCacheManager::new(KvCacheManagerConfig { num_host_blocks: 8, ..KvCacheManagerConfig::new(8, 4) });
    let p: Vec<u32> = (0..6).collect();
    m.allocate_slots(&seq(0, &p, 0), 6, ComputedBlocks::default()).unwrap();
    m.fork(SeqId(0), SeqId(1));
    let out = m.swap_out(&[SeqId(0), SeqId(1)]).unwrap();
    assert_eq!(out.len(), 2, "shared blocks move once");
    assert_eq!(m.num_free_blocks(), 8);
    assert!(m.is_swapped(SeqId(0)));
    assert_eq!(m.stats().num_used_host_blocks, 2);
    m.assert_invariants();
    let back = m.swap_in(&[SeqId(0), SeqId(1)]).unwrap();
    assert_eq!(back.len(), 2);
    let t0 = m.block_table(SeqId(0)).unwrap().to_vec();
    assert_eq!(t0, m.block_table(SeqId(1)).unwrap().to_vec(), "still shared after swap-in");
    assert_eq!(m.pool().ref_cnt(t0[0]), 2);
    assert_eq!(m.stats().num_used_host_blocks, 0);
    m.assert_invariants();
}

/// A copy-on-write made while scheduling a step has not run when that
/// step's swaps do (a step's copies run after them). If the group then
/// leaves in the same step (swapped out, or freed to recompute), the copy's
/// destination leaves with it: the swap-out takes the copy's source instead,
/// and the copy is dropped, so that it never writes a block the step may
/// have handed to another sequence.
#[test]
fn a_group_preempted_right_after_a_copy_on_write_swaps_the_source_and_drops_the_copy() {
    for swap in [true, false] {
        let mut m = KvCacheManager::new(KvCacheManagerConfig { num_host_blocks: 8, ..KvCacheManagerConfig::new(8, 4) });
        let prompt: Vec<u32> = (1..=6).collect();
        m.allocate_slots(&seq(0, &prompt, 0), 6, ComputedBlocks::default()).unwrap();
        assert!(m.fork(SeqId(0), SeqId(1)));
        let shared = m.block_table(SeqId(1)).unwrap()[1];
        // Sequence 1 writes position 6 into the shared partial block: a copy.
        let mut t1 = prompt.clone();
        t1.push(9);
        m.allocate_slots(&seq(1, &t1, 6), 1, ComputedBlocks::default()).unwrap();
        let dst = m.block_table(SeqId(1)).unwrap()[1];
        assert_ne!(dst, shared);
        // The same step preempts the group before its copies were taken.
        if swap {
            let swaps = m.swap_out(&[SeqId(0), SeqId(1)]).unwrap();
            assert!(swaps.iter().all(|s| s.device != dst), "the uncopied destination is never read: {swaps:?}");
            assert_eq!(swaps.iter().filter(|s| s.device == shared).count(), 2, "its host copy comes from the source");
        } else {
            m.free(SeqId(0));
            m.free(SeqId(1));
        }
        assert!(m.take_block_copies().is_empty(), "swap {swap}: the copy into a block that left is dropped");
        m.assert_invariants();
    }
}

#[test]
fn swap_is_all_or_nothing_and_host_pool_is_capped() {
    let mut m = KvCacheManager::new(KvCacheManagerConfig { num_host_blocks: 100, ..KvCacheManagerConfig::new(3, 4) });
    assert_eq!(m.stats().num_host_blocks, 3, "host pool never larger than the device pool");
    let p: Vec<u32> = (0..12).collect();
    m.allocate_slots(&seq(0, &p, 0), 12, ComputedBlocks::default()).unwrap();
    m.swap_out(&[SeqId(0)]).unwrap();
    let q: Vec<u32> = (50..54).collect();
    m.allocate_slots(&seq(1, &q, 0), 4, ComputedBlocks::default()).unwrap();
    assert!(m.swap_in(&[SeqId(0)]).is_none(), "needs 3 device blocks, 2 free");
    assert!(m.is_swapped(SeqId(0)));
    m.assert_invariants();
}

#[test]
fn orca_reservations_follow_the_mode() {
    let hint = LengthHint { max_total_tokens: 2048, true_total_tokens: Some(10 + 25) };
    let toks: Vec<u32> = (0..10).collect();
    let s = SeqTokens { seq_id: SeqId(0), token_ids: &toks, num_prompt_tokens: 10, num_computed_tokens: 0, hint };
    let used = |mode| {
        let mut o = OrcaAllocator::new(mode, 1024, 1, 2048);
        o.allocate_slots(&s, 10, ComputedBlocks::default()).unwrap();
        let st = o.stats();
        (st.num_used_blocks, st.num_filled_slots, st.num_reserved_slots, st.num_internal_frag_slots, st.num_external_frag_slots)
    };
    // Oracle: 35 tokens requested, buddy rounds to 64.
    assert_eq!(used(OrcaMode::Oracle), (64, 10, 25, 0, 29));
    // Pow2: 10 + 32 = 42 requested (7 over the truth), 64 allocated.
    assert_eq!(used(OrcaMode::Pow2), (64, 10, 25, 7, 22));
    // Max: 2048 > pool of 1024 -> cannot even admit.
    let mut o = OrcaAllocator::new(OrcaMode::Max, 1024, 1, 2048);
    assert!(o.allocate_slots(&s, 10, ComputedBlocks::default()).is_none());
}

// ---------------------------------------------------------------------------
// Property tests: a random walk of operations, with every invariant checked
// after every step, against a shadow model that plays the backend (it stores
// the token each slot holds and applies copies and swaps).

#[derive(Clone, Debug)]
enum Op {
    Add { prompt: Vec<u32>, chunk: usize },
    Step { pick: usize, chunk: usize, token: u32 },
    Fork { pick: usize },
    Free { pick: usize },
    SwapOut { pick: usize },
    SwapIn { pick: usize },
    Trim { pick: usize, back: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // A tiny alphabet and short prompts make prefix hits common.
        3 => (prop::collection::vec(0u32..3, 1..14), 1usize..16).prop_map(|(prompt, chunk)| Op::Add { prompt, chunk }),
        6 => (any::<usize>(), 1usize..6, 0u32..3).prop_map(|(pick, chunk, token)| Op::Step { pick, chunk, token }),
        2 => any::<usize>().prop_map(|pick| Op::Fork { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => any::<usize>().prop_map(|pick| Op::SwapOut { pick }),
        1 => any::<usize>().prop_map(|pick| Op::SwapIn { pick }),
        1 => (any::<usize>(), 0usize..6).prop_map(|(pick, back)| Op::Trim { pick, back }),
    ]
}

struct ShadowSeq {
    tokens: Vec<u32>,
    num_prompt: usize,
    num_computed: usize,
    /// `num_computed` at the last allocation: with a window, blocks before
    /// `last_alloc + 1 - window` are gone, so a trim stops there.
    last_alloc: usize,
}

/// The first position a query after `num_computed` tokens still sees.
fn first_visible(num_computed: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (num_computed + 1).saturating_sub(w))
}

/// What a slot holds. A real KV entry depends on its token *and* every token
/// before it, and on the layers of its KV-cache group, so the shadow stores
/// the group and the whole prefix up to the slot.
type Slot = Option<(usize, Vec<u32>)>;

struct Shadow {
    bs: usize,
    groups: usize,
    device: HashMap<BlockId, Vec<Slot>>,
    host: HashMap<HostBlockId, Vec<Slot>>,
}

impl Shadow {
    fn write(&mut self, m: &KvCacheManager, id: SeqId, tokens: &[u32], from: usize, to: usize) {
        let table = m.block_table(id).expect("live").to_vec();
        for pos in from..to {
            for g in 0..self.groups {
                let b = table[pos / self.bs * self.groups + g];
                assert_eq!(m.pool().ref_cnt(b), 1, "write into shared {b}");
                self.device.entry(b).or_insert_with(|| vec![None; self.bs])[pos % self.bs] = Some((g, tokens[..=pos].to_vec()));
            }
        }
    }

    /// Every position a query still sees reads its own group's KV of its
    /// own prefix through `table`.
    fn check_reads(&self, table: &[BlockId], tokens: &[u32], num_computed: usize, windows: &[Option<usize>], what: &str) {
        for (g, &w) in windows.iter().enumerate() {
            for pos in first_visible(num_computed, w)..num_computed {
                let b = table[pos / self.bs * self.groups + g];
                let want = (g, tokens[..=pos].to_vec());
                assert_eq!(self.device.get(&b).and_then(|slots| slots[pos % self.bs].as_ref()), Some(&want), "{what}: group {g} at {pos}");
            }
        }
    }
    fn apply_copies(&mut self, m: &mut KvCacheManager) {
        for c in m.take_block_copies() {
            let src = self.device.get(&c.src).cloned().unwrap_or_else(|| vec![None; self.bs]);
            self.device.insert(c.dst, src);
        }
    }
}

fn run_ops(ops: Vec<Op>, num_blocks: usize, bs: usize, windows: &[Option<usize>]) {
    let mut m = KvCacheManager::new(
        KvCacheManagerConfig { num_host_blocks: num_blocks / 2, ..KvCacheManagerConfig::new(num_blocks, bs) }
            .with_group_windows(windows.to_vec()),
    );
    let groups = windows.len();
    let any_window = windows.iter().any(Option::is_some);
    let mut sh = Shadow { bs, groups, device: HashMap::new(), host: HashMap::new() };
    let mut live: Vec<(SeqId, ShadowSeq)> = Vec::new();
    let mut swapped: Vec<(SeqId, ShadowSeq)> = Vec::new();
    let mut next_id = 0u64;
    let hint = LengthHint { max_total_tokens: 64, true_total_tokens: None };
    let view = |id: SeqId, s: &ShadowSeq| -> (Vec<u32>, usize, usize) {
        let _ = id;
        (s.tokens.clone(), s.num_prompt, s.num_computed)
    };
    for op in ops {
        match op {
            Op::Add { prompt, chunk } => {
                let id = SeqId(next_id);
                next_id += 1;
                let st = SeqTokens { seq_id: id, token_ids: &prompt, num_prompt_tokens: prompt.len(), num_computed_tokens: 0, hint };
                let hit = m.get_computed_blocks(&st);
                assert!(hit.num_computed_tokens < prompt.len(), "a hit never covers the whole prompt");
                assert_eq!(hit.block_ids.len(), hit.num_computed_tokens / bs * groups);
                for (j, b) in hit.block_ids.iter().enumerate().filter(|(_, b)| !b.is_null()) {
                    let (i, g) = (j / groups, j % groups);
                    let want: Vec<Slot> = (i * bs..(i + 1) * bs).map(|pos| Some((g, prompt[..=pos].to_vec()))).collect();
                    assert_eq!(sh.device.get(b), Some(&want), "prefix hit on {b} holds other tokens");
                }
                let n_new = chunk.min(prompt.len() - hit.num_computed_tokens);
                let start = hit.num_computed_tokens;
                let st = SeqTokens { num_computed_tokens: start, ..st };
                if m.allocate_slots(&st, n_new, hit).is_some() {
                    sh.apply_copies(&mut m);
                    sh.write(&m, id, &prompt, start, start + n_new);
                    live.push((id, ShadowSeq { num_prompt: prompt.len(), num_computed: start + n_new, last_alloc: start, tokens: prompt }));
                } else {
                    assert!(m.block_table(id).is_none(), "failed allocation left state behind");
                }
            }
            Op::Step { pick, chunk, token } if !live.is_empty() => {
                let i = pick % live.len();
                let (id, s) = &mut live[i];
                if s.num_computed == s.tokens.len() {
                    s.tokens.push(token); // the sampled token
                }
                let n_new = chunk.min(s.tokens.len() - s.num_computed);
                let (tokens, num_prompt, num_computed) = view(*id, s);
                let st =
                    SeqTokens { seq_id: *id, token_ids: &tokens, num_prompt_tokens: num_prompt, num_computed_tokens: num_computed, hint };
                if m.allocate_slots(&st, n_new, ComputedBlocks::default()).is_some() {
                    sh.apply_copies(&mut m);
                    sh.write(&m, *id, &tokens, num_computed, num_computed + n_new);
                    s.num_computed += n_new;
                    s.last_alloc = num_computed;
                } else {
                    assert!(m.take_block_copies().is_empty(), "no copies from a failed allocation");
                }
            }
            Op::Fork { pick } if !live.is_empty() => {
                let i = pick % live.len();
                let child = SeqId(next_id);
                next_id += 1;
                assert!(m.fork(live[i].0, child));
                let p = &live[i].1;
                let c = ShadowSeq {
                    tokens: p.tokens.clone(),
                    num_prompt: p.num_prompt,
                    num_computed: p.num_computed,
                    last_alloc: p.last_alloc,
                };
                // Tokens past num_computed are not stored yet; the child keeps them too.
                live.push((child, c));
            }
            Op::Free { pick } if !live.is_empty() => {
                let (id, _) = live.swap_remove(pick % live.len());
                m.free(id);
                assert!(m.block_table(id).is_none());
            }
            Op::Trim { pick, back } if !live.is_empty() => {
                // A step that will not run: its slots (and any prefix-cache
                // registration of uncomputed blocks) are given back.
                let i = pick % live.len();
                let (id, s) = &mut live[i];
                let floor = if any_window { s.last_alloc } else { 0 };
                let n = s.num_computed.saturating_sub(back).max(floor);
                m.trim(*id, n);
                s.num_computed = n;
            }
            Op::SwapOut { pick } if !live.is_empty() => {
                let i = pick % live.len();
                let id = live[i].0;
                if let Some(swaps) = m.swap_out(&[id]) {
                    for s in swaps {
                        let data = sh.device.get(&s.device).cloned().unwrap_or_else(|| vec![None; bs]);
                        sh.host.insert(s.host, data);
                    }
                    swapped.push(live.swap_remove(i));
                }
            }
            Op::SwapIn { pick } if !swapped.is_empty() => {
                let i = pick % swapped.len();
                let id = swapped[i].0;
                if let Some(swaps) = m.swap_in(&[id]) {
                    for s in swaps {
                        let data = sh.host.get(&s.host).cloned().unwrap_or_else(|| vec![None; bs]);
                        sh.device.insert(s.device, data);
                    }
                    // The content survived the round trip.
                    let (id, s) = swapped.swap_remove(i);
                    let table = m.block_table(id).unwrap().to_vec();
                    sh.check_reads(&table, &s.tokens, s.num_computed, windows, &format!("{id} after a swap"));
                    live.push((id, s));
                }
            }
            _ => {}
        }
        m.assert_invariants();
        // Every live sequence still reads its own tokens through its table.
        for (id, s) in &live {
            let table = m.block_table(*id).unwrap();
            assert_eq!(table.len(), s.num_computed.div_ceil(bs) * groups, "{id}: table covers exactly its tokens");
            sh.check_reads(table, &s.tokens, s.num_computed, windows, &id.to_string());
            for (g, w) in windows.iter().enumerate() {
                if let Some(w) = w {
                    // Nothing wholly before the window is held.
                    let held = table.iter().skip(g).step_by(groups).filter(|b| !b.is_null()).count();
                    let bound = w.div_ceil(bs) + 1 + s.num_computed.saturating_sub(s.last_alloc).div_ceil(bs);
                    assert!(held <= bound, "{id} holds {held} blocks of group {g}");
                }
            }
        }
    }
    for (id, _) in live.into_iter().chain(swapped) {
        m.free(id);
    }
    m.assert_invariants();
    assert_eq!(m.num_free_blocks(), num_blocks, "releasing everything returns the pool to full");
    assert_eq!(m.stats().num_used_host_blocks, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn paged_manager_invariants(ops in prop::collection::vec(op(), 1..120), num_blocks in 4usize..40, bs_pow in 0u32..3) {
        run_ops(ops, num_blocks, 1 << bs_pow, &[None]);
    }

    #[test]
    fn paged_manager_invariants_with_a_sliding_window(
        ops in prop::collection::vec(op(), 1..120), num_blocks in 4usize..40, bs_pow in 0u32..3, window in 1usize..20,
    ) {
        run_ops(ops, num_blocks, 1 << bs_pow, &[Some(window)]);
    }

    #[test]
    fn paged_manager_invariants_with_kv_cache_groups(
        ops in prop::collection::vec(op(), 1..120), num_blocks in 6usize..60, bs_pow in 0u32..3,
        windows in prop::collection::vec(prop::option::of(1usize..20), 2..4),
    ) {
        run_ops(ops, num_blocks, 1 << bs_pow, &windows);
    }

    #[test]
    fn orca_reservations_never_overlap(
        ops in prop::collection::vec((any::<bool>(), 1usize..300, 0usize..600, any::<usize>()), 1..100),
        mode in prop_oneof![Just(OrcaMode::Max), Just(OrcaMode::Pow2), Just(OrcaMode::Oracle)],
    ) {
        let mut o = OrcaAllocator::new(mode, 1500, 4, 512);
        let mut live: Vec<SeqId> = Vec::new();
        for (i, (admit, prompt_len, out_len, pick)) in ops.into_iter().enumerate() {
            if admit || live.is_empty() {
                let toks = vec![1u32; prompt_len];
                let hint = LengthHint { max_total_tokens: 512, true_total_tokens: Some((prompt_len + out_len).min(512)) };
                let s = SeqTokens { seq_id: SeqId(i as u64), token_ids: &toks, num_prompt_tokens: prompt_len, num_computed_tokens: 0, hint };
                if o.allocate_slots(&s, prompt_len, ComputedBlocks::default()).is_some() {
                    live.push(SeqId(i as u64));
                }
            } else {
                let id = live.swap_remove(pick % live.len());
                o.free(id);
            }
            o.assert_invariants();
            let st = o.stats();
            prop_assert_eq!(st.num_used_blocks + o.num_free_blocks(), 1500);
            prop_assert!(st.num_filled_slots + st.num_reserved_slots + st.num_internal_frag_slots + st.num_external_frag_slots == st.num_used_slots());
        }
        for id in live { o.free(id); }
        prop_assert_eq!(o.num_free_blocks(), 1500);
    }
}
