//! Anthropic's Messages API: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.
//!
//! A Messages request is translated into a chat-completion request and run by
//! the chat path itself ([`openai::chat_completions`]: the chat template, tool
//! calling, sampling, admission, metrics), and its answer is translated back:
//!
//! | Anthropic | chat completion |
//! |---|---|
//! | `system` (a string or text blocks) | a first `system` message |
//! | `text` blocks | `content` |
//! | an assistant's `tool_use` blocks | its `tool_calls`, `input` as the JSON `arguments` |
//! | a user's `tool_result` blocks | `tool` messages naming `tool_call_id`, before the user's text |
//! | `tools[].input_schema` | `tools[].function.parameters` |
//! | `tool_choice` `auto` / `any` / `tool` / `none` | `auto` / `required` / the named function / `none` |
//! | `stop_sequences`, `max_tokens` (required), `temperature`, `top_p`, `top_k` | `stop`, `max_tokens`, … |
//! | `stop_reason` `end_turn` / `max_tokens` / `tool_use` | `finish_reason` `stop` / `length` / `tool_calls` |
//!
//! With `--reasoning-parser`, the reasoning (`reasoning_content`) is a first
//! `thinking` block (its `signature` empty).
//!
//! Streaming turns the chat chunks into Anthropic's events: `message_start`,
//! per block `content_block_start`, `content_block_delta` (`thinking_delta`
//! then an empty `signature_delta`, `text_delta` or `input_json_delta`) and
//! `content_block_stop`, then `message_delta` (stop
//! reason, output tokens) and `message_stop`. Errors keep their status with
//! Anthropic's body, `{"type": "error", "error": {"type", "message"}}`. A
//! field this server does not implement (images, documents, …) is a 400
//! naming it. `thinking` switches the chat template's thinking
//! (`enable_thinking`) on or off; its `budget_tokens` is not enforced.
//! A stop on one of `stop_sequences` is `stop_reason: "stop_sequence"` with
//! the string (the chat path's `stop_reason`).

use super::error::ApiError;
use super::openai::{self, ChatStreamTranslator};
use super::AppState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The request fields implemented here; any other is refused by name.
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
];

/// An error in Anthropic's shape.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    };
    (status, axum::Json(json!({"type": "error", "error": {"type": kind, "message": message.into()}}))).into_response()
}

/// A request refused with a 400 `invalid_request_error` saying why.
struct Invalid(String);

fn bad(message: impl Into<String>) -> Invalid {
    Invalid(message.into())
}

fn refuse(Invalid(message): Invalid) -> Response {
    error(StatusCode::BAD_REQUEST, message)
}

/// The text of a `content` that is a string or a list of blocks of which
/// only `text` ones are allowed (`system`, a `tool_result`'s content).
fn plain_text(v: &Value, field: &str) -> Result<String, Invalid> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (kind, _) => return Err(bad(format!("{field}: a block of type {} is not supported here", kind.unwrap_or("(none)")))),
                }
            }
            Ok(out)
        }
        _ => Err(bad(format!("{field}: expected a string or a list of text blocks"))),
    }
}

