//! Rendering a conversation to prompt text with the model's Jinja chat
//! template, the way Hugging Face `transformers` does.
//!
//! The environment matches `transformers`' own: `trim_blocks` and
//! `lstrip_blocks`, loop controls, `raise_exception(msg)`, a `tojson` that
//! prints like Python's `json.dumps` (`", "` and `": "` separators, no HTML
//! escaping), Python string/dict methods (`.strip()`, `.startswith()`,
//! `.items()`, ...) and the variables `messages`, `add_generation_prompt`,
//! `bos_token` and `eos_token`.

use crate::gguf::GgufFile;
use crate::{Error, Result};
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;
use std::path::Path;

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template with the special-token strings it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("source", &self.source).finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings the
    /// template sees under those names (empty when `None`).
    pub fn new(source: impl Into<String>, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone()).map_err(|e| Error::ChatTemplate(describe(&e)))?;
        Ok(Self { env, source, bos_token: bos_token.unwrap_or_default(), eos_token: eos_token.unwrap_or_default() })
    }

    /// The template in a GGUF file's `tokenizer.chat_template`, if any.
    pub fn from_gguf(file: &GgufFile) -> Result<Option<Self>> {
        let Some(value) = file.get("tokenizer.chat_template") else { return Ok(None) };
        let source = value.as_str().ok_or_else(|| file.bad_type("tokenizer.chat_template", "a string", value))?;
        let token = |key: &str| -> Option<String> {
            let id = file.get(key)?.as_u64()?;
            let tokens = file.get("tokenizer.ggml.tokens")?.as_array()?;
            Some(tokens.get(usize::try_from(id).ok()?)?.as_str()?.to_string())
        };
        Self::new(source, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")).map(Some)
    }

    /// The template of a Hugging Face directory: `chat_template.jinja`, or
    /// `chat_template` in `tokenizer_config.json` (a string, or a list of
    /// named templates of which `default` is taken).
    pub fn from_hf_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
            serde_json::from_str(&text).map_err(|e| Error::ChatTemplate(format!("{}: {e}", config_path.display())))?
        } else {
            serde_json::Value::Null
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            Some(std::fs::read_to_string(&jinja_path).map_err(|e| Error::io(&jinja_path, e))?)
        } else {
            match config.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
                _ => None,
            }
        };
        let Some(source) = source else { return Ok(None) };
        let token = |key: &str| -> Option<String> {
            match config.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                other => other.get("content")?.as_str().map(str::to_string),
            }
        };
        Self::new(source, token("bos_token"), token("eos_token")).map(Some)
    }

    /// Renders `messages` (anything serializable with `role` and `content`
    /// fields); `add_generation_prompt` appends the assistant's turn header.
    pub fn render<M: Serialize>(&self, messages: &[M], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools::<M, ()>(messages, None, add_generation_prompt)
    }

    /// [`render`](Self::render) with the `tools` variable of Hugging Face
    /// templates set (OpenAI's tool list: `{"type": "function", "function":
    /// {...}}` objects); `None` sets it to `none`, as `transformers` does
    /// when no tools are given.
    pub fn render_with_tools<M: Serialize, T: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&T>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::ChatTemplate(describe(&e)))?;
        let tools = tools.map(Value::from_serialize);
        template
            .render(minijinja::context! {
                messages => Value::from_serialize(messages),
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| Error::ChatTemplate(describe(&e)))
    }

    /// Whether the template reads the `tools` variable (otherwise tools are
    /// described to the model by a default system prompt).
    pub fn supports_tools(&self) -> bool {
        self.env.get_template(TEMPLATE_NAME).is_ok_and(|t| t.undeclared_variables(false).contains("tools"))
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `value | tojson(indent=None)` printed as Python's `json.dumps(value,
/// ensure_ascii=False, indent=indent)` prints it.
fn tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = " ".repeat(n);
            let mut ser =
                serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(spaces.as_bytes()));
            value.serialize(&mut ser)
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter)),
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// serde_json output with Python's default separators `", "` and `": "`.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// The error with its template location and cause chain.
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_like_environment() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
             [{{ m.content.strip() | upper }}]{{ m | tojson }}\n{% endfor %}\
             {% if add_generation_prompt %}{{ bos_token }}>{% endif %}",
            Some("<s>".into()),
            None,
        )
        .unwrap();
        let out = t.render(&[ChatMessage::new("user", "  hi <b> "), ChatMessage::new("skip", "x")], true).unwrap();
        assert_eq!(out, "[HI <B>]{\"role\": \"user\", \"content\": \"  hi <b> \"}\n<s>>");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None).unwrap();
        let err = t.render::<ChatMessage>(&[], false).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        assert!(ChatTemplate::new("{% if %}", None, None).is_err());
    }

    #[test]
    fn tools_reach_a_template_that_reads_them() {
        let t = ChatTemplate::new(
            "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}\
             {% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}\
             [{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}\n{% endfor %}",
            None,
            None,
        )
        .unwrap();
        assert!(t.supports_tools());
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let msgs = serde_json::json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
        ]);
        let msgs = msgs.as_array().unwrap();
        let out = t.render_with_tools(msgs, Some(&tools), false).unwrap();
        // (`trim_blocks` eats the newline after each `{% endfor %}`.)
        assert_eq!(out, "<tools>f;</tools>user:hiassistant:[f {\"a\": 1}]");
        // No tools: `tools` is none, as transformers passes it.
        assert_eq!(t.render(msgs, false).unwrap(), "user:hiassistant:[f {\"a\": 1}]");
        assert!(!ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}", None, None).unwrap().supports_tools());
    }
}
