//! `vellum serve`: the OpenAI-compatible HTTP server (thesis §4.1–4.2).
//!
//! ```text
//!  HTTP (axum, 2 tokio workers) ──add_request──▶ EngineClient ──▶ engine thread (steps)
//!        ▲                                                │
//!        └──────────── RequestStream (deltas) ◀───────────┘
//! ```
//!
//! Each HTTP request holds the [`vellum_engine::RequestStream`]s of its
//! engine requests; dropping them (client gone) aborts the requests and
//! frees their KV blocks before the next engine step.

mod anthropic;
mod embeddings;
mod error;
mod generation;
mod metrics;
mod openai;
mod protocol;
mod python_literal;
mod reasoning;
mod responses;
mod tool_format;
mod tools;

use crate::cli::engine_flags::{EngineDefaults, EngineFlags};
use anyhow::{anyhow, bail, Context, Result};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use error::ApiError;
use metrics::Metrics;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use vellum_engine::EngineClient;
use vellum_models::{ChatTemplate, Tokenizer};

/// Arguments of `vellum serve` (named and defaulted like vLLM's).
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A .gguf file, a Hugging Face directory, a hub id in the local cache,
    /// or a short name fetched on first use: smollm2-135m (the default,
    /// SmolLM2-135M-Instruct Q4_1), gemma3-270m (Gemma 3 270M Q4_K_M).
    pub model: Option<String>,
    /// The model, as a flag (vLLM accepts both forms).
    #[arg(long = "model", value_name = "MODEL", conflicts_with = "model")]
    pub model_flag: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the chosen one is logged).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer <KEY>` (or `x-api-key: <KEY>`) on
    /// /v1/* (also read from VLLM_API_KEY).
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Model name(s) the API answers to (default: the model argument, or
    /// SmolLM2-135M-Instruct). The first is the one reported.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// A chat template: a file, or the Jinja source itself (default: the
    /// model's own).
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Accepted for vLLM compatibility: `tool_choice: "auto"` is always
    /// available (calls are parsed only from requests that give `tools`).
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// How `auto` tool calls are read from the output (and asked for by
    /// the default tool prompt, used when the chat template does not read
    /// `tools`): `hermes` and `qwen3` (`<tool_call>{"name": ..., "arguments":
    /// ...}</tool_call>` blocks), `qwen3_coder` (`<tool_call><function=f>
    /// <parameter=x>...`), `llama3_json` (`{"name": ..., "parameters": ...}`
    /// objects opening the output), `mistral` (`[TOOL_CALLS]` then a JSON
    /// list, or `name[ARGS]{...}`; special tokens are kept for requests with
    /// tools), `pythonic` (`[f(x=1), g()]` opening the output) or `gemma3`
    /// (pythonic, or calls in a ```tool_code fence).
    #[arg(long, value_enum, default_value = "hermes")]
    pub tool_call_parser: ToolCallParserKind,
    /// Splits the model's reasoning from its answer (`reasoning_content` in
    /// chat completions, a `reasoning` item in the Responses API, a
    /// `thinking` block in the Messages API): `deepseek_r1` (the output
    /// starts inside `<think>`; reasoning ends at `</think>`) or `qwen3`
    /// (reasoning when the output opens with `<think>`, or the prompt ends
    /// inside one). Unset: the output is all content.
    #[arg(long, value_enum)]
    pub reasoning_parser: Option<ReasoningParserKind>,
    /// Requests allowed to wait before new ones get 503.
    #[arg(long, default_value_t = 4096)]
    pub max_waiting_requests: usize,
    /// Events (one per sequence per step) a streaming response may hold
    /// unsent while its client does not read; beyond them the request is
    /// aborted, its KV blocks are freed and its stream ends with an error
    /// event (`vellum:requests_aborted_slow_reader_total`). At least 2.
    #[arg(long, default_value_t = vellum_engine::STREAM_BUFFER_EVENTS)]
    pub max_stream_buffer_events: usize,
    /// Largest request body accepted, in bytes; a larger one gets 413.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_request_body_bytes: usize,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before
    /// they are aborted.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_timeout: f64,
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// `--tool-call-parser` values (vLLM's names).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallParserKind {
    /// `<tool_call>` blocks holding a JSON call or a list of calls.
    Hermes,
    /// Qwen3's calls: Hermes blocks.
    Qwen3,
    /// Qwen3-Coder's `<tool_call><function=name><parameter=x>` blocks.
    #[value(name = "qwen3_coder", alias = "qwen3_xml")]
    Qwen3Coder,
    /// Llama 3.1/3.2's JSON calls, `;`-separated, opening the output.
    #[value(name = "llama3_json")]
    Llama3Json,
    /// `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}`.
    Mistral,
    /// A Python list of calls opening the output.
    Pythonic,
    /// Pythonic, or calls in a ```tool_code fence.
    Gemma3,
}

