//! Tool calling on `/v1/chat/completions`: OpenAI's `tools`,
//! `tool_choice` and `parallel_tool_calls`.
//!
//! Three parts, in request order:
//! 1. [`ToolRequest::parse`] checks the request's tools and choice (a 400
//!    naming the field for anything malformed).
//! 2. [`prompt_messages`] prepares the conversation for the chat template:
//!    a template that reads `tools` gets the tools and the messages as
//!    Hugging Face templates expect them (tool-call arguments as objects,
//!    `role: "tool"` results); any other template gets the documented default
//!    ([`ToolFormat::default_prompt`], [`super::tool_format::DEFAULT_TOOL_PROMPT`] for Hermes):
//!    the tools in a system message asking for the server's format, earlier
//!    calls written in that format, results as `<tool_response>` blocks in a
//!    user turn.
//! 3. [`ToolCallParser`] turns the generated text into content and calls,
//!    one delta at a time, so that a stream and a whole response are parsed
//!    by the same code and always agree.
//!
//! With `tool_choice: "required"` or a named function, decoding is
//! constrained ([`ToolRequest::constraint`]): a named function's output *is*
//! its arguments (a JSON value of its parameter schema); `required` produces
//! a JSON array of `{"name", "parameters"}` objects, as vLLM does. Under
//! `auto` the model writes calls in the format `--tool-call-parser` names
//! ([`ToolFormat`]: Hermes `<tool_call>` blocks by default, Llama 3 JSON,
//! Mistral `[TOOL_CALLS]`, pythonic lists, Gemma 3 `tool_code` fences,
//! Qwen3-Coder XML) between ordinary text.

use super::error::ApiError;
use super::protocol::{self, Message};
pub use super::tool_format::ToolFormat;
use super::tool_format::{parse_json_calls, Scanned, Start};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use vellum_base::StructuredOutput;

/// One function the model may call.
#[derive(Clone, Debug)]
pub struct FunctionTool {
    /// Its name (`^[A-Za-z0-9_-]{1,64}$`).
    pub name: String,
    /// JSON schema of its arguments (an empty object schema when absent).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call: the output is plain content.
    None,
    /// The model decides; calls are parsed from its output.
    Auto,
    /// At least one call, decoding constrained to valid calls.
    Required,
    /// Exactly this function, decoding constrained to its arguments.
    Named(String),
}

/// A request's tools and how they may be used.
#[derive(Clone, Debug)]
pub struct ToolRequest {
    /// The functions, in request order.
    pub functions: Vec<FunctionTool>,
    /// The tools as the request gave them (for the chat template).
    pub raw_tools: Vec<Value>,
    /// `tool_choice` (default: `auto` with tools, `none` without).
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): more than one call per turn.
    pub parallel: bool,
}

fn bad(message: impl Into<String>, field: &'static str) -> ApiError {
    ApiError::bad_request(message, Some(field))
}

/// Whether `name` is a valid function name (`^[A-Za-z0-9_-]{1,64}$`).
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ToolRequest {
    /// Checks `tools`, `tool_choice` and `parallel_tool_calls`. `None` when
    /// the request has no tools and chooses none.
    pub fn parse(tools: Option<&Value>, tool_choice: Option<&Value>, parallel: Option<bool>) -> Result<Option<Self>, ApiError> {
        let raw_tools: Vec<Value> = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(other) => return Err(bad(format!("tools must be a list of tools, got {other}"), "tools")),
        };
        let mut functions = Vec::with_capacity(raw_tools.len());
        for (i, t) in raw_tools.iter().enumerate() {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                other => {
                    return Err(bad(format!("tools[{i}].type must be \"function\", got {}", other.unwrap_or("nothing")), "tools"));
                }
            }
            let f = t
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(format!("tools[{i}].function must be an object"), "tools"))?;
            let name =
                f.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("tools[{i}].function.name is required"), "tools"))?;
            if !valid_name(name) {
                return Err(bad(format!("tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name:?}"), "tools"));
            }
            if functions.iter().any(|g: &FunctionTool| g.name == name) {
                return Err(bad(format!("tools: the function name {name:?} appears twice"), "tools"));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(other) => {
                    return Err(bad(format!("tools[{i}].function.parameters must be a JSON schema object, got {other}"), "tools"))
                }
            };
            functions.push(FunctionTool { name: name.to_string(), parameters });
        }
        let choice = match tool_choice {
            None | Some(Value::Null) => {
                if functions.is_empty() {
                    ToolChoice::None
                } else {
                    ToolChoice::Auto
                }
            }
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => return Err(bad(format!("tool_choice must be none, auto, required or a function, got {other:?}"), "tool_choice")),
            },
            Some(v @ Value::Object(_)) => {
                let name =
                    match (v.get("type").and_then(Value::as_str), v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str)) {
                        (Some("function"), Some(name)) => name,
                        _ => return Err(bad("tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")),
                    };
                if !functions.iter().any(|f| f.name == name) {
                    return Err(bad(format!("tool_choice names the function {name:?}, which is not among the tools"), "tool_choice"));
                }
                ToolChoice::Named(name.to_string())
            }
            Some(other) => return Err(bad(format!("tool_choice must be a string or an object, got {other}"), "tool_choice")),
        };
        if functions.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(bad("tool_choice \"required\" needs at least one tool in tools", "tool_choice")),
            };
        }
        Ok(Some(Self { functions, raw_tools, choice, parallel: parallel.unwrap_or(true) }))
    }

    /// The decoding constraint `tool_choice` implies, if any.
    pub fn constraint(&self) -> Option<StructuredOutput> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Named(name) => {
                let f = self.functions.iter().find(|f| &f.name == name)?;
                Some(StructuredOutput::Json(f.parameters.to_string()))
            }
            ToolChoice::Required => {
                let calls: Vec<Value> = self
                    .functions
                    .iter()
                    .map(|f| {
                        json!({
                            "type": "object",
                            "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": f.parameters},
                            "required": ["name", "parameters"],
                            "additionalProperties": false
                        })
                    })
                    .collect();
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if !self.parallel {
                    schema["maxItems"] = json!(1);
                }
                Some(StructuredOutput::Json(schema.to_string()))
            }
        }
    }

    /// How the output is read, calls under `auto` being written in `format`.
    pub fn parsing(&self, format: ToolFormat) -> Option<ToolParsing> {
        let mode = match &self.choice {
            ToolChoice::None => return None,
            ToolChoice::Auto => ParseMode::Auto(format),
            ToolChoice::Required => ParseMode::Array,
            ToolChoice::Named(name) => ParseMode::Arguments(name.clone()),
        };
        Some(ToolParsing { mode, parallel: self.parallel, functions: self.functions.clone().into() })
    }
}

