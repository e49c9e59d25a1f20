//! The ways models write tool calls under `tool_choice: "auto"`
//! (`--tool-call-parser`, named as vLLM names them), and how each is read:
//!
//! | format | output | families |
//! |---|---|---|
//! | [`ToolFormat::Hermes`] | `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` | Hermes, Qwen2.5, Qwen3 (`qwen3`) |
//! | [`ToolFormat::Qwen3Coder`] | `<tool_call><function=f><parameter=x>value</parameter></function></tool_call>` | Qwen3-Coder |
//! | [`ToolFormat::Llama3Json`] | `<\|python_tag\|>{"name": "f", "parameters": {...}}; {...}` at the start | Llama 3.1, 3.2 |
//! | [`ToolFormat::Mistral`] | `[TOOL_CALLS][{"name": "f", "arguments": {...}}]` or `[TOOL_CALLS]f[ARGS]{...}` | Mistral, Mixtral, Ministral |
//! | [`ToolFormat::Pythonic`] | `[f(x="a", n=3), g()]` at the start | Llama 3.2/4 (pythonic prompts), ToolACE |
//! | [`ToolFormat::Gemma3`] | a pythonic list at the start, or calls in a `` ```tool_code `` fence | Gemma 3 |
//!
//! The output is cut into *regions*: content, and spans that open with a
//! format's opener (`<tool_call>`, `[TOOL_CALLS]`, `` ```tool_code ``
//! anywhere; `{`, `<|python_tag|>` or `[` only at the start of the output or
//! right after a call). [`ToolFormat::scan_region`] decides a region from
//! its text alone: more text is needed, it is calls, or it is content. A
//! decision is taken only once later text cannot change it, which is what
//! lets [`super::tools::ToolCallParser`] stream any split of the output to
//! the same result as the whole.

use super::python_literal::{self, call_to_python};
use super::tools::{valid_name, FunctionTool};
use serde_json::{json, Map, Value};

/// How calls are written in the output (`tool_choice: "auto"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>` blocks holding a JSON call or a list of calls.
    Hermes,
    /// `<tool_call>` blocks holding `<function=name>` with `<parameter=x>`
    /// elements (a JSON block is read too).
    Qwen3Coder,
    /// JSON objects `{"name", "parameters"|"arguments"}` separated by `;`,
    /// opening the output (after an optional `<|python_tag|>`).
    Llama3Json,
    /// `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}`.
    Mistral,
    /// A Python list of calls opening the output.
    Pythonic,
    /// [`ToolFormat::Pythonic`], or calls in a `` ```tool_code `` fence
    /// anywhere.
    Gemma3,
}

/// What [`ToolFormat::scan_region`] found at the start of a region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scanned {
    /// Not decided yet: more text is needed.
    Wait,
    /// The first `len` bytes are these calls (`(name, arguments as JSON
    /// text)`).
    Calls {
        /// Bytes the calls took.
        len: usize,
        /// The calls, in order.
        calls: Vec<(String, String)>,
    },
    /// The first `len` bytes are content.
    Text {
        /// Bytes of content.
        len: usize,
    },
}

/// Whether text at a call boundary opens a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// It does.
    Region,
    /// It may: more text is needed.
    Wait,
    /// It does not.
    No,
}

const TOOL_CALL_OPEN: &str = "<tool_call>";
const TOOL_CALL_CLOSE: &str = "</tool_call>";
const TOOL_CALLS: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";
const PYTHON_TAG: &str = "<|python_tag|>";
const FENCE_OPEN: &str = "```tool_code";
const FENCE_CLOSE: &str = "```";
/// Longest `name[CALL_ID]id` before `[ARGS]` in Mistral's named form.
const MAX_MISTRAL_HEADER: usize = 128;

/// The listing of tools and the closing line every default prompt shares.
macro_rules! tool_prompt {
    ($how:expr) => {
        concat!(
            "You can call functions to answer. The functions are listed, one JSON object each, between <tools> and </tools>:\n",
            "<tools>\n{tools}\n</tools>\n",
            $how,
            "\nA function's result comes back between <tool_response> and </tool_response>. If no function fits, answer in plain text."
        )
    };
}

