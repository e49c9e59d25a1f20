//! Scheduler tests through the public API, with a fake executor that
//! "samples" a deterministic token per position.

use proptest::prelude::*;
use std::collections::HashMap;
use vellum_base::{
    BeamSearchParams, BlockAllocator, PreemptionMode, RequestId, SamplingParams, SchedulerConfig, SchedulingPolicy, SeqId, TokenId,
};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig};
use vellum_scheduler::{Error, FinishReason, NewRequest, RequestSamples, Scheduler, SchedulerOutput, StepSamples};

const EOS: TokenId = 2;

fn sched(num_blocks: usize, bs: usize, config: SchedulerConfig) -> Scheduler<KvCacheManager> {
    let kv = KvCacheManager::new(KvCacheManagerConfig { num_host_blocks: num_blocks, ..KvCacheManagerConfig::new(num_blocks, bs) });
    Scheduler::new(config, kv).unwrap()
}

fn cfg(budget: usize) -> SchedulerConfig {
    SchedulerConfig { max_num_batched_tokens: budget, max_model_len: 4096, ..SchedulerConfig::default() }
}

fn prompt(len: usize, salt: u32) -> Vec<TokenId> {
    (0..len as u32).map(|i| 100 + salt * 1000 + i).collect()
}

fn add(s: &mut Scheduler<KvCacheManager>, id: u64, p: Vec<TokenId>, max_tokens: usize) {
    let params = SamplingParams { max_tokens: Some(max_tokens), ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
    s.add_request(NewRequest { eos_token_ids: vec![EOS], ..NewRequest::new(RequestId(id), p, params) }).unwrap();
}

/// The fake sampler: token = 10_000 + position of the new token.
fn token_for(s: &Scheduler<KvCacheManager>, id: RequestId, seq: SeqId) -> TokenId {
    let req = s.request(id).unwrap();
    let q = req.seqs.iter().find(|q| q.seq_id == seq).unwrap();
    10_000 + q.state.num_total_tokens() as TokenId
}

/// Samples one token per sampling sequence and applies the step.
fn finish_step(s: &mut Scheduler<KvCacheManager>, out: &SchedulerOutput) {
    let mut per_req: HashMap<RequestId, Vec<(SeqId, TokenId)>> = HashMap::new();
    for x in out.scheduled.iter().filter(|x| x.samples) {
        let t = token_for(s, x.request_id, x.seq_id);
        per_req.entry(x.request_id).or_default().push((x.seq_id, t));
    }
    let requests = per_req.into_iter().map(|(id, next)| RequestSamples::tokens(id, next)).collect();
    s.update_from_output(&StepSamples { requests });
}

fn step(s: &mut Scheduler<KvCacheManager>) -> SchedulerOutput {
    let out = s.schedule();
    finish_step(s, &out);
    s.assert_invariants();
    s.allocator().assert_invariants();
    out
}

fn counters(s: &Scheduler<KvCacheManager>, id: u64) -> (usize, usize) {
    let st = &s.request(RequestId(id)).unwrap().seqs[0].state;
    (st.num_computed_tokens(), st.num_total_tokens())
}

// ---- Thesis Table 4.1, one test per row -----------------------------------

#[test]
fn row_prefill_is_one_step_of_the_whole_prompt() {
    let mut s = sched(64, 16, cfg(512));
    add(&mut s, 0, prompt(40, 0), 8);
    let out = step(&mut s);
    assert_eq!(out.scheduled.len(), 1);
    let x = out.scheduled[0];
    assert_eq!((x.num_scheduled_tokens, x.num_computed_tokens, x.samples), (40, 0, true));
    assert_eq!(out.new_requests, vec![RequestId(0)]);
    assert_eq!(counters(&s, 0), (40, 41));
}

#[test]
fn row_decode_is_delta_one() {
    let mut s = sched(64, 16, cfg(512));
    add(&mut s, 0, prompt(40, 0), 8);
    step(&mut s);
    let out = step(&mut s);
    assert_eq!((out.scheduled[0].num_scheduled_tokens, out.scheduled[0].num_computed_tokens), (1, 40));
    assert_eq!(counters(&s, 0), (41, 42));
}

#[test]
fn row_chunked_prefill_splits_under_the_budget_and_mixes_with_decodes() {
    let mut s = sched(64, 16, cfg(16));
    add(&mut s, 0, prompt(8, 0), 8);
    step(&mut s); // A prefilled
    add(&mut s, 1, prompt(40, 1), 8);
    let out = step(&mut s);
    // A's decode (1) plus a 15-token chunk of B.
    let b = out.scheduled.iter().find(|x| x.request_id == RequestId(1)).unwrap();
    assert_eq!(out.num_scheduled_tokens(), 16);
    assert_eq!((b.num_scheduled_tokens, b.samples), (15, false));
    assert_eq!(counters(&s, 1), (15, 40));
    step(&mut s);
    let out = step(&mut s);
    let b = out.scheduled.iter().find(|x| x.request_id == RequestId(1)).unwrap();
    assert_eq!((b.num_computed_tokens, b.num_scheduled_tokens, b.samples), (30, 10, true));
    assert_eq!(counters(&s, 1), (40, 41));
}

#[test]
fn a_prefill_budget_caps_the_prompt_tokens_of_a_step_but_never_its_decodes() {
    let mut s = sched(256, 16, SchedulerConfig { max_num_prefill_tokens: 100, ..cfg(2048) });
    for id in 0..3 {
        add(&mut s, id, prompt(80, id as u32), 4);
    }
    // 80 of A's prompt and a 20-token chunk of B; C waits.
    let out = step(&mut s);
    let of = |out: &SchedulerOutput, id: u64| out.scheduled.iter().find(|x| x.request_id == RequestId(id)).map(|x| x.num_scheduled_tokens);
    assert_eq!((of(&out, 0), of(&out, 1), of(&out, 2)), (Some(80), Some(20), None));
    // A decodes beside the next 100 prompt tokens: the rest of B and 40 of C.
    let out = step(&mut s);
    assert_eq!((of(&out, 0), of(&out, 1), of(&out, 2)), (Some(1), Some(60), Some(40)));
    assert_eq!(out.num_scheduled_tokens(), 101);
    // Decodes only ever count against the step's whole budget.
    let out = step(&mut s);
    assert_eq!((of(&out, 0), of(&out, 1), of(&out, 2)), (Some(1), Some(1), Some(40)));
    // Every request finishes with its tokens.
    while s.has_unfinished_requests() {
        step(&mut s);
    }
    assert_eq!(s.allocator().stats().num_used_blocks, 0, "every block comes back");
}

#[test]
fn row_preemption_resets_computed_and_recomputes_in_one_pass() {
    // 4 blocks of 4: A (8 tokens) takes 2, B (7 tokens) takes 2.
    let mut s = sched(4, 4, cfg(64));
    add(&mut s, 0, prompt(8, 0), 6);
    add(&mut s, 1, prompt(7, 1), 6);
    step(&mut s); // both prefilled; A's 9th token needs a 3rd block next
    assert_eq!(counters(&s, 1), (7, 8));
    let out = step(&mut s);
    assert_eq!(out.preempted_requests, vec![RequestId(1)], "the latest arrival goes first");
    assert_eq!(counters(&s, 1), (0, 8), "num_computed_tokens ← 0, tokens kept");
    assert_eq!(s.num_preemptions(), 1);
    // Run A to completion; B then recomputes prompt + its output at once.
    let mut resumed = None;
    for _ in 0..10 {
        let out = step(&mut s);
        if let Some(x) = out.scheduled.iter().find(|x| x.request_id == RequestId(1)) {
            resumed = Some(*x);
            assert_eq!(out.resumed_requests, vec![RequestId(1)]);
            break;
        }
    }
    let x = resumed.expect("B resumed");
    assert_eq!((x.num_computed_tokens, x.num_scheduled_tokens), (0, 8), "prompt (7) and the token it had (1)");
}

#[test]
fn row_streaming_prefill_grows_the_total() {
    let mut s = sched(64, 16, cfg(512));
    add(&mut s, 0, prompt(10, 0), 8);
    let out = s.schedule();
    // While the first chunk runs, more prompt streams in (before any output).
    s.update_from_output(&StepSamples::default()); // no sample: pretend the chunk did not finish the prompt
    let _ = out;
    assert_eq!(counters(&s, 0), (10, 10));
    s.extend_prompt(RequestId(0), &[7, 8, 9]).unwrap();
    assert_eq!(counters(&s, 0), (10, 13));
    let out = step(&mut s);
    assert_eq!((out.scheduled[0].num_computed_tokens, out.scheduled[0].num_scheduled_tokens), (10, 3));
    assert_eq!(counters(&s, 0), (13, 14));
    assert!(s.extend_prompt(RequestId(0), &[1]).is_err(), "not after output");
}

#[test]
fn row_prefix_caching_sets_computed_to_the_cached_length() {
    let mut s = sched(64, 16, cfg(512));
    add(&mut s, 0, prompt(33, 0), 4);
    step(&mut s);
    add(&mut s, 1, prompt(33, 0), 4);
    let out = step(&mut s);
    let b = out.scheduled.iter().find(|x| x.request_id == RequestId(1)).unwrap();
    assert_eq!((b.num_computed_tokens, b.num_scheduled_tokens), (32, 1), "two full blocks hit");
    let st = s.allocator().stats();
    assert_eq!(st.prefix_cache_hits, 32);
}

#[test]
fn row_prefill_disaggregation_starts_at_the_first_token() {
    let mut s = sched(64, 16, cfg(512));
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(4) };
    s.add_remote_prefilled_request(NewRequest::new(RequestId(0), prompt(20, 0), params), 555).unwrap();
    assert_eq!(counters(&s, 0), (20, 21));
    let out = step(&mut s);
    let x = out.scheduled[0];
    assert_eq!((x.num_computed_tokens, x.num_scheduled_tokens), (20, 1));
    assert_eq!(out.block_table_updates[0].block_ids.len(), 2, "slots cover the loaded KV too");
    assert_eq!(counters(&s, 0), (21, 22));
}

