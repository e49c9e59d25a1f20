//! OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`
//! and `DELETE /v1/responses/{id}` — what the Agents SDK and Codex CLI speak.
//!
//! As the Messages API does (`anthropic.rs`), a Responses request becomes a
//! chat-completion request run by the chat path itself
//! ([`openai::chat_completions`]: the chat template, tool calling,
//! structured outputs, sampling, admission, metrics), and the answer is
//! translated back:
//!
//! | Responses | chat completion |
//! |---|---|
//! | `instructions` | a first `system` message (not carried over by `previous_response_id`) |
//! | `input`: a string, or `message` items (`input_text`/`output_text` parts; role `developer` as `system`) | messages |
//! | `function_call` items / `function_call_output` items | an assistant's `tool_calls` / `tool` messages |
//! | `tools` (`type: "function"`), `tool_choice`, `parallel_tool_calls` | the same, in the chat shape |
//! | `text.format` `json_schema` / `json_object` | `response_format` (structured outputs) |
//! | `max_output_tokens`, `temperature`, `top_p` | `max_tokens`, … |
//! | `previous_response_id` | the stored conversation, before this input |
//! | `output`: a `reasoning` item (one `reasoning_text` part), a `message` item with `output_text`, then `function_call` items | `reasoning_content` (`--reasoning-parser`), `content`, `tool_calls` |
//! | `usage.output_tokens_details.reasoning_tokens` | `usage.completion_tokens_details.reasoning_tokens` (`--reasoning-parser`: the output tokens from the reasoning's start through the one closing it) |
//! | `status` `incomplete`, `incomplete_details.reason` `max_output_tokens` | `finish_reason` `length` |
//!
//! Responses are stored (unless `store: false`) in a bounded, in-memory
//! store of the last [`STORE_CAPACITY`]: what `previous_response_id`,
//! `GET` and `DELETE` reach. Streaming turns the chat chunks into the typed
//! events, each with its `sequence_number`: `response.created`,
//! `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta` …
//! `.done` (`response.reasoning_text.delta` … `.done` for a `reasoning`
//! item, with `--reasoning-parser`), `response.function_call_arguments.delta` … `.done`,
//! `response.output_item.done`, and last `response.completed` (or
//! `response.incomplete`, or `response.failed` when the engine fails
//! mid-stream). `reasoning.effort` reaches the chat template as
//! `reasoning_effort` (and `none` as `enable_thinking: false`); a field this
//! server does not implement (hosted tools, images, background mode, …) is
//! a 400 naming it.

use super::error::ApiError;
use super::openai::{self, ChatStreamTranslator};
use super::AppState;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Responses kept for `previous_response_id`, `GET` and `DELETE`; the
/// oldest goes first.
pub const STORE_CAPACITY: usize = 1024;

/// The request fields implemented (or accepted as hints); any other is
/// refused by name.
const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "previous_response_id",
    "store",
    "metadata",
    "user",
    "truncation",
    "reasoning",
    "include",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// A stored response and the conversation that led to it, as chat messages
/// (its instructions left out: they do not carry over).
#[derive(Clone)]
struct Stored {
    response: Value,
    conversation: Vec<Value>,
}

/// The bounded store of responses.
#[derive(Default)]
pub struct ResponseStore {
    by_id: HashMap<String, Stored>,
    order: VecDeque<String>,
}

impl ResponseStore {
    fn insert(&mut self, id: String, stored: Stored) {
        if self.by_id.insert(id.clone(), stored).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > STORE_CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.by_id.remove(&old);
            }
        }
    }

    fn get(&self, id: &str) -> Option<Stored> {
        self.by_id.get(id).cloned()
    }

    fn remove(&mut self, id: &str) -> bool {
        self.order.retain(|x| x != id);
        self.by_id.remove(id).is_some()
    }
}

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

/// The text of a content that is a string or a list of text parts
/// (`input_text`, `output_text`, `text`).
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(bad(format!("{at}.{j}: a {} part is not supported here", kind.unwrap_or("(untyped)")), at));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(format!("{at}: expected a string or a list of text parts"), at)),
    }
}

