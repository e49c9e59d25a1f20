//! The scheduler: which sequences run in the next step, and how many tokens
//! each (thesis §4.4–4.6, Listing 4.3).
//!
//! ```text
//!  add_request ─▶ waiting ──(FIFO batch, two-level only)──▶ staging
//!                   ▲  │ admit: get_computed_blocks + allocate_slots
//!        recompute  │  ▼
//!        preemption └─ running ──swap preemption──▶ swapped ──swap in──┐
//!                      ▲ └───────────────────────────────────────────────┘
//!                      └─ finish / abort: every block freed at once
//! ```
//!
//! One step: running requests are served first (FCFS/priority: in arrival
//! order; two-level: shortest remaining tokens first together with the staged
//! requests); when `allocate_slots` finds no room, the latest arrival among
//! the running requests not yet scheduled is preempted. New requests are
//! admitted only when nothing was preempted in this step and nothing is
//! swapped out (paper §4.5).
//!
//! `schedule()` advances no `num_computed_tokens`; it records the step as in
//! flight, so the next step can be decided before this step's samples arrive
//! (asynchronous scheduling, thesis §4.6.1). `update_from_output` applies the
//! oldest in-flight step.

use crate::error::Error;
use crate::request::{FinishReason, Request, RequestStatus, Sequence};
use crate::scheduler_output::{BlockTableUpdate, RequestSamples, ScheduledSeq, SchedulerOutput, StepSamples};
use std::collections::{BTreeMap, VecDeque};
use vellum_core::{
    BlockAllocator, ComputedBlocks, IdMap, IdSet, PreemptionMode, RequestId, RequestState, SamplingParams, SchedulerConfig,
    SchedulingPolicy, SeqId, SeqTokens, TokenId,
};

/// Queue order: (priority under the priority policy, else 0; arrival order).
type QueueKey = (i64, u64);

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

/// A new request for [`Scheduler::add_request`].
#[derive(Clone, Debug)]
pub struct NewRequest {
    /// Caller-chosen id, unique among live requests.
    pub request_id: RequestId,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<TokenId>,
    /// Sampling parameters (validated on entry).
    pub params: SamplingParams,
    /// End-of-sequence tokens of the model.
    pub eos_token_ids: Vec<TokenId>,
    /// Lower runs first under the priority policy.
    pub priority: i64,
    /// Arrival time in seconds (metrics only).
    pub arrival_time: f64,
    /// The true eventual length, for simulations of the Orca baselines.
    pub true_total_tokens: Option<usize>,
}

impl NewRequest {
    /// A request with default priority and no length oracle.
    pub fn new(request_id: RequestId, prompt_token_ids: Vec<TokenId>, params: SamplingParams) -> Self {
        Self {
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids: Vec::new(),
            priority: 0,
            arrival_time: 0.0,
            true_total_tokens: None,
        }
    }
}

/// Continuous-batching scheduler over any [`BlockAllocator`].
pub struct Scheduler<A: BlockAllocator> {
    config: SchedulerConfig,
    allocator: A,
    requests: IdMap<RequestId, Request>,
    waiting: BTreeMap<QueueKey, RequestId>,
    staging: Vec<RequestId>,
    /// Running requests in queue order.
    running: BTreeMap<QueueKey, RequestId>,
    swapped: BTreeMap<QueueKey, RequestId>,
    finished: Vec<Request>,
    finished_since_output: Vec<(RequestId, FinishReason)>,
    in_flight: VecDeque<Vec<ScheduledSeq>>,
    next_arrival: u64,
    next_seq_id: u64,
    /// Id of the next `schedule()` call (marks requests scheduled in it).
    next_step_id: u64,
    num_preemptions: u64,
}

