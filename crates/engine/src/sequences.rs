//! The engine's own view of every request and sequence, kept from what it
//! adds, what it samples and the scheduler's [`StepUpdate`] diffs — never
//! read out of the scheduler's request objects.
//!
//! ```text
//!  add_request ──▶ ReqView + the first SeqView (prompt)
//!  sample      ──▶ one Draw per entry of RequestSamples::next
//!  StepUpdate  ──▶ entry e took its token on its parent, on the fork made
//!                  for e (a clone of the parent before the step), or nowhere;
//!                  stopped / dropped sequences, finished requests
//! ```

use crate::outputs::{beam_score, PromptLogprob, RequestOutput, SequenceDelta, SequenceOutput};
use crate::sampler::PenaltyHistory;
use crate::structured::Constraint;
use std::time::Instant;
use vellum_base::{IdMap, Pooler, RequestId, SamplingParams, SeededRng, SeqId, TokenId};
use vellum_scheduler::{FinishReason, StepSamples, StepUpdate};

/// One sequence as the engine sees it.
#[derive(Clone, Debug)]
pub(crate) struct SeqView {
    /// Place among the request's outputs (draw order for parallel samples).
    pub index: usize,
    /// Prompt then output tokens.
    pub tokens: Vec<TokenId>,
    pub num_prompt: usize,
    pub logprobs: Vec<Vec<(TokenId, f32)>>,
    pub token_logprobs: Vec<f32>,
    pub cumulative: f64,
    /// Output tokens already reported in deltas.
    pub reported: usize,
    pub finish_reason: Option<FinishReason>,
    /// Its structured-output constraint, advanced with every token.
    pub constraint: Option<Constraint>,
    /// Speculative decoding: drafts added for the next step to verify (not
    /// in `tokens` until accepted).
    pub drafts: Vec<TokenId>,
    /// A parallel request's sequence, once its first draw forked it: a
    /// generator of its own ([`sequence_rng`]), so that what it draws does
    /// not depend on which steps its siblings run in (preemption, the step
    /// budget, asynchronous scheduling). `None`: the request's generator.
    pub rng: Option<SeededRng>,
    /// What its penalties read, for a request with penalties (device
    /// sampling builds each step's entries from it).
    pub penalties: Option<PenaltyHistory>,
}

/// The generator of output `index` of a parallel request seeded with
/// `seed`: a stream of its own per index.
pub(crate) fn sequence_rng(seed: u64, index: usize) -> SeededRng {
    SeededRng::new(seed ^ (index as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03))
}

impl SeqView {
    pub fn prompt(&self) -> &[TokenId] {
        &self.tokens[..self.num_prompt]
    }

    pub fn output(&self) -> &[TokenId] {
        &self.tokens[self.num_prompt..]
    }

    fn push(&mut self, d: &Draw) {
        if let Some(c) = &mut self.constraint {
            c.commit(d.token);
        }
        self.tokens.push(d.token);
        if let Some(h) = &mut self.penalties {
            h.push(d.token);
        }
        self.cumulative += d.logprob as f64;
        self.token_logprobs.push(d.logprob);
        self.logprobs.extend(d.top.clone());
    }

    /// The new output tokens since the last delta (and marks them reported).
    fn take_delta(&mut self, request_id: RequestId) -> Option<SequenceDelta> {
        let from = self.reported;
        let out = self.output();
        if from >= out.len() {
            return None;
        }
        let d = SequenceDelta {
            request_id,
            index: self.index,
            token_ids: out[from..].to_vec(),
            logprobs: self.logprobs.get(from..).map(<[_]>::to_vec).unwrap_or_default(),
            token_logprobs: self.token_logprobs.get(from..).map(<[_]>::to_vec).unwrap_or_default(),
        };
        self.reported = out.len();
        Some(d)
    }
}

/// One request as the engine sees it.
pub(crate) struct ReqView {
    pub params: SamplingParams,
    pub rng: SeededRng,
    /// The seed `rng` started from (its sequences' generators derive from it).
    pub seed: u64,
    /// Tokens that end a sequence (EOS unless `ignore_eos`, stop token ids).
    pub stop_token_ids: Vec<TokenId>,
    /// Its sequences, oldest first (beam candidates come and go).
    pub seqs: Vec<SeqId>,
    /// The first sample reshaped it (parallel samples drawn, beams begun).
    pub forked: bool,
    /// Per prompt position; filled as prompt chunks are computed.
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    pub arrival: Instant,
    pub first_scheduled: Option<Instant>,
    /// Set once it ended.
    pub finished: Option<FinishReason>,
    /// A pooling request: its pooled hidden state so far.
    pub pooler: Option<Pooler>,
    /// A pooling request: its vector, once its prompt is computed.
    pub embedding: Option<Vec<f32>>,
}