#[test]
fn row_speculative_decoding_accepts_and_rejects() {
    let mut s = sched(64, 16, cfg(512));
    add(&mut s, 0, prompt(10, 0), 20);
    step(&mut s); // (10, 11)
    s.add_draft_tokens(RequestId(0), &[1, 2, 3]).unwrap();
    assert_eq!(counters(&s, 0), (10, 14));
    let out = s.schedule();
    assert_eq!(out.scheduled[0].num_scheduled_tokens, 4, "Δ = 1 + L_draft");
    let seq = out.scheduled[0].seq_id;
    s.update_from_output(&StepSamples {
        requests: vec![RequestSamples { request_id: RequestId(0), next: vec![(seq, 99)], num_rejected_drafts: 1 }],
    });
    // computed: 10 + 4 - 1 = 13; total: 11 + 3 - 1 + 1 = 14.
    assert_eq!(counters(&s, 0), (13, 14));
    assert_eq!(s.request(RequestId(0)).unwrap().seqs[0].state.output_token_ids(), &[10_010, 1, 2, 99]);
    s.assert_invariants();
    let out = step(&mut s);
    assert_eq!((out.scheduled[0].num_computed_tokens, out.scheduled[0].num_scheduled_tokens), (13, 1));
}

#[test]
fn drafts_are_offered_only_to_a_running_decode_within_its_length_limit() {
    let mut s = sched(64, 4, cfg(512));
    add(&mut s, 0, prompt(6, 0), 5);
    assert_eq!(s.max_draft_tokens(RequestId(0)), 0, "waiting: no drafts");
    assert!(s.add_draft_tokens(RequestId(0), &[1]).is_err());
    step(&mut s); // (6, 7): one output of at most 5
                  // Total may reach 11: drafts d with 7 + d + 1 <= 11.
    assert_eq!(s.max_draft_tokens(RequestId(0)), 3);
    assert!(s.add_draft_tokens(RequestId(0), &[1, 2, 3, 4]).is_err(), "past the length limit");
    s.add_draft_tokens(RequestId(0), &[1, 2, 3]).unwrap();
    assert_eq!(s.max_draft_tokens(RequestId(0)), 0, "drafts pending");
    let out = s.schedule();
    assert_eq!((out.scheduled[0].num_scheduled_tokens, out.scheduled[0].num_draft_tokens), (4, 3));
    assert!(out.scheduled[0].samples);
    // Every draft rejected: the blocks reserved for them go back, and the
    // block the drafts filled (positions 8..12 hold tokens 1, 2, 3) was never
    // registered in the prefix cache.
    let used_before = s.allocator().stats().num_used_blocks;
    let seq = out.scheduled[0].seq_id;
    s.update_from_output(&StepSamples {
        requests: vec![RequestSamples { request_id: RequestId(0), next: vec![(seq, 77)], num_rejected_drafts: 3 }],
    });
    assert_eq!(counters(&s, 0), (7, 8));
    assert!(s.allocator().stats().num_used_blocks < used_before, "the rejected drafts' block is released");
    s.assert_invariants();
    s.allocator().assert_invariants();
}

