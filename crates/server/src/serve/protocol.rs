//! The OpenAI request bodies (with vLLM's extra sampling fields), and their
//! translation into [`SamplingParams`].

use super::error::ApiError;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use vellum_base::{BeamSearchParams, SamplingParams, StructuredOutput, TokenId};

/// `prompt`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<i64>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<i64>>),
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    // vLLM's extras.
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub use_beam_search: Option<bool>,
    pub length_penalty: Option<f32>,
    pub priority: Option<i64>,
    pub return_tokens_as_token_ids: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    // Structured outputs: OpenAI's `response_format`, vLLM's
    // `structured_outputs` and its older `guided_*` fields.
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Option<Prompt>,
    pub echo: Option<bool>,
    /// Top logprobs per token (0..=20); `null` = none.
    pub logprobs: Option<i64>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: Common,
    /// Fields we do not know: accepted, logged, ignored.
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Value>,
}

/// One chat message. `content` is a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
    /// An assistant turn's calls (`[{"id", "type", "function": {"name", "arguments"}}]`).
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A `tool` turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub add_generation_prompt: Option<bool>,
    /// Functions the model may call, `tool_choice`, `parallel_tool_calls`
    /// (checked by `tools::ToolRequest::parse`).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Extra chat-template variables (vLLM's; e.g. Qwen3's
    /// `{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(flatten)]
    pub common: Common,
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Value>,
}

/// Field names that `Common` takes; `flatten` hands them to `unknown` too,
/// so they are filtered out before logging.
const KNOWN: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "best_of",
    "stop",
    "stop_token_ids",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream",
    "stream_options",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "use_beam_search",
    "length_penalty",
    "priority",
    "return_tokens_as_token_ids",
    "skip_special_tokens",
    "prompt",
    "echo",
    "logprobs",
    "suffix",
    "messages",
    "top_logprobs",
    "add_generation_prompt",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
];

/// A JSON schema given as an object or as JSON text: its text.
fn schema_text(v: &Value, field: &'static str) -> Result<String, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.to_string()),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(_) => Ok(s.clone()),
            Err(e) => Err(ApiError::bad_request(format!("{field} is not valid JSON: {e}"), Some(field))),
        },
        other => Err(ApiError::bad_request(format!("{field} must be a JSON schema object, got {other}"), Some(field))),
    }
}

/// The structured-output constraint a request asks for, from whichever of
/// `response_format`, `structured_outputs` or `guided_*` it uses (at most
/// one of them).
pub fn structured_output(c: &Common) -> Result<Option<StructuredOutput>, ApiError> {
    Ok(structured_output_with_field(c)?.map(|(_, s)| s))
}

/// [`structured_output`] with the request field it came from.
pub fn structured_output_with_field(c: &Common) -> Result<Option<(&'static str, StructuredOutput)>, ApiError> {
    let mut found: Vec<(&'static str, StructuredOutput)> = Vec::new();
    if let Some(rf) = &c.response_format {
        let kind = rf.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => {}
            Some("json_object") => found.push(("response_format", StructuredOutput::JsonObject)),
            Some("json_schema") => {
                let schema = rf.get("json_schema").and_then(|j| j.get("schema")).ok_or_else(|| {
                    ApiError::bad_request("response_format.json_schema.schema is required for type json_schema", Some("response_format"))
                })?;
                found.push(("response_format", StructuredOutput::Json(schema_text(schema, "response_format")?)));
            }
            other => {
                return Err(ApiError::bad_request(
                    format!("response_format.type must be text, json_object or json_schema, got {}", other.unwrap_or("nothing")),
                    Some("response_format"),
                ))
            }
        }
    }
    if let Some(so) = &c.structured_outputs {
        let obj =
            so.as_object().ok_or_else(|| ApiError::bad_request("structured_outputs must be an object", Some("structured_outputs")))?;
        let bad = |what: &str| ApiError::bad_request(format!("structured_outputs.{what}"), Some("structured_outputs"));
        for (k, v) in obj {
            let spec = match (k.as_str(), v) {
                (_, Value::Null) => continue,
                ("json", v) => StructuredOutput::Json(schema_text(v, "structured_outputs")?),
                ("regex", Value::String(r)) => StructuredOutput::Regex(r.clone()),
                ("choice", Value::Array(a)) => StructuredOutput::Choice(
                    a.iter()
                        .map(|x| x.as_str().map(String::from))
                        .collect::<Option<_>>()
                        .ok_or_else(|| bad("choice must be a list of strings"))?,
                ),
                ("grammar", Value::String(g)) => StructuredOutput::Grammar(g.clone()),
                ("json_object", Value::Bool(true)) => StructuredOutput::JsonObject,
                ("json_object", Value::Bool(false)) | ("disable_fallback" | "disable_any_whitespace" | "whitespace_pattern", _) => continue,
                (k, _) => return Err(bad(&format!("{k} is not supported or has the wrong type"))),
            };
            found.push(("structured_outputs", spec));
        }
    }
    if let Some(v) = &c.guided_json {
        found.push(("guided_json", StructuredOutput::Json(schema_text(v, "guided_json")?)));
    }
    if let Some(r) = &c.guided_regex {
        found.push(("guided_regex", StructuredOutput::Regex(r.clone())));
    }
    if let Some(ch) = &c.guided_choice {
        found.push(("guided_choice", StructuredOutput::Choice(ch.clone())));
    }
    if let Some(g) = &c.guided_grammar {
        found.push(("guided_grammar", StructuredOutput::Grammar(g.clone())));
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(ApiError::bad_request(
            format!("only one structured-output constraint per request, got {}", found.iter().map(|f| f.0).collect::<Vec<_>>().join(", ")),
            Some(found[1].0),
        )),
    }
}