/// The default prompt of [`ToolFormat::Hermes`] (`{tools}`: one JSON object
/// per line).
pub const DEFAULT_TOOL_PROMPT: &str = tool_prompt!(
    "To call a function, answer with a JSON object naming it and giving its arguments between <tool_call> and </tool_call>, one block per call:
<tool_call>
{\"name\": \"<function name>\", \"arguments\": {<arguments as the function's parameters describe them>}}
</tool_call>"
);

const QWEN3_CODER_PROMPT: &str = tool_prompt!(
    "To call a function, answer with a block naming it and giving each argument as a parameter, one block per call:
<tool_call>
<function=<function name>>
<parameter=<parameter name>>
<value>
</parameter>
</function>
</tool_call>"
);

const LLAMA3_JSON_PROMPT: &str = tool_prompt!(
    "To call a function, answer with only a JSON object in the format {\"name\": <function name>, \"parameters\": {<argument name>: <value>, ...}}; separate several calls with ;. Do not use variables."
);

const MISTRAL_PROMPT: &str = tool_prompt!(
    "To call functions, answer with [TOOL_CALLS] followed by a JSON list of the calls:
[TOOL_CALLS][{\"name\": \"<function name>\", \"arguments\": {<arguments as the function's parameters describe them>}}]"
);

const PYTHONIC_PROMPT: &str = tool_prompt!(
    "To call functions, answer with only a Python list of calls, arguments as keyword arguments with Python literal values:
[func_name1(param1=value1, param2=value2), func_name2(param=value)]"
);

const GEMMA3_PROMPT: &str = tool_prompt!(
    "To call functions, answer with the calls in a tool_code block, one per line, arguments as keyword arguments with Python literal values:
```tool_code
func_name(param1=value1, param2=value2)
```"
);

impl ToolFormat {
    /// Whether the format's markers are special tokens the output must
    /// keep (`[TOOL_CALLS]`, `[ARGS]`): a request with tools under `auto`
    /// is then detokenized with `skip_special_tokens: false`, as vLLM's
    /// Mistral parser does.
    pub fn keeps_special_tokens(self) -> bool {
        matches!(self, ToolFormat::Mistral)
    }

    /// The system prompt that describes the tools to a model whose chat
    /// template does not read `tools`, asking for this format; `{tools}`
    /// becomes one JSON object per line.
    pub fn default_prompt(self) -> &'static str {
        match self {
            ToolFormat::Hermes => DEFAULT_TOOL_PROMPT,
            ToolFormat::Qwen3Coder => QWEN3_CODER_PROMPT,
            ToolFormat::Llama3Json => LLAMA3_JSON_PROMPT,
            ToolFormat::Mistral => MISTRAL_PROMPT,
            ToolFormat::Pythonic => PYTHONIC_PROMPT,
            ToolFormat::Gemma3 => GEMMA3_PROMPT,
        }
    }

    /// An assistant turn's earlier calls written as the model would write
    /// them (for the default prompt's history).
    pub fn render_calls(self, calls: &[(String, Value)]) -> String {
        match self {
            ToolFormat::Hermes => calls
                .iter()
                .map(|(name, arguments)| format!("{TOOL_CALL_OPEN}\n{}\n{TOOL_CALL_CLOSE}", json!({"name": name, "arguments": arguments})))
                .collect::<Vec<_>>()
                .join("\n"),
            ToolFormat::Qwen3Coder => calls
                .iter()
                .map(|(name, arguments)| {
                    let params: String = arguments
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| {
                            let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                            format!("<parameter={k}>\n{v}\n</parameter>\n")
                        })
                        .collect();
                    format!("{TOOL_CALL_OPEN}\n<function={name}>\n{params}</function>\n{TOOL_CALL_CLOSE}")
                })
                .collect::<Vec<_>>()
                .join("\n"),
            ToolFormat::Llama3Json => calls
                .iter()
                .map(|(name, arguments)| json!({"name": name, "parameters": arguments}).to_string())
                .collect::<Vec<_>>()
                .join("; "),
            ToolFormat::Mistral => {
                let list: Vec<Value> = calls.iter().map(|(name, arguments)| json!({"name": name, "arguments": arguments})).collect();
                format!("{TOOL_CALLS}{}", Value::Array(list))
            }
            ToolFormat::Pythonic => {
                format!("[{}]", calls.iter().map(|(name, arguments)| call_to_python(name, arguments)).collect::<Vec<_>>().join(", "))
            }
            ToolFormat::Gemma3 => {
                let lines: Vec<String> = calls.iter().map(|(name, arguments)| call_to_python(name, arguments)).collect();
                format!("{FENCE_OPEN}\n{}\n{FENCE_CLOSE}", lines.join("\n"))
            }
        }
    }

    /// Where the first opener that counts anywhere in the text starts.
    pub fn find_opener(self, text: &str) -> Option<usize> {
        self.anywhere_opener().and_then(|o| text.find(o))
    }

    /// Bytes at the end of `text` that may be the start of an opener (held
    /// back until the next delta decides).
    pub fn partial_opener(self, text: &str) -> usize {
        self.anywhere_opener().map_or(0, |o| partial_suffix(text, o))
    }

    /// Whether `;` separates calls (skipped after a call).
    pub fn separates_with_semicolons(self) -> bool {
        self == ToolFormat::Llama3Json
    }

    /// Whether `text`, at the start of the output or right after a call
    /// (whitespace skipped), opens a region.
    pub fn starts_region(self, text: &str, at_end: bool) -> Start {
        let openers: &[&str] = match self {
            ToolFormat::Llama3Json => &[PYTHON_TAG, "{"],
            ToolFormat::Pythonic | ToolFormat::Gemma3 => &["["],
            _ => &[],
        };
        if openers.iter().any(|o| text.starts_with(o)) {
            Start::Region
        } else if !at_end && openers.iter().any(|o| o.len() > text.len() && o.starts_with(text)) {
            Start::Wait
        } else {
            Start::No
        }
    }

    /// Decides the region that `text` opens (it starts with an opener);
    /// `at_end`: no more text will come.
    pub fn scan_region(self, text: &str, at_end: bool, functions: &[FunctionTool]) -> Scanned {
        if text.starts_with(TOOL_CALL_OPEN) {
            return delimited(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, at_end, |block| match self {
                ToolFormat::Qwen3Coder => parse_coder_block(block, functions).or_else(|| parse_json_calls(block)),
                _ => parse_json_calls(block),
            });
        }
        if text.starts_with(FENCE_OPEN) {
            return delimited(text, FENCE_OPEN, FENCE_CLOSE, at_end, |block| python_calls(python_literal::parse_call_block(block)));
        }
        if text.starts_with(TOOL_CALLS) {
            return scan_mistral(text, at_end);
        }
        match self {
            ToolFormat::Llama3Json => scan_llama3(text, at_end),
            ToolFormat::Pythonic | ToolFormat::Gemma3 => {
                scan_bracketed(text, 0, true, at_end, |list| python_calls(python_literal::parse_call_list(list)))
            }
            _ => Scanned::Text { len: first_char_len(text) },
        }
    }

    fn anywhere_opener(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => Some(TOOL_CALL_OPEN),
            ToolFormat::Mistral => Some(TOOL_CALLS),
            ToolFormat::Gemma3 => Some(FENCE_OPEN),
            ToolFormat::Llama3Json | ToolFormat::Pythonic => None,
        }
    }
}