impl<A: BlockAllocator> Scheduler<A> {
    /// A scheduler over `allocator`. The config must be valid.
    pub fn new(config: SchedulerConfig, allocator: A) -> Result<Self, Error> {
        config.validate()?;
        Ok(Self {
            config,
            allocator,
            requests: IdMap::default(),
            waiting: BTreeMap::new(),
            staging: Vec::new(),
            running: BTreeMap::new(),
            swapped: BTreeMap::new(),
            finished: Vec::new(),
            finished_since_output: Vec::new(),
            in_flight: VecDeque::new(),
            next_arrival: 0,
            next_seq_id: 0,
            next_step_id: 1,
            num_preemptions: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The allocator (read-only).
    pub fn allocator(&self) -> &A {
        &self.allocator
    }

    /// A live request.
    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    /// Requests holding device blocks.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued (waiting plus staging).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.staging.len()
    }

    /// Requests swapped out to the host pool.
    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    /// Preemptions so far.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// Whether any request is not finished.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Steps scheduled whose output has not been applied.
    pub fn num_steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Finished requests (with their outputs) since the last call.
    pub fn take_finished_requests(&mut self) -> Vec<Request> {
        std::mem::take(&mut self.finished)
    }

    fn is_running(&self, id: RequestId) -> bool {
        self.requests.get(&id).is_some_and(|r| r.status == RequestStatus::Running)
    }

    fn queue_key(&self, req: &Request) -> QueueKey {
        let prio = if self.config.policy == SchedulingPolicy::Priority { req.priority } else { 0 };
        (prio, req.arrival_order)
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq_id += 1;
        SeqId(self.next_seq_id - 1)
    }

    /// Queues a request after checking it: valid parameters, a non-empty
    /// prompt, prompt plus `max_tokens` within `max_model_len`, and one
    /// sequence at its longest within the KV cache.
    pub fn add_request(&mut self, new: NewRequest) -> Result<(), Error> {
        let id = new.request_id;
        if self.requests.contains_key(&id) {
            return Err(Error::DuplicateRequest(id));
        }
        new.params.validate()?;
        let num_prompt = new.prompt_token_ids.len();
        if num_prompt == 0 {
            return Err(Error::EmptyPrompt(id));
        }
        let max_len = self.config.max_model_len;
        let max_tokens = new.params.max_tokens.unwrap_or(max_len.saturating_sub(num_prompt).max(1));
        if num_prompt + max_tokens > max_len {
            return Err(Error::TooLong {
                request_id: id,
                requested: num_prompt + max_tokens,
                num_prompt_tokens: num_prompt,
                max_tokens,
                max_model_len: max_len,
            });
        }
        let max_total_tokens = num_prompt + max_tokens;
        // At its longest, the group holds the full prompt blocks once and
        // every sequence's own tail.
        let bs = self.allocator.block_size();
        let per_seq = max_total_tokens.div_ceil(bs);
        let shared = num_prompt / bs;
        let needed_blocks = per_seq + (new.params.num_sequences() - 1) * (per_seq - shared);
        if needed_blocks > self.allocator.num_blocks() {
            return Err(Error::ExceedsKvCapacity { request_id: id, needed_blocks, num_blocks: self.allocator.num_blocks() });
        }
        let seq_id = self.new_seq_id();
        let req = Request {
            request_id: id,
            params: new.params,
            priority: new.priority,
            arrival_time: new.arrival_time,
            arrival_order: self.next_arrival,
            eos_token_ids: new.eos_token_ids,
            seqs: vec![Sequence::new(seq_id, RequestState::new(new.prompt_token_ids))],
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            max_total_tokens,
            true_total_tokens: new.true_total_tokens,
            forked: false,
            scheduled_step: 0,
        };
        self.next_arrival += 1;
        self.waiting.insert(self.queue_key(&req), id);
        self.requests.insert(id, req);
        Ok(())
    }

    /// Streaming prefill (Table 4.1): more prompt arrives for a request that
    /// has produced no output yet; `num_total_tokens += L_new`.
    pub fn extend_prompt(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), Error> {
        let req = self.requests.get_mut(&id).ok_or(Error::UnknownRequest(id))?;
        let new_total = req.seqs[0].state.num_total_tokens() + tokens.len();
        if req.seqs.len() != 1 || new_total >= req.max_total_tokens {
            return Err(Error::TooLong {
                request_id: id,
                requested: new_total,
                num_prompt_tokens: new_total,
                max_tokens: req.max_total_tokens.saturating_sub(new_total),
                max_model_len: self.config.max_model_len,
            });
        }
        req.seqs[0].state.extend_prompt(tokens)?;
        Ok(())
    }

    /// Speculative decoding (Table 4.1): a drafter proposes tokens for a
    /// single-sequence request in decode; the next step verifies them with
    /// Δ = 1 + L_draft. Report rejections in
    /// [`RequestSamples::num_rejected_drafts`].
    pub fn add_draft_tokens(&mut self, id: RequestId, drafts: &[TokenId]) -> Result<(), Error> {
        let req = self.requests.get_mut(&id).ok_or(Error::UnknownRequest(id))?;
        if req.seqs.len() != 1 || req.has_in_flight() {
            return Err(Error::InvalidParams(vellum_core::Error::InvalidTransition(
                "drafts need a single sequence with no step in flight".into(),
            )));
        }
        let seq = &mut req.seqs[0];
        seq.state.add_draft_tokens(drafts)?;
        Ok(())
    }

    /// Prefill disaggregation (Table 4.1): another instance computed the
    /// prompt and its first token; its KV is loaded into this instance's
    /// blocks on admission: `num_computed_tokens ← L_prompt`,
    /// `num_total_tokens ← L_prompt + 1`.
    pub fn add_remote_prefilled_request(&mut self, new: NewRequest, first_token: TokenId) -> Result<(), Error> {
        let id = new.request_id;
        self.add_request(new)?;
        let req = self.requests.get_mut(&id).expect("just added");
        req.seqs[0].state.apply_remote_prefill(first_token)?;
        Ok(())
    }

    /// Ends a request from outside (client abort, stop string): every block
    /// it holds is freed now. Returns false for an unknown request.
    pub fn finish_request(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let Some(mut req) = self.requests.remove(&id) else { return false };
        match req.status {
            RequestStatus::Waiting => {
                let key = self.queue_key(&req);
                self.waiting.remove(&key);
                self.staging.retain(|r| *r != id);
            }
            RequestStatus::Running => {
                let key = self.queue_key(&req);
                self.running.remove(&key);
            }
            RequestStatus::Swapped => {
                let key = self.queue_key(&req);
                self.swapped.remove(&key);
            }
            RequestStatus::Finished(_) => {}
        }
        for seq in &mut req.seqs {
            self.allocator.free(seq.seq_id);
            if seq.finish_reason.is_none() {
                seq.finish_reason = Some(reason);
            }
        }
        req.status = RequestStatus::Finished(reason);
        self.finished_since_output.push((id, reason));
        self.finished.push(req);
        true
    }

    /// Ends one sequence of a request from outside (a stop string matched
    /// in one of several parallel samples): its blocks are freed now; the
    /// request finishes when no sequence runs. Returns false for an unknown
    /// or finished sequence, or one with a step in flight.
    pub fn finish_sequence(&mut self, id: RequestId, seq_id: SeqId, reason: FinishReason) -> bool {
        let Some(req) = self.requests.get_mut(&id) else { return false };
        if req.seqs.len() == 1 || req.params.beam_search.is_some() {
            return req.seqs[0].seq_id == seq_id && req.params.beam_search.is_none() && self.finish_request(id, reason);
        }
        let Some(seq) = req.seqs.iter_mut().find(|s| s.seq_id == seq_id && s.is_running() && s.num_in_flight_tokens == 0) else {
            return false;
        };
        seq.finish_reason = Some(reason);
        self.allocator.free(seq_id);
        if req.running_seqs().next().is_none() {
            self.finish_request(id, reason);
        }
        true
    }

    /// Client abort.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.finish_request(id, FinishReason::Abort)
    }

    /// Decides the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput { finished_requests: std::mem::take(&mut self.finished_since_output), ..Default::default() };
        let mut step = StepState {
            budget: self.config.max_num_batched_tokens,
            step_id: self.next_step_id,
            preempted: false,
            num_running_seqs: self.running.values().map(|id| self.requests[id].num_seq_slots()).sum(),
        };
        match self.config.policy {
            SchedulingPolicy::Fcfs | SchedulingPolicy::Priority => self.schedule_in_order(&mut step, &mut out),
            SchedulingPolicy::TwoLevel { staging_queue_size } => self.schedule_two_level(staging_queue_size, &mut step, &mut out),
        }
        out.block_ops.copies = self.allocator.take_block_copies();
        self.in_flight.push_back(out.scheduled.clone());
        self.next_step_id += 1;
        out
    }

