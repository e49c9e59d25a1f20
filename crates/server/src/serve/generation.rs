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
use vellum_base::{RequestId, SamplingParams, TokenId};
use vellum_engine::{OutputPiece, OutputProcessor, RequestEvent, RequestStream};
use vellum_scheduler::FinishReason;

/// One generated token with its log-probabilities (the engine's).
pub use vellum_engine::TokenOutput as TokenInfo;

/// New output of one choice.
#[derive(Clone, Debug, Default)]
pub struct Piece {
    /// `prompt index * n + sequence index`.
    pub choice: usize,
    /// Text that may be shown now.
    pub text: String,
    /// The tokens behind it (for logprobs; empty unless asked).
    pub tokens: Vec<TokenInfo>,
    /// How many output tokens it holds (asked for logprobs or not).
    pub num_tokens: usize,
    /// Set on the choice's last piece.
    pub finish_reason: Option<&'static str>,
    /// The stop string that ended the choice, on its last piece (vLLM's
    /// `stop_reason`).
    pub stop_string: Option<String>,
}

struct PromptState {
    request_id: RequestId,
    finished: bool,
}

/// The live engine requests of one HTTP request.
pub struct Generation {
    state: Arc<AppState>,
    /// The server's id of the request (`cmpl-...`, `chatcmpl-...`).
    pub id: String,
    events: SelectAll<BoxStream<'static, (usize, RequestEvent)>>,
    prompts: Vec<PromptState>,
    /// Text, stop strings and logprobs of every choice: the engine's one
    /// output path.
    outputs: OutputProcessor,
    n: usize,
    want_logprobs: bool,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    inter_token: Vec<f64>,
    /// Prompt tokens over all prompts.
    pub prompt_tokens: usize,
    completion_tokens: usize,
    finish_reasons: Vec<FinishReason>,
    recorded: bool,
    /// The engine's queue time of the first prompt.
    queue_time: Option<f64>,
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
        let mut streams: Vec<RequestStream> = Vec::with_capacity(prompts.len());
        let mut states = Vec::with_capacity(prompts.len());
        let mut outputs = OutputProcessor::with_eos_token_ids(state.engine.eos_token_ids());
        let mut prompt_tokens = 0;
        for p in &prompts {
            prompt_tokens += p.len();
            let rs = state.engine.add_request_async(p.clone(), params.clone(), priority).await.map_err(ApiError::from_engine)?;
            outputs.add_request(rs.request_id(), p, params, skip_special_tokens);
            states.push(PromptState { request_id: rs.request_id(), finished: false });
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
            outputs,
            n: params.n,
            want_logprobs: params.logprobs.is_some(),
            started,
            first_token: None,
            last_token: None,
            inter_token: Vec::new(),
            prompt_tokens,
            completion_tokens: 0,
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
        self.completion_tokens
    }

    /// The engine's piece of prompt `p` as a choice of this request.
    fn choice(&mut self, p: usize, piece: OutputPiece) -> Piece {
        self.completion_tokens += piece.tokens.len();
        self.finish_reasons.extend(piece.finish_reason);
        let finish_reason = piece.finish_reason.map(FinishReason::as_str);
        Piece {
            choice: p * self.n + piece.index,
            num_tokens: piece.tokens.len(),
            text: piece.text,
            tokens: if self.want_logprobs { piece.tokens } else { Vec::new() },
            finish_reason,
            stop_string: piece.stop_string,
        }
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
            let tokenizer = &self.state.tokenizer;
            let engine_pieces = match ev {
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
                    let (piece, stopped) = match self.outputs.process_delta(tokenizer, &d) {
                        Ok(r) => r,
                        Err(e) => return Some(Err(ApiError::internal(format!("detokenizing: {e}")))),
                    };
                    if stopped && !self.prompts[p].finished {
                        // A stop string matched: that sequence ends now and
                        // frees its blocks (the request with its last one).
                        self.state.engine.finish_sequence(self.prompts[p].request_id, d.index, FinishReason::Stop);
                    }
                    piece.into_iter().collect()
                }
                RequestEvent::Finished(r) => {
                    if p == 0 {
                        self.queue_time = r.queue_time_s;
                    }
                    if self.first_token.is_none() {
                        self.first_token = Some(Instant::now());
                    }
                    self.prompts[p].finished = true;
                    match self.outputs.process_finished(tokenizer, r) {
                        Ok((pieces, _)) => pieces,
                        Err(e) => return Some(Err(ApiError::internal(format!("detokenizing: {e}")))),
                    }
                }
                RequestEvent::Error(msg) => {
                    tracing::warn!(request_id = %self.id, error = %msg, "request ended unfinished");
                    return Some(Err(ApiError::internal(msg)));
                }
            };
            let pieces: Vec<Piece> = engine_pieces.into_iter().map(|piece| self.choice(p, piece)).collect();
            if !pieces.is_empty() {
                return Some(Ok(pieces));
            }
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
        let finish_reason = if aborted || self.finish_reasons.contains(&FinishReason::Abort) {
            FinishReason::Abort
        } else if self.finish_reasons.iter().all(|&r| r == FinishReason::Stop) {
            FinishReason::Stop
        } else {
            FinishReason::Length
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
            generation_tokens: self.completion_tokens,
            finish_reason: Some(finish_reason),
        };
        self.state.metrics.record(&record);
        if aborted {
            tracing::info!(request_id = %self.id, elapsed_s = format!("{e2e:.3}"), "aborted (client went away or server shutting down)");
        } else {
            tracing::info!(
                request_id = %self.id,
                prompt_tokens = self.prompt_tokens,
                completion_tokens = record.generation_tokens,
                finish_reason = finish_reason.as_str(),
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