/// The `input` as chat messages.
fn input_messages(input: &Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) => items,
        _ => return Err(bad("input: expected a string or a list of items", "input")),
    };
    let mut out: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input.{i}");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or(if item.get("role").is_some() { "message" } else { "" });
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.role: field required"), "input"))?;
                let role = match role {
                    "user" | "assistant" | "system" => role,
                    "developer" => "system",
                    other => return Err(bad(format!("{at}.role: unknown role {other:?}"), "input")),
                };
                let content = item.get("content").ok_or_else(|| bad(format!("{at}.content: field required"), "input"))?;
                out.push(json!({"role": role, "content": text_of(content, &format!("{at}.content"))?}));
            }
            "function_call" => {
                let field = |k: &str| {
                    item.get(k).and_then(Value::as_str).map(str::to_string).ok_or_else(|| bad(format!("{at}.{k}: field required"), "input"))
                };
                let call = json!({"id": field("call_id")?, "type": "function",
                                  "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls of one turn join the assistant message before them.
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    Some(last) if last["role"] == "assistant" => last["tool_calls"] = json!([call]),
                    _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let id =
                    item.get("call_id").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.call_id: field required"), "input"))?;
                let output = item.get("output").ok_or_else(|| bad(format!("{at}.output: field required"), "input"))?;
                out.push(json!({"role": "tool", "tool_call_id": id, "content": text_of(output, &format!("{at}.output"))?}));
            }
            // A model's earlier reasoning, sent back by agents: nothing to render.
            "reasoning" => {}
            "" => return Err(bad(format!("{at}.type: field required"), "input")),
            other => return Err(bad(format!("{at}: items of type {other:?} are not supported"), "input")),
        }
    }
    Ok(out)
}

/// `reasoning`'s effort, checked (`summary` is accepted and has no
/// effect: reasoning items carry the reasoning text itself).
fn reasoning_effort(reasoning: Option<&Value>) -> Result<Option<&str>, ApiError> {
    const EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh"];
    const SUMMARIES: &[&str] = &["auto", "concise", "detailed"];
    let Some(r) = reasoning.filter(|v| !v.is_null()) else { return Ok(None) };
    let r = r.as_object().ok_or_else(|| bad("reasoning: expected an object", "reasoning"))?;
    for (key, value) in r {
        match (key.as_str(), value) {
            (_, Value::Null) => {}
            ("effort", Value::String(e)) if EFFORTS.contains(&e.as_str()) => {}
            ("summary" | "generate_summary", Value::String(s)) if SUMMARIES.contains(&s.as_str()) => {}
            ("effort", _) => return Err(bad(format!("reasoning.effort: one of {}", EFFORTS.join(", ")), "reasoning")),
            ("summary" | "generate_summary", _) => {
                return Err(bad(format!("reasoning.{key}: one of {}", SUMMARIES.join(", ")), "reasoning"))
            }
            (other, _) => return Err(bad(format!("reasoning.{other} is not supported"), "reasoning")),
        }
    }
    Ok(r.get("effort").and_then(Value::as_str))
}

