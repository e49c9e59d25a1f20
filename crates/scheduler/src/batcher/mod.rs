//! The scheduler (the continuous batcher): which sequences run in the next step, and how many tokens
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
//!
//! The code: this file holds the state and the requests' life cycle;
//! [`policies`] decides a step (`schedule()`), [`preemption`] takes a
//! group's blocks away, [`update`] applies a step's samples.

mod policies;
mod preemption;
mod running;
mod update;

use crate::error::Error;
use crate::scheduler_output::ScheduledSeq;
use crate::sequence_group::{FinishReason, HotParams, Request, RequestStatus, Sequence};
use running::RunningQueue;
use std::collections::{BTreeMap, VecDeque};
use vellum_base::{BlockAllocator, IdSlab, RequestId, RequestState, SamplingParams, SchedulerConfig, SchedulingPolicy, SeqId, TokenId};

/// Queue order: (priority under the priority policy, else 0; arrival order).
pub(crate) type QueueKey = (i64, u64);

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
        Self { request_id, prompt_token_ids, params, eos_token_ids: Vec::new(), priority: 0, arrival_time: 0.0, true_total_tokens: None }
    }
}

/// Continuous-batching scheduler over any [`BlockAllocator`].
pub struct Scheduler<A: BlockAllocator> {
    config: SchedulerConfig,
    allocator: A,
    requests: IdSlab<RequestId, Request>,
    waiting: BTreeMap<QueueKey, RequestId>,
    staging: Vec<RequestId>,
    /// Running requests in queue order, with their slots in `requests`.
    running: RunningQueue,
    swapped: BTreeMap<QueueKey, RequestId>,
    finished: Vec<Request>,
    /// Whether finished requests are kept for `take_finished_requests`.
    keep_finished: bool,
    finished_since_output: Vec<(RequestId, FinishReason)>,
    /// Steps in flight: each scheduled sequence with its request's slot.
    in_flight: VecDeque<Vec<(ScheduledSeq, u32)>>,
    /// Buffers of applied steps, reused for the next in-flight records.
    spare_records: Vec<Vec<(ScheduledSeq, u32)>>,
    /// The request slot of each entry of the step's `scheduled` list.
    step_slots: Vec<u32>,
    /// Per-step scratch space, kept to reuse its allocation.
    scratch_order: Vec<(usize, QueueKey, u32)>,
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
            requests: IdSlab::default(),
            waiting: BTreeMap::new(),
            staging: Vec::new(),
            running: RunningQueue::default(),
            swapped: BTreeMap::new(),
            finished: Vec::new(),
            keep_finished: true,
            finished_since_output: Vec::new(),
            in_flight: VecDeque::new(),
            spare_records: Vec::new(),
            step_slots: Vec::new(),
            scratch_order: Vec::new(),
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

    /// Whether finished requests are kept for
    /// [`Scheduler::take_finished_requests`] (the default). An engine that
    /// keeps its own view of sequences from [`crate::StepUpdate`]s turns it
    /// off, and finished requests are dropped at once.
    pub fn keep_finished_requests(&mut self, keep: bool) {
        self.keep_finished = keep;
        if !keep {
            self.finished.clear();
        }
    }