/// The Messages request as a chat-completion request body.
fn to_chat_request(req: &Map<String, Value>) -> Result<Value, Invalid> {
    let unknown: Vec<&str> = req.keys().map(String::as_str).filter(|k| !KNOWN.contains(k)).collect();
    if !unknown.is_empty() {
        return Err(bad(format!("unsupported field(s): {}", unknown.join(", "))));
    }
    let max_tokens = match req.get("max_tokens") {
        Some(v) => v.as_i64().filter(|&n| n >= 1).ok_or_else(|| bad("max_tokens: expected a positive integer"))?,
        None => return Err(bad("max_tokens: field required")),
    };
    let messages = req.get("messages").and_then(Value::as_array).ok_or_else(|| bad("messages: field required (a list)"))?;
    let mut chat = Vec::new();
    if let Some(system) = req.get("system") {
        chat.push(json!({"role": "system", "content": plain_text(system, "system")?}));
    }
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| bad(format!("messages.{i}.role: field required")))?;
        if role != "user" && role != "assistant" {
            return Err(bad(format!("messages.{i}.role: expected \"user\" or \"assistant\", got {role:?}")));
        }
        let content = m.get("content").ok_or_else(|| bad(format!("messages.{i}.content: field required")))?;
        let blocks: Vec<Value> = match content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => return Err(bad(format!("messages.{i}.content: expected a string or a list of blocks"))),
        };
        let (mut text, mut calls, mut results) = (String::new(), Vec::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages.{i}.content.{j}");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => {
                    text.push_str(b.get("text").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.text: field required")))?)
                }
                Some("tool_use") if role == "assistant" => {
                    let id = b.get("id").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.id: field required")))?;
                    let name = b.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.name: field required")))?;
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                }
                Some("tool_result") if role == "user" => {
                    let id =
                        b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.tool_use_id: field required")))?;
                    let body = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => plain_text(c, &format!("{at}.content"))?,
                    };
                    let body = if b.get("is_error").and_then(Value::as_bool).unwrap_or(false) { format!("Error: {body}") } else { body };
                    results.push(json!({"role": "tool", "tool_call_id": id, "content": body}));
                }
                Some(kind) => return Err(bad(format!("{at}: a {kind:?} block is not supported in a {role} message"))),
                None => return Err(bad(format!("{at}.type: field required"))),
            }
        }
        chat.extend(results);
        if role == "assistant" {
            let mut msg = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            chat.push(msg);
        } else if !text.is_empty() || blocks.is_empty() {
            chat.push(json!({"role": "user", "content": text}));
        }
    }
    let mut out = json!({"messages": chat, "max_tokens": max_tokens});
    // Extended thinking turns the template's thinking on or off (Qwen3's
    // `enable_thinking`); `budget_tokens` is not enforced: `max_tokens`
    // bounds thinking and answer together.
    if let Some(thinking) = req.get("thinking").filter(|v| !v.is_null()) {
        let enabled = match thinking.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive") => true,
            Some("disabled") => false,
            _ => return Err(bad("thinking.type: expected \"enabled\", \"adaptive\" or \"disabled\"")),
        };
        if let Some(b) = thinking.get("budget_tokens").filter(|v| !v.is_null()) {
            b.as_i64().filter(|&b| b >= 1).ok_or_else(|| bad("thinking.budget_tokens: expected a positive integer"))?;
        }
        out["chat_template_kwargs"] = json!({"enable_thinking": enabled});
    }
    if let Some(model) = req.get("model") {
        out["model"] = model.clone();
    }
    for (ours, theirs) in [("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("stop_sequences", "stop")] {
        if let Some(v) = req.get(ours).filter(|v| !v.is_null()) {
            out[theirs] = v.clone();
        }
    }
    if let Some(tools) = req.get("tools").filter(|v| !v.is_null()) {
        let tools = tools.as_array().ok_or_else(|| bad("tools: expected a list"))?;
        let mut converted = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
                return Err(bad(format!("tools.{i}: server tools ({kind}) are not supported")));
            }
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("tools.{i}.name: field required")))?;
            let schema = t.get("input_schema").cloned().ok_or_else(|| bad(format!("tools.{i}.input_schema: field required")))?;
            let mut function = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description") {
                function["description"] = d.clone();
            }
            converted.push(json!({"type": "function", "function": function}));
        }
        out["tools"] = Value::Array(converted);
    }
    if let Some(choice) = req.get("tool_choice").filter(|v| !v.is_null()) {
        let kind = choice.get("type").and_then(Value::as_str).ok_or_else(|| bad("tool_choice.type: field required"))?;
        out["tool_choice"] = match kind {
            "auto" => json!("auto"),
            "any" => json!("required"),
            "none" => json!("none"),
            "tool" => {
                let name = choice.get("name").and_then(Value::as_str).ok_or_else(|| bad("tool_choice.name: field required"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            other => return Err(bad(format!("tool_choice.type: unknown {other:?}"))),
        };
        if choice.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
            out["parallel_tool_calls"] = json!(false);
        }
    }
    if req.get("stream").and_then(Value::as_bool) == Some(true) {
        out["stream"] = json!(true);
        out["stream_options"] = json!({"include_usage": true});
    }
    Ok(out)
}

/// Anthropic's `stop_reason`: `tool_use` whenever the answer calls a tool
/// (the chat path says `stop` for a forced named function, as OpenAI does),
/// `stop_sequence` when one of the request's stop strings ended it.
fn stop_reason(finish_reason: Option<&str>, called_a_tool: bool, stop_sequence: Option<&str>) -> Value {
    match finish_reason {
        Some("length") => json!("max_tokens"),
        Some(_) if stop_sequence.is_some() => json!("stop_sequence"),
        Some(_) if called_a_tool => json!("tool_use"),
        Some("tool_calls") => json!("tool_use"),
        Some(_) => json!("end_turn"),
        None => Value::Null,
    }
}

/// `msg_…` from the chat completion's id.
fn message_id(chat_id: &str) -> String {
    format!("msg_{}", chat_id.strip_prefix("chatcmpl-").unwrap_or(chat_id))
}

/// `toolu_…` from the chat path's tool-call id.
fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call-").unwrap_or(call_id))
}