#[test]
fn drafts_without_the_budget_for_all_of_them_are_dropped_for_a_plain_decode() {
    // A budget of 3 tokens: a request is offered at most 2 drafts, and when
    // an earlier request's decode takes 1 of the 3 they do not fit.
    let mut s = sched(64, 16, SchedulerConfig { max_num_batched_tokens: 3, max_model_len: 4096, ..SchedulerConfig::default() });
    add(&mut s, 0, prompt(2, 0), 20);
    add(&mut s, 1, prompt(1, 1), 20);
    step(&mut s);
    assert_eq!(s.max_draft_tokens(RequestId(1)), 2, "within the step's budget");
    s.add_draft_tokens(RequestId(1), &[5, 6]).unwrap();
    let out = s.schedule();
    let b = out.scheduled.iter().find(|x| x.request_id == RequestId(1)).unwrap();
    assert_eq!((b.num_scheduled_tokens, b.num_draft_tokens), (1, 0));
    finish_step(&mut s, &out);
    assert_eq!(counters(&s, 1), (2, 3));
    assert_eq!(s.request(RequestId(1)).unwrap().seqs[0].state.output_token_ids(), &[10_001, 10_002]);
    s.assert_invariants();
}

#[test]
fn drafts_without_room_are_dropped_rather_than_preempting_anyone() {
    // 2 blocks of 4, one each for A and B (3 tokens each, room for one
    // more): A's 3 drafts would need another block, which only preempting
    // B could give.
    let mut s = sched(2, 4, cfg(512));
    add(&mut s, 0, prompt(3, 0), 5);
    add(&mut s, 1, prompt(3, 1), 5);
    step(&mut s);
    s.add_draft_tokens(RequestId(0), &[5, 6, 7]).unwrap();
    let out = step(&mut s);
    assert_eq!(s.num_preemptions(), 0, "nobody was preempted for drafts");
    let a = out.scheduled.iter().find(|x| x.request_id == RequestId(0)).unwrap();
    assert_eq!((a.num_scheduled_tokens, a.num_draft_tokens), (1, 0));
    assert_eq!((counters(&s, 0), counters(&s, 1)), ((4, 5), (4, 5)));
}

