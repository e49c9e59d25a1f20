//! The OpenAI endpoints: `/v1/completions`, `/v1/chat/completions` (both
//! with `stream: true` as server-sent events), `/v1/models`, and vLLM's
//! `/tokenize`, `/detokenize`, `/version`.

use super::error::{too_long, ApiError};
use super::generation::{Generation, Piece, TokenInfo};
use super::protocol::{self, ChatRequest, Common, CompletionRequest, Prompt};
use super::reasoning::{ReasoningEvent, ReasoningParser};
use super::tools::{self, Assembled, ToolCallParser, ToolChoice, ToolEvent, ToolParsing, ToolRequest};
use super::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tracing::Instrument;
use vellum_base::{SamplingParams, TokenId};

/// Which endpoint a generation answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// How the output is rendered.
struct Format {
    kind: Kind,
    model: String,
    created: u64,
    /// Top logprobs asked for (`None`: no logprobs).
    logprobs: Option<usize>,
    tokens_as_ids: bool,
    include_usage: bool,
    /// Completions with `echo`: the prompt text per prompt.
    echo: Option<Vec<String>>,
    /// Chat with tools: how calls are read from the output.
    tools: Option<ToolParsing>,
    /// Chat with `--reasoning-parser`: a fresh splitter for the prompt,
    /// cloned for each choice.
    reasoning: Option<ReasoningParser>,
}

/// Most top logprobs per token (vLLM's default `max_logprobs`; the engine checks it too).
const MAX_LOGPROBS: usize = 20;

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn request_id(prefix: &str) -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{prefix}-{:012x}{n:06x}", (t as u64) & 0xffff_ffff_ffff)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl AppState {
    pub(super) fn check_model(&self, model: &Option<String>) -> Result<String, ApiError> {
        match model {
            None => Ok(self.served_names[0].clone()),
            Some(m) if self.served_names.iter().any(|n| n == m) => Ok(m.clone()),
            Some(m) => Err(ApiError::not_found(format!("The model `{m}` does not exist."))),
        }
    }

    pub(super) fn admit(&self) -> Result<(), ApiError> {
        self.admit_many(1)
    }

    /// Admission of a request that queues `n` engine requests (one per
    /// input of an embeddings call): 503 when they would take the waiting
    /// queue past `--max-waiting-requests`.
    pub(super) fn admit_many(&self, n: usize) -> Result<(), ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("The server is shutting down."));
        }
        let waiting = self.engine.num_waiting();
        if waiting + n as u64 > self.max_waiting_requests as u64 {
            self.metrics.rejected_busy();
            return Err(ApiError::unavailable(format!(
                "The server is overloaded: {waiting} requests are waiting (--max-waiting-requests {}). Retry later.",
                self.max_waiting_requests
            )));
        }
        Ok(())
    }

    fn token_text(&self, id: TokenId, as_ids: bool) -> String {
        if as_ids {
            format!("token_id:{id}")
        } else {
            self.tokenizer.decode(&[id], false).unwrap_or_default()
        }
    }

    /// 400 when a prompt plus `max_tokens` cannot fit the context.
    fn check_length(&self, prompts: &[Vec<TokenId>], max_tokens: Option<usize>) -> Result<(), ApiError> {
        for p in prompts {
            let requested = p.len() + max_tokens.unwrap_or(0);
            if p.len() >= self.max_model_len || requested > self.max_model_len {
                return Err(too_long(p.len(), max_tokens.unwrap_or(0), self.max_model_len));
            }
        }
        Ok(())
    }
}

fn log_unknown(unknown: &std::collections::BTreeMap<String, Value>) {
    let names = protocol::unknown_fields(unknown);
    if !names.is_empty() {
        tracing::debug!(fields = ?names, "ignoring unknown request fields");
    }
}