/// The conversation as the chat template gets it, and the `tools` variable
/// (`None`: leave it unset). `template_reads_tools` picks between the
/// template's own tool support and the default prompt of `format`.
pub fn prompt_messages(
    messages: &[Message],
    tools: Option<&ToolRequest>,
    template_reads_tools: bool,
    format: ToolFormat,
) -> Result<(Vec<Value>, Option<Vec<Value>>), ApiError> {
    if template_reads_tools {
        let msgs = messages.iter().map(template_message).collect::<Result<_, _>>()?;
        return Ok((msgs, tools.map(|t| t.raw_tools.clone())));
    }
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    for m in messages {
        let text = protocol::message_text(m)?;
        if m.role == "tool" {
            // Results of parallel calls share one user turn.
            let block = format!("<tool_response>\n{text}\n</tool_response>");
            match out.last_mut() {
                Some(prev) if prev["role"] == "user" && prev["content"].as_str().is_some_and(|c| c.ends_with("</tool_response>")) => {
                    let merged = format!("{}\n{block}", prev["content"].as_str().unwrap_or_default());
                    prev["content"] = Value::String(merged);
                }
                _ => out.push(json!({"role": "user", "content": block})),
            }
            continue;
        }
        let mut content = text;
        let calls = calls_of(m)?;
        if !calls.is_empty() {
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&format.render_calls(&calls));
        }
        out.push(json!({"role": m.role, "content": content}));
    }
    if let Some(t) = tools {
        let listed: Vec<String> = t.raw_tools.iter().map(|tool| tool.get("function").map_or_else(String::new, |f| f.to_string())).collect();
        let prompt = format.default_prompt().replace("{tools}", &listed.join("\n"));
        match out.first_mut() {
            Some(first) if first["role"] == "system" => {
                let merged = format!("{}\n\n{prompt}", first["content"].as_str().unwrap_or_default());
                first["content"] = Value::String(merged);
            }
            _ => out.insert(0, json!({"role": "system", "content": prompt})),
        }
    }
    Ok((out, None))
}

/// The `(name, arguments)` of an assistant message's `tool_calls`, with
/// arguments as JSON values (they arrive as JSON text).
fn calls_of(m: &Message) -> Result<Vec<(String, Value)>, ApiError> {
    let Some(calls) = &m.tool_calls else { return Ok(Vec::new()) };
    let calls = calls.as_array().ok_or_else(|| bad("messages[].tool_calls must be a list", "messages"))?;
    calls
        .iter()
        .map(|c| {
            let f = c.get("function").ok_or_else(|| bad("messages[].tool_calls[].function is required", "messages"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("messages[].tool_calls[].function.name is required", "messages"))?;
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                    bad(format!("messages[].tool_calls[].function.arguments of {name:?} is not valid JSON: {e}"), "messages")
                })?,
                Some(v) => v.clone(),
            };
            Ok((name.to_string(), arguments))
        })
        .collect()
}