// ---- Behaviour -------------------------------------------------------------

#[test]
fn block_table_updates_carry_only_changes() {
    let mut s = sched(64, 4, cfg(512));
    add(&mut s, 0, prompt(6, 0), 10);
    let out = step(&mut s);
    assert_eq!(out.block_table_updates[0].start, 0);
    assert_eq!(out.block_table_updates[0].block_ids.len(), 2);
    let out = step(&mut s); // 7th token fits block 1
    assert!(out.block_table_updates.is_empty());
    step(&mut s); // 8th
    let out = step(&mut s); // 9th needs block 2
    assert_eq!(out.block_table_updates.len(), 1);
    assert_eq!((out.block_table_updates[0].start, out.block_table_updates[0].block_ids.len()), (2, 1));
}

#[test]
fn stop_conditions() {
    let mut s = sched(64, 16, cfg(512));
    let p = |extra: SamplingParams| NewRequest { eos_token_ids: vec![10_005], ..NewRequest::new(RequestId(0), prompt(4, 0), extra) };
    // EOS (token 10_005 is produced at position 5) ends it, unless ignore_eos or min_tokens.
    s.add_request(p(SamplingParams::greedy(10))).unwrap();
    while s.has_unfinished_requests() {
        step(&mut s);
    }
    let f = s.take_finished_requests();
    assert_eq!(f[0].status, vellum_scheduler::RequestStatus::Finished(FinishReason::Stop));
    assert_eq!(f[0].seqs[0].state.output_token_ids(), &[10_004, 10_005]);

    let mut s = sched(64, 16, cfg(512));
    s.add_request(p(SamplingParams { min_tokens: 3, ..SamplingParams::greedy(10) })).unwrap();
    while s.has_unfinished_requests() {
        step(&mut s);
    }
    let f = s.take_finished_requests();
    assert_eq!(f[0].seqs[0].state.num_output_tokens(), 10, "EOS before min_tokens does not stop; none after");
    assert_eq!(f[0].seqs[0].finish_reason, Some(FinishReason::Length));

    let mut s = sched(64, 16, cfg(512));
    s.add_request(p(SamplingParams { stop_token_ids: vec![10_006], ignore_eos: true, ..SamplingParams::greedy(10) })).unwrap();
    while s.has_unfinished_requests() {
        step(&mut s);
    }
    assert_eq!(s.take_finished_requests()[0].seqs[0].state.num_output_tokens(), 3);
}

#[test]
fn abort_frees_every_block_at_once() {
    let mut s = sched(64, 4, cfg(512));
    add(&mut s, 0, prompt(30, 0), 50);
    add(&mut s, 1, prompt(30, 1), 50);
    step(&mut s);
    step(&mut s);
    assert!(s.allocator().num_free_blocks() < 64);
    assert!(s.abort(RequestId(0)));
    assert!(s.abort(RequestId(1)));
    assert!(!s.abort(RequestId(1)), "unknown now");
    assert_eq!(s.allocator().num_free_blocks(), 64);
    assert_eq!(s.allocator().stats().num_used_blocks, 0);
    let out = s.schedule();
    assert_eq!(out.finished_requests.len(), 2);
    assert!(out.scheduled.is_empty());
}