fn json_response(v: Value) -> Response {
    (StatusCode::OK, Json(v)).into_response()
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    state.metrics.http_request();
    let req: CompletionRequest = protocol::parse_body(&body)?;
    log_unknown(&req.unknown);
    let model = state.check_model(&req.common.model)?;
    if req.suffix.is_some() {
        return Err(ApiError::bad_request("suffix is not currently supported", Some("suffix")));
    }
    let vocab = state.tokenizer.vocab_size();
    let prompts: Vec<Vec<TokenId>> = match &req.prompt {
        None => return Err(ApiError::bad_request("prompt is required", Some("prompt"))),
        Some(Prompt::Text(s)) => vec![encode(&state, s, true)?],
        Some(Prompt::Texts(v)) => v.iter().map(|s| encode(&state, s, true)).collect::<Result<_, _>>()?,
        Some(Prompt::Tokens(ids)) => vec![protocol::token_prompt(ids, vocab)?],
        Some(Prompt::TokenLists(v)) => v.iter().map(|ids| protocol::token_prompt(ids, vocab)).collect::<Result<_, _>>()?,
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad_request("The prompt is empty.", Some("prompt")));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if !(0..=MAX_LOGPROBS as i64).contains(&k) => {
            return Err(ApiError::bad_request(format!("logprobs must be between 0 and {}, got {k}", MAX_LOGPROBS), Some("logprobs")))
        }
        Some(k) => Some(k as usize),
    };
    let params = protocol::sampling_params(&req.common, Some(16), logprobs, vocab)?;
    // Echo gives text prompts back as written (as vLLM does: no BOS the
    // tokenizer added), token prompts decoded.
    let echo = match (req.echo.unwrap_or(false), &req.prompt) {
        (false, _) => None,
        (true, Some(Prompt::Text(s))) => Some(vec![s.clone()]),
        (true, Some(Prompt::Texts(v))) => Some(v.clone()),
        (true, _) => Some(prompts.iter().map(|p| state.tokenizer.decode(p, false).unwrap_or_default()).collect()),
    };
    let format = Format {
        kind: Kind::Completion,
        model,
        created: unix_now(),
        logprobs,
        tokens_as_ids: req.common.return_tokens_as_token_ids.unwrap_or(false),
        include_usage: req.common.stream_options.as_ref().is_some_and(|o| o.include_usage),
        echo,
        tools: None,
        reasoning: None,
    };
    let skip_special_tokens = req.common.skip_special_tokens.unwrap_or(true);
    let request = Request { id: request_id("cmpl"), prompts, params, constraint_field: None, skip_special_tokens };
    generate(state, request, &req.common, format).await
}

/// A prompt's ids; `add_special_tokens` adds the BOS the model asks for.
fn encode(state: &AppState, text: &str, add_special_tokens: bool) -> Result<Vec<TokenId>, ApiError> {
    state
        .tokenizer
        .encode(text, add_special_tokens)
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}"), Some("prompt")))
}

/// Renders chat messages (and the request's tools: through the template
/// if it reads `tools`, else with the default tool prompt) with the chat
/// template.
fn render_chat(
    state: &AppState,
    messages: &[protocol::Message],
    tools: Option<&ToolRequest>,
    add_generation_prompt: bool,
    kwargs: Option<&Map<String, Value>>,
) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty", Some("messages")));
    }
    let template = state.chat_template.as_ref().ok_or_else(|| match state.embedding {
        // An encoder has no template: what the client needs to hear is the task.
        Some(_) => ApiError::bad_request("this engine serves embeddings (--task embed); it does not generate text", Some("model")),
        None => ApiError::bad_request("The model has no chat template; pass one with --chat-template.", Some("messages")),
    })?;
    let (msgs, tools_var) = tools::prompt_messages(messages, tools, template.supports_tools(), state.tool_format)?;
    template
        .render_with_kwargs(&msgs, tools_var.as_ref(), add_generation_prompt, kwargs)
        .map_err(|e| ApiError::bad_request(format!("cannot apply the chat template: {e}"), Some("messages")))
}

/// What turns the chat path's SSE stream into another API's events (the
/// Messages and Responses adapters): each `data:` payload in order, or the
/// error that broke the stream.
pub trait ChatStreamTranslator: Send + 'static {
    /// The events for one `data:` payload (`[DONE]` included), appended to `out`.
    fn chunk(&mut self, data: &str, out: &mut String);
    /// The events for a stream broken by `message`.
    fn fail(&mut self, message: &str, out: &mut String);
}

/// `translator`'s events for the `data:` payloads of a chat stream, in
/// order (the adapters' unit tests).
#[cfg(test)]
pub fn translate_payloads(translator: &mut impl ChatStreamTranslator, payloads: &[&str]) -> String {
    let mut out = String::new();
    for data in payloads {
        translator.chunk(data, &mut out);
    }
    out
}