/// Length of the longest proper prefix of `tag` that `text` ends with.
pub fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&n| text.ends_with(&tag[..n])).unwrap_or(0)
}

/// `open … close` (the close may be missing at the end of the output):
/// calls if `parse` reads the block between, else content.
fn delimited(text: &str, open: &str, close: &str, at_end: bool, parse: impl FnOnce(&str) -> Option<Vec<(String, String)>>) -> Scanned {
    let inner = &text[open.len()..];
    let (block, len) = match inner.find(close) {
        Some(i) => (&inner[..i], open.len() + i + close.len()),
        None if at_end => (inner, text.len()),
        None => return Scanned::Wait,
    };
    match parse(block) {
        Some(calls) => Scanned::Calls { len, calls },
        None => Scanned::Text { len },
    }
}

/// Where a bracketed value that opens a text ends.
enum Balance {
    /// It closes (or a closer does not match) just before this byte.
    Closed(usize),
    /// Still open: the brackets open and whether inside a string.
    Open { depth: usize, in_string: bool },
}

/// Scans the bracketed value at the start of `text` (JSON strings, or
/// Python's in either quote).
fn balance(text: &str, python: bool) -> Balance {
    let mut stack: Vec<u8> = Vec::new();
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for (i, b) in text.bytes().enumerate() {
        if let Some(q) = quote {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, _) if b == q => quote = None,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => quote = Some(b),
            b'\'' if python => quote = Some(b),
            b'[' => stack.push(b']'),
            b'{' => stack.push(b'}'),
            b'(' => stack.push(b')'),
            // A closer that does not match ends the value (it will not parse).
            b']' | b'}' | b')' if stack.last() != Some(&b) => return Balance::Closed(i + 1),
            b']' | b'}' | b')' => {
                stack.pop();
            }
            _ => {}
        }
        if stack.is_empty() {
            // Text before any bracket: not a bracketed value.
            return Balance::Closed(i + 1);
        }
    }
    Balance::Open { depth: stack.len(), in_string: quote.is_some() }
}

