//! The one output path (vLLM's `OutputProcessor`): the engine's token
//! outputs become text a client may show, for the offline API, the server
//! and `vellum chat` alike.
//!
//! ```text
//!  EngineCore / EngineClient ── SequenceDelta, RequestOutput (tokens) ──▶ OutputProcessor
//!        ▲                                                                    │ per sequence:
//!        └──────────── finish_sequence(request, index) ◀── stop string ──────┤ IncrementalDetokenizer
//!                                                                             │ + StopStrings (hold-back)
//!                                          OutputPiece (text, tokens, finish) ◀┘
//! ```
//!
//! Per sequence it keeps a [`TextStream`]: tokens are detokenized one at a
//! time (never half a character), text that may still become a stop string
//! is held back, and once a stop string matches the sequence is done — the
//! caller then ends it in the engine ([`Processed::stopped`]) so its KV
//! blocks are freed while its siblings go on. Requests whose outputs are
//! only known at the end (beam search, `best_of > n`) stream nothing and are
//! detokenized when they finish.
//!
//! The token that ends a sequence (an EOS unless `ignore_eos`, or one of
//! `stop_token_ids`, once `min_tokens` are out) counts as output but is not
//! detokenized, as in vLLM: with `skip_special_tokens: false` the text never
//! ends in `</s>` or `<|im_end|>`.

use crate::detokenizer::TextStream;
use crate::outputs::{RequestOutput, SequenceDelta, StepOutputs};
use vellum_base::{IdMap, RequestId, SamplingParams, TokenId};
use vellum_models::Tokenizer;
use vellum_scheduler::FinishReason;

/// One generated token with its log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOutput {
    /// The token.
    pub id: TokenId,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely alternatives (empty unless `logprobs` was asked).
    pub top: Vec<(TokenId, f32)>,
}

/// New output of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputPiece {
    /// The request.
    pub request_id: RequestId,
    /// The sequence's place among the request's outputs.
    pub index: usize,
    /// Text that may be shown now (held-back text comes in a later piece).
    pub text: String,
    /// The tokens consumed, up to a stop string.
    pub tokens: Vec<TokenOutput>,
    /// Set on the sequence's last piece.
    pub finish_reason: Option<FinishReason>,
    /// On the last piece of a sequence a stop string ended: that string
    /// (vLLM's `stop_reason`).
    pub stop_string: Option<String>,
}

impl OutputPiece {
    /// No output yet for sequence `index` of `request_id`.
    pub fn empty(request_id: RequestId, index: usize) -> Self {
        Self { request_id, index, text: String::new(), tokens: Vec::new(), finish_reason: None, stop_string: None }
    }

    fn is_empty(&self) -> bool {
        self.text.is_empty() && self.tokens.is_empty() && self.finish_reason.is_none()
    }
}

/// What processing produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Processed {
    /// New output, in the order it happened.
    pub pieces: Vec<OutputPiece>,
    /// Sequences a stop string just ended: the caller ends them in the
    /// engine (`finish_sequence`), which frees their blocks.
    pub stopped: Vec<(RequestId, usize)>,
    /// Requests that finished, with `text` and finish reasons filled in.
    pub finished: Vec<RequestOutput>,
}

struct SeqText {
    text: TextStream,
    /// Output tokens consumed (those after a stop string are not).
    num_tokens: usize,
    done: bool,
}

/// The tokens that end a sequence of one request.
#[derive(Clone, Debug, Default)]
struct StopTokens {
    /// EOS (unless `ignore_eos`) and `stop_token_ids`.
    ids: Vec<TokenId>,
    /// Output tokens before one of `ids` may end the sequence.
    min_tokens: usize,
}

impl StopTokens {
    fn new(eos: &[TokenId], params: &SamplingParams) -> Self {
        let mut ids: Vec<TokenId> = if params.ignore_eos { Vec::new() } else { eos.to_vec() };
        ids.extend(params.stop_token_ids.iter().copied());
        Self { ids, min_tokens: params.min_tokens }
    }

    /// Whether `token`, the sequence's output token number `n_out` (from
    /// 1), is the one that ends it.
    fn ends_sequence(&self, token: TokenId, n_out: usize) -> bool {
        n_out >= self.min_tokens && self.ids.contains(&token)
    }
}

struct Tracked {
    prompt: Vec<TokenId>,
    stop: Vec<String>,
    stop_tokens: StopTokens,
    skip_special_tokens: bool,
    /// Deltas are streamed (no beam search, no `best_of > n`).
    streams: bool,
    seqs: Vec<SeqText>,
}