    /// Whether `id` is queued or running (not finished, not unknown).
    pub fn has_request(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    fn queue_key(&self, req: &Request) -> QueueKey {
        let prio = if self.config.policy == SchedulingPolicy::Priority { req.priority } else { 0 };
        (prio, req.arrival_order)
    }

    /// The request whose record lies in `slot` (named by a running-queue
    /// entry, or just looked up): an index into the slab, no hash probe.
    fn request_at(&self, slot: u32) -> &Request {
        self.requests.get_slot(slot).expect("the slot of a live request").1
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq_id += 1;
        SeqId(self.next_seq_id - 1)
    }

    /// Queues a request after checking it: valid parameters, a non-empty
    /// prompt, prompt plus `max_tokens` (a pooling request: its prompt)
    /// within `max_model_len`, and one
    /// sequence at its longest within the KV cache. Returns the id of the
    /// request's first sequence.
    pub fn add_request(&mut self, new: NewRequest) -> Result<SeqId, Error> {
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
        // A pooling request ends with its prompt: its output slot is never
        // computed, so the prompt alone may fill the context.
        let counted = if new.params.pooling.is_some() { num_prompt } else { num_prompt + max_tokens };
        if counted > max_len {
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
        // every sequence's own tail (with a sliding window: each sequence
        // its own window, nothing shared for sure).
        let (bs, groups) = (self.allocator.block_size(), self.allocator.num_kv_groups());
        let per_seq = self.allocator.max_blocks_held(max_total_tokens, self.config.max_num_batched_tokens);
        let shared = if per_seq < groups * max_total_tokens.div_ceil(bs) { 0 } else { groups * (num_prompt / bs) };
        let needed_blocks = per_seq + (new.params.num_sequences() - 1) * (per_seq - shared);
        if needed_blocks > self.allocator.num_blocks() {
            return Err(Error::ExceedsKvCapacity { request_id: id, needed_blocks, num_blocks: self.allocator.num_blocks() });
        }
        let seq_id = self.new_seq_id();
        let req = Request {
            request_id: id,
            hot: HotParams::new(&new.params, &new.eos_token_ids),
            params: Box::new(new.params),
            priority: new.priority,
            arrival_time: new.arrival_time,
            arrival_order: self.next_arrival,
            eos_token_ids: new.eos_token_ids,
            seqs: smallvec::smallvec![Sequence::new(seq_id, RequestState::new(new.prompt_token_ids))],
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
        Ok(seq_id)
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
    /// [`crate::RequestSamples::num_rejected_drafts`].
    ///
    /// At most [`Scheduler::max_draft_tokens`] drafts are accepted.
    pub fn add_draft_tokens(&mut self, id: RequestId, drafts: &[TokenId]) -> Result<(), Error> {
        let most = self.max_draft_tokens(id);
        let req = self.requests.get_mut(&id).ok_or(Error::UnknownRequest(id))?;
        if most == 0 || drafts.len() > most {
            return Err(Error::InvalidParams(vellum_base::Error::InvalidTransition(format!(
                "{} drafts for a request that takes {most} now (a running single sequence in decode, no step in flight, \
                 drafts within its length limit)",
                drafts.len()
            ))));
        }
        req.seqs[0].state.add_draft_tokens(drafts)?;
        Ok(())
    }

    /// How many drafts request `id` can take now: 0 unless it runs a single
    /// sequence in decode (nothing in flight, one token to compute, none
    /// pending); else as many as keep the accepted drafts and the token
    /// after them within its length limit.
    pub fn max_draft_tokens(&self, id: RequestId) -> usize {
        let Some(req) = self.requests.get(&id) else { return 0 };
        let [seq] = &req.seqs[..] else { return 0 };
        let s = &seq.state;
        if req.status != RequestStatus::Running
            || !seq.is_running()
            || req.has_in_flight()
            || s.num_draft_tokens() > 0
            || s.num_computed_tokens() == 0
            || s.num_remaining_tokens() != 1
        {
            return 0;
        }
        // A verification runs whole in one step: within the step's budget
        // and the per-request chunk limit.
        let mut most = req.max_total_tokens.saturating_sub(s.num_total_tokens() + 1).min(self.config.max_num_batched_tokens - 1);
        if self.config.long_prefill_token_threshold > 0 {
            most = most.min(self.config.long_prefill_token_threshold - 1);
        }
        most
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
        if self.keep_finished {
            self.finished.push(req);
        }
        true
    }

    /// Ends one sequence of a request from outside (a stop string matched
    /// in one of several parallel samples): its blocks are freed now; the
    /// request finishes when no sequence runs. Returns false for an unknown
    /// or finished sequence. A step in flight may still write the freed
    /// blocks: steps run in order, so whatever reuses them runs after it,
    /// and its update skips the ended sequence (as for an abort).
    pub fn finish_sequence(&mut self, id: RequestId, seq_id: SeqId, reason: FinishReason) -> bool {
        let Some(req) = self.requests.get_mut(&id) else { return false };
        if req.seqs.len() == 1 || req.hot.is_beam {
            return req.seqs[0].seq_id == seq_id && !req.hot.is_beam && self.finish_request(id, reason);
        }
        let Some(seq) = req.seqs.iter_mut().find(|s| s.seq_id == seq_id && s.is_running()) else {
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

    /// Checks the scheduler's invariants; panics with a message on a breach.
    ///
    /// * every running sequence holds exactly the blocks its counters imply:
    ///   `G · ceil(num_scheduled_tokens / block_size)` (or is a fork child that
    ///   will recompute), and waiting requests hold none;
    /// * queues are disjoint and cover every live request.
    pub fn assert_invariants(&self) {
        let (bs, groups) = (self.allocator.block_size(), self.allocator.num_kv_groups());
        let mut seen = 0;
        for (id, req) in &self.requests {
            match req.status {
                RequestStatus::Running => {
                    assert_eq!(self.running.get(&self.queue_key(req)), Some(*id), "{id} running but not in the running queue");
                    let slot = self.running.iter().find(|e| e.2 == *id).map(|e| e.1);
                    assert_eq!(slot, self.requests.slot_of(id), "{id}: the running queue names another slot");
                    for s in req.running_seqs() {
                        let held = self.allocator.block_table(s.seq_id).map_or(0, |t| t.len());
                        let implied = groups * s.num_scheduled_tokens().div_ceil(bs);
                        assert!(
                            held == implied || (s.num_scheduled_tokens() == 0 && held == 0),
                            "{id}/{}: holds {held} blocks but its counters imply {implied} ({} computed, {} in flight, {} total, {} samples in flight)",
                            s.seq_id,
                            s.state.num_computed_tokens(),
                            s.num_in_flight_tokens,
                            s.state.num_total_tokens(),
                            s.num_in_flight_samples
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
        assert_eq!(
            seen,
            self.running.len() + self.waiting.len() + self.staging.len() + self.swapped.len(),
            "queues do not cover the live requests exactly"
        );
    }
}