#[test]
fn parallel_sampling_forks_and_shares_the_prompt() {
    let mut s = sched(64, 4, cfg(512));
    let params = SamplingParams { n: 4, temperature: 1.0, max_tokens: Some(5), ignore_eos: true, ..SamplingParams::default() };
    s.add_request(NewRequest::new(RequestId(0), prompt(10, 0), params)).unwrap();
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 1, "the prompt is computed once");
    let seq = out.scheduled[0].seq_id;
    s.update_from_output(&StepSamples { requests: vec![RequestSamples::tokens(RequestId(0), (0..4).map(|i| (seq, 500 + i)).collect())] });
    let req = s.request(RequestId(0)).unwrap();
    assert_eq!(req.seqs.len(), 4);
    let st = s.allocator().stats();
    assert_eq!((st.num_used_blocks, st.num_logical_blocks), (3, 12), "3 prompt blocks shared by 4 samples");
    let out = step(&mut s);
    assert_eq!(out.scheduled.len(), 4, "gang-scheduled");
    assert!(!out.block_ops.copies.is_empty(), "the shared partial block is copied on write");
    while s.has_unfinished_requests() {
        step(&mut s);
    }
    let f = s.take_finished_requests();
    let outs: Vec<_> = f[0].seqs.iter().map(|q| q.state.output_token_ids()[0]).collect();
    assert_eq!(outs, vec![500, 501, 502, 503]);
    assert_eq!(s.allocator().stats().num_used_blocks, 0);
}

#[test]
fn beam_search_forks_and_frees_candidates() {
    let mut s = sched(64, 4, cfg(512));
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(6),
        beam_search: Some(BeamSearchParams { beam_width: 3, length_penalty: 1.0 }),
        ..SamplingParams::default()
    };
    s.add_request(NewRequest::new(RequestId(0), prompt(8, 0), params)).unwrap();
    let out = s.schedule();
    let root = out.scheduled[0].seq_id;
    s.update_from_output(&StepSamples { requests: vec![RequestSamples::tokens(RequestId(0), vec![(root, 1), (root, 2), (root, 3)])] });
    for _ in 0..3 {
        let out = s.schedule();
        let seqs: Vec<SeqId> = out.scheduled.iter().map(|x| x.seq_id).collect();
        assert_eq!(seqs.len(), 3);
        // The first beam spawns two candidates, the second one, the third dies.
        let next = vec![(seqs[0], 7), (seqs[0], 8), (seqs[1], 9)];
        s.update_from_output(&StepSamples { requests: vec![RequestSamples::tokens(RequestId(0), next)] });
        s.assert_invariants();
        s.allocator().assert_invariants();
        let st = s.allocator().stats();
        assert!(st.sharing_savings() > 0.3, "beams share most blocks: {}", st.sharing_savings());
    }
    assert_eq!(s.request(RequestId(0)).unwrap().running_seqs().count(), 3);
    s.abort(RequestId(0));
    assert_eq!(s.allocator().stats().num_used_blocks, 0);
}

#[test]
fn swap_preemption_is_all_or_nothing_and_blocks_admission() {
    let c = SchedulerConfig { preemption_mode: PreemptionMode::Swap, ..cfg(64) };
    let mut s = sched(4, 4, c);
    add(&mut s, 0, prompt(8, 0), 6);
    add(&mut s, 1, prompt(7, 1), 6);
    step(&mut s);
    let out = step(&mut s);
    assert_eq!(out.preempted_requests, vec![RequestId(1)]);
    assert_eq!(out.block_ops.swap_out.len(), 2, "the whole group moves");
    assert_eq!(s.num_swapped(), 1);
    assert_eq!(counters(&s, 1), (7, 8), "swap keeps num_computed_tokens");
    add(&mut s, 2, prompt(2, 2), 2);
    let out = step(&mut s);
    assert!(!out.scheduled.iter().any(|x| x.request_id == RequestId(2)), "no admission while a group is swapped out");
    let mut swapped_in = false;
    for _ in 0..12 {
        let out = step(&mut s);
        if !out.block_ops.swap_in.is_empty() {
            swapped_in = true;
            let x = out.scheduled.iter().find(|x| x.request_id == RequestId(1)).unwrap();
            assert_eq!((x.num_computed_tokens, x.num_scheduled_tokens), (7, 1), "resumes where it was");
        }
    }
    assert!(swapped_in);
}

#[test]
fn two_level_prefers_decodes_then_shortest_staged() {
    let c = SchedulerConfig { policy: SchedulingPolicy::TwoLevel { staging_queue_size: 2 }, ..cfg(20) };
    let mut s = sched(256, 4, c);
    add(&mut s, 0, prompt(4, 0), 10);
    step(&mut s); // 0 decoding
    add(&mut s, 1, prompt(18, 1), 4); // long
    add(&mut s, 2, prompt(5, 2), 4); // short
    add(&mut s, 3, prompt(2, 3), 4); // shortest, but not in the first staging batch
    let out = step(&mut s);
    let order: Vec<(u64, usize)> = out.scheduled.iter().map(|x| (x.request_id.0, x.num_scheduled_tokens)).collect();
    // Decode first (Δ=1), then the shorter staged (5), then 14 of the long one. 3 waits.
    assert_eq!(order, vec![(0, 1), (2, 5), (1, 14)]);
    let out = step(&mut s);
    // Staging is now empty, so 3 is staged and runs.
    assert!(out.scheduled.iter().any(|x| x.request_id == RequestId(3)));
}