impl Tracked {
    fn new_text(&self) -> SeqText {
        SeqText { text: TextStream::new(&self.prompt, &self.stop, self.skip_special_tokens), num_tokens: 0, done: false }
    }
}

/// Turns token outputs into text for the requests it was told about.
#[derive(Default)]
pub struct OutputProcessor {
    requests: IdMap<RequestId, Tracked>,
    /// The engine's EOS tokens (their text is never part of the output).
    eos_token_ids: Vec<TokenId>,
}

impl OutputProcessor {
    /// An empty processor that knows no EOS token (only `stop_token_ids`
    /// are left out of the text).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty processor for an engine that ends sequences on
    /// `eos_token_ids` ([`crate::EngineClient::eos_token_ids`]).
    pub fn with_eos_token_ids(eos_token_ids: &[TokenId]) -> Self {
        Self { requests: IdMap::default(), eos_token_ids: eos_token_ids.to_vec() }
    }

    /// Starts tracking request `id` (prompt, stop strings, how many outputs).
    pub fn add_request(&mut self, id: RequestId, prompt: &[TokenId], params: &SamplingParams, skip_special_tokens: bool) {
        let streams = params.beam_search.is_none() && params.num_sequences() == params.n;
        let mut t = Tracked {
            prompt: prompt.to_vec(),
            stop: params.stop.clone(),
            stop_tokens: StopTokens::new(&self.eos_token_ids, params),
            skip_special_tokens,
            streams,
            seqs: Vec::new(),
        };
        if streams {
            t.seqs = (0..params.n).map(|_| t.new_text()).collect();
        }
        self.requests.insert(id, t);
    }

    /// Forgets a request (aborted by the caller).
    pub fn abort(&mut self, id: RequestId) {
        self.requests.remove(&id);
    }

    /// Whether no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Whether sequence `index` of request `id` already ended (a stop
    /// string matched).
    pub fn is_done(&self, id: RequestId, index: usize) -> bool {
        self.requests.get(&id).and_then(|t| t.seqs.get(index)).is_none_or(|s| s.done)
    }

    /// One step of the engine: its deltas, then its finished requests.
    pub fn process(&mut self, tokenizer: &Tokenizer, step: StepOutputs) -> vellum_models::Result<Processed> {
        let mut out = Processed::default();
        for d in &step.deltas {
            let (piece, stopped) = self.process_delta(tokenizer, d)?;
            out.pieces.extend(piece);
            if stopped {
                out.stopped.push((d.request_id, d.index));
            }
        }
        for r in step.finished {
            let (pieces, done) = self.process_finished(tokenizer, r)?;
            out.pieces.extend(pieces);
            out.finished.push(done);
        }
        Ok(out)
    }

    /// New tokens of one sequence; returns its piece (if any) and whether a
    /// stop string ended it just now.
    pub fn process_delta(&mut self, tokenizer: &Tokenizer, d: &SequenceDelta) -> vellum_models::Result<(Option<OutputPiece>, bool)> {
        let Some(t) = self.requests.get_mut(&d.request_id) else { return Ok((None, false)) };
        let Some(seq) = t.seqs.get_mut(d.index) else { return Ok((None, false)) };
        let new = NewTokens { ids: &d.token_ids, token_logprobs: &d.token_logprobs, tops: &d.logprobs };
        let piece = push(seq, &t.stop_tokens, d.request_id, d.index, tokenizer, new)?;
        let stopped = piece.as_ref().is_some_and(|p| p.finish_reason.is_some());
        Ok((piece, stopped))
    }