    /// FCFS and priority (thesis Algorithm 1): running requests in queue
    /// order, then swapped-out groups, then waiting requests.
    fn schedule_in_order(&mut self, step: &mut StepState, out: &mut SchedulerOutput) {
        let order: Vec<RequestId> = self.running.values().copied().collect();
        for i in 0..order.len() {
            if step.budget == 0 {
                break;
            }
            self.schedule_running(order[i], &order, step, out);
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
        let victims: Vec<RequestId> = self.running.values().copied().collect();
        let mut order: Vec<(usize, QueueKey, RequestId)> = self
            .running
            .iter()
            .map(|(key, id)| (self.requests[id].num_schedulable_tokens(), *key, *id))
            .collect();
        order.sort_unstable();
        self.admit_swapped(step, out);
        let staging = self.staging.clone();
        let mut staged: Vec<(usize, RequestId)> = staging.into_iter().map(|id| (self.staged_delta(id), id)).collect();
        let mut ri = 0;
        while step.budget > 0 {
            while ri < order.len() && !self.is_running(order[ri].2) {
                ri += 1; // preempted earlier in this step
            }
            let best_staged = staged.iter().enumerate().min_by_key(|(_, (d, id))| (*d, self.requests[id].arrival_order)).map(|(i, (d, _))| (i, *d));
            let run_next = order.get(ri).map(|(d, _, _)| *d);
            match (run_next, best_staged) {
                (None, None) => break,
                (Some(dr), Some((_, ds))) if dr <= ds => {
                    self.schedule_running(order[ri].2, &victims, step, out);
                    ri += 1;
                }
                (Some(_), None) => {
                    self.schedule_running(order[ri].2, &victims, step, out);
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
    }

    /// Remaining tokens of a staged request after its prefix-cache hit.
    fn staged_delta(&mut self, id: RequestId) -> usize {
        let req = &self.requests[&id];
        let seq = &req.seqs[0];
        let st = SeqTokens {
            seq_id: seq.seq_id,
            token_ids: seq.state.token_ids(),
            num_prompt_tokens: seq.state.num_prompt_tokens(),
            num_computed_tokens: 0,
            hint: req.length_hint(),
        };
        let hit = if req.params.prompt_logprobs.is_some() { 0 } else { self.allocator.get_computed_blocks(&st).num_computed_tokens };
        req.num_schedulable_tokens().saturating_sub(hit)
    }

    /// Brings swapped-out groups back, oldest first, while blocks allow.
    fn admit_swapped(&mut self, step: &mut StepState, out: &mut SchedulerOutput) {
        while !step.preempted {
            let Some((&key, &id)) = self.swapped.first_key_value() else { break };
            let req = &self.requests[&id];
            let n_seqs = req.num_seq_slots();
            if step.num_running_seqs + n_seqs > self.config.max_num_seqs {
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
            self.running.insert(key, id);
            step.num_running_seqs += n_seqs;
            out.resumed_requests.push(id);
            let order = [id];
            self.schedule_running(id, &order, step, out);
        }
    }

    /// Schedules a running request, preempting later arrivals (from the
    /// end of `victims`) while there is no room.
    fn schedule_running(&mut self, id: RequestId, victims: &[RequestId], step: &mut StepState, out: &mut SchedulerOutput) {
        match self.requests.get(&id) {
            Some(r) if r.status == RequestStatus::Running && r.scheduled_step != step.step_id => {}
            _ => return,
        }
        loop {
            match self.try_schedule(id, step, out) {
                Attempt::Scheduled | Attempt::Idle => return,
                Attempt::NoBudget => {
                    self.trim_to_scheduled(id);
                    return;
                }
                Attempt::NoRoom => {
                    let victim = victims.iter().rev().copied().find(|v| {
                        *v != id && self.is_running(*v) && self.requests[v].scheduled_step != step.step_id && !self.requests[v].has_in_flight()
                    });
                    match victim {
                        Some(v) => self.preempt(v, step, out),
                        None => {
                            if !self.requests[&id].has_in_flight() {
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
        let n_seqs = self.requests[&id].num_seq_slots();
        if step.num_running_seqs + n_seqs > self.config.max_num_seqs {
            return Attempt::NoBudget;
        }
        let attempt = self.try_schedule(id, step, out);
        let req = self.requests.get_mut(&id).expect("waiting request is live");
        if matches!(attempt, Attempt::Scheduled) {
            let key = (if self.config.policy == SchedulingPolicy::Priority { req.priority } else { 0 }, req.arrival_order);
            self.waiting.remove(&key);
            req.status = RequestStatus::Running;
            if req.num_preemptions == 0 { out.new_requests.push(id) } else { out.resumed_requests.push(id) }
            self.running.insert(key, id);
            step.num_running_seqs += n_seqs;
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

    /// Gives every running sequence of `id` its Δ, gang style: a group with
    /// several sequences runs all of them in full or not at all.
    fn try_schedule(&mut self, id: RequestId, step: &mut StepState, out: &mut SchedulerOutput) -> Attempt {
        let threshold = self.config.long_prefill_token_threshold;
        let chunked = self.config.enable_chunked_prefill;
        let req = self.requests.get_mut(&id).expect("scheduled request is live");
        if req.has_in_flight() && req.next_sample_reshapes() {
            return Attempt::Idle;
        }
        let hint = req.length_hint();
        // Prompt logprobs need every prompt position computed: no prefix hit.
        let use_prefix_cache = req.params.prompt_logprobs.is_none();
        // Scheduled sequences go straight to the output; a failed attempt
        // truncates them away again.
        let mark = out.scheduled.len();
        let mut budget = step.budget;
        // A sequence recomputing from scratch (after preemption) waits while
        // a sibling is still computing the prompt, so that it then finds the
        // whole prompt in the prefix cache instead of computing a copy.
        let num_prompt = req.num_prompt_tokens();
        let prompt_leader = req.running_seqs().find(|s| s.num_scheduled_tokens() < num_prompt).map(|s| s.seq_id);
        let waits_for_leader = |s: &Sequence| {
            prompt_leader.is_some_and(|l| l != s.seq_id) && s.num_scheduled_tokens() == 0 && s.num_in_flight_tokens == 0
        };
        // Gang scheduling: every sequence of the group with work runs in the
        // same step; each later sequence keeps at least one token of budget.
        let mut seqs_left = req
            .seqs
            .iter()
            .filter(|s| s.is_running() && s.num_schedulable_tokens() > 0 && !waits_for_leader(s))
            .count();
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
                self.allocator.get_computed_blocks(&SeqTokens {
                    seq_id: seq.seq_id,
                    token_ids: seq.state.token_ids(),
                    num_prompt_tokens: seq.state.num_prompt_tokens(),
                    num_computed_tokens: 0,
                    hint,
                })
            } else {
                ComputedBlocks::default()
            };
            let hit = computed.num_computed_tokens;
            // This step's new tokens start after what is computed, in flight
            // or found in the prefix cache.
            let start = seq.num_scheduled_tokens() + hit;
            let remaining = seq.num_schedulable_tokens() - hit;
            if remaining == 0 {
                continue;
            }
            seqs_left = seqs_left.saturating_sub(1);
            let mut delta = remaining.min(budget - seqs_left);
            if threshold > 0 {
                delta = delta.min(threshold);
            }
            if delta == 0 || (delta < remaining && !chunked) {
                out.scheduled.truncate(mark);
                return Attempt::NoBudget;
            }
            // A sequence holding nothing gets slots from its prefix hit on; one
            // computed elsewhere (remote prefill) also for the KV it loads.
            let alloc_from = if holds_nothing { hit } else { start };
            let st = SeqTokens {
                seq_id: seq.seq_id,
                token_ids: seq.state.token_ids(),
                num_prompt_tokens: seq.state.num_prompt_tokens(),
                num_computed_tokens: alloc_from,
                hint,
            };
            let Some(slots) = self.allocator.allocate_slots(&st, start + delta - alloc_from, computed) else {
                out.scheduled.truncate(mark);
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
            });
            budget -= delta;
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
        req.scheduled_step = step.step_id;
        Attempt::Scheduled
    }

    /// Gives back slots reserved by an attempt that did not schedule `id`.
    fn trim_to_scheduled(&mut self, id: RequestId) {
        for s in self.requests[&id].running_seqs() {
            self.allocator.trim(s.seq_id, s.num_scheduled_tokens());
        }
    }

    /// Preempts a whole group: by swapping if configured and the host pool
    /// has room, else by recompute.
    fn preempt(&mut self, id: RequestId, step: &mut StepState, out: &mut SchedulerOutput) {
        self.trim_to_scheduled(id);
        let req = self.requests.get_mut(&id).expect("preempted request is live");
        let seq_ids: Vec<SeqId> = req.running_seqs().map(|s| s.seq_id).collect();
        let swaps = match self.config.preemption_mode {
            PreemptionMode::Swap => self.allocator.swap_out(&seq_ids),
            PreemptionMode::Recompute => None,
        };
        let key = (if self.config.policy == SchedulingPolicy::Priority { req.priority } else { 0 }, req.arrival_order);
        self.running.remove(&key);
        step.num_running_seqs -= req.num_seq_slots();
        step.preempted = true;
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        out.preempted_requests.push(id);
        for s in &mut req.seqs {
            s.num_synced_blocks = 0;
        }
        match swaps {
            Some(swaps) => {
                out.block_ops.swap_out.extend(swaps);
                req.status = RequestStatus::Swapped;
                self.swapped.insert(key, id);
            }
            None => {
                for s in &mut req.seqs {
                    self.allocator.free(s.seq_id);
                    s.state.preempt();
                }
                req.status = RequestStatus::Waiting;
                self.waiting.insert(key, id);
            }
        }
    }

    /// Applies the oldest in-flight step: `num_computed_tokens += Δ` for
    /// every scheduled sequence, then the sampled tokens (appends, forks,
    /// frees), then the stop conditions. Every sequence scheduled with
    /// `samples: true` must receive a token (or, in a beam search, be left
    /// out to be dropped).
    pub fn update_from_output(&mut self, samples: &StepSamples) {
        let scheduled = self.in_flight.pop_front().expect("update_from_output without a scheduled step");
        for s in &scheduled {
            let Some(req) = self.requests.get_mut(&s.request_id) else { continue };
            let Some(seq) = req.seqs.iter_mut().find(|q| q.seq_id == s.seq_id) else { continue };
            seq.num_in_flight_tokens -= s.num_scheduled_tokens;
            seq.num_in_flight_samples -= s.samples as usize;
            if seq.state.num_draft_tokens() > 0 && s.samples {
                continue; // verified with its samples in apply_samples
            }
            seq.state.advance(s.num_scheduled_tokens).expect("scheduled Δ fits the sequence");
        }
        for rs in &samples.requests {
            self.apply_samples(rs);
        }
    }

    fn apply_samples(&mut self, rs: &RequestSamples) {
        let Some(req) = self.requests.get_mut(&rs.request_id) else { return };
        let is_beam = req.params.beam_search.is_some();
        // Fast path: one token for a request whose set of sequences stays.
        if let [(seq_id, token)] = rs.next[..] {
            if !is_beam && !req.next_sample_reshapes() {
                if let Some(reason) = append_token(req, &mut self.allocator, seq_id, token, rs.num_rejected_drafts) {
                    self.finish_request(rs.request_id, reason);
                }
                return;
            }
        }
        // 1. Pair each entry with the sequence that takes its token: the
        //    parent for its first entry, a fork of it for every later one
        //    (forked from the parent's state before this token).
        let mut parents: IdSet<SeqId> = IdSet::default();
        let mut appends: Vec<(SeqId, TokenId, bool)> = Vec::with_capacity(rs.next.len());
        let mut children: Vec<Sequence> = Vec::new();
        for &(parent, token) in &rs.next {
            let Some(p) = req.seqs.iter().find(|s| s.seq_id == parent && s.is_running()) else { continue };
            if parents.insert(parent) {
                appends.push((parent, token, false));
                continue;
            }
            self.next_seq_id += 1;
            let child_id = SeqId(self.next_seq_id - 1);
            // A contiguous allocator may have no room to copy: the child then
            // recomputes its KV when next scheduled.
            let shares_blocks = self.allocator.fork(parent, child_id);
            children.push(Sequence::new(child_id, p.state.clone()));
            appends.push((child_id, token, !shares_blocks));
        }
        req.seqs.extend(children);
        req.forked = true;
        // 2. Beam search: candidates that no entry extends are dropped.
        if is_beam && !parents.is_empty() {
            let keep = |s: &Sequence| !s.is_running() || appends.iter().any(|a| a.0 == s.seq_id);
            for s in req.seqs.iter().filter(|s| !keep(s)) {
                self.allocator.free(s.seq_id);
            }
            req.seqs.retain(keep);
        }
        // 3. Append; check the stop conditions.
        for (seq_id, token, recompute) in appends {
            append_token(req, &mut self.allocator, seq_id, token, rs.num_rejected_drafts);
            if recompute {
                if let Some(seq) = req.seqs.iter_mut().find(|s| s.seq_id == seq_id && s.is_running()) {
                    seq.state.preempt();
                }
            }
        }
        if is_beam && rs.next.is_empty() {
            for s in req.seqs.iter_mut().filter(|s| s.is_running()) {
                s.finish_reason = Some(FinishReason::Stop);
                self.allocator.free(s.seq_id);
            }
        }
        if req.running_seqs().next().is_none() {
            let reason = req.seqs.iter().rev().find_map(|s| s.finish_reason).unwrap_or(FinishReason::Stop);
            let id = req.request_id;
            self.finish_request(id, reason);
        }
    }

    /// Checks the scheduler's invariants; panics with a message on a breach.
    ///
    /// * every running sequence holds exactly the blocks its counters imply:
    ///   `ceil(num_scheduled_tokens / block_size)` (or is a fork child that
    ///   will recompute), and waiting requests hold none;
    /// * queues are disjoint and cover every live request.
    pub fn assert_invariants(&self) {
        let bs = self.allocator.block_size();
        let mut seen = 0;
        for (id, req) in &self.requests {
            match req.status {
                RequestStatus::Running => {
                    assert_eq!(self.running.get(&self.queue_key(req)), Some(id), "{id} running but not in the running queue");
                    for s in req.running_seqs() {
                        let held = self.allocator.block_table(s.seq_id).map_or(0, |t| t.len());
                        let implied = s.num_scheduled_tokens().div_ceil(bs);
                        assert!(
                            held == implied || (s.num_scheduled_tokens() == 0 && held == 0),
                            "{id}/{}: holds {held} blocks but its counters imply {implied}",
                            s.seq_id
                        );
                    }
                }
                RequestStatus::Waiting => {
                    let key = self.queue_key(req);
                    assert!(self.waiting.get(&key) == Some(id) || self.staging.contains(id), "{id} waiting but queued nowhere");
                    for s in &req.seqs {
                        assert!(self.allocator.block_table(s.seq_id).is_none(), "{id} waits but holds blocks");
                        assert_eq!(s.state.num_computed_tokens(), 0, "{id} waits with computed tokens");
                    }
                }
                RequestStatus::Swapped => {
                    assert!(self.swapped.values().any(|r| r == id), "{id} swapped but not queued");
                }
                RequestStatus::Finished(_) => panic!("{id} finished but still live"),
            }
            seen += 1;
        }
        assert_eq!(seen, self.running.len() + self.waiting.len() + self.staging.len() + self.swapped.len(), "queues do not cover the live requests exactly");
    }
}

/// Appends a sampled token to one sequence of `req` (verifying drafts under
/// speculative decoding) and applies the stop conditions; a stopped sequence
/// frees its blocks. Returns the reason when the whole request is done (a
/// beam search ends only when the engine says so).
fn append_token<A: BlockAllocator>(
    req: &mut Request,
    allocator: &mut A,
    seq_id: SeqId,
    token: TokenId,
    num_rejected_drafts: usize,
) -> Option<FinishReason> {
    let seq = req.seqs.iter_mut().find(|s| s.seq_id == seq_id && s.is_running())?;
    if seq.state.num_draft_tokens() > 0 {
        let delta = seq.state.num_remaining_tokens();
        seq.state.apply_speculative_result(delta, num_rejected_drafts, token).expect("rejections within the drafts");
        allocator.trim(seq_id, seq.state.num_computed_tokens());
    } else {
        seq.state.append_output_token(token).expect("a sampled sequence is caught up");
    }
    let n_out = seq.state.num_output_tokens();
    let params = &req.params;
    let stop_token = (!params.ignore_eos && req.eos_token_ids.contains(&token)) || params.stop_token_ids.contains(&token);
    let reason = if stop_token && n_out >= params.min_tokens {
        FinishReason::Stop
    } else if seq.state.num_total_tokens() >= req.max_total_tokens {
        FinishReason::Length
    } else {
        return None;
    };
    seq.finish_reason = Some(reason);
    allocator.free(seq_id);
    (req.params.beam_search.is_none() && req.running_seqs().next().is_none()).then_some(reason)
}

/// Per-step bookkeeping of `schedule()`.
struct StepState {
    budget: usize,
    step_id: u64,
    preempted: bool,
    num_running_seqs: usize,
}
