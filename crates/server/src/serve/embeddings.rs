//! `POST /v1/embeddings` (OpenAI's shape), served by an engine started for
//! embeddings (`--task embed`).
//!
//! Every input is one engine request: a prefill-only pooling request
//! ([`vellum_base::PoolingParams`]) batched with the others by the same
//! scheduler, which ends and frees its KV blocks in the step that computes
//! its last prompt token. The model's pooling (`--pooler-config`, else what
//! the checkpoint declares) decides how the hidden states become a vector;
//! a request may ask for fewer `dimensions` where the model was trained
//! for Matryoshka truncation.
//!
//! ```text
//! {"input": "text" | ["text", …] | [id, …] | [[id, …], …],
//!  "encoding_format": "float" | "base64", "dimensions": N}
//!   → {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": […] | "base64…"}],
//!      "model": …, "usage": {"prompt_tokens": n, "total_tokens": n}}
//! ```

use super::error::ApiError;
use super::metrics::RequestRecord;
use super::{protocol, AppState};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Instant;
use vellum_base::{SamplingParams, TokenId};
use vellum_engine::RequestEvent;
use vellum_scheduler::FinishReason;

/// The fields this endpoint reads; any other is a 400 naming it.
const FIELDS: &[&str] =
    &["model", "input", "encoding_format", "dimensions", "user", "add_special_tokens", "truncate_prompt_tokens", "priority"];

/// Most inputs one request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

/// The inputs as token ids: a string, a list of strings, a list of token
/// ids, or a list of lists of token ids.
fn inputs(state: &AppState, input: Option<&Value>, add_special_tokens: bool) -> Result<Vec<Vec<TokenId>>, ApiError> {
    let vocab = state.tokenizer.vocab_size();
    let encode = |text: &str| -> Result<Vec<TokenId>, ApiError> {
        if text.is_empty() {
            return Err(bad("an input is empty", "input"));
        }
        state.tokenizer.encode(text, add_special_tokens).map_err(|e| bad(format!("cannot tokenize: {e}"), "input"))
    };
    let ids = |items: &[Value]| -> Result<Vec<TokenId>, ApiError> {
        let raw: Vec<i64> = items
            .iter()
            .map(|v| v.as_i64().ok_or_else(|| bad("a token-id input holds integers only", "input")))
            .collect::<Result<_, _>>()?;
        if raw.is_empty() {
            return Err(bad("an input is empty", "input"));
        }
        protocol::token_prompt(&raw, vocab).map_err(|mut e| {
            e.param = Some("input".into());
            e
        })
    };
    let prompts = match input {
        None => return Err(bad("`input` is required", "input")),
        Some(Value::String(s)) => vec![encode(s)?],
        Some(Value::Array(items)) if items.is_empty() => return Err(bad("`input` is an empty list", "input")),
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|v| v.as_str().ok_or_else(|| bad("a list of strings holds strings only", "input")).and_then(encode))
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![ids(items)?],
            Value::Array(_) => items
                .iter()
                .map(|v| v.as_array().ok_or_else(|| bad("a list of token-id lists holds lists only", "input")).and_then(|a| ids(a)))
                .collect::<Result<_, _>>()?,
            _ => return Err(bad("`input` is a string, a list of strings, or token ids", "input")),
        },
        Some(_) => return Err(bad("`input` is a string, a list of strings, or token ids", "input")),
    };
    if prompts.len() > MAX_INPUTS {
        return Err(bad(format!("at most {MAX_INPUTS} inputs per request, got {}", prompts.len()), "input"));
    }
    Ok(prompts)
}