impl ReqView {
    /// Whether its samples are streamed as deltas (not beam search, not
    /// `best_of > n`, whose outputs are only known at the end).
    pub fn streams(&self) -> bool {
        self.params.beam_search.is_none() && self.params.num_sequences() == self.params.n
    }
}

/// A sampled token for one entry of a `RequestSamples::next`.
#[derive(Clone, Debug)]
pub(crate) struct Draw {
    pub token: TokenId,
    pub logprob: f32,
    /// The top logprobs, if asked.
    pub top: Option<Vec<(TokenId, f32)>>,
    /// The output index the receiving sequence takes (parallel samples).
    pub index: Option<usize>,
}

/// Every live request and sequence.
#[derive(Default)]
pub(crate) struct Sequences {
    pub reqs: IdMap<RequestId, ReqView>,
    pub seqs: IdMap<SeqId, SeqView>,
}

impl Sequences {
    #[allow(clippy::too_many_arguments)] // One call site; the fields of one new request.
    pub fn add(
        &mut self,
        id: RequestId,
        seq: SeqId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        seed: u64,
        eos: &[TokenId],
        constraint: Option<Constraint>,
    ) {
        let mut stop_token_ids: Vec<TokenId> = if params.ignore_eos { Vec::new() } else { eos.to_vec() };
        stop_token_ids.extend(params.stop_token_ids.iter().copied());
        let num_prompt = prompt.len();
        let penalties = crate::sampler::has_penalties(&params).then(|| PenaltyHistory::new(&prompt, &[]));
        let view = SeqView {
            index: 0,
            tokens: prompt,
            num_prompt,
            logprobs: Vec::new(),
            token_logprobs: Vec::new(),
            cumulative: 0.0,
            reported: 0,
            finish_reason: None,
            constraint,
            drafts: Vec::new(),
            rng: None,
            penalties,
        };
        self.seqs.insert(seq, view);
        let pooler = params.pooling.map(|p| Pooler::new(p.pooling_type));
        self.reqs.insert(
            id,
            ReqView {
                prompt_logprobs: params.prompt_logprobs.map(|_| vec![None; num_prompt]),
                rng: SeededRng::new(seed),
                seed,
                params,
                stop_token_ids,
                seqs: vec![seq],
                forked: false,
                arrival: Instant::now(),
                first_scheduled: None,
                finished: None,
                pooler,
                embedding: None,
            },
        );
    }

    /// Applies one step: the draws of every entry, then what the scheduler
    /// reported. Returns the requests that finished.
    pub fn apply(&mut self, samples: &StepSamples, draws: &IdMap<RequestId, Vec<Draw>>, update: &StepUpdate) -> Vec<RequestId> {
        // Forks start from their parent's state before this step's token.
        let children: Vec<(RequestId, usize, SeqId, SeqView)> =
            update.forks.iter().filter_map(|f| Some((f.request_id, f.entry, f.child, self.seqs.get(&f.parent)?.clone()))).collect();
        for rs in &samples.requests {
            let Some(ds) = draws.get(&rs.request_id) else { continue };
            // A verified speculation: its one entry takes every draw (the
            // accepted drafts, then the target's own token).
            if let ([(parent, _)], true) = (&rs.next[..], ds.len() > 1) {
                if let Some(v) = self.seqs.get_mut(parent).filter(|_| !update.skipped.contains(&(rs.request_id, 0))) {
                    v.drafts.clear();
                    ds.iter().for_each(|d| v.push(d));
                }
                continue;
            }
            for (e, (&(parent, _), d)) in rs.next.iter().zip(ds).enumerate() {
                let forked = children.iter().any(|c| c.0 == rs.request_id && c.1 == e);
                if forked || update.skipped.contains(&(rs.request_id, e)) {
                    continue;
                }
                if let Some(v) = self.seqs.get_mut(&parent) {
                    v.drafts.clear(); // verified (all rejected) in this step
                    v.push(d);
                    if let Some(i) = d.index {
                        v.index = i;
                    }
                }
            }
        }
        let mut forked: Vec<RequestId> = Vec::new();
        for (rid, e, child, mut view) in children {
            if let Some(d) = draws.get(&rid).and_then(|ds| ds.get(e)) {
                view.push(d);
                view.index = d.index.unwrap_or(view.index);
            }
            self.seqs.insert(child, view);
            if let Some(r) = self.reqs.get_mut(&rid) {
                r.seqs.push(child);
            }
            if !forked.contains(&rid) {
                forked.push(rid);
            }
        }
        // A parallel request's first draw forked it: from now on each of its
        // sequences draws from a generator of its own.
        for rid in forked {
            let Some(r) = self.reqs.get(&rid).filter(|r| r.params.beam_search.is_none()) else { continue };
            for sid in &r.seqs {
                if let Some(v) = self.seqs.get_mut(sid) {
                    v.rng = Some(sequence_rng(r.seed, v.index));
                }
            }
        }
        for &(rid, sid) in &update.dropped_seqs {
            self.seqs.remove(&sid);
            if let Some(r) = self.reqs.get_mut(&rid) {
                r.seqs.retain(|s| *s != sid);
            }
        }
        for &(_, sid, reason) in &update.finished_seqs {
            if let Some(v) = self.seqs.get_mut(&sid) {
                v.finish_reason.get_or_insert(reason);
            }
        }
        let mut done = Vec::new();
        for &(rid, reason) in &update.finished_requests {
            if self.finish(rid, reason) {
                done.push(rid);
            }
        }
        done
    }