/// A bracketed value starting at `text[start..]`: once it closes, calls if
/// `parse` reads it, else content. At the end of the output, a list whose
/// items are complete but whose `]` is missing is read as if closed.
fn scan_bracketed(text: &str, start: usize, python: bool, at_end: bool, parse: impl Fn(&str) -> Option<Vec<(String, String)>>) -> Scanned {
    let value = &text[start..];
    match balance(value, python) {
        Balance::Closed(end) => match parse(&value[..end]) {
            Some(calls) => Scanned::Calls { len: start + end, calls },
            None => Scanned::Text { len: start + end },
        },
        Balance::Open { .. } if !at_end => Scanned::Wait,
        Balance::Open { depth, in_string } => {
            let closed = (depth == 1 && !in_string && value.starts_with('[')).then(|| format!("{value}]"));
            match closed.as_deref().and_then(&parse) {
                Some(calls) => Scanned::Calls { len: text.len(), calls },
                None => Scanned::Text { len: text.len() },
            }
        }
    }
}

/// Bytes of the first character of `text` (0 when empty).
fn first_char_len(text: &str) -> usize {
    text.chars().next().map_or(0, char::len_utf8)
}

/// Leading whitespace of `text`, in bytes.
fn leading_ws(text: &str) -> usize {
    text.len() - text.trim_start().len()
}

/// `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` (with an
/// optional `[CALL_ID]id` after the name).
fn scan_mistral(text: &str, at_end: bool) -> Scanned {
    let start = TOOL_CALLS.len() + leading_ws(&text[TOOL_CALLS.len()..]);
    let body = &text[start..];
    if body.is_empty() {
        return if at_end { Scanned::Text { len: text.len() } } else { Scanned::Wait };
    }
    if body.starts_with('[') {
        return scan_bracketed(text, start, false, at_end, parse_json_calls);
    }
    // The named form: `[ARGS]` must come within the header's length, on
    // its line, or the marker is content.
    let limit = body.find('\n').unwrap_or(usize::MAX).min(MAX_MISTRAL_HEADER + ARGS.len());
    let header_end = match body.find(ARGS) {
        Some(i) if i + ARGS.len() <= limit => i,
        _ if at_end || limit <= body.len() => return Scanned::Text { len: TOOL_CALLS.len() },
        _ => return Scanned::Wait,
    };
    let header = &body[..header_end];
    let name = header.split(CALL_ID).next().unwrap_or_default().trim();
    if !valid_name(name) {
        return Scanned::Text { len: TOOL_CALLS.len() };
    }
    let after = header_end + ARGS.len();
    let args_start = start + after + leading_ws(&body[after..]);
    match text[args_start..].chars().next() {
        None if !at_end => Scanned::Wait,
        Some('{') => scan_bracketed(text, args_start, false, at_end, |args| {
            let arguments: Value = serde_json::from_str(args).ok()?;
            arguments.is_object().then(|| vec![(name.to_string(), arguments.to_string())])
        }),
        _ => Scanned::Text { len: TOOL_CALLS.len() },
    }
}

