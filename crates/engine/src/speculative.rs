//! Speculative decoding (thesis Table 4.1, last row): a proposer drafts a
//! few tokens per sequence, one step of the target model verifies them all,
//! and the request's counters move by what was accepted.
//!
//! ```text
//!   before the step:  [ prompt | output | d0 d1 d2 ]      add_draft_tokens
//!   the step:         Δ = 1 + 3 positions, each sampled:
//!                     row 0 → x0 (checks d0), row 1 → x1 (checks d1),
//!                     row 2 → x2 (checks d2), row 3 → x3 (after d2)
//!   verification:     x0 = d0, x1 ≠ d1  →  output += d0, x1; 2 rejected
//! ```
//!
//! **Why the output is the target's own.** Every proposer here drafts
//! deterministically (a lookup or a draft model's argmax), so the draft
//! distribution `q` is a point mass on the draft `d`. Rejection sampling
//! (accept `d` with probability `min(1, p(d)/q(d)) = p(d)`, else draw from
//! `p` without `d`, renormalized) then reduces to: draw `x ~ p` as the
//! non-speculative sampler would (same filters, penalties over the same
//! history, the same random stream), accept `d` when `x = d`, else emit `x`
//! and stop. Each emitted token is exactly one draw of the target's sampler,
//! so greedy decoding gives the same tokens, and a seeded request the same
//! tokens as without speculation wherever the target's logits agree.
//!
//! A draft that is a stop token ends the verification there, as it would
//! end the sequence. The drafts of one step are verified in the same step
//! or withdrawn (the scheduler drops them when the step's budget cannot take
//! them all); prefix caching registers a block only once every token in it
//! is verified, and the slots of rejected drafts are given back.

use crate::engine_core::EngineCore;
use crate::error::Error;
use vellum_base::{IdMap, ModelExecutor, RequestId, SamplingParams, TokenId, MAX_SPECULATIVE_TOKENS};

/// One sequence that may take drafts this step.
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    /// Its request.
    pub request_id: RequestId,
    /// Prompt then output: every verified token.
    pub tokens: &'a [TokenId],
    /// Most drafts it takes (its length limit and `num_speculative_tokens`).
    pub max_drafts: usize,
}