/// A chat-completion stream re-sent as `translator`'s events, payload by
/// payload (an event split across chunks waits for its end).
pub fn translate_chat_stream(response: Response, mut translator: impl ChatStreamTranslator) -> Response {
    let mut pending = String::new();
    let body = response.into_body().into_data_stream().map(move |chunk| {
        let mut out = String::new();
        match chunk {
            Ok(bytes) => {
                pending.push_str(&String::from_utf8_lossy(&bytes));
                while let Some(end) = pending.find("\n\n") {
                    let event: String = pending.drain(..end + 2).collect();
                    for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                        translator.chunk(data.trim(), &mut out);
                    }
                }
            }
            Err(e) => translator.fail(&e.to_string(), &mut out),
        }
        Ok::<_, Infallible>(Bytes::from(out))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| ApiError::internal(e.to_string()).into_response())
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    state.metrics.http_request();
    let req: ChatRequest = protocol::parse_body(&body)?;
    log_unknown(&req.unknown);
    let model = state.check_model(&req.common.model)?;
    let ChatPrompt { tools: tool_request, text: prompt_text, tokens: prompt } = chat_prompt(&state, &req)?;
    let logprobs = if req.logprobs.unwrap_or(false) {
        match req.top_logprobs.unwrap_or(0) {
            k if (0..=MAX_LOGPROBS as i64).contains(&k) => Some(k as usize),
            k => {
                return Err(ApiError::bad_request(
                    format!("top_logprobs must be between 0 and {}, got {k}", MAX_LOGPROBS),
                    Some("top_logprobs"),
                ))
            }
        }
    } else if req.top_logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::bad_request("top_logprobs requires logprobs to be true", Some("top_logprobs")));
    } else {
        None
    };
    let vocab = state.tokenizer.vocab_size();
    let mut params = protocol::sampling_params(&req.common, None, logprobs, vocab)?;
    // `required` and a named function constrain decoding to valid calls.
    let mut constraint_field = None;
    if let Some(constraint) = tool_request.as_ref().and_then(ToolRequest::constraint) {
        if let Some((field, _)) = protocol::structured_output_with_field(&req.common)? {
            return Err(ApiError::bad_request(
                format!("tool_choice \"required\" or a named function cannot be combined with {field}"),
                Some("tool_choice"),
            ));
        }
        params.structured_output = Some(constraint);
        constraint_field = Some("tools");
    }
    let format = Format {
        kind: Kind::Chat,
        model,
        created: unix_now(),
        logprobs,
        tokens_as_ids: req.common.return_tokens_as_token_ids.unwrap_or(false),
        include_usage: req.common.stream_options.as_ref().is_some_and(|o| o.include_usage),
        echo: None,
        tools: tool_request.as_ref().and_then(|t| t.parsing(state.tool_format)),
        reasoning: state.reasoning.map(|kind| kind.parser(&prompt_text)),
    };
    // A format whose markers are special tokens keeps them while calls may
    // be written (as vLLM's Mistral parser does); the token that ends the
    // output is never text.
    let keeps_markers = state.tool_format.keeps_special_tokens() && tool_request.as_ref().is_some_and(|t| t.choice == ToolChoice::Auto);
    let skip_special_tokens = !keeps_markers && req.common.skip_special_tokens.unwrap_or(true);
    let request = Request { id: request_id("chatcmpl"), prompts: vec![prompt], params, constraint_field, skip_special_tokens };
    generate(state, request, &req.common, format).await
}

/// A chat request's tools (checked) and its prompt.
struct ChatPrompt {
    tools: Option<ToolRequest>,
    /// The messages rendered by the template with those tools.
    text: String,
    /// `text` tokenized. The template writes the special tokens (vLLM's
    /// default `add_special_tokens: false` for chat).
    tokens: Vec<TokenId>,
}