/// A message for a template that reads `tools`: text content, and
/// `tool_calls` with their arguments as objects (what Hugging Face
/// templates iterate over), `tool_call_id` and `name` passed through.
fn template_message(m: &Message) -> Result<Value, ApiError> {
    let mut v = Map::new();
    v.insert("role".into(), Value::String(m.role.clone()));
    v.insert("content".into(), Value::String(protocol::message_text(m)?));
    if m.tool_calls.is_some() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .flat_map(|c| c.as_array().into_iter().flatten())
            .zip(calls_of(m)?)
            .map(|(raw, (name, arguments))| {
                json!({"id": raw.get("id").cloned().unwrap_or(Value::Null), "type": "function", "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        v.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        v.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    if let Some(name) = &m.name {
        v.insert("name".into(), Value::String(name.clone()));
    }
    Ok(Value::Object(v))
}

/// How generated text carries calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseMode {
    /// Text with calls in the server's format (`tool_choice: "auto"`).
    Auto(ToolFormat),
    /// A JSON array of `{"name", "parameters"}` (`"required"`).
    Array,
    /// The whole output is this function's arguments (a named function).
    Arguments(String),
}

/// How one request's output is read: the mode, whether several calls are
/// allowed, and the functions (whose parameter types some formats need).
#[derive(Clone, Debug)]
pub struct ToolParsing {
    /// How calls are written.
    pub mode: ParseMode,
    /// `parallel_tool_calls`.
    pub parallel: bool,
    /// The request's functions.
    pub functions: Arc<[FunctionTool]>,
}

impl ToolParsing {
    /// A parser for one choice.
    pub fn parser(&self) -> ToolCallParser {
        ToolCallParser::new(self.mode.clone(), self.parallel).with_functions(self.functions.clone())
    }
}

/// What the parser found in the text so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Ordinary assistant text.
    Content(String),
    /// A call begins (`index` counts calls in this choice from 0).
    CallStart {
        /// Position among this choice's calls.
        index: usize,
        /// The function.
        name: String,
    },
    /// More of call `index`'s arguments (JSON text; the fragments of a call
    /// concatenate to its arguments).
    Arguments {
        /// Position among this choice's calls.
        index: usize,
        /// The next piece.
        fragment: String,
    },
}

/// Where the auto-mode scanner stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Boundary {
    /// Nothing but whitespace so far: start-of-output openers count.
    Start,
    /// Right after a call: start-of-output openers count again.
    AfterCall,
    /// In content: only the openers that count anywhere.
    Content,
}

/// Turns generated text into [`ToolEvent`]s one delta at a time.
///
/// In auto mode the text is cut into content and call regions
/// ([`ToolFormat::scan_region`]). Text that may still turn out to open a
/// call (a trailing `<tool_` say) and whitespace before a call are held
/// back until the next delta decides; a region is reported once it is
/// complete and parses, so a stream never shows a call that the whole
/// response would not contain. An unterminated last region that parses is
/// a call too (small models often stop before `</tool_call>`); one that
/// does not parse is content.
#[derive(Debug)]
pub struct ToolCallParser {
    mode: ParseMode,
    parallel: bool,
    /// The request's functions (Qwen3-Coder's parameter types).
    functions: Arc<[FunctionTool]>,
    /// Unconsumed text.
    buf: String,
    /// `buf` opens a call region (auto mode).
    in_region: bool,
    boundary: Boundary,
    /// Whitespace (and separators between calls) not yet shown: dropped
    /// before a call and at the end, shown before more content.
    held: String,
    num_calls: usize,
    /// Array mode: the scanner's position in `buf`, nesting depth, string
    /// state, and where the current item began.
    scan: JsonScan,
}

#[derive(Debug, Default)]
struct JsonScan {
    pos: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    item_start: Option<usize>,
}

impl ToolCallParser {
    /// A parser for one choice.
    pub fn new(mode: ParseMode, parallel: bool) -> Self {
        Self {
            mode,
            parallel,
            functions: Arc::from(Vec::new()),
            buf: String::new(),
            in_region: false,
            boundary: Boundary::Start,
            held: String::new(),
            num_calls: 0,
            scan: JsonScan::default(),
        }
    }

    /// The parser, knowing the request's functions.
    pub fn with_functions(mut self, functions: Arc<[FunctionTool]>) -> Self {
        self.functions = functions;
        self
    }

    /// Calls reported so far.
    pub fn num_calls(&self) -> usize {
        self.num_calls
    }