impl ToolCallParserKind {
    /// The format the parser reads.
    pub fn format(self) -> tool_format::ToolFormat {
        use tool_format::ToolFormat;
        match self {
            ToolCallParserKind::Hermes | ToolCallParserKind::Qwen3 => ToolFormat::Hermes,
            ToolCallParserKind::Qwen3Coder => ToolFormat::Qwen3Coder,
            ToolCallParserKind::Llama3Json => ToolFormat::Llama3Json,
            ToolCallParserKind::Mistral => ToolFormat::Mistral,
            ToolCallParserKind::Pythonic => ToolFormat::Pythonic,
            ToolCallParserKind::Gemma3 => ToolFormat::Gemma3,
        }
    }
}

/// `--reasoning-parser` values (vLLM's names).
pub use reasoning::ReasoningParserKind;

/// What every handler shares.
pub struct AppState {
    engine: EngineClient,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    /// How `auto` tool calls are written (`--tool-call-parser`).
    tool_format: tool_format::ToolFormat,
    /// How reasoning is split from the answer (`--reasoning-parser`).
    reasoning: Option<ReasoningParserKind>,
    served_names: Vec<String>,
    model_path: String,
    max_model_len: usize,
    api_key: Option<String>,
    max_waiting_requests: usize,
    max_request_body_bytes: usize,
    metrics: Metrics,
    created: u64,
    shutting_down: AtomicBool,
    /// Compiles structured-output constraints (checked here, off the engine
    /// loop, before a request is queued); `None` if the tokenizer allows none.
    structured: Option<Arc<vellum_engine::structured::StructuredOutputs>>,
    /// The Responses API's stored responses (`previous_response_id`, `GET`).
    responses: Arc<std::sync::Mutex<responses::ResponseStore>>,
    /// An embedding engine's pooling (`--task embed`); `None`: it generates.
    embedding: Option<vellum_engine::EmbeddingSpec>,
}

fn load_chat_template(spec: &str, tokenizer: &Tokenizer) -> Result<ChatTemplate> {
    let path = std::path::Path::new(spec);
    let source = if path.is_file() {
        std::fs::read_to_string(path).with_context(|| format!("reading --chat-template {spec}"))?
    } else if spec.contains("{{") || spec.contains("{%") {
        spec.to_string()
    } else {
        bail!("--chat-template {spec:?} is neither a file nor a Jinja template");
    };
    let piece = |id: Option<u32>| id.and_then(|i| tokenizer.token_to_piece(i));
    let eos = piece(tokenizer.eos_token_ids().first().copied());
    ChatTemplate::new(source, piece(tokenizer.bos_token_id()), eos).map_err(|e| anyhow!("--chat-template: {e}"))
}

/// Constant-time comparison (no early exit on the first differing byte).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= (x ^ y) as u64;
    }
    diff == 0
}

async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        // `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`.
        let bearer = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        let given = bearer.or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok())).unwrap_or("");
        if !constant_time_eq(given.trim().as_bytes(), key.as_bytes()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.shutting_down.load(Ordering::Relaxed) || !state.engine.is_alive() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn metrics_handler(State(state): State<Arc<AppState>>) -> Response {
    let body = state.metrics.render(&state.engine.stats());
    Response::builder()
        .header(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")
        .body(Body::from(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("No route for {} {}", req.method(), req.uri().path()))
}

/// The router (every endpoint), for a given state.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/embeddings", post(embeddings::create))
        .route("/v1/models", get(openai::models))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_api_key));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics_handler))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/version", get(openai::version))
        .route("/server_info", get(openai::server_info))
        .route("/get_server_info", get(openai::server_info))
        .route("/model_info", get(openai::model_info))
        .route("/get_model_info", get(openai::model_info))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(state.max_request_body_bytes))
        .layer(axum::middleware::map_response(framework_errors_as_json))
        .with_state(state)
}

/// Errors the HTTP framework answers by itself (405 wrong method, 413 body
/// too large, a body that is not UTF-8...) as plain text get vLLM's JSON
/// error shape, like every other error.
async fn framework_errors_as_json(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json") || v.starts_with("text/event-stream"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    // Framework error bodies are a line of text; anything longer is cut.
    let text = axum::body::to_bytes(response.into_body(), 4096).await.map(|b| String::from_utf8_lossy(&b).trim().to_string());
    let message = match text {
        Ok(t) if !t.is_empty() => t,
        _ => status.canonical_reason().unwrap_or("error").to_string(),
    };
    ApiError { status, message, param: None }.into_response()
}