/// An optional `<|python_tag|>`, then one JSON call object.
fn scan_llama3(text: &str, at_end: bool) -> Scanned {
    let tag = if text.starts_with(PYTHON_TAG) { PYTHON_TAG.len() } else { 0 };
    let start = tag + leading_ws(&text[tag..]);
    match text[start..].chars().next() {
        None if !at_end => Scanned::Wait,
        Some('{') => scan_bracketed(text, start, false, at_end, |object| {
            let calls = parse_json_calls(object)?;
            (object.trim_start().starts_with('{') && calls.len() == 1).then_some(calls)
        }),
        // `<|python_tag|>` before code (Llama's built-in tools): content.
        _ => Scanned::Text { len: start.max(first_char_len(text)) },
    }
}

/// The calls in a JSON block: `{"name": ..., "arguments"|"parameters": ...}`
/// or a list of those. Arguments given as JSON text are taken as that text.
pub fn parse_json_calls(block: &str) -> Option<Vec<(String, String)>> {
    let v: Value = serde_json::from_str(block.trim()).ok()?;
    let items = match v {
        Value::Array(items) if !items.is_empty() => items,
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

fn python_calls(calls: Option<Vec<python_literal::Call>>) -> Option<Vec<(String, String)>> {
    Some(calls?.into_iter().map(|(name, args)| (name, Value::Object(args).to_string())).collect())
}

/// A Qwen3-Coder block: one or more
/// `<function=name><parameter=x>value</parameter>…</function>`. A value is
/// text when its parameter is a string (or unknown); otherwise its JSON (or
/// Python's `True`/`False`) when it parses, else text.
fn parse_coder_block(block: &str, functions: &[FunctionTool]) -> Option<Vec<(String, String)>> {
    const FUNCTION: &str = "<function=";
    const FUNCTION_END: &str = "</function>";
    const PARAMETER: &str = "<parameter=";
    const PARAMETER_END: &str = "</parameter>";
    let mut calls = Vec::new();
    let mut rest = block.trim();
    while !rest.is_empty() {
        let after = rest.strip_prefix(FUNCTION)?;
        let gt = after.find('>')?;
        let name = after[..gt].trim();
        if !valid_name(name) {
            return None;
        }
        let schema = functions.iter().find(|f| f.name == name).map(|f| &f.parameters);
        let body = &after[gt + 1..];
        let (mut params, next) = match body.find(FUNCTION_END) {
            Some(e) => (&body[..e], &body[e + FUNCTION_END.len()..]),
            None => (body, ""),
        };
        let mut arguments = Map::new();
        loop {
            params = params.trim_start();
            if params.is_empty() {
                break;
            }
            let after = params.strip_prefix(PARAMETER)?;
            let gt = after.find('>')?;
            let key = after[..gt].trim();
            let value_all = &after[gt + 1..];
            let (raw, next) = match (value_all.find(PARAMETER_END), value_all.find(PARAMETER)) {
                (Some(e), _) => (&value_all[..e], &value_all[e + PARAMETER_END.len()..]),
                (None, Some(p)) => (&value_all[..p], &value_all[p..]),
                (None, None) => (value_all, ""),
            };
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            arguments.insert(key.to_string(), coder_value(raw, schema.and_then(|s| s.pointer(&format!("/properties/{key}/type")))));
            params = next;
        }
        calls.push((name.to_string(), Value::Object(arguments).to_string()));
        rest = next.trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// A Qwen3-Coder parameter value under its schema `type`.
fn coder_value(raw: &str, kind: Option<&Value>) -> Value {
    let is_string = match kind {
        None => true,
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "string"),
        Some(_) => true,
    };
    if is_string {
        return Value::String(raw.to_string());
    }
    match raw.trim() {
        "True" => Value::Bool(true),
        "False" => Value::Bool(false),
        "None" => Value::Null,
        t => serde_json::from_str(t).unwrap_or_else(|_| Value::String(raw.to_string())),
    }
}