    /// Feeds the next piece of generated text.
    pub fn push(&mut self, delta: &str) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        match self.mode {
            ParseMode::Arguments(_) => {
                self.start_named_call(&mut events);
                if !delta.is_empty() {
                    events.push(ToolEvent::Arguments { index: 0, fragment: delta.to_string() });
                }
            }
            ParseMode::Array => {
                self.buf.push_str(delta);
                self.scan_array(&mut events);
            }
            ParseMode::Auto(format) => {
                self.buf.push_str(delta);
                self.scan_auto(format, &mut events, false);
            }
        }
        events
    }

    /// Ends the text: reports what was held back.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        match self.mode {
            ParseMode::Arguments(_) => self.start_named_call(&mut events),
            // Grammar-constrained: only `max_tokens` ends it early. The call
            // being written then is dropped (the calls before it stand), in
            // a whole reply as in a stream, where a call is sent only once
            // its array item is complete; the JSON is never content.
            ParseMode::Array => self.buf.clear(),
            ParseMode::Auto(format) => self.scan_auto(format, &mut events, true),
        }
        events
    }

    /// A named function's one call opens with the first text (or at the end).
    fn start_named_call(&mut self, events: &mut Vec<ToolEvent>) {
        if let (ParseMode::Arguments(name), 0) = (&self.mode, self.num_calls) {
            events.push(ToolEvent::CallStart { index: 0, name: name.clone() });
            self.num_calls = 1;
        }
    }

    fn content(&mut self, events: &mut Vec<ToolEvent>, text: &str) {
        let mut t = std::mem::take(&mut self.held);
        t.push_str(text);
        let end = t.trim_end().len();
        self.held = t.split_off(end);
        if !t.is_empty() {
            match events.last_mut() {
                Some(ToolEvent::Content(prev)) => prev.push_str(&t),
                _ => events.push(ToolEvent::Content(t)),
            }
        }
    }

    fn call(&mut self, events: &mut Vec<ToolEvent>, name: String, arguments: String) {
        if self.num_calls > 0 && !self.parallel {
            return;
        }
        let index = self.num_calls;
        self.num_calls += 1;
        events.push(ToolEvent::CallStart { index, name });
        events.push(ToolEvent::Arguments { index, fragment: arguments });
    }

    /// Auto mode: content up to an opener, then the region it opens, as
    /// [`ToolFormat::scan_region`] decides it.
    fn scan_auto(&mut self, format: ToolFormat, events: &mut Vec<ToolEvent>, at_end: bool) {
        loop {
            if self.in_region {
                match format.scan_region(&self.buf, at_end, &self.functions) {
                    Scanned::Wait => return,
                    Scanned::Calls { len, calls } => {
                        self.buf.drain(..len);
                        self.held.clear();
                        for (name, arguments) in calls {
                            self.call(events, name, arguments);
                        }
                        self.boundary = Boundary::AfterCall;
                    }
                    Scanned::Text { len } => {
                        // Never nothing, so that the scan moves on.
                        let len = if len == 0 { self.buf.chars().next().map_or(0, char::len_utf8) } else { len };
                        let raw: String = self.buf.drain(..len).collect();
                        self.content(events, &raw);
                        self.boundary = Boundary::Content;
                    }
                }
                self.in_region = false;
                continue;
            }
            if self.boundary != Boundary::Content {
                let separators = format.separates_with_semicolons() && self.boundary == Boundary::AfterCall;
                let skip = self.buf.len() - self.buf.trim_start_matches(|c: char| c.is_whitespace() || (separators && c == ';')).len();
                let lead: String = self.buf.drain(..skip).collect();
                self.held.push_str(&lead);
                if self.buf.is_empty() {
                    if at_end {
                        self.held.clear();
                    }
                    return;
                }
                match format.starts_region(&self.buf, at_end) {
                    Start::Region => {
                        self.in_region = true;
                        continue;
                    }
                    Start::Wait => return,
                    Start::No => self.boundary = Boundary::Content,
                }
            }
            if let Some(i) = format.find_opener(&self.buf) {
                let before: String = self.buf.drain(..i).collect();
                // Whitespace before the region stays held: dropped if the
                // region is calls, shown if it turns out to be text.
                self.content(events, &before);
                self.in_region = true;
                continue;
            }
            // Hold back a tail that may be the start of an opener.
            let keep = if at_end { 0 } else { format.partial_opener(&self.buf) };
            let shown: String = self.buf.drain(..self.buf.len() - keep).collect();
            self.content(events, &shown);
            if at_end {
                self.held.clear();
            }
            return;
        }
    }

    /// Array mode: each complete top-level item of `[{...}, {...}]` is a call.
    fn scan_array(&mut self, events: &mut Vec<ToolEvent>) {
        let bytes = self.buf.as_bytes();
        let mut done: Vec<(usize, usize)> = Vec::new();
        let s = &mut self.scan;
        while s.pos < bytes.len() {
            let b = bytes[s.pos];
            if s.in_string {
                match (s.escaped, b) {
                    (true, _) => s.escaped = false,
                    (false, b'\\') => s.escaped = true,
                    (false, b'"') => s.in_string = false,
                    _ => {}
                }
            } else {
                match b {
                    b'"' => s.in_string = true,
                    b'{' | b'[' => {
                        s.depth += 1;
                        if s.depth == 2 && b == b'{' {
                            s.item_start = Some(s.pos);
                        }
                    }
                    b'}' | b']' => {
                        s.depth = s.depth.saturating_sub(1);
                        if s.depth == 1 && b == b'}' {
                            if let Some(start) = s.item_start.take() {
                                done.push((start, s.pos + 1));
                            }
                        }
                    }
                    _ => {}
                }
            }
            s.pos += 1;
        }
        for (start, end) in done {
            let item = self.buf[start..end].to_string();
            if let Some(mut calls) = parse_json_calls(&item) {
                if let Some((name, arguments)) = calls.pop() {
                    self.call(events, name, arguments);
                }
            }
        }
    }
}

/// A whole response's content and calls, from the events of one choice.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Assembled {
    /// The content (`None` if there was none and a call was made).
    pub content: Option<String>,
    /// `(name, arguments)` per call, in order.
    pub calls: Vec<(String, String)>,
}