/// The Responses request as a chat-completion request body, after the
/// stored conversation of `previous` (its messages).
fn to_chat_request(req: &Map<String, Value>, previous: &[Value]) -> Result<Value, ApiError> {
    let unknown: Vec<&str> = req.keys().map(String::as_str).filter(|k| !KNOWN.contains(k)).collect();
    if let Some(first) = unknown.first() {
        return Err(bad(format!("unsupported field(s): {}", unknown.join(", ")), first));
    }
    let refuse_unless = |key: &str, ok: &dyn Fn(&Value) -> bool, why: &str| match req.get(key) {
        Some(v) if !v.is_null() && !ok(v) => Err(bad(format!("{key}: {why}"), key)),
        _ => Ok(()),
    };
    refuse_unless("truncation", &|v| v == "disabled", "only \"disabled\" is supported (a prompt past the context is an error)")?;
    let effort = reasoning_effort(req.get("reasoning"))?;
    refuse_unless(
        "include",
        &|v| v.as_array().is_some_and(|a| a.iter().all(|x| x == "reasoning.encrypted_content")),
        "only \"reasoning.encrypted_content\" can be included (reasoning items carry their text; there is nothing to encrypt)",
    )?;
    refuse_unless("service_tier", &|v| v == "auto" || v == "default", "only \"auto\" and \"default\" are served")?;
    let mut chat = Vec::new();
    if let Some(instructions) = req.get("instructions").filter(|v| !v.is_null()) {
        chat.push(json!({"role": "system", "content": text_of(instructions, "instructions")?}));
    }
    chat.extend(previous.iter().cloned());
    let input = req.get("input").ok_or_else(|| bad("input: field required", "input"))?;
    chat.extend(input_messages(input)?);
    let mut out = json!({"messages": chat});
    for (ours, theirs) in
        [("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")]
    {
        if let Some(v) = req.get(ours).filter(|v| !v.is_null()) {
            out[theirs] = v.clone();
        }
    }
    if let Some(effort) = effort {
        // The template decides what effort means: gpt-oss reads
        // `reasoning_effort`, Qwen3 turns thinking off with `enable_thinking`.
        let mut kwargs = json!({"reasoning_effort": effort});
        if effort == "none" {
            kwargs["enable_thinking"] = json!(false);
        }
        out["chat_template_kwargs"] = kwargs;
    }
    if let Some(n) = req.get("max_output_tokens").filter(|v| !v.is_null()) {
        let n = n.as_i64().filter(|&n| n >= 1).ok_or_else(|| bad("max_output_tokens: expected a positive integer", "max_output_tokens"))?;
        out["max_tokens"] = json!(n);
    }
    if let Some(tools) = req.get("tools").filter(|v| !v.is_null()) {
        let tools = tools.as_array().ok_or_else(|| bad("tools: expected a list", "tools"))?;
        let mut converted = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(kind) => return Err(bad(format!("tools.{i}: hosted tools ({kind}) are not supported; declare a function"), "tools")),
                None => return Err(bad(format!("tools.{i}.type: field required"), "tools")),
            }
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("tools.{i}.name: field required"), "tools"))?;
            let mut function =
                json!({"name": name, "parameters": t.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}))});
            if let Some(d) = t.get("description").filter(|v| !v.is_null()) {
                function["description"] = d.clone();
            }
            converted.push(json!({"type": "function", "function": function}));
        }
        out["tools"] = Value::Array(converted);
    }
    if let Some(choice) = req.get("tool_choice").filter(|v| !v.is_null()) {
        out["tool_choice"] = match choice {
            Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => choice.clone(),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
                let name = o.get("name").and_then(Value::as_str).ok_or_else(|| bad("tool_choice.name: field required", "tool_choice"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            other => return Err(bad(format!("tool_choice: unsupported {other}"), "tool_choice")),
        };
    }
    if let Some(text) = req.get("text").filter(|v| !v.is_null()) {
        if let Some(verbosity) = text.get("verbosity").filter(|v| !v.is_null() && *v != "medium") {
            return Err(bad(format!("text.verbosity: {verbosity} is not supported"), "text"));
        }
        match text.get("format").filter(|v| !v.is_null()) {
            None => {}
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => out["response_format"] = json!({"type": "json_object"}),
                Some("json_schema") => {
                    let schema = f.get("schema").cloned().ok_or_else(|| bad("text.format.schema: field required", "text"))?;
                    let mut js = json!({"name": f.get("name").cloned().unwrap_or_else(|| json!("response")), "schema": schema});
                    if let Some(strict) = f.get("strict").filter(|v| !v.is_null()) {
                        js["strict"] = strict.clone();
                    }
                    out["response_format"] = json!({"type": "json_schema", "json_schema": js});
                }
                other => return Err(bad(format!("text.format.type: unsupported {other:?}"), "text")),
            },
        }
    }
    if req.get("stream").and_then(Value::as_bool) == Some(true) {
        out["stream"] = json!(true);
        out["stream_options"] = json!({"include_usage": true});
    }
    Ok(out)
}

/// The ids of one response, from its chat completion's.
struct Ids {
    response: String,
    message: String,
    reasoning: String,
}

impl Ids {
    fn of(chat_id: &str) -> Self {
        let suffix = chat_id.strip_prefix("chatcmpl-").unwrap_or(chat_id);
        Self { response: format!("resp_{suffix}"), message: format!("msg_{suffix}"), reasoning: format!("rs_{suffix}") }
    }
}

/// `fc_…`, a function-call item's id, from the chat path's tool-call id.
fn function_call_id(call_id: &str) -> String {
    format!("fc_{}", call_id.strip_prefix("call-").unwrap_or(call_id))
}

/// The parts of a request echoed in its response object.
#[derive(Clone)]
struct Echo {
    model: Value,
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    tools: Value,
    tool_choice: Value,
    text: Value,
    previous_response_id: Value,
    store: bool,
    metadata: Value,
    parallel_tool_calls: Value,
    user: Value,
    reasoning: Value,
    created_at: u64,
}