fn chat_prompt(state: &AppState, req: &ChatRequest) -> Result<ChatPrompt, ApiError> {
    let tools = ToolRequest::parse(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    let text =
        render_chat(state, &req.messages, tools.as_ref(), req.add_generation_prompt.unwrap_or(true), req.chat_template_kwargs.as_ref())?;
    let tokens = encode(state, &text, false)?;
    Ok(ChatPrompt { tools, text, tokens })
}

/// The prompt tokens of a chat request (a chat-completion body), as
/// [`chat_completions`] would run it: Anthropic's `/v1/messages/count_tokens`.
pub async fn count_chat_tokens(state: &AppState, body: Value) -> Result<usize, ApiError> {
    let req: ChatRequest = serde_json::from_value(body).map_err(|e| ApiError::bad_request(e.to_string(), None))?;
    state.check_model(&req.common.model)?;
    Ok(chat_prompt(state, &req)?.tokens.len())
}

/// A request ready to run.
struct Request {
    id: String,
    prompts: Vec<Vec<TokenId>>,
    params: SamplingParams,
    /// The request field a structured-output constraint came from, where
    /// not one of the structured-output fields (tool calling: `tools`).
    constraint_field: Option<&'static str>,
    /// Whether special tokens are left out of the text.
    skip_special_tokens: bool,
}

async fn generate(state: Arc<AppState>, request: Request, common: &Common, format: Format) -> Result<Response, ApiError> {
    let Request { id, prompts, params, constraint_field, skip_special_tokens } = request;
    state.check_length(&prompts, params.max_tokens)?;
    check_structured_output(&state, &params, common, constraint_field).await?;
    state.admit()?;
    let span = tracing::info_span!("request", request_id = %id, user = common.user.as_deref().unwrap_or(""));
    let gen =
        Generation::start(state.clone(), id, prompts, &params, common.priority.unwrap_or(0), skip_special_tokens).instrument(span).await?;
    if common.stream.unwrap_or(false) {
        Ok(sse_response(state, gen, format))
    } else {
        collect(state, gen, format).await
    }
}

/// How long a structured-output constraint may take to compile.
const STRUCTURED_OUTPUT_COMPILE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Compiles the request's structured-output constraint, if any, on a
/// blocking thread with a deadline, so that a pathological schema is a 400
/// and never stalls the engine loop; the compiled grammar is cached, so the
/// engine's own compile is a cache hit.
async fn check_structured_output(
    state: &Arc<AppState>,
    params: &SamplingParams,
    common: &Common,
    field_override: Option<&'static str>,
) -> Result<(), ApiError> {
    let Some(spec) = params.structured_output.clone() else { return Ok(()) };
    // The field the request used, for the error messages (looked up only
    // on an error).
    let spec_field = spec.field();
    let field =
        || field_override.unwrap_or_else(|| protocol::structured_output_with_field(common).ok().flatten().map_or(spec_field, |(f, _)| f));
    let refuse = |message: String| {
        let field = field();
        ApiError::bad_request(format!("{field}: {message}"), Some(field))
    };
    let compiler =
        state.structured.clone().ok_or_else(|| refuse("structured outputs are not available for this model's tokenizer".into()))?;
    if params.beam_search.is_some() {
        return Err(refuse("structured outputs are not supported together with beam search".into()));
    }
    let job = tokio::task::spawn_blocking(move || compiler.compile(&spec).map(|_| ()));
    match tokio::time::timeout(STRUCTURED_OUTPUT_COMPILE_TIMEOUT, job).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(vellum_engine::Error::StructuredOutput { message, .. }))) => Err(refuse(message)),
        Ok(Ok(Err(e))) => Err(ApiError::from_engine(e)),
        Ok(Err(join)) => Err(refuse(format!("the constraint could not be compiled: {join}"))),
        Err(_) => Err(refuse(format!("the constraint took longer than {} s to compile", STRUCTURED_OUTPUT_COMPILE_TIMEOUT.as_secs()))),
    }
}

/// Per-choice accumulated output (non-streaming).
#[derive(Default)]
struct Choice {
    text: String,
    /// Where each piece's text ends in `text`, and its tokens (the parsers
    /// count reasoning tokens piece by piece).
    pieces: Vec<(usize, usize)>,
    tokens: Vec<TokenInfo>,
    finish_reason: Option<&'static str>,
    /// The stop string that ended it (`stop_reason`).
    stop_string: Option<String>,
}

async fn collect(state: Arc<AppState>, mut gen: Generation, f: Format) -> Result<Response, ApiError> {
    let mut choices: Vec<Choice> = (0..gen.num_choices()).map(|_| Choice::default()).collect();
    while let Some(pieces) = gen.next().await {
        for p in pieces? {
            if let Some(c) = choices.get_mut(p.choice) {
                c.text.push_str(&p.text);
                c.pieces.push((c.text.len(), p.num_tokens));
                c.tokens.extend(p.tokens);
                if p.finish_reason.is_some() {
                    c.finish_reason = p.finish_reason;
                    c.stop_string = p.stop_string;
                }
            }
        }
    }
    let n_per_prompt = choices.len() / f.echo.as_ref().map_or(1, |e| e.len().max(1));
    let mut usage = usage(gen.prompt_tokens, gen.completion_tokens());
    let mut reasoning_tokens = 0;
    let body = match f.kind {
        Kind::Completion => {
            let out: Vec<Value> = choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let prefix = f.echo.as_ref().and_then(|e| e.get(i / n_per_prompt.max(1))).cloned().unwrap_or_default();
                    let logprobs = f.logprobs.map(|_| completion_logprobs(&state, &c.tokens, &f, prefix.len()));
                    json!({"index": i, "text": prefix + &c.text, "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_string})
                })
                .collect();
            json!({"id": gen.id, "object": "text_completion", "created": f.created, "model": f.model, "choices": out, "usage": usage})
        }
        Kind::Chat => {
            let out: Vec<Value> = choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let logprobs = f.logprobs.map(|_| json!({"content": chat_logprobs(&state, &c.tokens, &f)}));
                    let (message, finish_reason, reasoning) = chat_message(&c, &f);
                    reasoning_tokens += reasoning;
                    json!({
                        "index": i,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                        "stop_reason": c.stop_string
                    })
                })
                .collect();
            if f.reasoning.is_some() {
                usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning_tokens});
            }
            json!({"id": gen.id, "object": "chat.completion", "created": f.created, "model": f.model, "choices": out, "usage": usage})
        }
    };
    Ok(json_response(body))
}