impl Assembled {
    /// Adds events in order.
    pub fn apply(&mut self, events: Vec<ToolEvent>) {
        for e in events {
            match e {
                ToolEvent::Content(t) => self.content.get_or_insert_with(String::new).push_str(&t),
                ToolEvent::CallStart { name, .. } => self.calls.push((name, String::new())),
                ToolEvent::Arguments { index, fragment } => {
                    if let Some(c) = self.calls.get_mut(index) {
                        c.1.push_str(&fragment);
                    }
                }
            }
        }
    }
}

/// The OpenAI `finish_reason` of a choice that used tools: `tool_calls`
/// when a parsed (`auto`) or required call ended the turn, as vLLM reports
/// it (a named function keeps `stop`, as OpenAI does).
pub fn finish_reason(mode: &ParseMode, num_calls: usize, engine_reason: &'static str) -> &'static str {
    match mode {
        ParseMode::Auto(_) | ParseMode::Array if engine_reason == "stop" && num_calls > 0 => "tool_calls",
        _ => engine_reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_whole(mode: ParseMode, parallel: bool, text: &str) -> Assembled {
        let mut p = ToolCallParser::new(mode, parallel);
        let mut a = Assembled::default();
        a.apply(p.push(text));
        a.apply(p.finish());
        a
    }

    /// Every way of cutting `text` into three deltas gives the result of
    /// parsing it whole: the streaming bugs peers keep shipping (arguments
    /// split across chunks, a call lost at the end of a stream, text before
    /// a call) cannot happen without breaking this.
    fn assert_split_invariant(mode: ParseMode, parallel: bool, text: &str) -> Assembled {
        let whole = parse_whole(mode.clone(), parallel, text);
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &cuts {
            for &j in cuts.iter().filter(|&&j| j >= i) {
                let mut p = ToolCallParser::new(mode.clone(), parallel);
                let mut a = Assembled::default();
                for part in [&text[..i], &text[i..j], &text[j..]] {
                    a.apply(p.push(part));
                }
                a.apply(p.finish());
                assert_eq!(a, whole, "cut at {i} and {j} of {text:?}");
            }
        }
        whole
    }

    #[test]
    fn tagged_text_before_and_between_calls_and_every_split_agrees() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris <3\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>\n";
        let a = assert_split_invariant(ParseMode::Auto(ToolFormat::Hermes), true, text);
        assert_eq!(a.content.as_deref(), Some("Let me check."));
        assert_eq!(a.calls, vec![("get_weather".into(), r#"{"city":"Paris <3"}"#.into()), ("time".into(), "{}".into())]);
    }

    #[test]
    fn tagged_unterminated_last_call_still_counts_and_garbage_stays_content() {
        let a = assert_split_invariant(
            ParseMode::Auto(ToolFormat::Hermes),
            true,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}",
        );
        assert_eq!((a.content, a.calls), (None, vec![("f".into(), r#"{"x":[1,2]}"#.into())]));
        let a = assert_split_invariant(ParseMode::Auto(ToolFormat::Hermes), true, "A <tool_call>{\"name\": oops</tool_call> B");
        assert_eq!(a.content.as_deref(), Some("A <tool_call>{\"name\": oops</tool_call> B"));
        assert!(a.calls.is_empty());
        // A lone `<tool_` at the very end is text.
        let a = assert_split_invariant(ParseMode::Auto(ToolFormat::Hermes), true, "x <tool_");
        assert_eq!(a.content.as_deref(), Some("x <tool_"));
    }

    #[test]
    fn tagged_list_blocks_string_arguments_and_the_parallel_switch() {
        let text = "<tool_call>[{\"name\": \"a\", \"arguments\": \"{\\\"k\\\": 1}\"}, {\"name\": \"b\", \"parameters\": {\"q\": \"é\"}}]</tool_call>";
        let a = assert_split_invariant(ParseMode::Auto(ToolFormat::Hermes), true, text);
        assert_eq!(a.calls, vec![("a".into(), r#"{"k": 1}"#.into()), ("b".into(), r#"{"q":"é"}"#.into())]);
        let a = assert_split_invariant(ParseMode::Auto(ToolFormat::Hermes), false, text);
        assert_eq!(a.calls.len(), 1);
    }

    #[test]
    fn plain_text_passes_through_unchanged() {
        let a = assert_split_invariant(ParseMode::Auto(ToolFormat::Hermes), true, "Hello <b>world</b> < tool_call >");
        assert_eq!(a.content.as_deref(), Some("Hello <b>world</b> < tool_call >"));
        assert!(a.calls.is_empty());
    }

    #[test]
    fn array_mode_reports_complete_items_only() {
        let text = r#"[{"name": "f", "parameters": {"s": "}]{[\"", "n": 2}}, {"name": "g", "parameters": {}}]"#;
        let a = assert_split_invariant(ParseMode::Array, true, text);
        assert_eq!(a.calls, vec![("f".into(), r#"{"s":"}]{[\"","n":2}"#.into()), ("g".into(), "{}".into())]);
        assert_eq!(a.content, None);
        // Cut off mid-item (max_tokens): the complete item only.
        let a = assert_split_invariant(ParseMode::Array, true, r#"[{"name": "f", "parameters": {}}, {"name": "g", "para"#);
        assert_eq!(a.calls, vec![("f".into(), "{}".into())]);
        // Nothing complete: nothing to report, and the JSON is not content.
        let a = assert_split_invariant(ParseMode::Array, true, r#"[{"name": "f""#);
        assert_eq!((a.content.as_deref(), a.calls.len()), (None, 0));
    }

    #[test]
    fn arguments_mode_streams_the_output_as_the_arguments() {
        let a = assert_split_invariant(ParseMode::Arguments("f".into()), true, r#"{"city": "Oslo"}"#);
        assert_eq!(a.calls, vec![("f".into(), r#"{"city": "Oslo"}"#.into())]);
        assert_eq!(a.content, None);
    }

    fn auto(format: ToolFormat, text: &str) -> Assembled {
        assert_split_invariant(ParseMode::Auto(format), true, text)
    }

    fn calls(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect()
    }

    #[test]
    fn llama3_json_calls_open_the_output() {
        // Llama 3.1 with `<|python_tag|>` kept, two calls.
        let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"San Francisco, CA\", \"unit\": \"celsius\"}}; {\"name\": \"get_time\", \"parameters\": {\"tz\": \"PST\"}}";
        let a = auto(ToolFormat::Llama3Json, text);
        assert_eq!(a.calls, calls(&[("get_weather", r#"{"city":"San Francisco, CA","unit":"celsius"}"#), ("get_time", r#"{"tz":"PST"}"#)]));
        assert_eq!(a.content, None);
        // Llama 3.2 (special tokens skipped): bare JSON, "arguments" too.
        let a = auto(ToolFormat::Llama3Json, "\n\n{\"name\": \"f\", \"arguments\": {\"x\": [1, {\"y\": \"}\"}]}}\n");
        assert_eq!((a.content, a.calls), (None, calls(&[("f", r#"{"x":[1,{"y":"}"}]}"#)])));
        // Text that does not open with a call is content, braces and all.
        let a = auto(ToolFormat::Llama3Json, "The set {1, 2} has {\"name\": \"f\"} in it.");
        assert_eq!((a.content.as_deref(), a.calls.len()), (Some("The set {1, 2} has {\"name\": \"f\"} in it."), 0));
        // JSON that is not a call, or is cut off, stays content.
        let a = auto(ToolFormat::Llama3Json, "{\"answer\": 42}");
        assert_eq!((a.content.as_deref(), a.calls.len()), (Some("{\"answer\": 42}"), 0));
        let a = auto(ToolFormat::Llama3Json, "{\"name\": \"f\", \"parameters\": {\"a\": 1}");
        assert_eq!((a.content.as_deref(), a.calls.len()), (Some("{\"name\": \"f\", \"parameters\": {\"a\": 1}"), 0));
        // Code after the tag (Llama's built-in code interpreter): content.
        let a = auto(ToolFormat::Llama3Json, "<|python_tag|>print(1)");
        assert_eq!((a.content.as_deref(), a.calls.len()), (Some("<|python_tag|>print(1)"), 0));
    }

    #[test]
    fn mistral_calls_follow_the_tool_calls_marker_in_both_forms() {
        // v3 tokenizers: a JSON list.
        let text = "Let me look that up.[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}, {\"name\": \"get_time\", \"arguments\": {}}]";
        let a = auto(ToolFormat::Mistral, text);
        assert_eq!(a.content.as_deref(), Some("Let me look that up."));
        assert_eq!(a.calls, calls(&[("get_weather", r#"{"city":"Paris","days":3}"#), ("get_time", "{}")]));
        // v11+: `name[ARGS]{json}` per call (and `[CALL_ID]` in some versions).
        let text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris [FR]\"}[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}";
        let a = auto(ToolFormat::Mistral, text);
        assert_eq!((a.content, a.calls), (None, calls(&[("get_weather", r#"{"city":"Paris [FR]"}"#), ("get_time", "{}")])));
        // The list's `]` missing at the end: the complete calls count.
        let a = auto(ToolFormat::Mistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": \"]\"}}");
        assert_eq!(a.calls, calls(&[("f", r#"{"a":"]"}"#)]));
        // Garbage after the marker stays content.
        for text in ["[TOOL_CALLS] I cannot call tools.", "[TOOL_CALLS]not a name[ARGS]{}", "[TOOL_CALLS][{\"name\": 1}]", "A [TOOL_CALLS"]
        {
            let a = auto(ToolFormat::Mistral, text);
            assert_eq!((a.content.as_deref(), a.calls.len()), (Some(text), 0), "{text:?}");
        }
    }

    #[test]
    fn qwen3_coder_parameters_take_their_schema_types() {
        let functions: Arc<[FunctionTool]> = vec![FunctionTool {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                               "code": {"type": ["string", "null"]}, "opts": {"type": "object"}, "metric": {"type": "boolean"}}}),
        }]
        .into();
        let text = "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=code>\n007\n</parameter>\n<parameter=opts>\n{\"hourly\": true}\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>";
        let parse = |text: &str| {
            let mut p = ToolCallParser::new(ParseMode::Auto(ToolFormat::Qwen3Coder), true).with_functions(functions.clone());
            let mut a = Assembled::default();
            a.apply(p.push(text));
            a.apply(p.finish());
            a
        };
        let a = parse(text);
        assert_eq!(a.content.as_deref(), Some("I'll check."));
        assert_eq!(
            a.calls,
            calls(&[("get_weather", r#"{"city":"New York","days":3,"code":"007","opts":{"hourly":true},"metric":true,"note":"42"}"#)])
        );
        // Every split agrees (without the schema: all strings).
        let a = auto(ToolFormat::Qwen3Coder, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>");
        assert_eq!(a.calls, calls(&[("f", r#"{"a":"1"}"#)]));
        // Hermes JSON in the block is read too; malformed XML is content.
        let a = auto(ToolFormat::Qwen3Coder, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
        assert_eq!(a.calls, calls(&[("f", "{}")]));
        let a = auto(ToolFormat::Qwen3Coder, "<tool_call><function=bad name><parameter=a>1</tool_call>");
        assert_eq!(a.calls.len(), 0);
        assert_eq!(a.content.as_deref(), Some("<tool_call><function=bad name><parameter=a>1</tool_call>"));
    }

    #[test]
    fn qwen3_is_hermes_after_its_reasoning() {
        // What follows `</think>` (the reasoning parser's content).
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris, France\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"location\": \"Paris, France\"}}\n</tool_call>";
        let a = auto(ToolFormat::Hermes, text);
        assert_eq!(a.calls.len(), 2);
        assert_eq!(a.content, None);
    }

    #[test]
    fn pythonic_lists_open_the_output() {
        let text = " [get_weather(city=\"Paris\", days=3), search(query='l\\'été \"chaud\"', filters={\"lang\": [\"fr\", 'en'], 'safe': True, \"max\": 1.5e3}, limit=None, tags=(\"a\",))]";
        let a = auto(ToolFormat::Pythonic, text);
        assert_eq!(a.content, None);
        assert_eq!(
            a.calls,
            calls(&[
                ("get_weather", r#"{"city":"Paris","days":3}"#),
                (
                    "search",
                    r#"{"query":"l'été \"chaud\"","filters":{"lang":["fr","en"],"safe":true,"max":1500.0},"limit":null,"tags":["a"]}"#
                ),
            ])
        );
        // The closing `]` missing at the end: the calls count.
        let a = auto(ToolFormat::Pythonic, "[f(a=[1, 2])");
        assert_eq!(a.calls, calls(&[("f", r#"{"a":[1,2]}"#)]));
        // Not calls: content, as written.
        for text in ["[1] Paris is the capital.", "Call [f(a=1)] later.", "[f(a=1) + 2]", "[f(a=\"x)]", "[f(", "["] {
            let a = auto(ToolFormat::Pythonic, text);
            assert_eq!((a.content.as_deref(), a.calls.len()), (Some(text), 0), "{text:?}");
        }
    }

    #[test]
    fn gemma3_reads_tool_code_fences_and_pythonic_lists() {
        let text = "I'll check the weather for you.\n```tool_code\nprint(get_weather(city=\"Paris\", unit=\"celsius\"))\nget_time(tz='Europe/Paris')\n```\n";
        let a = auto(ToolFormat::Gemma3, text);
        assert_eq!(a.content.as_deref(), Some("I'll check the weather for you."));
        assert_eq!(a.calls, calls(&[("get_weather", r#"{"city":"Paris","unit":"celsius"}"#), ("get_time", r#"{"tz":"Europe/Paris"}"#)]));
        let a = auto(ToolFormat::Gemma3, "```tool_code\n[f(x=1), g()]\n```");
        assert_eq!(a.calls, calls(&[("f", r#"{"x":1}"#), ("g", "{}")]));
        let a = auto(ToolFormat::Gemma3, "[get_weather(city=\"Oslo\")]");
        assert_eq!(a.calls, calls(&[("get_weather", r#"{"city":"Oslo"}"#)]));
        // Code that is not calls stays content, fence and all.
        let text = "Try:\n```tool_code\nx = 1 + 2\n```\nand ```python\nprint(1)\n```";
        let a = auto(ToolFormat::Gemma3, text);
        assert_eq!((a.content.as_deref(), a.calls.len()), (Some(text), 0));
    }

    /// Random mixes of every format's markers, brackets, quotes and text:
    /// no panic, and a few splits agree with the whole, in every format.
    #[test]
    fn garbage_never_panics_and_splits_agree_in_every_format() {
        const PIECES: &[&str] = &[
            "[",
            "]",
            "{",
            "}",
            "(",
            ")",
            "\"",
            "'",
            "\\",
            ",",
            ";",
            ":",
            "=",
            " ",
            "\n",
            "é",
            "f",
            "name",
            "1",
            "True",
            "<tool_call>",
            "</tool_call>",
            "[TOOL_CALLS]",
            "[ARGS]",
            "```tool_code",
            "```",
            "<|python_tag|>",
            "<function=",
            "<parameter=",
            "</parameter>",
            "</function>",
            ">",
            "\"name\"",
            "\"arguments\"",
            "f(a=1)",
        ];
        let formats = [
            ToolFormat::Hermes,
            ToolFormat::Qwen3Coder,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
            ToolFormat::Pythonic,
            ToolFormat::Gemma3,
        ];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: usize| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 33) as usize) % n
        };
        for _ in 0..400 {
            let len = 1 + next(24);
            let text: String = (0..len).map(|_| PIECES[next(PIECES.len())]).collect();
            for format in formats {
                let whole = parse_whole(ParseMode::Auto(format), true, &text);
                let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
                for _ in 0..6 {
                    let (mut i, mut j) = (cuts[next(cuts.len())], cuts[next(cuts.len())]);
                    if i > j {
                        std::mem::swap(&mut i, &mut j);
                    }
                    let mut p = ToolCallParser::new(ParseMode::Auto(format), true);
                    let mut a = Assembled::default();
                    for part in [&text[..i], &text[i..j], &text[j..]] {
                        a.apply(p.push(part));
                    }
                    a.apply(p.finish());
                    assert_eq!(a, whole, "{format:?}: cut at {i} and {j} of {text:?}");
                }
                // Nothing is lost: without calls, the content is the text
                // (less the whitespace at its end).
                if whole.calls.is_empty() {
                    assert_eq!(whole.content.as_deref().unwrap_or(""), text.trim_end(), "{format:?}: {text:?}");
                }
            }
        }
    }

    #[test]
    fn each_format_prompts_for_and_renders_its_own_calls() {
        let history = vec![("get_weather".to_string(), json!({"city": "Paris", "days": 3}))];
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Qwen3Coder,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
            ToolFormat::Pythonic,
            ToolFormat::Gemma3,
        ] {
            assert!(format.default_prompt().contains("{tools}"), "{format:?}");
            // What the default prompt shows as an earlier call parses back.
            let rendered = format.render_calls(&history);
            let a = parse_whole(ParseMode::Auto(format), true, &rendered);
            let expected = if format == ToolFormat::Qwen3Coder { r#"{"city":"Paris","days":"3"}"# } else { r#"{"city":"Paris","days":3}"# };
            assert_eq!(a.calls, calls(&[("get_weather", expected)]), "{format:?}: {rendered}");
        }
        assert!(ToolFormat::Mistral.keeps_special_tokens() && !ToolFormat::Hermes.keeps_special_tokens());
    }

    #[test]
    fn tool_request_validation_names_the_field() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let t = ToolRequest::parse(Some(&tools), None, None).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        let named = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(ToolRequest::parse(Some(&tools), Some(&named), None).unwrap_err().param.as_deref(), Some("tool_choice"));
        assert_eq!(ToolRequest::parse(None, Some(&json!("required")), None).unwrap_err().param.as_deref(), Some("tool_choice"));
        let bad_name = json!([{"type": "function", "function": {"name": "a b"}}]);
        assert_eq!(ToolRequest::parse(Some(&bad_name), None, None).unwrap_err().param.as_deref(), Some("tools"));
        assert!(ToolRequest::parse(None, Some(&json!("auto")), None).unwrap().is_none());
        let required = ToolRequest::parse(Some(&tools), Some(&json!("required")), Some(false)).unwrap().unwrap();
        let Some(StructuredOutput::Json(schema)) = required.constraint() else { panic!("a JSON constraint") };
        let schema: Value = serde_json::from_str(&schema).unwrap();
        assert_eq!(schema["maxItems"], 1);
        assert_eq!(schema["items"]["anyOf"][0]["properties"]["name"]["enum"][0], "get_weather");
    }

    #[test]
    fn default_prompt_lists_tools_and_renders_history() {
        let tools = json!([{"type": "function", "function": {"name": "f", "description": "d"}}]);
        let t = ToolRequest::parse(Some(&tools), None, None).unwrap().unwrap();
        let msgs: Vec<Message> = serde_json::from_value(json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "tool", "tool_call_id": "c2", "content": "43"}
        ]))
        .unwrap();
        let (out, tools_var) = prompt_messages(&msgs, Some(&t), false, ToolFormat::Hermes).unwrap();
        assert!(tools_var.is_none());
        assert_eq!(out.len(), 4);
        assert!(out[0]["content"].as_str().unwrap().contains(r#"{"name":"f","description":"d"}"#));
        assert_eq!(out[2]["content"], "<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":1}}\n</tool_call>");
        assert_eq!(out[3]["role"], "user");
        assert_eq!(out[3]["content"], "<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>");
        // A template that reads tools gets them, and arguments as objects.
        let (out, tools_var) = prompt_messages(&msgs, Some(&t), true, ToolFormat::Hermes).unwrap();
        assert_eq!(tools_var.unwrap().len(), 1);
        assert_eq!(out[1]["tool_calls"][0]["function"]["arguments"]["a"], 1);
        assert_eq!(out[2]["tool_call_id"], "c1");
    }
}
