//! One HTTP request's generation: its engine requests (one per prompt), the
//! merged event stream, incremental detokenization with stop strings, and
//! the timings that feed the metrics.
//!
//! Dropping a [`Generation`] drops its [`vellum_engine::RequestStream`]s,
//! which aborts the engine requests and frees their KV blocks before the
//! next engine step: that is how a client that hangs up is handled, for
//! streaming (the response body is dropped) and non-streaming requests (the
//! handler future is dropped) alike.

use super::error::ApiError;
use super::metrics::RequestRecord;
use super::AppState;
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use std::sync::Arc;
use std::time::Instant;
use vellum_core::{RequestId, SamplingParams, TokenId};
use vellum_engine::detokenizer::TextStream;
use vellum_engine::{RequestEvent, RequestStream};
use vellum_scheduler::FinishReason;

/// One generated token with its log-probabilities.
#[derive(Clone, Debug)]
pub struct TokenInfo {
    /// The token.
    pub id: TokenId,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely alternatives (empty unless asked).
    pub top: Vec<(TokenId, f32)>,
}

/// New output of one choice.
#[derive(Clone, Debug, Default)]
pub struct Piece {
    /// `prompt index * n + sequence index`.
    pub choice: usize,
    /// Text that may be shown now.
    pub text: String,
    /// The tokens behind it (for logprobs).
    pub tokens: Vec<TokenInfo>,
    /// Set on the choice's last piece.
    pub finish_reason: Option<&'static str>,
}

struct SeqState {
    text: TextStream,
    num_tokens: usize,
    done: bool,
}

struct PromptState {
    request_id: RequestId,
    seqs: Vec<SeqState>,
    finished: bool,
}

/// The live engine requests of one HTTP request.
pub struct Generation {
    state: Arc<AppState>,
    /// The server's id of the request (`cmpl-...`, `chatcmpl-...`).
    pub id: String,
    events: SelectAll<BoxStream<'static, (usize, RequestEvent)>>,
    prompts: Vec<PromptState>,
    n: usize,
    want_logprobs: bool,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    inter_token: Vec<f64>,
    /// Prompt tokens over all prompts.
    pub prompt_tokens: usize,
    finish_reasons: Vec<&'static str>,
    recorded: bool,
    /// The engine's queue time of the first prompt.
    queue_time: Option<f64>,
}

fn reason_str(r: Option<FinishReason>) -> &'static str {
    match r {
        Some(FinishReason::Stop) => "stop",
        Some(FinishReason::Length) | None => "length",
        Some(FinishReason::Abort) => "abort",
    }
}

impl Generation {
    /// Queues one engine request per prompt. On a refusal, the requests
    /// already queued are aborted and the refusal returned.
    pub async fn start(
        state: Arc<AppState>,
        id: String,
        prompts: Vec<Vec<TokenId>>,
        params: &SamplingParams,
        priority: i64,
        skip_special_tokens: bool,
    ) -> Result<Self, ApiError> {
        let started = Instant::now();
        let n = params.n;
        let mut streams: Vec<RequestStream> = Vec::with_capacity(prompts.len());
        let mut states = Vec::with_capacity(prompts.len());
        let mut prompt_tokens = 0;
        for p in &prompts {
            prompt_tokens += p.len();
            let rs = state.engine.add_request_async(p.clone(), params.clone(), priority).await.map_err(ApiError::from_engine)?;
            states.push(PromptState {
                request_id: rs.request_id(),
                seqs: (0..n).map(|_| SeqState { text: TextStream::new(p, &params.stop, skip_special_tokens), num_tokens: 0, done: false }).collect(),
                finished: false,
            });
            streams.push(rs);
        }
        let mut events = SelectAll::new();
        for (i, rs) in streams.into_iter().enumerate() {
            let s = stream::unfold(rs, move |mut rs| async move { rs.next().await.map(|ev| ((i, ev), rs)) }).boxed();
            events.push(s);
        }
        tracing::debug!(request_id = %id, prompts = prompts.len(), prompt_tokens, "queued");
        Ok(Self {
            state,
            id,
            events,
            prompts: states,
            n,
            want_logprobs: params.logprobs.is_some(),
            started,
            first_token: None,
            last_token: None,
            inter_token: Vec::new(),
            prompt_tokens,
            finish_reasons: Vec::new(),
            recorded: false,
            queue_time: None,
        })
    }

