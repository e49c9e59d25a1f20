//! What the engine hands back: per-step token deltas and finished requests.

use vellum_base::{RequestId, TokenId};
use vellum_scheduler::FinishReason;

/// What a finished sequence produced.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceOutput {
    /// Its place among the request's outputs (`0..n`).
    pub index: usize,
    /// Detokenized text, stop string cut (filled by the
    /// [`crate::OutputProcessor`]; the engine core itself is token-only and
    /// leaves it empty).
    pub text: String,
    /// Generated token ids.
    pub token_ids: Vec<TokenId>,
    /// Per generated position, the top (token, logprob) pairs (if asked).
    pub logprobs: Vec<Vec<(TokenId, f32)>>,
    /// Log-probability of each generated token (empty unless
    /// [`SamplingParams::needs_sampled_logprobs`](vellum_base::SamplingParams::needs_sampled_logprobs)).
    pub token_logprobs: Vec<f32>,
    /// Sum of the chosen tokens' log-probabilities (`None` unless
    /// [`SamplingParams::needs_sampled_logprobs`](vellum_base::SamplingParams::needs_sampled_logprobs),
    /// as in vLLM).
    pub cumulative_logprob: Option<f64>,
    /// `stop`, `length` or `abort`.
    pub finish_reason: Option<FinishReason>,
}

/// A finished request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    /// The request.
    pub request_id: RequestId,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<TokenId>,
    /// Per prompt position (if asked): the prompt token's own logprob and
    /// the top alternatives; `None` at position 0, which nothing predicts.
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    /// One per returned sequence, ordered by `index`.
    pub outputs: Vec<SequenceOutput>,
    /// Seconds from `add_request` to the first step that computed any of
    /// its tokens (vLLM's queue time); `None` if it never ran.
    pub queue_time_s: Option<f64>,
    /// A pooling request's vector (pooled, truncated and normalized as its
    /// [`PoolingParams`](vellum_base::PoolingParams) say); `None` for
    /// generation, and for a pooling request that ended before its prompt
    /// was computed (aborted).
    pub embedding: Option<Vec<f32>>,
}

/// The log-probability of one prompt token given the tokens before it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    /// The prompt token.
    pub token_id: TokenId,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens at that position, most likely first.
    pub top: Vec<(TokenId, f32)>,
}

/// Tokens one sequence produced in one step (streaming).
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceDelta {
    /// The request.
    pub request_id: RequestId,
    /// The sequence's `index` among the request's outputs.
    pub index: usize,
    /// New tokens since the last delta.
    pub token_ids: Vec<TokenId>,
    /// Their top logprobs (empty unless asked).
    pub logprobs: Vec<Vec<(TokenId, f32)>>,
    /// Log-probabilities of the new tokens themselves.
    pub token_logprobs: Vec<f32>,
}

/// What one step produced: new tokens of live sequences, and the requests
/// that finished.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutputs {
    /// New tokens of sequences still running, or finished in this step.
    /// Beam-search requests emit none (their candidates change until the end).
    pub deltas: Vec<SequenceDelta>,
    /// Requests that finished.
    pub finished: Vec<RequestOutput>,
}

/// A beam hypothesis' score: its cumulative logprob over its length to the
/// power `length_penalty` (paper §4.4; vLLM's and Hugging Face's rule).
pub fn beam_score(cumulative_logprob: f64, len: usize, length_penalty: f32) -> f64 {
    cumulative_logprob / (len.max(1) as f64).powf(length_penalty as f64)
}