/// A tool call's `arguments` (a JSON text) as a `tool_use` block's `input`.
fn tool_input(arguments: &str) -> Value {
    serde_json::from_str::<Value>(arguments).ok().filter(Value::is_object).unwrap_or_else(|| json!({}))
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: Map<String, Value> = match serde_json::from_slice(&body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return refuse(bad("the body must be a JSON object")),
        Err(e) => return refuse(bad(format!("the body is not valid JSON: {e}"))),
    };
    let chat = match to_chat_request(&req) {
        Ok(c) => c,
        Err(invalid) => return refuse(invalid),
    };
    let model = req.get("model").cloned().unwrap_or(Value::Null);
    let stream = chat.get("stream").and_then(Value::as_bool) == Some(true);
    let response = match openai::chat_completions(State(state), Bytes::from(chat.to_string())).await {
        Ok(r) => r,
        Err(e) => return from_api_error(e),
    };
    if !response.status().is_success() {
        return translate_error(response).await;
    }
    if stream {
        openai::translate_chat_stream(response, Translator::new(model))
    } else {
        translate_message(response, model).await
    }
}

fn from_api_error(e: ApiError) -> Response {
    error(e.status, e.message)
}

async fn translate_error(response: Response) -> Response {
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    error(status, message)
}

async fn translate_message(response: Response, model: Value) -> Response {
    let bytes = match axum::body::to_bytes(response.into_body(), usize::MAX).await {
        Ok(b) => b,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("reading the completion: {e}")),
    };
    let Ok(v) = serde_json::from_slice::<Value>(&bytes) else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "the chat completion was not JSON");
    };
    let choice = &v["choices"][0];
    let message = &choice["message"];
    let mut content = Vec::new();
    if let Some(thinking) = message["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
    }
    if let Some(text) = message["content"].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        content.push(json!({
            "type": "tool_use",
            "id": call["id"].as_str().map(tool_use_id),
            "name": call["function"]["name"],
            "input": tool_input(call["function"]["arguments"].as_str().unwrap_or("{}")),
        }));
    }
    let called_a_tool = content.iter().any(|c| c["type"] == "tool_use");
    let body = json!({
        "id": message_id(v["id"].as_str().unwrap_or_default()),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice["finish_reason"].as_str(), called_a_tool, choice["stop_reason"].as_str()),
        "stop_sequence": choice["stop_reason"].as_str(),
        "usage": {"input_tokens": v["usage"]["prompt_tokens"], "output_tokens": v["usage"]["completion_tokens"]},
    });
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// Which content block is open in a translated stream.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    None,
    Thinking,
    Text,
    Tool,
}

/// Turns the chat path's SSE chunks into Anthropic's events.
struct Translator {
    model: Value,
    started: bool,
    open: Open,
    index: usize,
    finish_reason: Option<String>,
    stop_sequence: Option<String>,
    called_a_tool: bool,
    usage: (u64, u64),
    done: bool,
}

impl Translator {
    /// A translator for a stream answering with `model`.
    fn new(model: Value) -> Self {
        Self {
            model,
            started: false,
            open: Open::None,
            index: 0,
            finish_reason: None,
            stop_sequence: None,
            called_a_tool: false,
            usage: (0, 0),
            done: false,
        }
    }

