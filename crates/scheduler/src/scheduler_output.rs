//! What one `schedule()` call decides, and what the engine feeds back.

use crate::sequence_group::FinishReason;
use vellum_base::{BlockId, BlockOps, RequestId, SeqId, TokenId};

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The request.
    pub request_id: RequestId,
    /// The sequence.
    pub seq_id: SeqId,
    /// Δ: tokens computed this step.
    pub num_scheduled_tokens: usize,
    /// Tokens already computed before this step (counting steps in flight).
    pub num_computed_tokens: usize,
    /// Whether the step ends at the sequence's last token, so its logits
    /// are sampled.
    pub samples: bool,
    /// Speculative decoding: the draft tokens this step verifies (the last
    /// of its tokens). Each of the `1 + num_draft_tokens` last positions is
    /// sampled: position `i` checks draft `i`, the last one gives the token
    /// after every draft. 0 for a step without drafts.
    pub num_draft_tokens: usize,
}

/// Block-table entries from `start` on that changed since the last step
/// (thesis §4.6.2: only the delta travels to the executor).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockTableUpdate {
    /// The sequence.
    pub seq_id: SeqId,
    /// Index of the first entry replaced.
    pub start: usize,
    /// The entries from `start` to the table's end.
    pub block_ids: Vec<BlockId>,
}

/// The scheduling decision of one step (thesis Listing 4.3).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Sequences to run and how many tokens each.
    pub scheduled: Vec<ScheduledSeq>,
    /// Requests scheduled for the first time.
    pub new_requests: Vec<RequestId>,
    /// Requests scheduled again after a preemption.
    pub resumed_requests: Vec<RequestId>,
    /// Requests preempted in this step.
    pub preempted_requests: Vec<RequestId>,
    /// Requests that ended since the previous output (stops, aborts).
    pub finished_requests: Vec<(RequestId, FinishReason)>,
    /// Changed block-table entries.
    pub block_table_updates: Vec<BlockTableUpdate>,
    /// Swaps and copies to apply before the forward pass.
    pub block_ops: BlockOps,
}

impl SchedulerOutput {
    /// Tokens computed in this step.
    pub fn num_scheduled_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.num_scheduled_tokens).sum()
    }

    /// Distinct requests in the batch.
    pub fn num_scheduled_requests(&self) -> usize {
        let mut ids: Vec<RequestId> = self.scheduled.iter().map(|s| s.request_id).collect();
        ids.dedup();
        ids.len()
    }

    /// True when nothing runs.
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }

    /// True when the executor has nothing to do either: no sequence runs,
    /// no block moves (a step that only preempts swaps its victims out),
    /// and no block table changed (an attempt that found no room may have
    /// given a sequence a copy-on-write block already).
    pub fn is_idle(&self) -> bool {
        self.scheduled.is_empty() && self.block_ops.is_empty() && self.block_table_updates.is_empty()
    }
}

/// Sampled tokens of one request in one step.
///
/// `next` lists the sequences after the step as (parent, token) pairs:
/// * a decode: `[(seq, token)]`, one entry per running sequence;
/// * the first sample of a parallel-sampling request: `n` entries with the
///   same parent — the first continues it, the others fork from it;
/// * a beam-search step: the surviving candidates; a parent may appear
///   several times (fork) or not at all (that beam is freed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSamples {
    /// The request.
    pub request_id: RequestId,
    /// (parent sequence, sampled token). Under speculative decoding the token
    /// is the target model's own token after the accepted drafts.
    pub next: Vec<(SeqId, TokenId)>,
    /// Speculative decoding: drafts rejected by the verification step.
    pub num_rejected_drafts: usize,
}

impl RequestSamples {
    /// One token for each listed sequence.
    pub fn tokens(request_id: RequestId, next: Vec<(SeqId, TokenId)>) -> Self {
        Self { request_id, next, num_rejected_drafts: 0 }
    }
}

/// Everything sampled in one step, for `update_from_output`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepSamples {
    /// Per request that sampled.
    pub requests: Vec<RequestSamples>,
}

/// A sequence forked for one entry of [`RequestSamples::next`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqFork {
    /// The request.
    pub request_id: RequestId,
    /// Index of the entry in `next` whose token the fork took.
    pub entry: usize,
    /// The sequence it was forked from (its state before this step's token).
    pub parent: SeqId,
    /// The new sequence.
    pub child: SeqId,
}

/// What [`crate::Scheduler::update_from_output`] changed, so that an engine
/// can keep its own view of every sequence from these diffs instead of
/// reading the scheduler's requests.
///
/// Every entry `(parent, token)` of a [`RequestSamples::next`] appended its
/// token to `parent` itself (its first entry), to a fork listed in
/// [`StepUpdate::forks`] (its later entries), or to nothing when listed in
/// [`StepUpdate::skipped`] (the parent had stopped).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepUpdate {
    /// New sequences: parallel samples' first draws, beam candidates.
    pub forks: Vec<SeqFork>,
    /// `(request, entry)` whose token no sequence took.
    pub skipped: Vec<(RequestId, usize)>,
    /// Sequences that stopped: EOS or a stop token, a length limit, the end
    /// of a beam search.
    pub finished_seqs: Vec<(RequestId, SeqId, FinishReason)>,
    /// Beam candidates no entry extended: freed, with no output.
    pub dropped_seqs: Vec<(RequestId, SeqId)>,
    /// Requests that ended (also reported by the next `schedule()`).
    pub finished_requests: Vec<(RequestId, FinishReason)>,
}