    /// Number of choices (prompts × n).
    pub fn num_choices(&self) -> usize {
        self.prompts.len() * self.n
    }

    /// Output tokens so far over all choices (cut at stop strings).
    pub fn completion_tokens(&self) -> usize {
        self.prompts.iter().flat_map(|p| &p.seqs).map(|s| s.num_tokens).sum()
    }

    /// The next pieces of output; `None` once every prompt finished.
    pub async fn next(&mut self) -> Option<Result<Vec<Piece>, ApiError>> {
        loop {
            if self.prompts.iter().all(|p| p.finished) {
                self.record();
                return None;
            }
            let Some((p, ev)) = self.events.next().await else {
                // Streams ended without Finished: the engine went away.
                return Some(Err(ApiError::unavailable("The engine stopped before the request finished.")));
            };
            let pieces = match ev {
                RequestEvent::Delta(d) => {
                    let now = Instant::now();
                    if self.first_token.is_none() {
                        self.first_token = Some(now);
                    }
                    if p == 0 && d.index == 0 {
                        if let Some(last) = self.last_token {
                            self.inter_token.push(now.duration_since(last).as_secs_f64());
                        }
                        self.last_token = Some(now);
                    }
                    let mut out = Vec::new();
                    let was_done = self.prompts.get(p).and_then(|ps| ps.seqs.get(d.index)).is_some_and(|s| s.done);
                    if let Some(piece) = self.push_tokens(p, d.index, &d.token_ids, &d.token_logprobs, &d.logprobs) {
                        out.push(piece);
                    }
                    let prompt = &self.prompts[p];
                    let now_done = prompt.seqs.get(d.index).is_some_and(|s| s.done);
                    if !prompt.finished && now_done && !was_done {
                        // A stop string matched: that sequence ends now and
                        // frees its blocks (the request with its last one).
                        self.state.engine.finish_sequence(prompt.request_id, d.index, FinishReason::Stop);
                    }
                    out
                }
                RequestEvent::Finished(r) => {
                    if p == 0 {
                        self.queue_time = r.queue_time_s;
                    }
                    if self.first_token.is_none() {
                        self.first_token = Some(Instant::now());
                    }
                    let mut out = Vec::new();
                    for o in &r.outputs {
                        let Some(seq) = self.prompts.get(p).and_then(|ps| ps.seqs.get(o.index)) else { continue };
                        if seq.done {
                            continue;
                        }
                        let seen = seq.num_tokens.min(o.token_ids.len());
                        let mut piece = self
                            .push_tokens(
                                p,
                                o.index,
                                &o.token_ids[seen..],
                                o.token_logprobs.get(seen..).unwrap_or(&[]),
                                o.logprobs.get(seen..).unwrap_or(&[]),
                            )
                            .unwrap_or_else(|| Piece { choice: p * self.n + o.index, ..Piece::default() });
                        if piece.finish_reason.is_none() {
                            let tokenizer = &self.state.tokenizer;
                            let seq = &mut self.prompts[p].seqs[o.index];
                            match seq.text.finish(tokenizer) {
                                Ok(tail) => piece.text.push_str(&tail),
                                Err(e) => return Some(Err(ApiError::internal(format!("detokenizing: {e}")))),
                            }
                            seq.done = true;
                            piece.finish_reason = Some(if seq.text.stopped() { "stop" } else { reason_str(o.finish_reason) });
                        }
                        out.push(piece);
                    }
                    // Sequences the engine did not return (cannot happen):
                    // close them so that every choice gets a finish reason.
                    for (i, seq) in self.prompts[p].seqs.iter_mut().enumerate() {
                        if !seq.done {
                            seq.done = true;
                            out.push(Piece { choice: p * self.n + i, finish_reason: Some("abort"), ..Piece::default() });
                        }
                    }
                    self.prompts[p].finished = true;
                    out
                }
                RequestEvent::Error(msg) => {
                    tracing::error!(request_id = %self.id, error = %msg, "engine error");
                    return Some(Err(ApiError::internal(format!("The engine failed: {msg}"))));
                }
            };
            for piece in &pieces {
                if let Some(r) = piece.finish_reason {
                    self.finish_reasons.push(r);
                }
            }
            if !pieces.is_empty() {
                return Some(Ok(pieces));
            }
        }
    }

