//! A request (sequence group): one prompt, one or more sequences.
//!
//! A request starts with a single sequence. When its prompt is done, parallel
//! sampling (`n > 1`) forks it into `n` sequences that share the prompt's
//! blocks; a beam search forks and frees candidates every step (paper §4.4).
//! The group is scheduled and preempted as one unit.

use smallvec::SmallVec;
use vellum_base::{LengthHint, RequestId, RequestState, SamplingParams, SeqId, SeqTokens, TokenId};

/// Why a sequence or request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's length limit.
    Length,
    /// Aborted by the client (or a disconnect).
    Abort,
}

impl FinishReason {
    /// Every reason, in the order of [`FinishReason::index`].
    pub const ALL: [FinishReason; 3] = [FinishReason::Stop, FinishReason::Length, FinishReason::Abort];

    /// Position in [`FinishReason::ALL`] (for per-reason counters).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The OpenAI / vLLM spelling (the one spelling, everywhere).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Where a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// Queued, holding no KV blocks (new, or preempted by recompute).
    Waiting,
    /// Holding KV blocks on the device.
    Running,
    /// Its blocks are in the host pool.
    Swapped,
    /// Done.
    Finished(FinishReason),
}

/// One sequence of a request.
#[derive(Clone, Debug)]
pub struct Sequence {
    /// Its id (block tables are per sequence).
    pub seq_id: SeqId,
    /// Tokens and the two counters.
    pub state: RequestState,
    /// `Some` once it stopped.
    pub finish_reason: Option<FinishReason>,
    /// Tokens scheduled in steps whose output has not arrived yet.
    pub(crate) num_in_flight_tokens: usize,
    /// Samples expected from those steps.
    pub(crate) num_in_flight_samples: usize,
    /// Leading block-table entries the executor already has.
    pub(crate) num_synced_blocks: usize,
}

impl Sequence {
    pub(crate) fn new(seq_id: SeqId, state: RequestState) -> Self {
        Self { seq_id, state, finish_reason: None, num_in_flight_tokens: 0, num_in_flight_samples: 0, num_synced_blocks: 0 }
    }

    /// `num_computed_tokens` counting steps in flight.
    pub fn num_scheduled_tokens(&self) -> usize {
        self.state.num_computed_tokens() + self.num_in_flight_tokens
    }

    /// `num_total_tokens` counting samples in flight.
    pub fn num_expected_tokens(&self) -> usize {
        self.state.num_total_tokens() + self.num_in_flight_samples
    }

    /// Tokens the next step may compute.
    pub fn num_schedulable_tokens(&self) -> usize {
        self.num_expected_tokens() - self.num_scheduled_tokens()
    }

    /// What the allocator reads of it for slots after `num_computed_tokens`:
    /// its verified tokens (drafts get slots but no prefix-cache
    /// registration: a block joins the cache once every token in it is
    /// verified).
    pub(crate) fn tokens_for_allocator(&self, num_computed_tokens: usize, hint: LengthHint) -> SeqTokens<'_> {
        SeqTokens {
            seq_id: self.seq_id,
            token_ids: self.state.verified_token_ids(),
            num_prompt_tokens: self.state.num_prompt_tokens(),
            num_computed_tokens,
            hint,
        }
    }

    /// Withdraws its drafts unverified (a step without the budget or the
    /// room for them); returns the tokens the next step may compute now.
    pub(crate) fn drop_draft_tokens(&mut self) -> usize {
        self.state.drop_draft_tokens();
        self.num_schedulable_tokens()
    }

    /// Still generating.
    pub fn is_running(&self) -> bool {
        self.finish_reason.is_none()
    }
}

