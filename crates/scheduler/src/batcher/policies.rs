//! Deciding a step: running requests first (FCFS/priority in arrival
//! order; two-level: shortest remaining tokens first with the staged ones),
//! then swapped-out groups, then new admissions while nothing was
//! preempted; every attempt goes through `allocate_slots` (thesis §4.5).

use super::Scheduler;
use crate::scheduler_output::{BlockTableUpdate, ScheduledSeq, SchedulerOutput};
use crate::sequence_group::{RequestStatus, Sequence};
use vellum_base::{BlockAllocator, ComputedBlocks, RequestId, SchedulingPolicy, SeqId};

/// What happened when a request was offered a share of the step.
enum Attempt {
    /// Scheduled this many tokens.
    Scheduled,
    /// Nothing to compute now (or its next step must wait for samples).
    Idle,
    /// Not enough token budget (or sequence slots) left.
    NoBudget,
    /// `allocate_slots` found no room.
    NoRoom,
}

/// Whom a running request that finds no room may preempt.
#[derive(Clone, Copy)]
enum Victims {
    /// The latest arrivals among the running requests (paper §4.5).
    LaterArrivals,
    /// Nobody else: a group just swapped back in gives way itself.
    Itself,
}

/// Per-step bookkeeping of `schedule()`.
pub(super) struct StepState {
    pub(super) budget: usize,
    /// Of `budget`, what prefills may still take
    /// ([`SchedulerConfig::max_num_prefill_tokens`]; `usize::MAX`: all of it).
    pub(super) prefill_budget: usize,
    pub(super) step_id: u64,
    pub(super) preempted: bool,
    /// Sequence slots held by running requests, counted on first need (only
    /// admissions need it, so a step of decodes alone never walks them).
    pub(super) num_running_seqs: Option<usize>,
}