impl Echo {
    fn of(req: &Map<String, Value>) -> Self {
        let get = |k: &str, default: Value| req.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default);
        Self {
            model: get("model", Value::Null),
            instructions: get("instructions", Value::Null),
            max_output_tokens: get("max_output_tokens", Value::Null),
            temperature: get("temperature", json!(1.0)),
            top_p: get("top_p", json!(1.0)),
            tools: get("tools", json!([])),
            tool_choice: get("tool_choice", json!("auto")),
            text: get("text", json!({"format": {"type": "text"}})),
            previous_response_id: get("previous_response_id", Value::Null),
            store: req.get("store").and_then(Value::as_bool).unwrap_or(true),
            metadata: get("metadata", json!({})),
            parallel_tool_calls: get("parallel_tool_calls", json!(true)),
            user: get("user", Value::Null),
            reasoning: json!({
                "effort": req.get("reasoning").map_or(Value::Null, |r| r["effort"].clone()),
                "summary": req.get("reasoning").map_or(Value::Null, |r| r["summary"].clone()),
            }),
            created_at: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        }
    }

    /// The response object.
    fn response(&self, id: &str, status: &str, output: Vec<Value>, usage: Value, error: Value) -> Value {
        let incomplete = if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null };
        json!({
            "id": id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id, "reasoning": self.reasoning,
            "store": self.store, "temperature": self.temperature, "text": self.text, "tool_choice": self.tool_choice,
            "tools": self.tools, "top_p": self.top_p, "truncation": "disabled", "usage": usage, "user": self.user,
            "metadata": self.metadata,
        })
    }
}

/// The Responses `usage` of a chat completion's.
fn usage_of(u: &Value) -> Value {
    let (input, output) = (u["prompt_tokens"].as_u64().unwrap_or(0), u["completion_tokens"].as_u64().unwrap_or(0));
    let cached = u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0);
    let reasoning = u.pointer("/completion_tokens_details/reasoning_tokens").and_then(Value::as_u64).unwrap_or(0);
    json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
           "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": input + output})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

/// A `reasoning` item: the text as one `reasoning_text` part (no summary).
fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status})
}

fn function_call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// The conversation a stored response continues: the request's messages
/// (its instructions left out) and the answer as an assistant message.
fn conversation_after(chat: &Value, had_instructions: bool, text: &str, calls: &[(String, String, String)]) -> Vec<Value> {
    let mut messages: Vec<Value> = chat["messages"].as_array().cloned().unwrap_or_default();
    if had_instructions && !messages.is_empty() {
        messages.remove(0);
    }
    let mut answer = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        answer["tool_calls"] = calls
            .iter()
            .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
            .collect();
    }
    messages.push(answer);
    messages
}

/// `POST /v1/responses`.
pub async fn create(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: Map<String, Value> = match serde_json::from_slice(&body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return bad("the body must be a JSON object", "body").into_response(),
        Err(e) => return bad(format!("the body is not valid JSON: {e}"), "body").into_response(),
    };
    let previous = match req.get("previous_response_id").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(id) => {
            let id = id.as_str().unwrap_or_default();
            match lock(&state.responses).get(id) {
                Some(stored) => stored.conversation,
                None => return ApiError::not_found(format!("Response with id '{id}' not found.")).into_response(),
            }
        }
    };
    let chat = match to_chat_request(&req, &previous) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let echo = Echo::of(&req);
    let had_instructions = req.get("instructions").is_some_and(|v| !v.is_null());
    let stream = chat.get("stream").and_then(Value::as_bool) == Some(true);
    let response = match openai::chat_completions(State(state.clone()), Bytes::from(chat.to_string())).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if !response.status().is_success() {
        // The chat path's error is already in the OpenAI shape.
        return response;
    }
    let finish = Finish { store: state.responses.clone(), chat, had_instructions, echo };
    if stream {
        openai::translate_chat_stream(response, Translator::new(finish))
    } else {
        translate_whole(response, finish).await
    }
}

/// What a finished response needs to be answered and stored.
struct Finish {
    store: Arc<Mutex<ResponseStore>>,
    chat: Value,
    had_instructions: bool,
    echo: Echo,
}

impl Finish {
    /// Stores the response (unless `store: false`) with its conversation.
    fn store(&self, id: &str, response: &Value, text: &str, calls: &[(String, String, String)]) {
        if self.echo.store {
            let conversation = conversation_after(&self.chat, self.had_instructions, text, calls);
            lock(&self.store).insert(id.to_string(), Stored { response: response.clone(), conversation });
        }
    }
}