    /// Marks a request finished: every sequence without a reason gets
    /// `reason`. False when it is unknown or already finished.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let Some(r) = self.reqs.get_mut(&id) else { return false };
        if r.finished.is_some() {
            return false;
        }
        r.finished = Some(reason);
        for sid in &r.seqs {
            if let Some(v) = self.seqs.get_mut(sid) {
                v.finish_reason.get_or_insert(reason);
            }
        }
        true
    }

    /// New tokens of the streamed sequences of `id`.
    pub fn deltas(&mut self, id: RequestId, out: &mut Vec<SequenceDelta>) {
        let Some(r) = self.reqs.get(&id) else { return };
        if !r.streams() {
            return;
        }
        for sid in &r.seqs {
            if let Some(d) = self.seqs.get_mut(sid).and_then(|v| v.take_delta(id)) {
                out.push(d);
            }
        }
    }

    /// The output of a finished request (beams and `best_of`: the best `n`
    /// by score); forgets the request. Streamed tails not yet reported go to
    /// `deltas` first.
    pub fn take_output(&mut self, id: RequestId, deltas: &mut Vec<SequenceDelta>) -> Option<RequestOutput> {
        self.deltas(id, deltas);
        let r = self.reqs.remove(&id)?;
        let views: Vec<SeqView> = r.seqs.iter().filter_map(|sid| self.seqs.remove(sid)).collect();
        let prompt_token_ids = views.first().map(|v| v.prompt().to_vec()).unwrap_or_default();
        // Without logprobs wanted, the sampler left them NaN (not computed).
        let wanted = r.params.needs_sampled_logprobs();
        let mut outputs: Vec<(f64, SequenceOutput)> = views
            .into_iter()
            .map(|v| {
                let score = match &r.params.beam_search {
                    // The best `n` hypotheses by length-normalised score.
                    Some(beam) => beam_score(v.cumulative, v.output().len(), beam.length_penalty),
                    None => v.cumulative,
                };
                let out = SequenceOutput {
                    index: v.index,
                    text: String::new(),
                    token_ids: v.output().to_vec(),
                    logprobs: v.logprobs,
                    token_logprobs: if wanted { v.token_logprobs } else { Vec::new() },
                    cumulative_logprob: wanted.then_some(v.cumulative),
                    finish_reason: v.finish_reason.or(r.finished),
                };
                (score, out)
            })
            .collect();
        let n = r.params.n;
        if r.params.beam_search.is_some() || r.params.num_sequences() > n {
            // Beams, or best_of: the `n` best, re-indexed.
            outputs.sort_by(|a, b| b.0.total_cmp(&a.0));
            outputs.truncate(n);
            for (i, o) in outputs.iter_mut().enumerate() {
                o.1.index = i;
            }
        } else {
            outputs.sort_by_key(|o| o.1.index);
        }
        Some(RequestOutput {
            request_id: id,
            prompt_token_ids,
            queue_time_s: r.first_scheduled.map(|t| (t - r.arrival).as_secs_f64()),
            prompt_logprobs: r.prompt_logprobs,
            outputs: outputs.into_iter().map(|o| o.1).collect(),
            embedding: r.embedding,
        })
    }
}