impl<A: BlockAllocator> Scheduler<A> {
    /// Decides the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.running.compact();
        let mut out = SchedulerOutput {
            // Room for every running request's first sequence: no regrowth mid-step.
            scheduled: Vec::with_capacity(self.running.len() + 1),
            finished_requests: std::mem::take(&mut self.finished_since_output),
            ..Default::default()
        };
        self.step_slots.clear();
        let prefill_budget = match self.config.max_num_prefill_tokens {
            0 => usize::MAX,
            n => n,
        };
        let mut step = StepState {
            budget: self.config.max_num_batched_tokens,
            prefill_budget,
            step_id: self.next_step_id,
            preempted: false,
            num_running_seqs: None,
        };
        match self.config.policy {
            SchedulingPolicy::Fcfs | SchedulingPolicy::Priority => self.schedule_in_order(&mut step, &mut out),
            SchedulingPolicy::TwoLevel { staging_queue_size } => self.schedule_two_level(staging_queue_size, &mut step, &mut out),
        }
        out.block_ops.copies = self.allocator.take_block_copies();
        // The in-flight record reuses the buffer of an applied step: a step
        // allocates nothing it frees again (freeing ~100 KB a step made the
        // allocator give pages back and fault them in again, 14% of a step).
        debug_assert_eq!(self.step_slots.len(), out.scheduled.len());
        let mut record = self.spare_records.pop().unwrap_or_default();
        record.clear();
        record.extend(out.scheduled.iter().copied().zip(self.step_slots.iter().copied()));
        self.in_flight.push_back(record);
        self.next_step_id += 1;
        out
    }

    /// FCFS and priority (thesis Algorithm 1): running requests in queue
    /// order, then swapped-out groups, then waiting requests.
    fn schedule_in_order(&mut self, step: &mut StepState, out: &mut SchedulerOutput) {
        // Preemption only marks entries, so positions hold during the walk;
        // admissions and swap-ins, which insert, come after it.
        let n = self.running.positions();
        for i in 0..n {
            debug_assert_eq!(self.running.positions(), n, "the running queue grew during the walk");
            if step.budget == 0 {
                break;
            }
            if self.running.at(i).id.is_some() {
                self.schedule_running(self.running.at(i).slot, Victims::LaterArrivals, step, out);
            }
        }
        self.admit_swapped(step, out);
        while step.budget > 0 && self.swapped.is_empty() && !step.preempted {
            let Some((_, &id)) = self.waiting.first_key_value() else { break };
            if !matches!(self.admit(id, step, out), Attempt::Scheduled) {
                break;
            }
        }
    }

    /// Thesis §4.5.3: a FIFO-filled staging queue, refilled only when empty,
    /// and shortest-remaining-tokens-first over staging + running
    /// (Algorithm 2, refreshing staged prefix-cache hits after each admission).
    fn schedule_two_level(&mut self, staging_size: usize, step: &mut StepState, out: &mut SchedulerOutput) {
        if self.staging.is_empty() {
            while self.staging.len() < staging_size {
                let Some((_, id)) = self.waiting.pop_first() else { break };
                self.staging.push(id);
            }
        }
        let mut order = std::mem::take(&mut self.scratch_order);
        order.clear();
        order.extend(self.running.iter().map(|(key, slot, _)| (self.request_at(slot).num_schedulable_tokens(), key, slot)));
        // Decode steps keep the order of the last step: a sorted check is
        // one pass, a sort only where lengths changed.
        if !order.is_sorted() {
            order.sort_unstable();
        }
        self.admit_swapped(step, out);
        let staging = self.staging.clone();
        let mut staged: Vec<(usize, RequestId)> = staging.into_iter().map(|id| (self.staged_delta(id), id)).collect();
        let mut ri = 0;
        while step.budget > 0 {
            // An entry preempted earlier in this step is passed over by
            // `schedule_running`; admissions stop after a preemption anyway.
            let best_staged =
                staged.iter().enumerate().min_by_key(|(_, (d, id))| (*d, self.requests[id].arrival_order)).map(|(i, (d, _))| (i, *d));
            let run_next = order.get(ri).map(|(d, _, _)| *d);
            match (run_next, best_staged) {
                (None, None) => break,
                (Some(dr), Some((_, ds))) if dr <= ds => {
                    self.schedule_running(order[ri].2, Victims::LaterArrivals, step, out);
                    ri += 1;
                }
                (Some(_), None) => {
                    self.schedule_running(order[ri].2, Victims::LaterArrivals, step, out);
                    ri += 1;
                }
                (_, Some((i, _))) => {
                    let (_, id) = staged.swap_remove(i);
                    let can_admit = self.swapped.is_empty() && !step.preempted;
                    if can_admit && matches!(self.admit(id, step, out), Attempt::Scheduled) {
                        self.staging.retain(|r| *r != id);
                        // The new request's blocks may be other staged requests' prefix.
                        for s in staged.iter_mut() {
                            s.0 = self.staged_delta(s.1);
                        }
                    }
                }
            }
        }
        self.scratch_order = order;
    }

    /// Sequence slots held by running requests (counted once per step).
    fn num_running_seqs(&self, step: &mut StepState) -> usize {
        *step.num_running_seqs.get_or_insert_with(|| self.running.iter().map(|(_, slot, _)| self.request_at(slot).num_seq_slots()).sum())
    }

    /// Remaining tokens of a staged request after its prefix-cache hit.
    fn staged_delta(&mut self, id: RequestId) -> usize {
        let req = &self.requests[&id];
        let seq = &req.seqs[0];
        let st = seq.tokens_for_allocator(0, req.length_hint());
        let hit = if req.hot.computes_whole_prompt { 0 } else { self.allocator.get_computed_blocks(&st).num_computed_tokens };
        req.num_schedulable_tokens().saturating_sub(hit)
    }

    /// Brings swapped-out groups back, oldest first, while blocks allow.
    fn admit_swapped(&mut self, step: &mut StepState, out: &mut SchedulerOutput) {
        while !step.preempted {
            let Some((&key, &id)) = self.swapped.first_key_value() else { break };
            let num_running_seqs = self.num_running_seqs(step);
            let req = &self.requests[&id];
            let n_seqs = req.num_seq_slots();
            if num_running_seqs + n_seqs > self.config.max_num_seqs {
                break;
            }
            let seq_ids: Vec<SeqId> = req.running_seqs().map(|s| s.seq_id).collect();
            let Some(swaps) = self.allocator.swap_in(&seq_ids) else { break };
            out.block_ops.swap_in.extend(swaps);
            self.swapped.remove(&key);
            let req = self.requests.get_mut(&id).expect("swapped request is live");
            req.status = RequestStatus::Running;
            for s in &mut req.seqs {
                s.num_synced_blocks = 0;
            }
            let slot = self.requests.slot_of(&id).expect("swapped request is live");
            self.running.insert(key, slot, id);
            step.num_running_seqs = Some(num_running_seqs + n_seqs);
            out.resumed_requests.push(id);
            self.schedule_running(slot, Victims::Itself, step, out);
        }
    }

    /// Schedules the running request in `slot`, preempting (as `victims`
    /// allows) while there is no room.
    fn schedule_running(&mut self, slot: u32, victims: Victims, step: &mut StepState, out: &mut SchedulerOutput) {
        let id = match self.requests.get_slot(slot) {
            Some((id, r)) if r.status == RequestStatus::Running && r.scheduled_step != step.step_id => *id,
            _ => return,
        };
        loop {
            match self.try_schedule(slot, step, out) {
                Attempt::Scheduled | Attempt::Idle => return,
                Attempt::NoBudget => {
                    self.trim_to_scheduled(id);
                    return;
                }
                Attempt::NoRoom => {
                    // The latest arrival among the running requests not yet
                    // scheduled in this step (requests admitted in this step
                    // count as scheduled).
                    let victim = match victims {
                        Victims::Itself => None,
                        Victims::LaterArrivals => self.running.iter().rev().map(|(_, s, v)| (s, v)).find(|&(s, v)| {
                            let r = self.request_at(s);
                            v != id && r.scheduled_step != step.step_id && !r.has_in_flight()
                        }),
                    };
                    match victim {
                        Some((_, v)) => self.preempt(v, step, out),
                        None => {
                            // A request with a step in flight is not
                            // preempted (that step writes its blocks); it
                            // gives back what this attempt reserved and
                            // waits for the next step.
                            if self.request_at(slot).has_in_flight() {
                                self.trim_to_scheduled(id);
                            } else {
                                self.preempt(id, step, out);
                            }
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Admits a waiting request (new, or preempted by recompute). On
    /// failure it stays waiting and holds nothing.
    fn admit(&mut self, id: RequestId, step: &mut StepState, out: &mut SchedulerOutput) -> Attempt {
        let num_running_seqs = self.num_running_seqs(step);
        let slot = self.requests.slot_of(&id).expect("waiting request is live");
        let n_seqs = self.request_at(slot).num_seq_slots();
        if num_running_seqs + n_seqs > self.config.max_num_seqs {
            return Attempt::NoBudget;
        }
        let attempt = self.try_schedule(slot, step, out);
        let req = self.requests.get_slot_mut(slot).expect("waiting request is live").1;
        if matches!(attempt, Attempt::Scheduled) {
            let key = (if self.config.policy == SchedulingPolicy::Priority { req.priority } else { 0 }, req.arrival_order);
            self.waiting.remove(&key);
            req.status = RequestStatus::Running;
            if req.num_preemptions == 0 {
                out.new_requests.push(id)
            } else {
                out.resumed_requests.push(id)
            }
            self.running.insert(key, slot, id);
            step.num_running_seqs = Some(num_running_seqs + n_seqs);
        } else {
            // Roll back any partial allocation.
            for s in &mut req.seqs {
                self.allocator.trim(s.seq_id, s.state.num_computed_tokens());
                self.allocator.free(s.seq_id);
                s.state.preempt();
                s.num_synced_blocks = 0;
            }
            out.block_table_updates.retain(|u| !req.seqs.iter().any(|s| s.seq_id == u.seq_id));
        }
        attempt
    }

    /// Gives every running sequence of the request in `slot` its Δ, gang
    /// style: a group with several sequences runs all of them in full or
    /// not at all.
    fn try_schedule(&mut self, slot: u32, step: &mut StepState, out: &mut SchedulerOutput) -> Attempt {
        let threshold = self.config.long_prefill_token_threshold;
        let chunked = self.config.enable_chunked_prefill;
        let (&id, req) = self.requests.get_slot_mut(slot).expect("scheduled request is live");
        // Scheduled ahead of its samples only as one sequence that keeps its
        // shape: a sample that forks, drops or ranks sequences (parallel
        // sampling's first draw, beam search) changes what to schedule, and
        // the sequences of a parallel request draw from one generator in
        // the order their steps run, so they step with their samples known.
        if req.has_in_flight() && (req.next_sample_reshapes() || req.running_seqs().nth(1).is_some()) {
            return Attempt::Idle;
        }
        let hint = req.length_hint();
        // Prompt logprobs and MEAN/CLS pooling need every prompt position computed: no prefix hit.
        let use_prefix_cache = !req.hot.computes_whole_prompt;
        // Scheduled sequences go straight to the output; a failed attempt
        // truncates them away again.
        let mark = out.scheduled.len();
        let mut budget = step.budget;
        let mut prefill_budget = step.prefill_budget;
        // A sequence recomputing from scratch (after preemption) waits while
        // a sibling is still computing the prompt, so that it then finds the
        // whole prompt in the prefix cache instead of computing a copy.
        //
        // Not so for a beam search's candidates: a beam step ranks all of
        // them at once, so they recompute together and, when the budget
        // allows, in full in one step (a candidate sampled alone would see
        // the others dropped as unextended).
        let beam_gang = req.hot.is_beam && req.forked;
        let multi_seq = req.seqs.len() > 1;
        let whole_only = beam_gang && step.budget < self.config.max_num_batched_tokens;
        let num_prompt = req.num_prompt_tokens();
        let prompt_leader =
            if beam_gang { None } else { req.running_seqs().find(|s| s.num_scheduled_tokens() < num_prompt).map(|s| s.seq_id) };
        let waits_for_leader =
            |s: &Sequence| prompt_leader.is_some_and(|l| l != s.seq_id) && s.num_scheduled_tokens() == 0 && s.num_in_flight_tokens == 0;
        // Gang scheduling: every sequence of the group with work runs in the
        // same step; each later sequence keeps at least one token of budget.
        let mut seqs_left = req.seqs.iter().filter(|s| s.is_running() && s.num_schedulable_tokens() > 0 && !waits_for_leader(s)).count();
        if seqs_left > budget {
            return Attempt::NoBudget;
        }
        for seq in req.seqs.iter_mut().filter(|s| s.is_running()) {
            if waits_for_leader(seq) {
                continue;
            }
            // A sequence whose table the executor has holds blocks; otherwise ask.
            let holds_nothing = seq.num_synced_blocks == 0 && self.allocator.block_table(seq.seq_id).is_none();
            let fresh = holds_nothing && seq.num_in_flight_tokens == 0 && seq.state.num_computed_tokens() == 0;
            let computed = if fresh && use_prefix_cache {
                self.allocator.get_computed_blocks(&seq.tokens_for_allocator(0, hint))
            } else {
                ComputedBlocks::default()
            };
            let hit = computed.num_computed_tokens;
            // This step's new tokens start after what is computed, in flight
            // or found in the prefix cache.
            let start = seq.num_scheduled_tokens() + hit;
            let mut remaining = seq.num_schedulable_tokens() - hit;
            if remaining == 0 {
                continue;
            }
            seqs_left = seqs_left.saturating_sub(1);
            let mut delta = remaining.min(budget - seqs_left);
            if threshold > 0 {
                delta = delta.min(threshold);
            }
            // A prefill (a prompt, or a recomputation) is more than a token
            // besides drafts; decodes never count against the prefill budget.
            // A beam gang's recomputation is not held to it (its candidates
            // are ranked together and run whole, as without the budget), but
            // uses it up. The other sequences of a group are independent: one
            // that finds the budget spent waits for the next step while its
            // siblings run (each keeps its own generator).
            let prefill = remaining.saturating_sub(seq.state.num_draft_tokens()) > 1;
            if prefill && !beam_gang {
                if prefill_budget == 0 && multi_seq {
                    continue;
                }
                delta = delta.min(prefill_budget);
            }
            // Drafts are verified in one step or not at all: without the
            // budget for all of them the sequence decodes one token.
            if delta < remaining && seq.state.num_draft_tokens() > 0 {
                remaining = seq.drop_draft_tokens();
                delta = delta.min(remaining);
            }
            if delta == 0 || (delta < remaining && (!chunked || whole_only)) {
                out.scheduled.truncate(mark);
                self.step_slots.truncate(mark);
                return Attempt::NoBudget;
            }
            // A sequence holding nothing gets slots from its prefix hit on; one
            // computed elsewhere (remote prefill) also for the KV it loads.
            let alloc_from = if holds_nothing { hit } else { start };
            let mut slots =
                self.allocator.allocate_slots(&seq.tokens_for_allocator(alloc_from, hint), start + delta - alloc_from, computed);
            // Drafts never cost a preemption: without room for them the
            // sequence decodes one token. (A sequence with drafts holds its
            // blocks already: no prefix hit to hand over again.)
            if slots.is_none() && seq.state.num_draft_tokens() > 0 {
                remaining = seq.drop_draft_tokens();
                delta = delta.min(remaining);
                let st = seq.tokens_for_allocator(alloc_from, hint);
                slots = self.allocator.allocate_slots(&st, start + delta - alloc_from, ComputedBlocks::default());
            }
            let Some(slots) = slots else {
                out.scheduled.truncate(mark);
                self.step_slots.truncate(mark);
                return Attempt::NoRoom;
            };
            if hit > 0 {
                seq.state.apply_prefix_hit(hit).expect("a hit never covers the last token");
            }
            let changed_from = slots.first_changed_block_idx.min(seq.num_synced_blocks);
            if changed_from < slots.num_blocks {
                let table = self.allocator.block_table(seq.seq_id).expect("allocated");
                out.block_table_updates.push(BlockTableUpdate {
                    seq_id: seq.seq_id,
                    start: changed_from,
                    block_ids: table[changed_from..].to_vec(),
                });
            }
            seq.num_synced_blocks = slots.num_blocks;
            out.scheduled.push(ScheduledSeq {
                request_id: id,
                seq_id: seq.seq_id,
                num_scheduled_tokens: delta,
                num_computed_tokens: start,
                samples: delta == remaining,
                num_draft_tokens: seq.state.num_draft_tokens(),
            });
            self.step_slots.push(slot);
            budget -= delta;
            if prefill {
                prefill_budget = prefill_budget.saturating_sub(delta);
            }
        }
        if out.scheduled.len() == mark {
            return Attempt::Idle;
        }
        for p in &out.scheduled[mark..] {
            let seq = req.seqs.iter_mut().find(|s| s.seq_id == p.seq_id).expect("scheduled seq exists");
            seq.num_in_flight_tokens += p.num_scheduled_tokens;
            seq.num_in_flight_samples += p.samples as usize;
        }
        step.budget = budget;
        step.prefill_budget = prefill_budget;
        req.scheduled_step = step.step_id;
        Attempt::Scheduled
    }

    /// Gives back slots reserved by an attempt that did not schedule `id`.
    pub(super) fn trim_to_scheduled(&mut self, id: RequestId) {
        for s in self.requests[&id].running_seqs() {
            self.allocator.trim(s.seq_id, s.num_scheduled_tokens());
        }
    }
}