/// A request as the scheduler holds it.
///
/// Laid out in this order (`repr(C)`) so that what a decode step reads
/// (status, counters, the inline first sequence, the hot parameters) lies
/// together in its first three cache lines and the rest after them.
#[derive(Clone, Debug)]
#[repr(C)]
pub struct Request {
    /// Where it is.
    pub status: RequestStatus,
    /// Parallel samples / beams were forked off the first sequence.
    pub(crate) forked: bool,
    /// The last `schedule()` call that gave it tokens.
    pub(crate) scheduled_step: u64,
    /// Longest total length a sequence may reach.
    pub(crate) max_total_tokens: usize,
    /// Its sequences (one until the prompt is done). The first is stored
    /// inline: a decode step reads the request and its sequence from the
    /// same few cache lines.
    pub seqs: SmallVec<[Sequence; 1]>,
    /// What a step needs from `params`, copied on entry so that a decode
    /// step never reads the boxed parameters (cache lines a request fewer,
    /// twice a step, at 1,000 running requests: docs/benchmarks.md).
    pub(crate) hot: HotParams,
    /// Its id.
    pub request_id: RequestId,
    /// What the caller asked for.
    pub params: Box<SamplingParams>,
    /// Lower runs first under the priority policy.
    pub priority: i64,
    /// Arrival time in seconds (for metrics).
    pub arrival_time: f64,
    /// Arrival order: FCFS ties and "latest arrival is preempted first".
    pub(crate) arrival_order: u64,
    /// Tokens that end a sequence unless `ignore_eos`.
    pub eos_token_ids: Vec<TokenId>,
    /// Times it was preempted.
    pub num_preemptions: u32,
    /// The true eventual length, known only to a simulator.
    pub true_total_tokens: Option<usize>,
}

/// The parts of [`SamplingParams`] (and the model's EOS tokens) that every
/// step reads.
#[derive(Clone, Debug)]
pub(crate) struct HotParams {
    /// A beam search.
    pub(crate) is_beam: bool,
    /// `n` (or the beam width).
    pub(crate) num_sequences: usize,
    /// Every prompt position is computed (no prefix-cache hit): prompt
    /// logprobs asked for, or a pooling that reads every position.
    pub(crate) computes_whole_prompt: bool,
    /// Tokens that end a sequence: EOS unless `ignore_eos`, and the stop
    /// token ids.
    pub(crate) stop_token_ids: SmallVec<[TokenId; 2]>,
    /// No stop token ends a sequence before this many outputs.
    pub(crate) min_tokens: usize,
}

impl HotParams {
    pub(crate) fn new(params: &SamplingParams, eos_token_ids: &[TokenId]) -> Self {
        let eos = if params.ignore_eos { &[][..] } else { eos_token_ids };
        Self {
            is_beam: params.beam_search.is_some(),
            num_sequences: params.num_sequences(),
            computes_whole_prompt: params.prompt_logprobs.is_some() || params.pooling.is_some_and(|p| p.pooling_type.needs_whole_prompt()),
            stop_token_ids: eos.iter().chain(&params.stop_token_ids).copied().collect(),
            min_tokens: params.min_tokens,
        }
    }
}

impl Request {
    /// Prompt length.
    pub fn num_prompt_tokens(&self) -> usize {
        self.seqs[0].state.num_prompt_tokens()
    }

    /// Sequences still generating.
    pub fn running_seqs(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.iter().filter(|s| s.is_running())
    }

    /// Sequences it may run at once: `n` (or the beam width) before it
    /// forks, its running sequences after. Counted against `max_num_seqs`.
    pub fn num_seq_slots(&self) -> usize {
        if self.forked {
            self.running_seqs().count()
        } else {
            self.hot.num_sequences
        }
    }

    /// Tokens the next step may compute, over all running sequences.
    pub fn num_schedulable_tokens(&self) -> usize {
        self.running_seqs().map(Sequence::num_schedulable_tokens).sum()
    }

    /// What the allocator may know about its length.
    pub(crate) fn length_hint(&self) -> LengthHint {
        LengthHint { max_total_tokens: self.max_total_tokens, true_total_tokens: self.true_total_tokens }
    }

    /// Whether any step of it is in flight.
    pub(crate) fn has_in_flight(&self) -> bool {
        self.seqs.iter().any(|s| s.num_in_flight_tokens > 0)
    }

    /// The next sample changes the set of sequences (first sample of a
    /// parallel-sampling request, or any beam-search step): the next step
    /// cannot be decided before it arrives.
    pub(crate) fn next_sample_reshapes(&self) -> bool {
        self.hot.is_beam || (!self.forked && self.hot.num_sequences > 1)
    }
}