#[test]
fn priority_policy_orders_waiting_requests() {
    let c = SchedulerConfig { policy: SchedulingPolicy::Priority, max_num_seqs: 1, ..cfg(512) };
    let mut s = sched(64, 16, c);
    for (id, prio) in [(0u64, 5i64), (1, 1), (2, 3)] {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(1) };
        s.add_request(NewRequest { priority: prio, ..NewRequest::new(RequestId(id), prompt(4, id as u32), params) }).unwrap();
    }
    let mut order = Vec::new();
    while s.has_unfinished_requests() {
        let out = step(&mut s);
        order.extend(out.new_requests);
    }
    assert_eq!(order, vec![RequestId(1), RequestId(2), RequestId(0)]);
}

#[test]
fn next_step_is_decided_before_samples_arrive() {
    let mut s = sched(64, 4, cfg(512));
    add(&mut s, 0, prompt(8, 0), 10);
    let out1 = s.schedule();
    let out2 = s.schedule(); // step 1 still in flight
    assert_eq!(s.num_steps_in_flight(), 2);
    let x = out2.scheduled[0];
    assert_eq!((x.num_computed_tokens, x.num_scheduled_tokens), (8, 1), "decode of the token still being sampled");
    assert_eq!(out2.block_table_updates.len(), 1, "position 8 needs block 2");
    finish_step(&mut s, &out1);
    finish_step(&mut s, &out2);
    assert_eq!(counters(&s, 0), (9, 10));
    s.assert_invariants();
}

#[test]
fn bad_requests_get_typed_errors() {
    let mut s = sched(8, 16, SchedulerConfig { max_model_len: 100, ..SchedulerConfig::default() });
    let e = s.add_request(NewRequest::new(RequestId(0), prompt(90, 0), SamplingParams::greedy(20))).unwrap_err();
    assert!(matches!(e, Error::TooLong { requested: 110, max_model_len: 100, .. }), "{e}");
    assert!(e.to_string().contains("maximum context length is 100 tokens"));
    // A pooling request ends with its prompt: 100 prompt tokens fill the context; 101 do not fit.
    let pool = SamplingParams { pooling: Some(vellum_base::PoolingParams::default()), max_tokens: Some(1), ..SamplingParams::default() };
    s.add_request(NewRequest::new(RequestId(10), prompt(100, 0), pool.clone())).expect("a pooling prompt may fill the context");
    assert!(matches!(s.add_request(NewRequest::new(RequestId(11), prompt(101, 0), pool)), Err(Error::TooLong { .. })));
    assert!(matches!(s.add_request(NewRequest::new(RequestId(12), prompt(100, 0), SamplingParams::greedy(1))), Err(Error::TooLong { .. })));
    assert!(s.abort(RequestId(10)));
    assert!(matches!(s.add_request(NewRequest::new(RequestId(1), vec![], SamplingParams::greedy(2))), Err(Error::EmptyPrompt(_))));
    let bad = SamplingParams { top_p: 0.0, ..SamplingParams::default() };
    assert!(matches!(s.add_request(NewRequest::new(RequestId(2), prompt(4, 0), bad)), Err(Error::InvalidParams(_))));
    s.add_request(NewRequest::new(RequestId(3), prompt(4, 0), SamplingParams::greedy(2))).unwrap();
    assert!(matches!(
        s.add_request(NewRequest::new(RequestId(3), prompt(4, 0), SamplingParams::greedy(2))),
        Err(Error::DuplicateRequest(_))
    ));
    let mut tiny = sched(2, 4, SchedulerConfig { max_model_len: 100, ..SchedulerConfig::default() });
    assert!(matches!(
        tiny.add_request(NewRequest::new(RequestId(0), prompt(10, 0), SamplingParams::greedy(5))),
        Err(Error::ExceedsKvCapacity { .. })
    ));
    assert_eq!(s.num_waiting(), 1, "refused requests left nothing behind");
}

// ---- Property tests ---------------------------------------------------------

