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
//!    ([`DEFAULT_TOOL_PROMPT`]): the tools in a system message, earlier calls
//!    as `<tool_call>` blocks, results as `<tool_response>` blocks in a user
//!    turn.
//! 3. [`ToolCallParser`] turns the generated text into content and calls,
//!    one delta at a time, so that a stream and a whole response are parsed
//!    by the same code and always agree.
//!
//! With `tool_choice: "required"` or a named function, decoding is
//! constrained ([`ToolRequest::constraint`]): a named function's output *is*
//! its arguments (a JSON value of its parameter schema); `required` produces
//! a JSON array of `{"name", "parameters"}` objects, as vLLM does. Under
//! `auto` the model writes `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
//! blocks (the Hermes convention, which most open tool-tuned models and
//! our default prompt use) between ordinary text.

use super::error::ApiError;
use super::protocol::{self, Message};
use serde_json::{json, Map, Value};
use vellum_base::StructuredOutput;

/// The system prompt that describes tools to a model whose chat template
/// does not read `tools`; `{tools}` becomes one JSON object per line.
pub const DEFAULT_TOOL_PROMPT: &str =
    "You can call functions to answer. The functions are listed, one JSON object each, between <tools> and </tools>:
<tools>
{tools}
</tools>
To call a function, answer with a JSON object naming it and giving its arguments between <tool_call> and </tool_call>, one block per call:
<tool_call>
{\"name\": \"<function name>\", \"arguments\": {<arguments as the function's parameters describe them>}}
</tool_call>
A function's result comes back between <tool_response> and </tool_response>. If no function fits, answer in plain text.";

/// Opens a call in the output (and in the default prompt).
const CALL_OPEN: &str = "<tool_call>";
/// Closes a call.
const CALL_CLOSE: &str = "</tool_call>";

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

fn valid_name(name: &str) -> bool {
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

    /// How the output is read.
    pub fn parse_mode(&self) -> Option<ParseMode> {
        match &self.choice {
            ToolChoice::None => None,
            ToolChoice::Auto => Some(ParseMode::Tagged),
            ToolChoice::Required => Some(ParseMode::Array),
            ToolChoice::Named(name) => Some(ParseMode::Arguments(name.clone())),
        }
    }
}

/// The conversation as the chat template gets it, and the `tools` variable
/// (`None`: leave it unset). `template_reads_tools` picks between the
/// template's own tool support and the default prompt.
pub fn prompt_messages(
    messages: &[Message],
    tools: Option<&ToolRequest>,
    template_reads_tools: bool,
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
        for call in calls_of(m)? {
            if !content.is_empty() {
                content.push('\n');
            }
            let arguments = call.1;
            content.push_str(&format!("{CALL_OPEN}\n{}\n{CALL_CLOSE}", json!({"name": call.0, "arguments": arguments})));
        }
        out.push(json!({"role": m.role, "content": content}));
    }
    if let Some(t) = tools {
        let listed: Vec<String> = t.raw_tools.iter().map(|tool| tool.get("function").map_or_else(String::new, |f| f.to_string())).collect();
        let prompt = DEFAULT_TOOL_PROMPT.replace("{tools}", &listed.join("\n"));
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
    /// Text with `<tool_call>` blocks (`tool_choice: "auto"`).
    Tagged,
    /// A JSON array of `{"name", "parameters"}` (`"required"`).
    Array,
    /// The whole output is this function's arguments (a named function).
    Arguments(String),
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

/// Turns generated text into [`ToolEvent`]s one delta at a time.
///
/// Text that may still turn out to open a call (a trailing `<tool_` say) and
/// whitespace before a call are held back until the next delta decides;
/// a call is reported once its block is complete and parses, so a stream
/// never shows a call that the whole response would not contain. An
/// unterminated last block that parses is a call too (small models often
/// stop before `</tool_call>`); one that does not parse is content.
#[derive(Debug)]
pub struct ToolCallParser {
    mode: ParseMode,
    parallel: bool,
    /// Unconsumed text.
    buf: String,
    /// Inside a `<tool_call>` block (tagged mode).
    in_call: bool,
    /// Content whitespace not yet shown (dropped before a call and at the end).
    pending_ws: String,
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
        Self { mode, parallel, buf: String::new(), in_call: false, pending_ws: String::new(), num_calls: 0, scan: JsonScan::default() }
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
            ParseMode::Tagged => {
                self.buf.push_str(delta);
                self.scan_tagged(&mut events, false);
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
            ParseMode::Tagged => self.scan_tagged(&mut events, true),
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
        let mut t = std::mem::take(&mut self.pending_ws);
        t.push_str(text);
        let end = t.trim_end().len();
        self.pending_ws = t.split_off(end);
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

    /// Tagged mode: content up to a `<tool_call>`, then the block up to
    /// `</tool_call>`.
    fn scan_tagged(&mut self, events: &mut Vec<ToolEvent>, at_end: bool) {
        loop {
            if !self.in_call {
                if let Some(i) = self.buf.find(CALL_OPEN) {
                    let before: String = self.buf.drain(..i + CALL_OPEN.len()).collect();
                    // Whitespace before the block stays pending: dropped if
                    // the block is a call, shown if it turns out to be text.
                    self.content(events, &before[..i]);
                    self.in_call = true;
                    continue;
                }
                // Hold back a tail that may be the start of `<tool_call>`.
                let keep = if at_end { 0 } else { partial_suffix(&self.buf, CALL_OPEN) };
                let shown: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content(events, &shown);
                if at_end {
                    self.pending_ws.clear();
                }
                return;
            }
            let (block, closed) = match self.buf.find(CALL_CLOSE) {
                Some(i) => (self.buf[..i].to_string(), Some(i)),
                None if at_end => (self.buf.clone(), None),
                None => return,
            };
            let consumed = closed.map_or(self.buf.len(), |i| i + CALL_CLOSE.len());
            self.buf.drain(..consumed);
            self.in_call = false;
            match parse_calls(&block) {
                Some(calls) => {
                    self.pending_ws.clear();
                    for (name, arguments) in calls {
                        self.call(events, name, arguments);
                    }
                }
                None => {
                    let raw = format!("{CALL_OPEN}{block}{}", if closed.is_some() { CALL_CLOSE } else { "" });
                    self.content(events, &raw);
                }
            }
            if at_end && self.buf.is_empty() {
                self.pending_ws.clear();
                return;
            }
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
            if let Some(mut calls) = parse_calls(&item) {
                if let Some((name, arguments)) = calls.pop() {
                    self.call(events, name, arguments);
                }
            }
        }
    }
}

/// Length of the longest proper prefix of `tag` that `text` ends with.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&n| text.ends_with(&tag[..n])).unwrap_or(0)
}

/// The calls in a block: `{"name": ..., "arguments"|"parameters": ...}` or
/// a list of those. Arguments given as JSON text are taken as that text.
fn parse_calls(block: &str) -> Option<Vec<(String, String)>> {
    let v: Value = serde_json::from_str(block.trim()).ok()?;
    let items = match v {
        Value::Array(items) => items,
        one @ Value::Object(_) => vec![one],
        _ => return None,
    };
    items
        .iter()
        .map(|item| {
            let name = item.get("name")?.as_str()?.to_string();
            let arguments = match item.get("arguments").or_else(|| item.get("parameters")) {
                None | Some(Value::Null) => "{}".to_string(),
                Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
                Some(v) => v.to_string(),
            };
            Some((name, arguments))
        })
        .collect()
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
        ParseMode::Tagged | ParseMode::Array if engine_reason == "stop" && num_calls > 0 => "tool_calls",
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
        let a = assert_split_invariant(ParseMode::Tagged, true, text);
        assert_eq!(a.content.as_deref(), Some("Let me check."));
        assert_eq!(a.calls, vec![("get_weather".into(), r#"{"city":"Paris <3"}"#.into()), ("time".into(), "{}".into())]);
    }

    #[test]
    fn tagged_unterminated_last_call_still_counts_and_garbage_stays_content() {
        let a = assert_split_invariant(ParseMode::Tagged, true, "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}");
        assert_eq!((a.content, a.calls), (None, vec![("f".into(), r#"{"x":[1,2]}"#.into())]));
        let a = assert_split_invariant(ParseMode::Tagged, true, "A <tool_call>{\"name\": oops</tool_call> B");
        assert_eq!(a.content.as_deref(), Some("A <tool_call>{\"name\": oops</tool_call> B"));
        assert!(a.calls.is_empty());
        // A lone `<tool_` at the very end is text.
        let a = assert_split_invariant(ParseMode::Tagged, true, "x <tool_");
        assert_eq!(a.content.as_deref(), Some("x <tool_"));
    }

    #[test]
    fn tagged_list_blocks_string_arguments_and_the_parallel_switch() {
        let text = "<tool_call>[{\"name\": \"a\", \"arguments\": \"{\\\"k\\\": 1}\"}, {\"name\": \"b\", \"parameters\": {\"q\": \"é\"}}]</tool_call>";
        let a = assert_split_invariant(ParseMode::Tagged, true, text);
        assert_eq!(a.calls, vec![("a".into(), r#"{"k": 1}"#.into()), ("b".into(), r#"{"q":"é"}"#.into())]);
        let a = assert_split_invariant(ParseMode::Tagged, false, text);
        assert_eq!(a.calls.len(), 1);
    }

    #[test]
    fn plain_text_passes_through_unchanged() {
        let a = assert_split_invariant(ParseMode::Tagged, true, "Hello <b>world</b> < tool_call >");
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
        let (out, tools_var) = prompt_messages(&msgs, Some(&t), false).unwrap();
        assert!(tools_var.is_none());
        assert_eq!(out.len(), 4);
        assert!(out[0]["content"].as_str().unwrap().contains(r#"{"name":"f","description":"d"}"#));
        assert_eq!(out[2]["content"], "<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":1}}\n</tool_call>");
        assert_eq!(out[3]["role"], "user");
        assert_eq!(out[3]["content"], "<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>");
        // A template that reads tools gets them, and arguments as objects.
        let (out, tools_var) = prompt_messages(&msgs, Some(&t), true).unwrap();
        assert_eq!(tools_var.unwrap().len(), 1);
        assert_eq!(out[1]["tool_calls"][0]["function"]["arguments"]["a"], 1);
        assert_eq!(out[2]["tool_call_id"], "c1");
    }
}