    /// A finished request: the last piece of every sequence still open, and
    /// the output with each sequence's full `text` (cut at its stop string)
    /// and finish reason.
    pub fn process_finished(
        &mut self,
        tokenizer: &Tokenizer,
        mut r: RequestOutput,
    ) -> vellum_models::Result<(Vec<OutputPiece>, RequestOutput)> {
        let mut tracked = match self.requests.remove(&r.request_id) {
            Some(t) => t,
            None => Tracked {
                prompt: r.prompt_token_ids.clone(),
                stop: Vec::new(),
                stop_tokens: StopTokens::default(),
                skip_special_tokens: true,
                streams: false,
                seqs: Vec::new(),
            },
        };
        if !tracked.streams {
            // Nothing was streamed: every output is detokenized now.
            tracked.seqs = r.outputs.iter().map(|_| tracked.new_text()).collect();
        }
        let mut pieces = Vec::new();
        for (pos, o) in r.outputs.iter_mut().enumerate() {
            let slot = if tracked.streams { o.index } else { pos };
            let Some(seq) = tracked.seqs.get_mut(slot) else { continue };
            if !seq.done {
                let seen = seq.num_tokens.min(o.token_ids.len());
                let mut piece = push(
                    seq,
                    &tracked.stop_tokens,
                    r.request_id,
                    o.index,
                    tokenizer,
                    NewTokens {
                        ids: &o.token_ids[seen..],
                        token_logprobs: o.token_logprobs.get(seen..).unwrap_or(&[]),
                        tops: o.logprobs.get(seen..).unwrap_or(&[]),
                    },
                )?
                .unwrap_or_else(|| OutputPiece::empty(r.request_id, o.index));
                if piece.finish_reason.is_none() {
                    piece.text.push_str(&seq.text.finish(tokenizer)?);
                    seq.done = true;
                    piece.finish_reason =
                        Some(if seq.text.stopped() { FinishReason::Stop } else { o.finish_reason.unwrap_or(FinishReason::Length) });
                    piece.stop_string = seq.text.stop_string().map(str::to_string);
                }
                pieces.push(piece);
            }
            if seq.text.stopped() {
                o.finish_reason = Some(FinishReason::Stop);
                // Tokens after the one that completed the stop string (a
                // speculative step emits several at once; an output that was
                // not streamed is cut here) are not part of the output.
                let n = seq.num_tokens.min(o.token_ids.len());
                o.token_ids.truncate(n);
                o.logprobs.truncate(n);
                if o.token_logprobs.len() > n {
                    o.token_logprobs.truncate(n);
                    o.cumulative_logprob = o.cumulative_logprob.map(|_| o.token_logprobs.iter().map(|&x| x as f64).sum());
                }
            }
            o.text = seq.text.text().to_string();
        }
        // A streamed sequence the engine did not return (it cannot happen):
        // close it, so that every output gets a finish reason.
        for (index, seq) in tracked.seqs.iter_mut().enumerate().filter(|(_, s)| tracked.streams && !s.done) {
            seq.done = true;
            pieces.push(OutputPiece { finish_reason: Some(FinishReason::Abort), ..OutputPiece::empty(r.request_id, index) });
        }
        Ok((pieces, r))
    }
}

/// A sequence's new tokens with their log-probabilities.
struct NewTokens<'a> {
    ids: &'a [TokenId],
    token_logprobs: &'a [f32],
    tops: &'a [Vec<(TokenId, f32)>],
}

/// Feeds tokens of one sequence through its text stream (all but the token
/// that ends it).
fn push(
    seq: &mut SeqText,
    stop_tokens: &StopTokens,
    request_id: RequestId,
    index: usize,
    tokenizer: &Tokenizer,
    new: NewTokens<'_>,
) -> vellum_models::Result<Option<OutputPiece>> {
    let NewTokens { ids: tokens, token_logprobs, tops } = new;
    if seq.done {
        return Ok(None);
    }
    let mut piece = OutputPiece::empty(request_id, index);
    for (i, &t) in tokens.iter().enumerate() {
        seq.num_tokens += 1;
        if !stop_tokens.ends_sequence(t, seq.num_tokens) {
            piece.text.push_str(&seq.text.push(tokenizer, &[t])?);
        }
        piece.tokens.push(TokenOutput {
            id: t,
            logprob: token_logprobs.get(i).copied().unwrap_or(f32::NAN),
            top: tops.get(i).cloned().unwrap_or_default(),
        });
        if seq.text.stopped() {
            seq.done = true;
            piece.finish_reason = Some(FinishReason::Stop);
            piece.stop_string = seq.text.stop_string().map(str::to_string);
            break;
        }
    }
    Ok((!piece.is_empty()).then_some(piece))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ending_token_is_eos_unless_ignored_or_a_stop_token_after_min_tokens() {
        let params = SamplingParams { stop_token_ids: vec![7], min_tokens: 2, ..SamplingParams::greedy(8) };
        let stops = StopTokens::new(&[2], &params);
        assert!(!stops.ends_sequence(2, 1), "before min_tokens an EOS is text like any token");
        assert!(stops.ends_sequence(2, 2) && stops.ends_sequence(7, 3));
        assert!(!stops.ends_sequence(5, 3));
        let ignoring = StopTokens::new(&[2], &SamplingParams { ignore_eos: true, ..params });
        assert!(!ignoring.ends_sequence(2, 5) && ignoring.ends_sequence(7, 5));
    }
}