#[derive(Clone, Debug)]
struct Arrival {
    at_step: usize,
    prompt_len: usize,
    shared_prefix: bool,
    max_tokens: usize,
    n: usize,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (0usize..30, 1usize..60, any::<bool>(), 1usize..12, prop_oneof![4 => Just(1usize), 1 => 2usize..4])
        .prop_map(|(at_step, prompt_len, shared_prefix, max_tokens, n)| Arrival { at_step, prompt_len, shared_prefix, max_tokens, n })
}

fn policy() -> impl Strategy<Value = SchedulingPolicy> {
    prop_oneof![
        Just(SchedulingPolicy::Fcfs),
        Just(SchedulingPolicy::Priority),
        (1usize..5).prop_map(|n| SchedulingPolicy::TwoLevel { staging_queue_size: n }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random workloads on a small pool: budgets (the step's, the
    /// prefills') respected, counters and blocks agree after every step, preempted requests resume with exactly
    /// their tokens, and the pool is full again at the end.
    #[test]
    fn scheduler_invariants(
        arrivals in prop::collection::vec(arrival(), 1..24),
        pol in policy(),
        swap in any::<bool>(),
        num_blocks in 12usize..40,
        budget in 8usize..64,
        prefill_cap in prop_oneof![3 => Just(0usize), 1 => 1usize..16],
        aborts in prop::collection::vec((0usize..60, any::<usize>()), 0..4),
    ) {
        let config = SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: budget,
            max_num_prefill_tokens: prefill_cap,
            max_model_len: 96,
            policy: pol,
            preemption_mode: if swap { PreemptionMode::Swap } else { PreemptionMode::Recompute },
            ..SchedulerConfig::default()
        };
        let mut s = sched(num_blocks, 4, config);
        // What each sequence was fed, to check nothing is lost by preemption.
        let mut fed: HashMap<SeqId, Vec<TokenId>> = HashMap::new();
        let mut admitted = Vec::new();
        // (A prefill budget of one token computes a prompt a token a step.)
        for stepno in 0..4000 {
            for (i, a) in arrivals.iter().enumerate().filter(|(_, a)| a.at_step == stepno) {
                let p = if a.shared_prefix { prompt(a.prompt_len, 9) } else { prompt(a.prompt_len, i as u32) };
                let params = SamplingParams { n: a.n, temperature: 1.0, max_tokens: Some(a.max_tokens), ignore_eos: true, ..SamplingParams::default() };
                if s.add_request(NewRequest::new(RequestId(i as u64), p, params)).is_ok() {
                    admitted.push(i);
                }
            }
            for (at, pick) in &aborts {
                if *at == stepno && !admitted.is_empty() {
                    s.abort(RequestId(admitted[pick % admitted.len()] as u64));
                }
            }
            let out = s.schedule();
            prop_assert!(out.num_scheduled_tokens() <= budget, "budget exceeded");
            // Sequences given more than one token are prefills (no drafts here).
            let prefill: usize = out.scheduled.iter().map(|x| x.num_scheduled_tokens).filter(|&t| t > 1).sum();
            prop_assert!(prefill_cap == 0 || prefill <= prefill_cap, "prefill budget exceeded: {} > {}", prefill, prefill_cap);
            prop_assert!(out.scheduled.len() <= 8, "max_num_seqs exceeded");
            // Every scheduled sequence continues exactly from what it was fed.
            let mut per_req: HashMap<RequestId, Vec<(SeqId, TokenId)>> = HashMap::new();
            for x in out.scheduled.iter().filter(|x| x.samples) {
                let req = s.request(x.request_id).unwrap();
                let n = req.params.n;
                let q = req.seqs.iter().find(|q| q.seq_id == x.seq_id).unwrap();
                prop_assert_eq!(q.state.output_token_ids(), fed.get(&x.seq_id).map_or(&[][..], |v| &v[..]));
                let t = 20_000 + (x.seq_id.0 as TokenId) * 100 + q.state.num_output_tokens() as TokenId;
                let k = if req.seqs.len() == 1 && n > 1 { n } else { 1 };
                for j in 0..k {
                    per_req.entry(x.request_id).or_default().push((x.seq_id, t + j as TokenId * 7));
                }
            }
            let requests: Vec<RequestSamples> = per_req.into_iter().map(|(id, next)| RequestSamples::tokens(id, next)).collect();
            s.update_from_output(&StepSamples { requests: requests.clone() });
            for r in &requests {
                let Some(req) = s.request(r.request_id) else { continue };
                // Record what every sequence now holds.
                for q in &req.seqs {
                    fed.insert(q.seq_id, q.state.output_token_ids().to_vec());
                }
            }
            for f in s.take_finished_requests() {
                for q in &f.seqs {
                    if let Some(v) = fed.get(&q.seq_id) {
                        // Finished sequences hold what was fed plus at most the final token.
                        prop_assert!(q.state.output_token_ids().starts_with(v));
                    }
                }
            }
            s.assert_invariants();
            s.allocator().assert_invariants();
            if !s.has_unfinished_requests() && stepno > 30 {
                break;
            }
        }
        prop_assert!(!s.has_unfinished_requests(), "all requests finish");
        let st = s.allocator().stats();
        prop_assert_eq!(st.num_used_blocks, 0, "pool is full again");
        prop_assert_eq!(s.allocator().num_free_blocks(), num_blocks);
        prop_assert_eq!(st.num_used_host_blocks, 0);
    }

    /// Two-level scheduling does not starve: with ample memory and
    /// `max_num_seqs` above the number of requests, a request that is i-th in
    /// FIFO order when it arrives is first scheduled within
    ///   (⌊i / K⌋ + 1) · (K + ⌈(S + K) · L / (B − S)⌉)
    /// steps, where K is the staging size, S = max_num_seqs, L = max_model_len
    /// and B = max_num_batched_tokens (> S). Each staging round ends within
    /// K steps that admit a staged request plus the steps whose whole budget
    /// goes to running work no longer than the shortest staged request: at
    /// most S decode tokens and (S + K)·L prefill tokens in all.
    #[test]
    fn two_level_wait_is_bounded(
        lens in prop::collection::vec((1usize..64, 1usize..20, 0usize..6), 1..40),
        k in 1usize..6,
    ) {
        let (s_max, l, b) = (48usize, 96usize, 64usize);
        let config = SchedulerConfig {
            max_num_seqs: s_max, max_num_batched_tokens: b, max_model_len: l,
            policy: SchedulingPolicy::TwoLevel { staging_queue_size: k }, ..SchedulerConfig::default()
        };
        let mut s = sched(4096, 4, config);
        let mut first_scheduled: HashMap<u64, usize> = HashMap::new();
        let mut arrived: HashMap<u64, (usize, usize)> = HashMap::new(); // id -> (step, fifo index)
        let mut next = 0usize;
        let round = k + ((s_max + k) * l).div_ceil(b - s_max);
        for stepno in 0..2000 {
            // Arrivals: request `next` arrives after a gap given by its third field.
            while next < lens.len() && lens[..=next].iter().map(|x| x.2).sum::<usize>() <= stepno {
                let (pl, mt, _) = lens[next];
                add(&mut s, next as u64, prompt(pl, next as u32), mt.min(l - pl));
                arrived.insert(next as u64, (stepno, s.num_waiting() - 1));
                next += 1;
            }
            let out = step(&mut s);
            for x in &out.scheduled {
                first_scheduled.entry(x.request_id.0).or_insert(stepno);
            }
            if next == lens.len() && !s.has_unfinished_requests() {
                break;
            }
        }
        for (id, (at, fifo_idx)) in arrived {
            let first = first_scheduled[&id];
            let bound = (fifo_idx / k + 1) * round;
            prop_assert!(first - at <= bound, "request {} waited {} steps > bound {}", id, first - at, bound);
        }
    }
}

/// In-flight steps name their requests by slot: a request aborted while its
/// step is in flight leaves its slot to a newcomer (and its id is reused
/// too), and applying the old steps touches neither.
#[test]
fn an_in_flight_step_survives_an_abort_whose_slot_and_id_are_reused() {
    let mut s = sched(64, 4, cfg(512));
    add(&mut s, 0, prompt(8, 0), 10);
    add(&mut s, 1, prompt(8, 1), 10);
    let first = s.schedule();
    assert!(s.abort(RequestId(1)));
    add(&mut s, 7, prompt(6, 7), 10);
    let second = s.schedule();
    add(&mut s, 1, prompt(5, 3), 10);
    let third = s.schedule();
    s.assert_invariants();
    let before = counters(&s, 1);
    for out in [&first, &second, &third] {
        // Samples for the sequences that still exist, as an engine sends them.
        let mut per_req: HashMap<RequestId, Vec<(SeqId, TokenId)>> = HashMap::new();
        for x in out.scheduled.iter().filter(|x| x.samples) {
            if s.request(x.request_id).is_some_and(|r| r.seqs.iter().any(|q| q.seq_id == x.seq_id)) {
                per_req.entry(x.request_id).or_default().push((x.seq_id, 30_000));
            }
        }
        let requests = per_req.into_iter().map(|(id, next)| RequestSamples::tokens(id, next)).collect();
        s.update_from_output(&StepSamples { requests });
        s.assert_invariants();
        s.allocator().assert_invariants();
        if std::ptr::eq(out, &first) {
            assert_eq!(counters(&s, 1), before, "the aborted request's step left the new request 1 alone");
        }
    }
    for _ in 0..40 {
        if !s.has_unfinished_requests() {
            break;
        }
        step(&mut s);
    }
    assert!(!s.has_unfinished_requests());
}