/// What a chat choice's text holds, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ChatEvent {
    /// Reasoning (`--reasoning-parser`).
    Reasoning(String),
    /// Content or a call.
    Tool(ToolEvent),
}

/// Splits one chat choice's text: reasoning first (with a reasoning
/// parser), then the rest through the tool-call parser (with tools), one
/// delta at a time.
struct ChoiceParser {
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolCallParser>,
}

impl ChoiceParser {
    fn new(f: &Format) -> Self {
        Self { reasoning: f.reasoning.clone(), tools: f.tools.as_ref().map(ToolParsing::parser) }
    }

    /// The next piece: its text and how many output tokens it holds.
    fn push(&mut self, text: &str, tokens: usize) -> Vec<ChatEvent> {
        let mut out = Vec::new();
        match self.reasoning.as_mut().map(|r| r.push_tokens(text, tokens)) {
            Some(events) => self.route(events, &mut out),
            None => self.content(text, &mut out),
        }
        out
    }

    fn finish(&mut self) -> Vec<ChatEvent> {
        let mut out = Vec::new();
        if let Some(events) = self.reasoning.as_mut().map(ReasoningParser::finish) {
            self.route(events, &mut out);
        }
        if let Some(t) = self.tools.as_mut() {
            out.extend(t.finish().into_iter().map(ChatEvent::Tool));
        }
        out
    }

    /// Output tokens spent reasoning so far.
    fn reasoning_tokens(&self) -> usize {
        self.reasoning.as_ref().map_or(0, ReasoningParser::reasoning_tokens)
    }

    /// Calls reported so far.
    fn num_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, ToolCallParser::num_calls)
    }

    fn route(&mut self, events: Vec<ReasoningEvent>, out: &mut Vec<ChatEvent>) {
        for e in events {
            match e {
                ReasoningEvent::Reasoning(t) => out.push(ChatEvent::Reasoning(t)),
                ReasoningEvent::Content(t) => self.content(&t, out),
            }
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<ChatEvent>) {
        match self.tools.as_mut() {
            Some(t) => out.extend(t.push(text).into_iter().map(ChatEvent::Tool)),
            None if text.is_empty() => {}
            None => out.push(ChatEvent::Tool(ToolEvent::Content(text.to_string()))),
        }
    }
}