/// Runs `vellum serve` until SIGINT/SIGTERM.
pub fn run(mut args: ServeArgs) -> Result<()> {
    if !(args.shutdown_timeout >= 0.0 && args.shutdown_timeout.is_finite()) {
        bail!("--shutdown-timeout must be a non-negative number of seconds");
    }
    if args.model.is_none() {
        args.model = args.model_flag.take();
    }
    let engine_args = args.engine.engine_args(args.model.clone(), EngineDefaults::serving(&args.engine.device))?;
    tracing::info!(model = args.model.as_deref().unwrap_or("default (SmolLM2-135M-Instruct Q4_1)"), "loading model");
    let mut llm = crate::cli::load_with_progress(engine_args)?;
    let max_model_len = llm.engine().max_model_len();
    if let Some(asked) = args.engine.max_model_len {
        if asked > max_model_len {
            tracing::warn!(asked, max_model_len, "--max-model-len is above the model's context; capped");
        }
    }
    let structured = llm.structured_outputs();
    let embedding = llm.embedding();
    let (engine, tokenizer, model_template) = llm.into_client_with_stream_buffer(args.max_stream_buffer_events);
    let chat_template = match &args.chat_template {
        Some(spec) => Some(load_chat_template(spec, &tokenizer)?),
        None => model_template,
    };
    let model_path = args.model.clone().unwrap_or_else(|| "SmolLM2-135M-Instruct".to_string());
    let served_names = if args.served_model_name.is_empty() { vec![model_path.clone()] } else { args.served_model_name.clone() };
    let state = Arc::new(AppState {
        engine: engine.clone(),
        tokenizer,
        chat_template,
        tool_format: args.tool_call_parser.format(),
        reasoning: args.reasoning_parser,
        metrics: Metrics::new(&served_names[0], max_model_len),
        served_names,
        model_path,
        max_model_len,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_waiting_requests: args.max_waiting_requests,
        max_request_body_bytes: args.max_request_body_bytes,
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        shutting_down: AtomicBool::new(false),
        structured,
        responses: Default::default(),
        embedding,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = runtime.block_on(serve(state, &args));
    engine.shutdown();
    runtime.shutdown_timeout(Duration::from_secs(1));
    result?;
    tracing::info!("server stopped");
    Ok(())
}

async fn shutdown_signal() -> &'static str {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => "SIGINT",
        _ = term => "SIGTERM",
    }
}

async fn serve(state: Arc<AppState>, args: &ServeArgs) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    tracing::info!(
        url = format!("http://{addr}"),
        model = state.served_names[0],
        max_model_len = state.max_model_len,
        api_key = state.api_key.is_some(),
        "serving (OpenAI API under /v1)"
    );
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let stop_on_engine_death = stop_tx.clone();
    let deadline = Duration::from_secs_f64(args.shutdown_timeout);
    let st = state.clone();
    tokio::spawn(async move {
        let which = shutdown_signal().await;
        tracing::info!(
            signal = which,
            deadline_s = deadline.as_secs_f64(),
            "shutting down: no new requests; in-flight ones get the deadline"
        );
        st.shutting_down.store(true, Ordering::Relaxed);
        let _ = stop_tx.send(true);
        tokio::time::sleep(deadline).await;
        let running = st.engine.stats();
        if running.num_running + running.num_waiting + running.num_swapped > 0 {
            tracing::warn!(running = running.num_running, waiting = running.num_waiting, "deadline passed: aborting in-flight requests");
        }
        // Aborts what is left: streams end with finish_reason "abort".
        let engine = st.engine.clone();
        let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
        // Connections that still hang on get a few seconds more.
        tokio::time::sleep(Duration::from_secs(3)).await;
        tracing::warn!("connections still open after the deadline; exiting");
        std::process::exit(0);
    });
    // The engine thread died (a panic): every live stream already ended with
    // an error; stop taking requests, let the responses flush, and exit
    // non-zero so a supervisor restarts the server (vLLM does the same).
    let engine_died = Arc::new(AtomicBool::new(false));
    let (st, died) = (state.clone(), engine_died.clone());
    let mut stop_rx2 = stop_rx.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = stop_rx2.wait_for(|v| *v) => return,
            }
            if !st.engine.is_alive() {
                tracing::error!("the engine thread died: /health now fails; closing the server (exit status 1)");
                died.store(true, Ordering::SeqCst);
                st.shutting_down.store(true, Ordering::Relaxed);
                let _ = stop_on_engine_death.send(true);
                tokio::time::sleep(Duration::from_secs(10)).await;
                tracing::error!("connections still open 10 s after the engine died; exiting");
                std::process::exit(1);
            }
        }
    });
    let app = router(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop_rx.wait_for(|v| *v).await;
        })
        .await
        .context("serving")?;
    if engine_died.load(Ordering::SeqCst) {
        bail!("the engine thread died (see the error above)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_whole_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