/// Proposes draft tokens. Proposals must be deterministic functions of the
/// tokens (a point-mass draft distribution; see the module docs).
pub trait Proposer: Send {
    /// Fills `drafts[i]` (empty on entry) with at most
    /// `requests[i].max_drafts` tokens to follow `requests[i].tokens`.
    fn propose(&mut self, requests: &[DraftRequest<'_>], drafts: &mut [Vec<TokenId>]) -> Result<(), Error>;

    /// A request ended: forget what was kept for it.
    fn finish(&mut self, _request_id: RequestId) {}

    /// For logs: the method and its settings.
    fn describe(&self) -> String;
}

/// Prompt lookup decoding: the tokens that followed the latest earlier
/// occurrence of the sequence's last `n` tokens, longest `n` first.
#[derive(Clone, Debug)]
pub struct NgramProposer {
    /// Shortest suffix matched.
    pub min: usize,
    /// Longest suffix matched.
    pub max: usize,
}

impl NgramProposer {
    /// The drafts for one sequence (at most `k`).
    pub fn lookup(&self, tokens: &[TokenId], k: usize, out: &mut Vec<TokenId>) {
        let len = tokens.len();
        if k == 0 {
            return;
        }
        for n in (self.min..=self.max.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // The latest start before the suffix itself whose n tokens match
            // and that has a continuation.
            if let Some(start) = (0..len - n).rev().find(|&i| tokens[i..i + n] == *suffix) {
                let from = start + n;
                out.extend_from_slice(&tokens[from..(from + k).min(len)]);
                return;
            }
        }
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, requests: &[DraftRequest<'_>], drafts: &mut [Vec<TokenId>]) -> Result<(), Error> {
        for (r, d) in requests.iter().zip(drafts) {
            self.lookup(r.tokens, r.max_drafts, d);
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("ngram (prompt lookup {}..={})", self.min, self.max)
    }
}

/// A draft model on an engine of its own: for each proposal it runs every
/// asking sequence as a greedy request of `max_drafts` tokens. Its prefix
/// cache keeps the KV of what it computed before, so a proposal computes the
/// tokens accepted since the last one (and the last partial block) and its
/// own drafts, batched over the sequences.
pub struct DraftModelProposer<E: ModelExecutor> {
    engine: EngineCore<E>,
    name: String,
}

impl<E: ModelExecutor> DraftModelProposer<E> {
    /// A proposer running the model behind `engine` (named `name` in logs).
    pub fn new(engine: EngineCore<E>, name: String) -> Self {
        Self { engine, name }
    }
}

impl<E: ModelExecutor + Send> Proposer for DraftModelProposer<E> {
    fn propose(&mut self, requests: &[DraftRequest<'_>], drafts: &mut [Vec<TokenId>]) -> Result<(), Error> {
        let mut asked: Vec<(RequestId, usize)> = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            let params = SamplingParams::greedy(r.max_drafts);
            // A sequence the draft cannot take (past its context) gets no drafts.
            if let Ok(id) = self.engine.add_request(r.tokens.to_vec(), params) {
                asked.push((id, i));
            }
        }
        let outputs = match self.engine.run_to_completion() {
            Ok(outputs) => outputs,
            Err(e) => {
                // Leave nothing queued in the draft engine for the next proposal.
                for &(id, _) in &asked {
                    self.engine.finish_request(id, vellum_scheduler::FinishReason::Abort);
                }
                let _ = self.engine.take_finished();
                return Err(e);
            }
        };
        for out in outputs {
            // Request ids grow, so `asked` is sorted by them.
            if let Ok(j) = asked.binary_search_by_key(&out.request_id, |a| a.0) {
                let i = asked[j].1;
                if let Some(seq) = out.outputs.first() {
                    drafts[i].extend_from_slice(&seq.token_ids);
                }
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("draft model {}", self.name)
    }
}

/// vLLM's speculative-decoding counters (`vllm:spec_decode_*` on `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecDecodeCounters {
    /// Verifications run (one per sequence per step with drafts).
    pub num_drafts: u64,
    /// Draft tokens proposed and verified.
    pub num_draft_tokens: u64,
    /// Draft tokens accepted.
    pub num_accepted_tokens: u64,
    /// Per draft position, how often it was accepted.
    pub num_accepted_tokens_per_pos: [u64; MAX_SPECULATIVE_TOKENS],
}

impl SpecDecodeCounters {
    /// Accepted draft tokens over proposed ones (0 with none proposed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.num_draft_tokens == 0 {
            0.0
        } else {
            self.num_accepted_tokens as f64 / self.num_draft_tokens as f64
        }
    }

    /// Tokens emitted per verification: accepted drafts plus the target's own.
    pub fn mean_acceptance_length(&self) -> f64 {
        if self.num_drafts == 0 {
            0.0
        } else {
            1.0 + self.num_accepted_tokens as f64 / self.num_drafts as f64
        }
    }

    /// Counts one verification of `proposed` drafts, `accepted` of them taken.
    pub(crate) fn record(&mut self, proposed: usize, accepted: usize) {
        self.num_drafts += 1;
        self.num_draft_tokens += proposed as u64;
        self.num_accepted_tokens += accepted as u64;
        for c in &mut self.num_accepted_tokens_per_pos[..accepted.min(MAX_SPECULATIVE_TOKENS)] {
            *c += 1;
        }
    }
}

/// Steps a request sits out after `misses` verifications in a row that
/// accepted nothing: 0, 1, 2, 4, … up to 32. A verification of `1 + k`
/// positions costs more than a decode of one, so a request whose drafts keep
/// failing (open-ended text) soon stops paying for them; one accepted draft
/// resets it.
fn backoff_steps(misses: u32) -> u32 {
    if misses == 0 {
        0
    } else {
        1 << (misses - 1).min(5)
    }
}

/// Per request: how its recent drafts fared.
#[derive(Clone, Copy, Debug, Default)]
struct Backoff {
    misses: u32,
    /// Steps left before it is offered drafts again.
    wait: u32,
    /// Most drafts its next proposal may hold (0: `num_speculative_tokens`).
    next_len: usize,
    /// Moving average of the share of its drafts rejected (0 until a
    /// verification says otherwise).
    rejected: f32,
}

/// Below this moving acceptance a request's verifications count as misses
/// even when they accept something. A verified position costs compute
/// whether or not it is accepted: on the CPU a step of 2 positions costs
/// 1.27 of one (docs/benchmarks.md), so a one-token draft pays for itself
/// from about 27% acceptance; this leaves a margin.
const MIN_ACCEPTANCE: f32 = 0.35;

/// The engine's speculative decoding: the proposer, `num_speculative_tokens`
/// and the adaptive per-request backoff.
pub(crate) struct Speculator {
    proposer: Box<dyn Proposer>,
    num_speculative_tokens: usize,
    backoff: IdMap<RequestId, Backoff>,
    pub(crate) counters: SpecDecodeCounters,
}

impl Speculator {
    pub(crate) fn new(proposer: Box<dyn Proposer>, num_speculative_tokens: usize) -> Self {
        Self {
            proposer,
            num_speculative_tokens: num_speculative_tokens.clamp(1, MAX_SPECULATIVE_TOKENS),
            backoff: IdMap::default(),
            counters: SpecDecodeCounters::default(),
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!("{}, {} tokens", self.proposer.describe(), self.num_speculative_tokens)
    }

    /// Most drafts request `id` is offered this step: 0 while it sits out
    /// a backoff (the step counts), else `num_speculative_tokens` after a
    /// verification that accepted every draft and one more than it accepted
    /// after one that did not. A verified position costs compute whether or
    /// not it is accepted: on the CPU a step of 5 positions costs about two
    /// of one, so a run of rejections must not keep paying for the longest
    /// drafts (docs/benchmarks.md).
    pub(crate) fn draft_len(&mut self, id: RequestId) -> usize {
        match self.backoff.get_mut(&id) {
            Some(b) if b.wait > 0 => {
                b.wait -= 1;
                0
            }
            Some(b) if b.next_len > 0 => b.next_len.min(self.num_speculative_tokens),
            _ => self.num_speculative_tokens,
        }
    }

    pub(crate) fn propose(&mut self, requests: &[DraftRequest<'_>], drafts: &mut [Vec<TokenId>]) -> Result<(), Error> {
        self.proposer.propose(requests, drafts)
    }

    /// Records one verification of request `id`.
    pub(crate) fn verified(&mut self, id: RequestId, proposed: usize, accepted: usize) {
        self.counters.record(proposed, accepted);
        let b = self.backoff.entry(id).or_default();
        b.next_len = if accepted == proposed { self.num_speculative_tokens } else { accepted + 1 };
        b.rejected = 0.7 * b.rejected + 0.3 * (1.0 - accepted as f32 / proposed.max(1) as f32);
        if accepted == 0 || 1.0 - b.rejected < MIN_ACCEPTANCE {
            b.misses += 1;
            b.wait = backoff_steps(b.misses);
        } else {
            // A hit halves the misses rather than forgetting them: text that
            // matches now and then (open-ended chat) keeps backing off.
            b.misses /= 2;
        }
    }

    pub(crate) fn finish(&mut self, id: RequestId) {
        self.backoff.remove(&id);
        self.proposer.finish(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(p: &NgramProposer, tokens: &[TokenId], k: usize) -> Vec<TokenId> {
        let mut out = Vec::new();
        p.lookup(tokens, k, &mut out);
        out
    }

    #[test]
    fn ngram_lookup_proposes_the_latest_continuation_longest_match_first() {
        let p = NgramProposer { min: 1, max: 3 };
        // "7 8" last occurred at 4..6, followed by 1 2.
        assert_eq!(lookup(&p, &[7, 8, 9, 9, 7, 8, 1, 2, 5, 7, 8], 3), [1, 2, 5]);
        // The 3-gram "9 7 8" wins over the later 2-gram match.
        assert_eq!(lookup(&p, &[9, 7, 8, 4, 4, 0, 7, 8, 6, 9, 7, 8], 2), [4, 4]);
        // k caps the drafts; the continuation may end at the sequence's end.
        assert_eq!(lookup(&p, &[1, 2, 3, 1, 2], 8), [3, 1, 2]);
        assert_eq!(lookup(&p, &[1, 2, 3, 4], 3), Vec::<TokenId>::new(), "no earlier occurrence");
        assert_eq!(lookup(&NgramProposer { min: 2, max: 2 }, &[5, 1, 9, 1], 3), Vec::<TokenId>::new(), "1-grams are below min");
        assert_eq!(lookup(&p, &[], 3), Vec::<TokenId>::new());
        assert_eq!(lookup(&p, &[4], 3), Vec::<TokenId>::new());
        assert_eq!(lookup(&p, &[1, 2, 1, 2], 0), Vec::<TokenId>::new());
    }

    #[test]
    fn counters_and_backoff() {
        let mut s = Speculator::new(Box::new(NgramProposer { min: 1, max: 2 }), 4);
        let id = RequestId(3);
        s.verified(id, 4, 2);
        s.verified(id, 4, 4);
        assert_eq!(s.counters.num_accepted_tokens_per_pos[..5], [2, 2, 1, 1, 0]);
        assert_eq!((s.counters.num_drafts, s.counters.num_draft_tokens, s.counters.num_accepted_tokens), (2, 8, 6));
        assert_eq!(s.counters.acceptance_rate(), 0.75);
        assert_eq!(s.counters.mean_acceptance_length(), 4.0);
        assert_eq!(s.draft_len(id), 4, "all accepted: the longest drafts");
        // Misses in a row: it sits out 1, then 2 steps, then drafts 1 token.
        s.verified(id, 4, 0);
        assert_eq!((s.draft_len(id), s.draft_len(id)), (0, 1));
        s.verified(id, 1, 0);
        assert_eq!((s.draft_len(id), s.draft_len(id), s.draft_len(id)), (0, 0, 1));
        s.verified(id, 1, 1);
        assert_eq!(s.draft_len(id), 4, "all accepted: no wait, the longest drafts");
        s.verified(id, 4, 0);
        assert_eq!((s.draft_len(id), s.draft_len(id), s.draft_len(id)), (0, 0, 1), "the misses were halved, not forgotten");
        s.verified(id, 1, 1);
        s.verified(id, 4, 2);
        assert_eq!(s.draft_len(id), 3, "one more than it accepted");
        assert_eq!((1..=8).map(backoff_steps).collect::<Vec<_>>(), [1, 2, 4, 8, 16, 32, 32, 32]);
        // A quarter of every draft accepted: below MIN_ACCEPTANCE once the
        // moving average has come down to it, and then it backs off.
        let other = RequestId(4);
        for _ in 0..5 {
            s.verified(other, 4, 1);
            assert_eq!(s.draft_len(other), 2);
        }
        s.verified(other, 4, 1);
        assert_eq!(s.draft_len(other), 0, "a quarter accepted is a miss");
    }
}