    fn event(out: &mut String, name: &str, data: Value) {
        out.push_str("event: ");
        out.push_str(name);
        out.push_str("\ndata: ");
        out.push_str(&data.to_string());
        out.push_str("\n\n");
    }

    fn close(&mut self, out: &mut String) {
        if self.open == Open::Thinking {
            // The API signs thinking just before the block ends; there is
            // no signature to give here.
            Self::event(
                out,
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.index, "delta": {"type": "signature_delta", "signature": ""}}),
            );
        }
        if self.open != Open::None {
            Self::event(out, "content_block_stop", json!({"type": "content_block_stop", "index": self.index}));
            self.index += 1;
            self.open = Open::None;
        }
    }

    fn finish(&mut self, out: &mut String) {
        if self.done {
            return;
        }
        self.done = true;
        self.close(out);
        Self::event(
            out,
            "message_delta",
            json!({"type": "message_delta", "delta": {
                "stop_reason": stop_reason(self.finish_reason.as_deref(), self.called_a_tool, self.stop_sequence.as_deref()),
                "stop_sequence": self.stop_sequence},
                   "usage": {"input_tokens": self.usage.0, "output_tokens": self.usage.1}}),
        );
        Self::event(out, "message_stop", json!({"type": "message_stop"}));
    }
}