/// Standard base64 (with padding) of the vector's little-endian f32 bytes:
/// what OpenAI's `encoding_format: "base64"` returns.
fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16) | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8) | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `POST /v1/embeddings`.
pub async fn create(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let started = Instant::now();
    state.metrics.http_request();
    let req: Map<String, Value> = protocol::parse_body(&body)?;
    if let Some(field) = req.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(bad(format!("`{field}` is not supported by /v1/embeddings"), field));
    }
    let model = state.check_model(&req.get("model").and_then(Value::as_str).map(str::to_string))?;
    let Some(spec) = state.embedding else {
        return Err(ApiError::bad_request(
            "This model generates text; start `vellum serve` with --task embed (and an embedding model) to serve /v1/embeddings",
            Some("model"),
        ));
    };
    let base64 = match req.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "float" => false,
        Some(Value::String(s)) if s == "base64" => true,
        Some(other) => return Err(bad(format!("`encoding_format` is \"float\" or \"base64\", got {other}"), "encoding_format")),
    };
    let dimensions = match req.get("dimensions") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|&d| d > 0).ok_or_else(|| bad("`dimensions` is a positive integer", "dimensions"))? as usize),
    };
    let pooling = spec.request(dimensions).map_err(|e| bad(e, "dimensions"))?;
    let add_special_tokens = match req.get("add_special_tokens") {
        None | Some(Value::Null) => true,
        Some(v) => v.as_bool().ok_or_else(|| bad("`add_special_tokens` is a boolean", "add_special_tokens"))?,
    };
    let priority = match req.get("priority") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_i64().ok_or_else(|| bad("`priority` is an integer", "priority"))?,
    };
    let mut prompts = inputs(&state, req.get("input"), add_special_tokens)?;
    let encoder = state.embedding.as_ref().is_some_and(|e| e.encoder);
    // vLLM's truncate_prompt_tokens: keep the last k tokens of each input;
    // an encoder's input keeps its first k - 1 and its last (`[CLS]` … `[SEP]`,
    // as its tokenizer truncates).
    match req.get("truncate_prompt_tokens") {
        None | Some(Value::Null) => {}
        Some(v) => {
            let k = v
                .as_u64()
                .filter(|&k| k > 0)
                .ok_or_else(|| bad("`truncate_prompt_tokens` is a positive integer", "truncate_prompt_tokens"))?
                as usize;
            for p in prompts.iter_mut().filter(|p| p.len() > k) {
                if encoder && k >= 2 {
                    let last = p[p.len() - 1];
                    p.truncate(k - 1);
                    p.push(last);
                } else {
                    let cut = p.len() - k;
                    p.drain(..cut);
                }
            }
        }
    }
    // A pooling request ends with its prompt, which may fill the context.
    let limit = state.max_model_len;
    if let Some(p) = prompts.iter().find(|p| p.len() > limit) {
        return Err(bad(
            format!(
                "This model's maximum context length is {limit} tokens. However, you requested {} tokens in the input for embedding generation. Please reduce the length of the input.",
                p.len()
            ),
            "input",
        ));
    }
    state.admit_many(prompts.len())?;
    let params = SamplingParams { pooling: Some(pooling), max_tokens: Some(1), ..SamplingParams::default() };
    // Queue every input before awaiting any: they share the engine's steps.
    let mut streams = Vec::with_capacity(prompts.len());
    for p in &prompts {
        streams.push(state.engine.add_request_async(p.clone(), params.clone(), priority).await.map_err(ApiError::from_engine)?);
    }
    let mut data = Vec::with_capacity(streams.len());
    for (index, mut stream) in streams.into_iter().enumerate() {
        let vector = loop {
            match stream.next().await {
                Some(RequestEvent::Finished(out)) => match out.embedding {
                    Some(v) => break v,
                    // Aborted (the server shutting down) before its prompt was computed.
                    None => return Err(ApiError::unavailable(format!("input {index} was aborted before its embedding was computed"))),
                },
                Some(RequestEvent::Delta(_)) => continue,
                Some(RequestEvent::Error(e)) => return Err(ApiError::internal(e)),
                None => return Err(ApiError::unavailable("The engine stopped before the embedding was computed.")),
            }
        };
        let embedding = if base64 { Value::String(base64_f32(&vector)) } else { json!(vector) };
        data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    state.metrics.record(&RequestRecord {
        ttft: None,
        queue_time: None,
        inter_token: Vec::new(),
        e2e: started.elapsed().as_secs_f64(),
        prompt_tokens,
        generation_tokens: 0,
        finish_reason: Some(FinishReason::Stop),
    });
    let usage = json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens});
    Ok(Json(json!({"object": "list", "data": data, "model": model, "usage": usage})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_little_endian_f32_bytes() {
        // 1.0f32 = 00 00 80 3f; 2.0f32 = 00 00 00 40.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64_f32(&[]), "");
        // Three floats: 12 bytes, no padding.
        assert_eq!(base64_f32(&[0.0, 0.0, 0.0]), "AAAAAAAAAAAAAAAA");
    }
}