fn lock(store: &Mutex<ResponseStore>) -> std::sync::MutexGuard<'_, ResponseStore> {
    store.lock().unwrap_or_else(|p| p.into_inner())
}

async fn translate_whole(response: Response, finish: Finish) -> Response {
    let bytes = match axum::body::to_bytes(response.into_body(), usize::MAX).await {
        Ok(b) => b,
        Err(e) => return ApiError::internal(format!("reading the completion: {e}")).into_response(),
    };
    let Ok(v) = serde_json::from_slice::<Value>(&bytes) else {
        return ApiError::internal("the chat completion was not JSON").into_response();
    };
    let mut finish = finish;
    if finish.echo.model.is_null() {
        finish.echo.model = v["model"].clone();
    }
    let ids = Ids::of(v["id"].as_str().unwrap_or_default());
    let choice = &v["choices"][0];
    let message = &choice["message"];
    let text = message["content"].as_str().unwrap_or_default().to_string();
    let status = if choice["finish_reason"] == "length" { "incomplete" } else { "completed" };
    let mut output = Vec::new();
    if let Some(reasoning) = message["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
        output.push(reasoning_item(&ids.reasoning, reasoning, "completed"));
    }
    if !text.is_empty() {
        output.push(message_item(&ids.message, &text, status));
    }
    let mut calls = Vec::new();
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        let (id, name) = (call["id"].as_str().unwrap_or_default(), call["function"]["name"].as_str().unwrap_or_default());
        let args = call["function"]["arguments"].as_str().unwrap_or("{}");
        output.push(function_call_item(&function_call_id(id), id, name, args, "completed"));
        calls.push((id.to_string(), name.to_string(), args.to_string()));
    }
    let body = finish.echo.response(&ids.response, status, output, usage_of(&v["usage"]), Value::Null);
    finish.store(&ids.response, &body, &text, &calls);
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// The output item a stream is writing.
enum Open {
    None,
    Reasoning { index: usize, text: String },
    Text { index: usize, text: String },
    Call { index: usize, id: String, call_id: String, name: String, arguments: String },
}

/// Turns the chat path's SSE chunks into the Responses events.
struct Translator {
    finish: Finish,
    ids: Option<Ids>,
    sequence: u64,
    open: Open,
    output: Vec<Value>,
    text: String,
    calls: Vec<(String, String, String)>,
    finish_reason: Option<String>,
    usage: Value,
    done: bool,
}

impl Translator {
    fn new(finish: Finish) -> Self {
        Self {
            finish,
            ids: None,
            sequence: 0,
            open: Open::None,
            output: Vec::new(),
            text: String::new(),
            calls: Vec::new(),
            finish_reason: None,
            usage: usage_of(&Value::Null),
            done: false,
        }
    }

    fn event(&mut self, out: &mut String, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.push_str("event: ");
        out.push_str(kind);
        out.push_str("\ndata: ");
        out.push_str(&data.to_string());
        out.push_str("\n\n");
    }

    fn response(&self, status: &str, error: Value) -> Value {
        let id = self.ids.as_ref().map_or("", |i| i.response.as_str());
        let output = if status == "in_progress" { Vec::new() } else { self.output.clone() };
        self.finish.echo.response(id, status, output, self.usage.clone(), error)
    }

    /// Ends the open output item with its `.done` events.
    fn close(&mut self, out: &mut String) {
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => {}
            Open::Reasoning { index, text } => {
                let id = self.ids.as_ref().map_or(String::new(), |i| i.reasoning.clone());
                let done = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
                self.event(out, "response.reasoning_text.done", done);
                let part = json!({"type": "reasoning_text", "text": text});
                self.event(
                    out,
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
                let item = reasoning_item(&id, &text, "completed");
                self.event(out, "response.output_item.done", json!({"output_index": index, "item": item}));
                self.output.push(item);
            }
            Open::Text { index, text } => {
                let id = self.ids.as_ref().map_or(String::new(), |i| i.message.clone());
                let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let done = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []});
                self.event(out, "response.output_text.done", done);
                let done = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
                self.event(out, "response.content_part.done", done);
                // A message the output budget cut is incomplete, as its response.
                let status = if self.finish_reason.as_deref() == Some("length") { "incomplete" } else { "completed" };
                let item = message_item(&id, &text, status);
                self.event(out, "response.output_item.done", json!({"output_index": index, "item": item}));
                self.text = text;
                self.output.push(item);
            }
            Open::Call { index, id, call_id, name, arguments } => {
                self.event(
                    out,
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": arguments}),
                );
                let item = function_call_item(&id, &call_id, &name, &arguments, "completed");
                self.event(out, "response.output_item.done", json!({"output_index": index, "item": item}));
                self.output.push(item);
                self.calls.push((call_id, name, arguments));
            }
        }
    }

    /// The terminal event: `response.completed`, or `response.incomplete`
    /// when the output budget cut the answer.
    fn complete(&mut self, out: &mut String) {
        self.close(out);
        self.done = true;
        let status = if self.finish_reason.as_deref() == Some("length") { "incomplete" } else { "completed" };
        let response = self.response(status, Value::Null);
        if let Some(id) = self.ids.as_ref().map(|i| i.response.clone()) {
            self.finish.store(&id, &response, &self.text, &self.calls);
        }
        self.event(out, &format!("response.{status}"), json!({"response": response}));
    }
}