/// A chat choice's finish reason, once its parser has seen all its text.
fn chat_finish_reason(f: &Format, parser: &ChoiceParser, engine_reason: &'static str) -> &'static str {
    match &f.tools {
        Some(t) => tools::finish_reason(&t.mode, parser.num_calls(), engine_reason),
        None => engine_reason,
    }
}

/// A whole chat choice: the message (reasoning, content and parsed tool
/// calls), its finish reason and its reasoning tokens.
fn chat_message(c: &Choice, f: &Format) -> (Value, Option<&'static str>, usize) {
    if f.tools.is_none() && f.reasoning.is_none() {
        return (json!({"role": "assistant", "content": c.text}), c.finish_reason, 0);
    }
    let mut parser = ChoiceParser::new(f);
    // Piece by piece, as streamed: the same split, and the tokens of each.
    let mut events = Vec::new();
    let mut start = 0;
    for &(end, tokens) in &c.pieces {
        events.extend(parser.push(c.text.get(start..end).unwrap_or_default(), tokens));
        start = end;
    }
    events.extend(parser.push(c.text.get(start..).unwrap_or_default(), 0));
    events.extend(parser.finish());
    let mut whole = Assembled::default();
    let mut reasoning: Option<String> = None;
    for e in events {
        match e {
            ChatEvent::Reasoning(t) => reasoning.get_or_insert_with(String::new).push_str(&t),
            ChatEvent::Tool(e) => whole.apply(vec![e]),
        }
    }
    let mut message = json!({"role": "assistant", "content": whole.content});
    if f.reasoning.is_some() {
        message["reasoning_content"] = json!(reasoning);
    }
    if whole.calls.is_empty() {
        message["content"] = json!(whole.content.unwrap_or_default());
    } else {
        let calls: Vec<Value> = whole
            .calls
            .into_iter()
            .map(|(name, arguments)| json!({"id": request_id("call"), "type": "function", "function": {"name": name, "arguments": arguments}}))
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    let finish_reason = c.finish_reason.map(|r| chat_finish_reason(f, &parser, r));
    (message, finish_reason, parser.reasoning_tokens())
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn completion_logprobs(state: &AppState, tokens: &[TokenInfo], f: &Format, start_offset: usize) -> Value {
    let mut offset = start_offset;
    let mut texts = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for t in tokens {
        let text = state.token_text(t.id, f.tokens_as_ids);
        offsets.push(offset);
        offset += text.len();
        texts.push(text);
        lps.push(finite(t.logprob));
        let mut top = Map::new();
        for &(id, lp) in &t.top {
            top.insert(state.token_text(id, f.tokens_as_ids), finite(lp));
        }
        tops.push(Value::Object(top));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

fn chat_logprobs(state: &AppState, tokens: &[TokenInfo], f: &Format) -> Vec<Value> {
    let k = f.logprobs.unwrap_or(0);
    tokens
        .iter()
        .map(|t| {
            let text = state.token_text(t.id, f.tokens_as_ids);
            let top: Vec<Value> = t
                .top
                .iter()
                .take(k)
                .map(|&(id, lp)| {
                    let s = state.token_text(id, f.tokens_as_ids);
                    json!({"token": s, "logprob": finite(lp), "bytes": s.as_bytes()})
                })
                .collect();
            json!({"token": text, "logprob": finite(t.logprob), "bytes": text.as_bytes(), "top_logprobs": top})
        })
        .collect()
}

/// JSON has no -inf: clamp as vLLM does.
fn finite(v: f32) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        json!(-9999.0)
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

struct SseState {
    state: Arc<AppState>,
    gen: Generation,
    f: Format,
    queued: std::collections::VecDeque<Bytes>,
    done: bool,
    /// Chat with tools or a reasoning parser: one parser per choice.
    parsers: Vec<ChoiceParser>,
}

fn chunk(s: &SseState, choices: Vec<Value>) -> Value {
    let object = if s.f.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
    let mut v = json!({"id": s.gen.id, "object": object, "created": s.f.created, "model": s.f.model, "choices": choices});
    if s.f.include_usage {
        v["usage"] = Value::Null;
    }
    v
}

fn piece_choice(s: &SseState, p: &Piece) -> Value {
    match s.f.kind {
        Kind::Completion => {
            let logprobs = s.f.logprobs.map(|_| completion_logprobs(&s.state, &p.tokens, &s.f, 0));
            json!({"index": p.choice, "text": p.text, "logprobs": logprobs, "finish_reason": p.finish_reason, "stop_reason": p.stop_string})
        }
        Kind::Chat => {
            let delta = if p.text.is_empty() && p.finish_reason.is_some() { json!({}) } else { json!({"content": p.text}) };
            let logprobs = s.f.logprobs.map(|_| json!({"content": chat_logprobs(&s.state, &p.tokens, &s.f)}));
            json!({"index": p.choice, "delta": delta, "logprobs": logprobs, "finish_reason": p.finish_reason, "stop_reason": p.stop_string})
        }
    }
}

/// The chunks' choices for one piece of a chat with tools or a reasoning
/// parser: its text goes through the choice's parser; reasoning, content,
/// each call's opening (id, name) and each piece of arguments become
/// `delta`s of their own; the finish reason comes last, after everything
/// the parser held back.
fn parsed_piece_choices(s: &mut SseState, p: &Piece) -> Vec<Value> {
    let Some(parser) = s.parsers.get_mut(p.choice) else { return Vec::new() };
    let mut events = parser.push(&p.text, p.num_tokens);
    let finish_reason = p.finish_reason.map(|r| {
        events.extend(parser.finish());
        chat_finish_reason(&s.f, parser, r)
    });
    let mut deltas: Vec<Value> = Vec::with_capacity(events.len() + 1);
    for e in events {
        deltas.push(match e {
            ChatEvent::Reasoning(text) => json!({"reasoning_content": text}),
            ChatEvent::Tool(ToolEvent::Content(text)) => json!({"content": text}),
            ChatEvent::Tool(ToolEvent::CallStart { index, name }) => {
                json!({"tool_calls": [{"index": index, "id": request_id("call"), "type": "function", "function": {"name": name, "arguments": ""}}]})
            }
            ChatEvent::Tool(ToolEvent::Arguments { index, fragment }) => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            }
        });
    }
    let logprobs = s.f.logprobs.map(|_| json!({"content": chat_logprobs(&s.state, &p.tokens, &s.f)}));
    if deltas.is_empty() && (logprobs.is_some() || finish_reason.is_some()) {
        deltas.push(json!({}));
    }
    let last = deltas.len().saturating_sub(1);
    deltas
        .into_iter()
        .enumerate()
        .map(|(i, delta)| {
            let lp = if i == 0 { logprobs.clone() } else { None };
            let (finish_reason, stop_string) = if i == last { (finish_reason, p.stop_string.as_deref()) } else { (None, None) };
            json!({"index": p.choice, "delta": delta, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_string})
        })
        .collect()
}

fn sse_response(state: Arc<AppState>, gen: Generation, f: Format) -> Response {
    let n = gen.num_choices();
    let parsers = if f.tools.is_some() || f.reasoning.is_some() { (0..n).map(|_| ChoiceParser::new(&f)).collect() } else { Vec::new() };
    let mut s = SseState { state, gen, f, queued: Default::default(), done: false, parsers };
    // Opening chunks: the assistant role (chat) or the echoed prompt.
    match s.f.kind {
        Kind::Chat => {
            let choices = (0..n)
                .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                .collect();
            let c = chunk(&s, choices);
            s.queued.push_back(sse(&c));
        }
        Kind::Completion => {
            if let Some(echo) = s.f.echo.clone() {
                let per = (n / echo.len().max(1)).max(1);
                let choices =
                    (0..n).map(|i| json!({"index": i, "text": echo.get(i / per).cloned().unwrap_or_default(), "logprobs": null, "finish_reason": null})).collect();
                let c = chunk(&s, choices);
                s.queued.push_back(sse(&c));
            }
        }
    }
    let body = stream::unfold(s, |mut s| async move {
        loop {
            if let Some(b) = s.queued.pop_front() {
                return Some((Ok::<Bytes, Infallible>(b), s));
            }
            if s.done {
                return None;
            }
            match s.gen.next().await {
                Some(Ok(pieces)) if !s.parsers.is_empty() => {
                    for p in &pieces {
                        for choice in parsed_piece_choices(&mut s, p) {
                            let c = chunk(&s, vec![choice]);
                            s.queued.push_back(sse(&c));
                        }
                    }
                }
                Some(Ok(pieces)) => {
                    let choices: Vec<Value> = pieces.iter().map(|p| piece_choice(&s, p)).collect();
                    let c = chunk(&s, choices);
                    s.queued.push_back(sse(&c));
                }
                Some(Err(e)) => {
                    s.queued.push_back(sse(&e.body()));
                    s.queued.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    s.done = true;
                }
                None => {
                    if s.f.include_usage {
                        let object = if s.f.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
                        let mut usage = usage(s.gen.prompt_tokens, s.gen.completion_tokens());
                        if s.f.kind == Kind::Chat && s.f.reasoning.is_some() {
                            let reasoning: usize = s.parsers.iter().map(ChoiceParser::reasoning_tokens).sum();
                            usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning});
                        }
                        let v = json!({
                            "id": s.gen.id, "object": object, "created": s.f.created, "model": s.f.model,
                            "choices": [], "usage": usage
                        });
                        s.queued.push_back(sse(&v));
                    }
                    s.queued.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    s.done = true;
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| ApiError::internal("building the response failed").into_response())
}

/// `GET /v1/models`.
pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    let data: Vec<Value> = state
        .served_names
        .iter()
        .map(|n| {
            json!({"id": n, "object": "model", "created": state.created, "owned_by": "vellum", "root": state.model_path, "parent": null, "max_model_len": state.max_model_len})
        })
        .collect();
    json_response(json!({"object": "list", "data": data}))
}

/// `POST /tokenize`: `{"prompt": "..."}` or `{"messages": [...]}`.
pub async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Req {
        model: Option<String>,
        prompt: Option<String>,
        messages: Option<Vec<protocol::Message>>,
        tools: Option<Value>,
        add_special_tokens: Option<bool>,
        add_generation_prompt: Option<bool>,
        chat_template_kwargs: Option<Map<String, Value>>,
    }
    let req: Req = protocol::parse_body(&body)?;
    state.check_model(&req.model)?;
    let text = match (&req.prompt, &req.messages) {
        (Some(p), None) => p.clone(),
        (None, Some(m)) => {
            let tools = ToolRequest::parse(req.tools.as_ref(), None, None)?;
            render_chat(&state, m, tools.as_ref(), req.add_generation_prompt.unwrap_or(true), req.chat_template_kwargs.as_ref())?
        }
        _ => return Err(ApiError::bad_request("give exactly one of prompt or messages", Some("prompt"))),
    };
    let tokens = state
        .tokenizer
        .encode(&text, req.add_special_tokens.unwrap_or(true))
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize: {e}"), Some("prompt")))?;
    Ok(json_response(json!({"count": tokens.len(), "max_model_len": state.max_model_len, "tokens": tokens})))
}

/// `POST /detokenize`: `{"tokens": [...]}`.
pub async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Req {
        model: Option<String>,
        tokens: Vec<i64>,
    }
    let req: Req = protocol::parse_body(&body)?;
    state.check_model(&req.model)?;
    let ids = protocol::token_prompt(&req.tokens, state.tokenizer.vocab_size()).map_err(|mut e| {
        e.param = Some("tokens".into());
        e
    })?;
    let text = state.tokenizer.decode(&ids, false).map_err(|e| ApiError::bad_request(format!("cannot detokenize: {e}"), Some("tokens")))?;
    Ok(json_response(json!({"prompt": text})))
}

/// `GET /version`.
pub async fn version() -> Response {
    json_response(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// `GET /server_info` (and SGLang's older `/get_server_info`): what a router
/// such as `sglang-router` labels a worker with when it registers it.
pub async fn server_info(State(state): State<Arc<AppState>>) -> Response {
    json_response(json!({
        "model_path": state.model_path,
        "served_model_name": state.served_names[0],
        "version": env!("CARGO_PKG_VERSION"),
        "dp_size": 1,
        "max_model_len": state.max_model_len,
    }))
}

/// `GET /model_info` (and `/get_model_info`): the model a router routes to.
pub async fn model_info(State(state): State<Arc<AppState>>) -> Response {
    json_response(json!({
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": state.embedding.is_none(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::reasoning::ReasoningParserKind;
    use crate::serve::tools::{ParseMode, ToolFormat};

    fn chat_format(tools: Option<ToolParsing>, reasoning: Option<ReasoningParser>) -> Format {
        let (model, created, logprobs, tokens_as_ids, include_usage, echo) = (String::new(), 0, None, false, false, None);
        Format { kind: Kind::Chat, model, created, logprobs, tokens_as_ids, include_usage, echo, tools, reasoning }
    }

    /// The events of `text` in two deltas cut at `at`, merged by kind.
    fn parse_in_two(f: &Format, text: &str, at: usize) -> (String, Assembled) {
        let mut p = ChoiceParser::new(f);
        let mut events = p.push(&text[..at], 0);
        events.extend(p.push(&text[at..], 0));
        events.extend(p.finish());
        let (mut reasoning, mut rest) = (String::new(), Assembled::default());
        for e in events {
            match e {
                ChatEvent::Reasoning(t) => reasoning.push_str(&t),
                ChatEvent::Tool(e) => rest.apply(vec![e]),
            }
        }
        (reasoning, rest)
    }

    /// A Qwen3 reply: reasoning, then a call, the same at every split.
    #[test]
    fn reasoning_then_a_call_agree_at_every_split() {
        let tools = ToolParsing { mode: ParseMode::Auto(ToolFormat::Hermes), parallel: true, functions: Arc::from(Vec::new()) };
        let f = chat_format(Some(tools), Some(ReasoningParserKind::Qwen3.parser("<|im_start|>assistant\n")));
        let text = "<think>\nThe user wants Paris weather. I'll call get_weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let whole = parse_in_two(&f, text, text.len());
        assert_eq!(whole.0, "\nThe user wants Paris weather. I'll call get_weather.\n");
        assert_eq!(whole.1.calls, vec![("get_weather".to_string(), r#"{"city":"Paris"}"#.to_string())]);
        assert_eq!(whole.1.content, None);
        for at in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            assert_eq!(parse_in_two(&f, text, at), whole, "cut at {at}");
        }
        // Reasoning alone (no tools): the answer is content.
        let f = chat_format(None, Some(ReasoningParserKind::DeepseekR1.parser("")));
        let (reasoning, rest) = parse_in_two(&f, "Simple.</think>\n\n4", 3);
        assert_eq!((reasoning.as_str(), rest.content.as_deref()), ("Simple.", Some("4")));
    }
}