    /// Feeds tokens of one sequence through its text stream.
    fn push_tokens(
        &mut self,
        p: usize,
        index: usize,
        tokens: &[TokenId],
        token_logprobs: &[f32],
        tops: &[Vec<(TokenId, f32)>],
    ) -> Option<Piece> {
        let n = self.n;
        let want_logprobs = self.want_logprobs;
        let tokenizer = &self.state.tokenizer;
        let seq = self.prompts.get_mut(p)?.seqs.get_mut(index)?;
        if seq.done {
            return None;
        }
        let mut piece = Piece { choice: p * n + index, ..Piece::default() };
        for (i, &t) in tokens.iter().enumerate() {
            match seq.text.push(tokenizer, &[t]) {
                Ok(s) => piece.text.push_str(&s),
                Err(e) => {
                    tracing::warn!(error = %e, token = t, "detokenizing failed");
                }
            }
            seq.num_tokens += 1;
            if want_logprobs {
                piece.tokens.push(TokenInfo {
                    id: t,
                    logprob: token_logprobs.get(i).copied().unwrap_or(f32::NAN),
                    top: tops.get(i).cloned().unwrap_or_default(),
                });
            }
            if seq.text.stopped() {
                seq.done = true;
                piece.finish_reason = Some("stop");
                break;
            }
        }
        if piece.text.is_empty() && piece.tokens.is_empty() && piece.finish_reason.is_none() {
            None
        } else {
            Some(piece)
        }
    }

    /// Records the request in the metrics (once; an unfinished request
    /// counts as aborted).
    fn record(&mut self) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        let e2e = self.started.elapsed().as_secs_f64();
        let aborted = !self.prompts.iter().all(|p| p.finished);
        let finish_reason = if aborted || self.finish_reasons.contains(&"abort") {
            "abort"
        } else if self.finish_reasons.iter().all(|&r| r == "stop") {
            "stop"
        } else {
            "length"
        };
        let ttft = self.first_token.map(|t| t.duration_since(self.started).as_secs_f64());
        let stats = self.state.engine.stats();
        let c = stats.counters;
        let mean_step = if c.num_steps == 0 { 0.0 } else { (c.schedule_s + c.execute_s + c.sample_s) / c.num_steps as f64 };
        let record = RequestRecord {
            ttft,
            queue_time: self.queue_time.or(ttft.map(|t| (t - mean_step).max(0.0))),
            inter_token: std::mem::take(&mut self.inter_token),
            e2e,
            prompt_tokens: self.prompt_tokens,
            generation_tokens: self.completion_tokens(),
            finish_reason,
        };
        self.state.metrics.record(&record);
        if aborted {
            tracing::info!(request_id = %self.id, elapsed_s = format!("{e2e:.3}"), "aborted (client went away or server shutting down)");
        } else {
            tracing::info!(
                request_id = %self.id,
                prompt_tokens = self.prompt_tokens,
                completion_tokens = record.generation_tokens,
                finish_reason,
                ttft_s = format!("{:.3}", ttft.unwrap_or(0.0)),
                e2e_s = format!("{e2e:.3}"),
                "finished"
            );
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.record();
    }
}