/// The names of fields nobody reads (for the debug log).
pub fn unknown_fields(unknown: &BTreeMap<String, Value>) -> Vec<&str> {
    unknown.keys().map(String::as_str).filter(|k| !KNOWN.contains(k)).collect()
}

/// Parses a JSON body into `T`, every failure a 400 naming what is wrong
/// and, for a value of the wrong type, the field that holds it
/// (`"temperature": "hot"` names `temperature`).
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request("The request body is empty; a JSON object is expected.", None));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            return ApiError::bad_request(format!("Malformed JSON: {e}"), None);
        }
        let param = culprit::<T>(bytes);
        let at = param.as_deref().map(|p| format!(" in `{p}`")).unwrap_or_default();
        ApiError::bad_request(format!("Invalid request{at}: {e}"), param.as_deref())
    })
}

/// The top-level field of a well-formed JSON object that `T` refuses: the
/// one without which it parses, or only misses that field (a required one
/// of the wrong type). The request types keep their unknown fields in a
/// flattened map, so serde's own error has no path. Run on the error path
/// only.
fn culprit<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<String> {
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(bytes) else { return None };
    object.keys().find_map(|k| {
        let mut without = object.clone();
        without.remove(k);
        match serde_json::from_value::<T>(Value::Object(without)) {
            Ok(_) => Some(k.clone()),
            Err(e) if e.to_string().starts_with(&format!("missing field `{k}`")) => Some(k.clone()),
            Err(_) => None,
        }
    })
}

fn non_negative(param: &'static str, v: i64) -> Result<usize, ApiError> {
    usize::try_from(v).map_err(|_| ApiError::bad_request(format!("{param} must be non-negative, got {v}"), Some(param)))
}

fn token_id(param: &'static str, v: i64, vocab: usize) -> Result<TokenId, ApiError> {
    match u32::try_from(v) {
        Ok(t) if (t as usize) < vocab => Ok(t),
        _ => Err(ApiError::bad_request(format!("token id {v} is out of vocabulary (0..{vocab})"), Some(param))),
    }
}

/// Token-id prompts, checked against the vocabulary.
pub fn token_prompt(ids: &[i64], vocab: usize) -> Result<Vec<TokenId>, ApiError> {
    ids.iter().map(|&t| token_id("prompt", t, vocab)).collect()
}

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 256;
/// Longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 4096;