impl ChatStreamTranslator for Translator {
    /// The events for one `data:` payload of the chat stream.
    fn chunk(&mut self, data: &str, out: &mut String) {
        if self.done {
            return;
        }
        if data == "[DONE]" {
            self.complete(out);
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else { return };
        if let Some(message) = v.pointer("/error/message").and_then(Value::as_str) {
            self.fail(message, out);
            return;
        }
        if self.ids.is_none() {
            self.ids = Some(Ids::of(v["id"].as_str().unwrap_or_default()));
            if self.finish.echo.model.is_null() {
                self.finish.echo.model = v["model"].clone();
            }
            let created = self.response("in_progress", Value::Null);
            self.event(out, "response.created", json!({"response": created}));
            self.event(out, "response.in_progress", json!({"response": created}));
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.usage = usage_of(u);
        }
        let Some(choice) = v["choices"].as_array().and_then(|c| c.first()) else { return };
        let delta = &choice["delta"];
        if let Some(text) = delta["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
            let id = self.ids.as_ref().map_or(String::new(), |i| i.reasoning.clone());
            if !matches!(self.open, Open::Reasoning { .. }) {
                self.close(out);
                let index = self.output.len();
                let mut item = reasoning_item(&id, "", "in_progress");
                item["content"] = json!([]);
                self.event(out, "response.output_item.added", json!({"output_index": index, "item": item}));
                self.event(
                    out,
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
                );
                self.open = Open::Reasoning { index, text: String::new() };
            }
            if let Open::Reasoning { index, text: t } = &mut self.open {
                t.push_str(text);
                let data = json!({"item_id": id, "output_index": *index, "content_index": 0, "delta": text});
                self.event(out, "response.reasoning_text.delta", data);
            }
        }
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            if !matches!(self.open, Open::Text { .. }) {
                self.close(out);
                let index = self.output.len();
                let id = self.ids.as_ref().map_or(String::new(), |i| i.message.clone());
                let mut item = message_item(&id, "", "in_progress");
                item["content"] = json!([]);
                self.event(out, "response.output_item.added", json!({"output_index": index, "item": item}));
                self.event(
                    out,
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
                );
                self.open = Open::Text { index, text: String::new() };
            }
            let index = match &mut self.open {
                Open::Text { index, text: t } => {
                    t.push_str(text);
                    *index
                }
                _ => 0,
            };
            let id = self.ids.as_ref().map_or(String::new(), |i| i.message.clone());
            self.event(
                out,
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
            );
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            if let Some(name) = call.pointer("/function/name").and_then(Value::as_str) {
                self.close(out);
                let index = self.output.len();
                let call_id = call["id"].as_str().unwrap_or_default().to_string();
                let id = function_call_id(&call_id);
                let item = function_call_item(&id, &call_id, name, "", "in_progress");
                self.event(out, "response.output_item.added", json!({"output_index": index, "item": item}));
                self.open = Open::Call { index, id, call_id, name: name.to_string(), arguments: String::new() };
            }
            if let Some(fragment) = call.pointer("/function/arguments").and_then(Value::as_str).filter(|f| !f.is_empty()) {
                if let Open::Call { index, id, arguments, .. } = &mut self.open {
                    arguments.push_str(fragment);
                    let data = json!({"item_id": id, "output_index": *index, "delta": fragment});
                    self.event(out, "response.function_call_arguments.delta", data);
                }
            }
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish_reason = Some(reason.to_string());
        }
    }