impl ChatStreamTranslator for Translator {
    /// The events for one `data:` payload of the chat stream.
    fn chunk(&mut self, data: &str, out: &mut String) {
        if data == "[DONE]" {
            self.finish(out);
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else { return };
        if let Some(message) = v.pointer("/error/message").and_then(Value::as_str) {
            self.fail(message, out);
            return;
        }
        if !self.started {
            self.started = true;
            Self::event(
                out,
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": message_id(v["id"].as_str().unwrap_or_default()), "type": "message", "role": "assistant",
                    "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0}}}),
            );
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.usage = (u["prompt_tokens"].as_u64().unwrap_or(0), u["completion_tokens"].as_u64().unwrap_or(0));
        }
        let Some(choice) = v["choices"].as_array().and_then(|c| c.first()) else { return };
        let delta = &choice["delta"];
        if let Some(thinking) = delta["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
            if self.open != Open::Thinking {
                self.close(out);
                Self::event(
                    out,
                    "content_block_start",
                    json!({"type": "content_block_start", "index": self.index,
                           "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                );
                self.open = Open::Thinking;
            }
            Self::event(
                out,
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.index, "delta": {"type": "thinking_delta", "thinking": thinking}}),
            );
        }
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            if self.open != Open::Text {
                self.close(out);
                Self::event(
                    out,
                    "content_block_start",
                    json!({"type": "content_block_start", "index": self.index, "content_block": {"type": "text", "text": ""}}),
                );
                self.open = Open::Text;
            }
            Self::event(
                out,
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}),
            );
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            if let Some(name) = call.pointer("/function/name").and_then(Value::as_str) {
                self.close(out);
                let id = call["id"].as_str().map(tool_use_id);
                Self::event(
                    out,
                    "content_block_start",
                    json!({"type": "content_block_start", "index": self.index,
                           "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
                );
                self.open = Open::Tool;
                self.called_a_tool = true;
            }
            if let Some(fragment) = call.pointer("/function/arguments").and_then(Value::as_str).filter(|f| !f.is_empty()) {
                if self.open == Open::Tool {
                    Self::event(
                        out,
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "input_json_delta", "partial_json": fragment}}),
                    );
                }
            }
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish_reason = Some(reason.to_string());
            self.stop_sequence = choice["stop_reason"].as_str().map(str::to_string);
        }
    }

    fn fail(&mut self, message: &str, out: &mut String) {
        Self::event(out, "error", json!({"type": "error", "error": {"type": "api_error", "message": message}}));
        self.done = true;
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model's chat
/// template renders the conversation (with its tools).
pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let mut req: Map<String, Value> = match serde_json::from_slice(&body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return refuse(bad("the body must be a JSON object")),
        Err(e) => return refuse(bad(format!("the body is not valid JSON: {e}"))),
    };
    // Counting needs no output budget.
    req.insert("max_tokens".into(), json!(1));
    let chat = match to_chat_request(&req) {
        Ok(c) => c,
        Err(invalid) => return refuse(invalid),
    };
    match openai::count_chat_tokens(&state, chat).await {
        Ok(n) => (StatusCode::OK, axum::Json(json!({"input_tokens": n}))).into_response(),
        Err(e) => from_api_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("an object")
    }

    #[test]
    fn a_conversation_with_tools_becomes_the_chat_request() {
        let req = object(json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "top_k": 5,
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "text", "text": "Thanks"}]},
            ],
        }));
        let chat = to_chat_request(&req).unwrap_or_else(|_| panic!("translates"));
        let m = chat["messages"].as_array().expect("messages");
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1], json!({"role": "user", "content": "Weather in Paris?"}));
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], json!("{\"city\":\"Paris\"}"));
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"}));
        assert_eq!(m[4], json!({"role": "user", "content": "Thanks"}));
        assert_eq!(chat["stop"], json!(["END"]));
        assert_eq!(chat["top_k"], json!(5));
        assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(chat["parallel_tool_calls"], json!(false));
        assert_eq!(chat["tools"][0]["function"]["parameters"], json!({"type": "object"}));
    }

    #[test]
    fn extended_thinking_switches_the_templates_thinking() {
        let with = |thinking: Value| {
            let req = object(json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "thinking": thinking}));
            let Ok(chat) = to_chat_request(&req) else { panic!("refused") };
            chat["chat_template_kwargs"].clone()
        };
        assert_eq!(with(json!({"type": "enabled", "budget_tokens": 1024})), json!({"enable_thinking": true}));
        assert_eq!(with(json!({"type": "disabled"})), json!({"enable_thinking": false}));
        assert_eq!(with(Value::Null), Value::Null);
    }

    #[test]
    fn missing_max_tokens_and_unsupported_fields_are_named() {
        for (req, field) in [
            (json!({"model": "m", "messages": []}), "max_tokens"),
            (json!({"model": "m", "max_tokens": 8, "messages": [], "thinking": {"type": "maybe"}}), "thinking.type"),
            (json!({"model": "m", "max_tokens": 8, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 0}}), "budget_tokens"),
            (json!({"model": "m", "max_tokens": 8, "messages": [], "container": "c"}), "container"),
            (json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), "image"),
        ] {
            let Err(Invalid(message)) = to_chat_request(&object(req)) else { panic!("{field}: accepted") };
            assert!(message.contains(field), "{field}: {message}");
        }
    }

    #[test]
    fn a_streamed_completion_becomes_anthropic_events_in_order() {
        let mut t = Translator::new(json!("m"));
        let out = openai::translate_payloads(
            &mut t,
            &[
                r#"{"id":"chatcmpl-7","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-7","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-7","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call-1","type":"function","function":{"name":"f","arguments":""}}]},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-7","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\":1}"}}]},"finish_reason":"tool_calls"}]}"#,
                r#"{"id":"chatcmpl-7","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#,
                "[DONE]",
            ],
        );
        let names: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert!(out.contains(r#""stop_reason":"tool_use""#) && out.contains(r#""output_tokens":4"#), "{out}");
        assert!(out.contains(r#""partial_json":"{\"a\":1}""#) && out.contains(r#""id":"msg_7""#), "{out}");
    }

    #[test]
    fn streamed_reasoning_is_a_thinking_block_before_the_text() {
        let mut t = Translator::new(json!("m"));
        let out = openai::translate_payloads(
            &mut t,
            &[
                r#"{"id":"chatcmpl-9","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-9","choices":[{"index":0,"delta":{"reasoning_content":"Hmm."},"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-9","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}]}"#,
                "[DONE]",
            ],
        );
        let names: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert!(out.contains(r#""content_block":{"type":"thinking","thinking":"","signature":""}"#), "{out}");
        assert!(out.contains(r#""delta":{"type":"thinking_delta","thinking":"Hmm."}"#), "{out}");
        assert!(out.contains(r#""type":"signature_delta""#) && out.contains(r#""stop_reason":"end_turn""#), "{out}");
    }
}