/// Builds the engine's parameters. `default_max_tokens` is 16 for
/// completions and `None` (up to the context) for chat; `logprobs` the top
/// count asked for, already checked.
pub fn sampling_params(
    c: &Common,
    default_max_tokens: Option<usize>,
    logprobs: Option<usize>,
    vocab: usize,
) -> Result<SamplingParams, ApiError> {
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        Some(v) => {
            let param = if c.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
            if v < 1 {
                return Err(ApiError::bad_request(format!("{param} must be at least 1, got {v}"), Some(param)));
            }
            Some(non_negative(param, v)?)
        }
        None => default_max_tokens,
    };
    let n = match c.n {
        Some(v) if v < 1 => return Err(ApiError::bad_request(format!("n must be at least 1, got {v}"), Some("n"))),
        Some(v) if v > 64 => return Err(ApiError::bad_request(format!("n must be at most 64, got {v}"), Some("n"))),
        Some(v) => v as usize,
        None => 1,
    };
    let best_of = match c.best_of {
        Some(v) if v > 64 => return Err(ApiError::bad_request(format!("best_of must be at most 64, got {v}"), Some("best_of"))),
        Some(v) => Some(non_negative("best_of", v)?),
        None => None,
    };
    let mut logit_bias = Vec::new();
    for (k, &bias) in c.logit_bias.iter().flatten() {
        let id: i64 = k
            .trim()
            .parse()
            .map_err(|_| ApiError::bad_request(format!("logit_bias keys must be token ids, got {k:?}"), Some("logit_bias")))?;
        logit_bias.push((token_id("logit_bias", id, vocab)?, bias));
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    // Every generated token is checked against every stop string (with
    // hold-back of the longest): bound the work one request can ask for.
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::bad_request(format!("at most {MAX_STOP_STRINGS} stop strings, got {}", stop.len()), Some("stop")));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::bad_request(
            format!("a stop string may be at most {MAX_STOP_STRING_BYTES} bytes, got {}", long.len()),
            Some("stop"),
        ));
    }
    let stop_token_ids = c.stop_token_ids.iter().flatten().map(|&t| token_id("stop_token_ids", t, vocab)).collect::<Result<Vec<_>, _>>()?;
    let beam_search = if c.use_beam_search.unwrap_or(false) {
        Some(BeamSearchParams { beam_width: best_of.unwrap_or(n).max(n), length_penalty: c.length_penalty.unwrap_or(1.0) })
    } else {
        None
    };
    let d = SamplingParams::default();
    let params = SamplingParams {
        n,
        best_of: if beam_search.is_some() { None } else { best_of.filter(|&b| b != n) },
        temperature: if beam_search.is_some() { 0.0 } else { c.temperature.unwrap_or(1.0) },
        top_p: c.top_p.unwrap_or(d.top_p),
        top_k: c.top_k.unwrap_or(d.top_k),
        min_p: c.min_p.unwrap_or(d.min_p),
        seed: c.seed.map(|s| s as u64),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        stop,
        stop_token_ids,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        max_tokens,
        min_tokens: match c.min_tokens {
            Some(v) => non_negative("min_tokens", v)?,
            None => 0,
        },
        logprobs,
        prompt_logprobs: None,
        beam_search,
        logit_bias,
        structured_output: structured_output(c)?,
        pooling: None,
    };
    params.validate().map_err(|e| match e {
        vellum_base::Error::InvalidSamplingParam { param, message } => ApiError::bad_request(format!("{param}: {message}"), Some(param)),
        other => ApiError::bad_request(other.to_string(), None),
    })?;
    Ok(params)
}