    /// The engine failed mid-stream: `response.failed` with the error.
    fn fail(&mut self, message: &str, out: &mut String) {
        self.close(out);
        self.done = true;
        if self.ids.is_none() {
            self.ids = Some(Ids::of("failed"));
        }
        let response = self.response("failed", json!({"code": "server_error", "message": message}));
        self.event(out, "response.failed", json!({"response": response}));
    }
}

/// `GET /v1/responses/{id}`: a stored response.
pub async fn retrieve(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match lock(&state.responses).get(&id) {
        Some(stored) => (StatusCode::OK, axum::Json(stored.response)).into_response(),
        None => ApiError::not_found(format!("Response with id '{id}' not found.")).into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if lock(&state.responses).remove(&id) {
        (StatusCode::OK, axum::Json(json!({"id": id, "object": "response", "deleted": true}))).into_response()
    } else {
        ApiError::not_found(format!("Response with id '{id}' not found.")).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("an object")
    }

    /// The `data:` payloads of a stream of server-sent events, parsed.
    fn data_events(out: &str) -> Vec<Value> {
        out.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).expect("JSON")).collect()
    }

    #[test]
    fn items_tools_and_formats_become_the_chat_request() {
        let previous = vec![json!({"role": "user", "content": "Hi"}), json!({"role": "assistant", "content": "Hello"})];
        let req = object(json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 64, "temperature": 0.5,
            "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": false,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "call-1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "call-2", "name": "get_weather", "arguments": "{\"city\":\"Lyon\"}"},
                {"type": "function_call_output", "call_id": "call-1", "output": "18 C"},
            ],
        }));
        let chat = to_chat_request(&req, &previous).unwrap_or_else(|e| panic!("translates: {}", e.message));
        let m = chat["messages"].as_array().expect("messages");
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(&m[1..3], &previous[..]);
        assert_eq!(m[3], json!({"role": "system", "content": "Use tools."}));
        assert_eq!(m[4], json!({"role": "user", "content": "Weather in Paris?"}));
        assert_eq!(m[5]["tool_calls"].as_array().map(Vec::len), Some(2), "one turn's calls in one message: {}", m[5]);
        assert_eq!(m[6], json!({"role": "tool", "tool_call_id": "call-1", "content": "18 C"}));
        assert_eq!(chat["max_tokens"], json!(64));
        assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(chat["parallel_tool_calls"], json!(false));
        assert_eq!(chat["tools"][0]["function"]["parameters"], json!({"type": "object"}));
        assert_eq!(chat["response_format"]["json_schema"]["name"], json!("w"));
        assert!(chat.get("stream").is_none());
    }

    #[test]
    fn unsupported_fields_and_items_are_named() {
        for (req, name) in [
            (json!({"input": "x", "frobnicate": 1}), "frobnicate"),
            (json!({"input": "x", "tools": [{"type": "web_search"}]}), "web_search"),
            (json!({"input": "x", "reasoning": {"effort": "extreme"}}), "reasoning.effort"),
            (json!({"input": "x", "reasoning": {"summary": "long"}}), "reasoning.summary"),
            (json!({"input": "x", "reasoning": {"budget": 9}}), "reasoning.budget"),
            (json!({"input": "x", "include": ["file_search_call.results"]}), "include"),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (json!({"input": "x", "max_output_tokens": 0}), "max_output_tokens"),
            (
                json!({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
                "input_image",
            ),
            (json!({"input": [{"type": "item_reference", "id": "msg_1"}]}), "item_reference"),
            (json!({"model": "m"}), "input"),
        ] {
            let e = to_chat_request(&object(req), &[]).expect_err(name);
            assert!(e.message.contains(name), "{name}: {}", e.message);
        }
        // Accepted as the defaults they name.
        let ok = json!({"input": "x", "reasoning": {"effort": null}, "truncation": "disabled", "include": [], "store": false, "metadata": {"a": "b"}});
        assert!(to_chat_request(&object(ok), &[]).is_ok());
        // What Codex CLI sends: an effort (the chat template reads it), a
        // summary (no effect), encrypted reasoning to include (none exists).
        let codex = json!({"input": "x", "reasoning": {"effort": "high", "summary": "auto"}, "include": ["reasoning.encrypted_content"]});
        let chat = to_chat_request(&object(codex), &[]).expect("accepted");
        assert_eq!(chat["chat_template_kwargs"], json!({"reasoning_effort": "high"}));
        let off = to_chat_request(&object(json!({"input": "x", "reasoning": {"effort": "none"}})), &[]).expect("accepted");
        assert_eq!(off["chat_template_kwargs"], json!({"reasoning_effort": "none", "enable_thinking": false}));
        assert!(to_chat_request(&object(json!({"input": "x"})), &[]).expect("accepted").get("chat_template_kwargs").is_none());
    }

    /// A streamed answer of text, then a tool call, then the usage: the
    /// typed events in the order the client's helper checks, numbered from
    /// 0, and the response stored with the conversation that led to it.
    #[test]
    fn a_streamed_completion_becomes_the_typed_events_in_order_and_is_stored() {
        let store = Arc::new(Mutex::new(ResponseStore::default()));
        let req = object(json!({"input": "Weather?", "instructions": "Be brief.", "stream": true}));
        let chat = to_chat_request(&req, &[]).unwrap_or_else(|e| panic!("{}", e.message));
        let finish = Finish { store: store.clone(), chat, had_instructions: true, echo: Echo::of(&req) };
        let mut t = Translator::new(finish);
        let out = openai::translate_payloads(
            &mut t,
            &[
                r#"{"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"content":"Let me check."},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call-1","type":"function","function":{"name":"f","arguments":""}}]},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-7","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\":1}"}}]},"finish_reason":"tool_calls"}]}"#,
                r#"{"id":"chatcmpl-7","model":"m","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#,
                "[DONE]",
            ],
        );
        let events = data_events(&out);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap_or("")).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert!(events.iter().enumerate().all(|(i, e)| e["sequence_number"] == json!(i)));
        let done = &events[12]["response"];
        assert_eq!(done["id"], json!("resp_7"));
        assert_eq!(done["model"], json!("m"));
        assert_eq!(done["usage"]["total_tokens"], json!(13));
        assert_eq!(done["output"][1]["call_id"], json!("call-1"));
        assert_eq!(done["output"][1]["arguments"], json!("{\"a\":1}"));
        assert_eq!(events[9]["output_index"], json!(1));
        let stored = lock(&store).get("resp_7").expect("stored");
        // Without its instructions, with the answer's text and call.
        assert_eq!(stored.conversation[0], json!({"role": "user", "content": "Weather?"}));
        assert_eq!(stored.conversation[1]["content"], json!("Let me check."));
        assert_eq!(stored.conversation[1]["tool_calls"][0]["id"], json!("call-1"));
    }

    /// `--reasoning-parser`: the reasoning streams as a `reasoning` item
    /// before the message, with the events the official client types.
    #[test]
    fn streamed_reasoning_is_a_reasoning_item_before_the_message() {
        let store = Arc::new(Mutex::new(ResponseStore::default()));
        let req = object(json!({"input": "2+2?", "stream": true}));
        let chat = to_chat_request(&req, &[]).unwrap_or_else(|e| panic!("{}", e.message));
        let mut t = Translator::new(Finish { store, chat, had_instructions: false, echo: Echo::of(&req) });
        let out = openai::translate_payloads(
            &mut t,
            &[
                r#"{"id":"chatcmpl-8","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-8","model":"m","choices":[{"index":0,"delta":{"reasoning_content":"Two and"},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-8","model":"m","choices":[{"index":0,"delta":{"reasoning_content":" two."},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-8","model":"m","choices":[{"index":0,"delta":{"content":"4"},"finish_reason":"stop"}]}"#,
                "[DONE]",
            ],
        );
        let events = data_events(&out);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap_or("")).collect();
        assert_eq!(
            kinds[2..10],
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
            ]
        );
        assert_eq!(events[2]["item"]["id"], json!("rs_8"));
        assert_eq!(events[6]["text"], json!("Two and two."));
        let done = &events.last().expect("events")["response"];
        assert_eq!(done["output"][0], reasoning_item("rs_8", "Two and two.", "completed"));
        assert_eq!(done["output"][1]["content"][0]["text"], json!("4"));
    }

    #[test]
    fn the_store_keeps_the_latest_responses() {
        let mut store = ResponseStore::default();
        for i in 0..STORE_CAPACITY + 5 {
            store.insert(format!("resp_{i}"), Stored { response: json!({"id": i}), conversation: Vec::new() });
        }
        assert!(store.get("resp_4").is_none() && store.get("resp_5").is_some());
        assert_eq!(store.by_id.len(), STORE_CAPACITY);
        assert!(store.remove("resp_5") && !store.remove("resp_5"));
    }
}