/// A message's content as text: a string, or the text parts of a list.
pub fn message_text(m: &Message) -> Result<String, ApiError> {
    match &m.content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::bad_request(
                            format!("unsupported content part type {:?}: only text parts are supported", kind.unwrap_or("?")),
                            Some("messages"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(other) => {
            Err(ApiError::bad_request(format!("message content must be a string or a list of parts, got {other}"), Some("messages")))
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_field_of_the_wrong_type_is_named() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Req {
            messages: Vec<String>,
            temperature: Option<f32>,
            #[serde(flatten)]
            rest: std::collections::BTreeMap<String, Value>,
        }
        let named = |body: &str| parse_body::<Req>(body.as_bytes()).err().and_then(|e| e.param);
        assert_eq!(named(r#"{"messages": ["a"], "temperature": "hot", "x": 1}"#).as_deref(), Some("temperature"));
        assert_eq!(named(r#"{"messages": 3}"#).as_deref(), Some("messages"));
        assert_eq!(named(r#"{"temperature": 1}"#), None);
        assert!(parse_body::<Req>(br#"{"messages": ["a"], "temperature": 0.5}"#).is_ok());
    }
    use super::*;

    #[test]
    fn prompt_forms_parse() {
        let r: CompletionRequest = parse_body(br#"{"prompt": [1, 2, 3], "foo": 1, "max_tokens": 4}"#).unwrap();
        assert!(matches!(r.prompt, Some(Prompt::Tokens(ref v)) if v == &[1, 2, 3]));
        assert_eq!(unknown_fields(&r.unknown), vec!["foo"]);
        assert_eq!(r.common.max_tokens, Some(4));
        let r: CompletionRequest = parse_body(br#"{"prompt": [[1], [2, 3]]}"#).unwrap();
        assert!(matches!(r.prompt, Some(Prompt::TokenLists(_))));
        let r: CompletionRequest = parse_body(br#"{"prompt": ["a", "b"], "stop": "x"}"#).unwrap();
        assert!(matches!(r.prompt, Some(Prompt::Texts(_))));
    }

    #[test]
    fn malformed_and_mistyped_bodies_are_400() {
        let e = parse_body::<CompletionRequest>(b"{\"prompt\": ").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.starts_with("Malformed JSON"), "{}", e.message);
        let e = parse_body::<CompletionRequest>(br#"{"prompt": "a", "max_tokens": "many"}"#).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let e = parse_body::<ChatRequest>(br#"{"model": "x"}"#).unwrap_err();
        assert!(e.message.contains("messages"), "{}", e.message);
    }

    #[test]
    fn params_are_checked_and_named() {
        let c = |s: &str| parse_body::<CompletionRequest>(s.as_bytes()).unwrap().common;
        let p = sampling_params(&c(r#"{"temperature": 0, "max_tokens": 5, "logit_bias": {"7": 5}}"#), Some(16), None, 100).unwrap();
        assert_eq!(p.max_tokens, Some(5));
        assert_eq!(p.logit_bias, vec![(7, 5.0)]);
        let e = sampling_params(&c(r#"{"temperature": -1}"#), Some(16), None, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = sampling_params(&c(r#"{"max_tokens": 0}"#), Some(16), None, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = sampling_params(&c(r#"{"logit_bias": {"1000": 1}}"#), Some(16), None, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
        let e = sampling_params(&c(r#"{"n": 0}"#), Some(16), None, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let p = sampling_params(&c(r#"{"max_completion_tokens": 3, "max_tokens": 9}"#), None, None, 100).unwrap();
        assert_eq!(p.max_tokens, Some(3));
        let many = serde_json::json!({ "stop": vec!["x"; MAX_STOP_STRINGS + 1] }).to_string();
        assert_eq!(sampling_params(&c(&many), None, None, 100).unwrap_err().param.as_deref(), Some("stop"));
        let long = serde_json::json!({ "stop": "y".repeat(MAX_STOP_STRING_BYTES + 1) }).to_string();
        assert_eq!(sampling_params(&c(&long), None, None, 100).unwrap_err().param.as_deref(), Some("stop"));
        let fine = serde_json::json!({ "stop": vec!["z"; MAX_STOP_STRINGS] }).to_string();
        assert!(sampling_params(&c(&fine), None, None, 100).is_ok());
    }

    /// Fuzzing on stable: request bodies built from the fields we read (and
    /// others), with values of every JSON type at their edges (i64 limits,
    /// floats beyond f32, empty and non-ASCII strings, nesting), never panic
    /// between the bytes and `SamplingParams`: each is parameters that
    /// validate, or a 400.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn leaf() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                prop_oneof![
                    Just(i64::MIN),
                    Just(i64::MAX),
                    Just(-1),
                    Just(0),
                    Just(1),
                    Just(20),
                    Just(21),
                    Just(64),
                    Just(65),
                    any::<i64>()
                ]
                .prop_map(Value::from),
                prop_oneof![Just(1e39), Just(-1e39), Just(1e-300), Just(0.5), Just(-0.0), Just(f64::MAX), -1e6f64..1e6]
                    .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
                "[ -~]{0,12}".prop_map(Value::from),
                "\\PC{0,6}".prop_map(Value::from),
            ]
        }

        fn value() -> impl Strategy<Value = Value> {
            leaf().prop_recursive(3, 32, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                    prop::collection::btree_map("[a-z0-9_]{0,8}", inner, 0..5).prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        fn body() -> impl Strategy<Value = Value> {
            let key = prop_oneof![4 => prop::sample::select(KNOWN.to_vec()).prop_map(String::from), 1 => "[a-z_]{1,10}"];
            prop::collection::btree_map(key, value(), 0..12).prop_map(|m| Value::Object(m.into_iter().collect()))
        }

        /// Bodies whose fields have the types the server reads, at their
        /// edges, so that most reach `sampling_params` itself.
        fn typed_body() -> impl Strategy<Value = Value> {
            let int = || {
                prop_oneof![
                    Just(i64::MIN),
                    Just(i64::MAX),
                    Just(-1i64),
                    Just(0),
                    Just(1),
                    Just(20),
                    Just(21),
                    Just(64),
                    Just(65),
                    -100i64..5000
                ]
            };
            let float = || prop_oneof![Just(-1.0f64), Just(0.0), Just(1.0), Just(2.0), Just(1e39), Just(-1e39), -5.0f64..5.0];
            let num = move || float().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number));
            let ints = [
                "max_tokens",
                "max_completion_tokens",
                "n",
                "best_of",
                "seed",
                "min_tokens",
                "priority",
                "logprobs",
                "top_logprobs",
                "top_k",
            ];
            let floats = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty"];
            let flags = ["ignore_eos", "use_beam_search", "echo", "stream", "return_tokens_as_token_ids", "skip_special_tokens"];
            (
                prop::collection::btree_map(prop::sample::select(ints.to_vec()), int().prop_map(Value::from), 0..5),
                prop::collection::btree_map(prop::sample::select(floats.to_vec()), num(), 0..5),
                prop::collection::btree_map(prop::sample::select(flags.to_vec()), any::<bool>().prop_map(Value::from), 0..3),
                prop::option::of(prop_oneof![
                    "\\PC{0,8}".prop_map(Value::from),
                    prop::collection::vec("\\PC{0,4}", 0..4).prop_map(Value::from)
                ]),
                prop::option::of(prop::collection::vec(int(), 0..4)),
                prop::option::of(prop::collection::btree_map("-?[0-9 ]{1,6}|x", num(), 0..4)),
                prop_oneof!["\\PC{0,8}".prop_map(Value::from), prop::collection::vec(int(), 0..6).prop_map(Value::from)],
            )
                .prop_map(|(i, f, b, stop, stop_ids, bias, prompt)| {
                    let mut m: serde_json::Map<String, Value> = i.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
                    m.extend(f.into_iter().map(|(k, v)| (k.to_string(), v)));
                    m.extend(b.into_iter().map(|(k, v)| (k.to_string(), v)));
                    if let Some(s) = stop {
                        m.insert("stop".into(), s);
                    }
                    if let Some(ids) = stop_ids {
                        m.insert("stop_token_ids".into(), Value::from(ids));
                    }
                    if let Some(bias) = bias {
                        m.insert("logit_bias".into(), Value::Object(bias.into_iter().collect()));
                    }
                    m.insert("prompt".into(), prompt);
                    m.insert("messages".into(), serde_json::json!([{"role": "user", "content": "hi"}]));
                    Value::Object(m)
                })
        }

        fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
            let vocab = 1000;
            match parse_body::<CompletionRequest>(bytes) {
                Ok(r) => {
                    let _ = unknown_fields(&r.unknown);
                    if let Some(Prompt::Tokens(ids)) = &r.prompt {
                        let _ = token_prompt(ids, vocab);
                    }
                    let logprobs = r.logprobs.and_then(|k| usize::try_from(k).ok()).filter(|&k| k <= 20);
                    match sampling_params(&r.common, Some(16), logprobs, vocab) {
                        Ok(p) => prop_assert!(p.validate().is_ok()),
                        Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
                    }
                }
                Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
            }
            match parse_body::<ChatRequest>(bytes) {
                Ok(r) => {
                    for m in &r.messages {
                        if let Err(e) = message_text(m) {
                            prop_assert_eq!(e.status.as_u16(), 400);
                        }
                    }
                    match sampling_params(&r.common, None, None, vocab) {
                        Ok(p) => prop_assert!(p.validate().is_ok()),
                        Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
                    }
                }
                Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4000))]

            #[test]
            fn arbitrary_bodies_become_valid_params_or_a_400(body in body()) {
                let bytes = serde_json::to_vec(&body).expect("serializes");
                check(&bytes)?;
            }

            #[test]
            fn typed_bodies_at_their_edges_become_valid_params_or_a_400(body in typed_body()) {
                let bytes = serde_json::to_vec(&body).expect("serializes");
                check(&bytes)?;
            }

            #[test]
            fn mangled_bytes_become_valid_params_or_a_400(
                body in body(),
                edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
                cut in any::<prop::sample::Index>(),
            ) {
                let mut bytes = serde_json::to_vec(&body).expect("serializes");
                for (at, b) in edits {
                    let i = at.index(bytes.len());
                    bytes[i] = b;
                }
                let keep = cut.index(bytes.len() + 1);
                bytes.truncate(keep.max(bytes.len() / 2));
                check(&bytes)?;
            }
        }
    }
}
