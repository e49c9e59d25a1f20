//! Rendering a conversation to prompt text with the model's Jinja chat
//! template, the way Hugging Face `transformers` does.
//!
//! The environment matches `transformers`' own: `trim_blocks` and
//! `lstrip_blocks`, loop controls, `raise_exception(msg)`, a `tojson` that
//! prints like Python's `json.dumps` (`", "` and `": "` separators, no HTML
//! escaping), Python string/dict methods (`.strip()`, `.startswith()`,
//! `.items()`, ...) and the variables `messages`, `add_generation_prompt`,
//! `bos_token` and `eos_token`.
//!
//! A template comes with a model file, so it is untrusted input: rendering
//! is bounded (docs/fuzzing.md). minijinja 2.24 folds constant expressions
//! while it compiles, with a `*` that repeats a sequence lazily and without
//! bound (a fuzzed `() * 2.2e16` never finished;
//! `fuzz/regressions/chat_template/`), so a template is parsed here, a
//! constant sequence repetition refused before code generation
//! (`constant_folding`), and every other compiled `*` rewritten into a call
//! of `guarded_mul` (at most [`MAX_REPEATED_ITEMS`] items; an empty
//! sequence repeated at once). Every instruction burns fuel ([`FUEL`]) and
//! printed values are capped ([`MAX_PRINTED_BYTES`]). This goes through
//! minijinja's `unstable_machinery` API, which is why the workspace pins it
//! exactly.

use crate::{Error, Result};
use minijinja::machinery::{self, CodeGenerator, Instruction, Instructions, WhitespaceConfig};
use minijinja::value::ValueKind;
use minijinja::{AutoEscape, Environment, ErrorKind, Value};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::LazyLock;
use vellum_formats::gguf::GgufFile;

const TEMPLATE_NAME: &str = "chat";

/// Instructions one rendering may execute. SmolLM2's template spends 23
/// per message (1,000 messages: 23,015 in 1.1 ms), so this allows
/// conversations of tens of thousands of messages even for templates that
/// spend ten times more, and stops a runaway loop after about 0.1 s.
pub const FUEL: u64 = 2_000_000;

/// The most bytes `{{ ... }}` expressions may print in one rendering: four
/// times a million-token context (the template's own text between them is
/// bounded by [`FUEL`] times its length).
pub const MAX_PRINTED_BYTES: usize = 16 << 20;

/// The most items `sequence * n` may produce: the limit minijinja's own
/// `range()` applies to its item count.
pub const MAX_REPEATED_ITEMS: usize = 100_000;

/// The function every compiled `*` is rewritten to call.
const GUARDED_MUL: &str = "__vellum_guarded_mul";

/// The whitespace rules of `transformers`' environment.
const WHITESPACE: WhitespaceConfig = WhitespaceConfig { keep_trailing_newline: false, lstrip_blocks: true, trim_blocks: true };

/// A compiled chat template with the special-token strings it may print.
pub struct ChatTemplate {
    /// Functions, filters and fuel; holds no template, so an `{% include %}`
    /// cannot reach an unguarded copy of this one.
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    supports_tools: bool,
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
        env.set_trim_blocks(WHITESPACE.trim_blocks);
        env.set_lstrip_blocks(WHITESPACE.lstrip_blocks);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function(GUARDED_MUL, guarded_mul);
        env.add_filter("tojson", tojson);
        env.set_fuel(Some(FUEL));
        env.set_formatter(counted_formatter);
        compile(&source)?;
        // `tools` read anywhere: asked of a throwaway environment, since the
        // rendering one must not hold the template.
        let supports_tools = {
            let mut scratch = Environment::new();
            scratch.set_trim_blocks(WHITESPACE.trim_blocks);
            scratch.set_lstrip_blocks(WHITESPACE.lstrip_blocks);
            scratch.add_template(TEMPLATE_NAME, &source).map_err(|e| Error::ChatTemplate(describe(&e)))?;
            let template = scratch.get_template(TEMPLATE_NAME).map_err(|e| Error::ChatTemplate(describe(&e)))?;
            template.undeclared_variables(false).contains("tools")
        };
        Ok(Self { env, source, bos_token: bos_token.unwrap_or_default(), eos_token: eos_token.unwrap_or_default(), supports_tools })
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
        self.render_with_kwargs::<M, T, ()>(messages, tools, add_generation_prompt, None)
    }

    /// [`render_with_tools`](Self::render_with_tools) with extra template
    /// variables (vLLM's `chat_template_kwargs`, such as Qwen3's
    /// `enable_thinking`): `kwargs` must serialize to a map; the variables
    /// above (`messages`, `tools`, ...) take precedence over its keys.
    pub fn render_with_kwargs<M: Serialize, T: Serialize, K: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&T>,
        add_generation_prompt: bool,
        kwargs: Option<&K>,
    ) -> Result<String> {
        // Compiled again for each rendering (tens of microseconds): the
        // instructions borrow the source, and this keeps the struct plain.
        let (instructions, blocks) = compile(&self.source)?;
        let extra = kwargs.map(Value::from_serialize).unwrap_or_else(|| Value::from(()));
        let root = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..extra
        };
        let mut text = String::new();
        let (_, state) = machinery::Vm::new(&self.env)
            .eval(&instructions, root, &blocks, &mut machinery::make_string_output(&mut text), AutoEscape::None)
            .map_err(|e| Error::ChatTemplate(describe(&e)))?;
        tracing::trace!(fuel = ?state.fuel_levels(), bytes = text.len(), "chat template rendered");
        Ok(text)
    }

    /// Whether the template reads the `tools` variable (otherwise tools are
    /// described to the model by a default system prompt).
    pub fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// The template's instructions and blocks, with every `*` rewritten into a
/// call of [`guarded_mul`] (same operands, same stack effect).
type Compiled<'s> = (Instructions<'s>, BTreeMap<&'s str, Instructions<'s>>);

fn compile(source: &str) -> Result<Compiled<'_>> {
    let ast = machinery::parse(source, TEMPLATE_NAME, Default::default(), WHITESPACE).map_err(|e| Error::ChatTemplate(describe(&e)))?;
    // Before code generation, which folds constant expressions unguarded.
    constant_folding::check_stmt(&ast)?;
    let mut generator = CodeGenerator::new(TEMPLATE_NAME, source);
    generator.compile_stmt(&ast);
    let (mut instructions, mut blocks) = generator.finish();
    for code in std::iter::once(&mut instructions).chain(blocks.values_mut()) {
        for pc in 0..code.len() {
            let pc = u32::try_from(pc).map_err(|_| Error::ChatTemplate("template too long".into()))?;
            if let Some(instruction @ Instruction::Mul) = code.get_mut(pc) {
                *instruction = Instruction::CallFunction(GUARDED_MUL, Some(2));
            }
        }
    }
    Ok((instructions, blocks))
}

/// Bytes printed so far by one rendering (a per-`State` temporary).
#[derive(Debug, Default)]
struct PrintedBytes(std::sync::atomic::AtomicUsize);

impl minijinja::value::Object for PrintedBytes {}

/// minijinja's own formatter, after adding the value's length to the
/// rendering's count and refusing past [`MAX_PRINTED_BYTES`].
fn counted_formatter(out: &mut minijinja::Output, state: &minijinja::State, value: &Value) -> std::result::Result<(), minijinja::Error> {
    const KEY: &str = "__vellum_printed_bytes";
    // Formatted once: printing a long list is the costly part.
    let formatted;
    let text = match value.as_str() {
        Some(text) => text,
        None => {
            formatted = value.to_string();
            &formatted
        }
    };
    // Only this function sets KEY, always to a PrintedBytes (templates
    // cannot set temporaries), so the helper's downcast cannot fail.
    let printed = state.get_or_set_temp_object(KEY, PrintedBytes::default);
    let total = printed.0.fetch_add(text.len(), std::sync::atomic::Ordering::Relaxed).saturating_add(text.len());
    if total > MAX_PRINTED_BYTES {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("the template printed more than {MAX_PRINTED_BYTES} bytes"),
        ));
    }
    match state.auto_escape() {
        // What minijinja's formatter prints without escaping.
        AutoEscape::None => out.write_str(text).map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "writing the prompt")),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// minijinja's code generator evaluates constant expressions while it
/// compiles, with its own `*`: `() * 10**16` would fold into a lazy sequence
/// of 10¹⁶ empty copies, and `(() * 10**16) ~ ''` would hang the compiler
/// itself. Templates are checked bottom-up first, so every `*` is seen
/// before an enclosing expression folds it, and a constant sequence
/// repetition (which no real chat template writes) is refused.
mod constant_folding {
    use super::{Error, Result};
    use minijinja::machinery::ast::{BinOpKind, CallArg, Expr, Stmt};
    use minijinja::value::ValueKind;

    pub(super) fn check_stmt(stmt: &Stmt<'_>) -> Result<()> {
        let body = |stmts: &[Stmt<'_>]| stmts.iter().try_for_each(check_stmt);
        match stmt {
            Stmt::Template(t) => body(&t.children),
            Stmt::EmitExpr(e) => check_expr(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => Ok(()),
            Stmt::ForLoop(f) => {
                check_expr(&f.target)?;
                check_expr(&f.iter)?;
                f.filter_expr.iter().try_for_each(check_expr)?;
                body(&f.body)?;
                body(&f.else_body)
            }
            Stmt::IfCond(i) => {
                check_expr(&i.expr)?;
                body(&i.true_body)?;
                body(&i.false_body)
            }
            Stmt::WithBlock(w) => {
                w.assignments.iter().try_for_each(|(target, value)| check_expr(target).and_then(|_| check_expr(value)))?;
                body(&w.body)
            }
            Stmt::Set(s) => check_expr(&s.target).and_then(|_| check_expr(&s.expr)),
            Stmt::SetBlock(s) => {
                check_expr(&s.target)?;
                s.filter.iter().try_for_each(check_expr)?;
                body(&s.body)
            }
            Stmt::AutoEscape(a) => check_expr(&a.enabled).and_then(|_| body(&a.body)),
            Stmt::FilterBlock(f) => check_expr(&f.filter).and_then(|_| body(&f.body)),
            Stmt::Block(b) => body(&b.body),
            Stmt::Import(i) => check_expr(&i.expr).and_then(|_| check_expr(&i.name)),
            Stmt::FromImport(i) => {
                check_expr(&i.expr)?;
                i.names.iter().try_for_each(|(name, alias)| {
                    check_expr(name)?;
                    alias.iter().try_for_each(check_expr)
                })
            }
            Stmt::Extends(e) => check_expr(&e.name),
            Stmt::Include(i) => check_expr(&i.name),
            Stmt::Macro(m) => {
                m.args.iter().chain(&m.defaults).try_for_each(check_expr)?;
                body(&m.body)
            }
            Stmt::CallBlock(c) => {
                check_expr(&c.call.expr)?;
                check_args(&c.call.args)?;
                c.macro_decl.args.iter().chain(&c.macro_decl.defaults).try_for_each(check_expr)?;
                body(&c.macro_decl.body)
            }
            Stmt::Do(d) => check_expr(&d.call.expr).and_then(|_| check_args(&d.call.args)),
        }
    }

    fn check_args(args: &[CallArg<'_>]) -> Result<()> {
        args.iter().try_for_each(|arg| match arg {
            CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) | CallArg::KwargSplat(e) => check_expr(e),
        })
    }

    fn check_expr(expr: &Expr<'_>) -> Result<()> {
        match expr {
            Expr::Var(_) | Expr::Const(_) => Ok(()),
            Expr::Slice(s) => {
                check_expr(&s.expr)?;
                [&s.start, &s.stop, &s.step].into_iter().flatten().try_for_each(check_expr)
            }
            Expr::UnaryOp(u) => check_expr(&u.expr),
            Expr::BinOp(b) => {
                check_expr(&b.left)?;
                check_expr(&b.right)?;
                if matches!(b.op, BinOpKind::Mul) {
                    // Safe to evaluate: the operands hold no unchecked `*`.
                    if let (Some(left), Some(right)) = (b.left.as_const(), b.right.as_const()) {
                        if [left, right].iter().any(|v| matches!(v.kind(), ValueKind::Seq | ValueKind::Iterable)) {
                            return Err(Error::ChatTemplate(format!(
                                "line {}: a constant sequence repeated with `*` is not supported in chat templates",
                                b.span().start_line
                            )));
                        }
                    }
                }
                Ok(())
            }
            Expr::Compare(c) => {
                check_expr(&c.expr)?;
                c.ops.iter().try_for_each(|op| check_expr(&op.expr))
            }
            Expr::IfExpr(i) => {
                check_expr(&i.test_expr)?;
                check_expr(&i.true_expr)?;
                i.false_expr.iter().try_for_each(check_expr)
            }
            Expr::Filter(f) => {
                f.expr.iter().try_for_each(check_expr)?;
                check_args(&f.args)
            }
            Expr::Test(t) => check_expr(&t.expr).and_then(|_| check_args(&t.args)),
            Expr::GetAttr(g) => check_expr(&g.expr),
            Expr::GetItem(g) => check_expr(&g.expr).and_then(|_| check_expr(&g.subscript_expr)),
            Expr::Call(c) => check_expr(&c.expr).and_then(|_| check_args(&c.args)),
            Expr::List(l) => l.items.iter().try_for_each(check_expr),
            Expr::Map(m) => m.keys.iter().chain(&m.values).try_for_each(check_expr),
        }
    }
}

/// `lhs * rhs` as Jinja computes it, except that repeating a sequence may
/// not produce more than [`MAX_REPEATED_ITEMS`] items, and an empty sequence
/// repeated is the empty list at once.
fn guarded_mul(lhs: Value, rhs: Value) -> std::result::Result<Value, minijinja::Error> {
    let is_sequence = |v: &Value| matches!(v.kind(), ValueKind::Seq | ValueKind::Iterable);
    let repeated = if is_sequence(&lhs) {
        Some((&lhs, &rhs))
    } else if is_sequence(&rhs) {
        Some((&rhs, &lhs))
    } else {
        None
    };
    if let Some((sequence, count)) = repeated {
        if let (Some(len), Some(n)) = (sequence.len(), count.as_usize()) {
            if len == 0 {
                return Ok(Value::from(Vec::<Value>::new()));
            }
            if len.checked_mul(n).is_none_or(|items| items > MAX_REPEATED_ITEMS) {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{len} items repeated {n} times: more than {MAX_REPEATED_ITEMS}"),
                ));
            }
        }
    }
    // Everything else is minijinja's own `*`, compiled once.
    static ENV: LazyLock<Environment<'static>> = LazyLock::new(Environment::new);
    static MUL: LazyLock<std::result::Result<minijinja::Expression<'static, 'static>, minijinja::Error>> =
        LazyLock::new(|| ENV.compile_expression("a * b"));
    match &*MUL {
        Ok(mul) => mul.eval(minijinja::context! { a => lhs, b => rhs }),
        Err(e) => Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("compiling `a * b`: {e}"))),
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
    fn chat_template_kwargs_are_variables_that_cannot_replace_the_messages() {
        // Qwen3's switch, in the shape of its template.
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.content }}{% endfor %}|{% if add_generation_prompt %}<a>\
             {% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}",
            None,
            None,
        )
        .unwrap();
        let msgs = [ChatMessage::new("user", "hi")];
        assert_eq!(t.render(&msgs, true).unwrap(), "hi|<a>");
        let off = serde_json::json!({"enable_thinking": false, "messages": []});
        assert_eq!(t.render_with_kwargs::<_, (), _>(&msgs, None, true, Some(&off)).unwrap(), "hi|<a><think></think>");
        let on = serde_json::json!({"enable_thinking": true});
        assert_eq!(t.render_with_kwargs::<_, (), _>(&msgs, None, true, Some(&on)).unwrap(), "hi|<a>");
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

    fn render_source(source: &str) -> Result<String> {
        ChatTemplate::new(source, None, None)?.render::<ChatMessage>(&[], false)
    }

    #[test]
    fn multiplication_keeps_jinja_meaning() {
        assert_eq!(
            render_source("{% set n = 7 %}{{ 6 * n }} {{ 2.5 * 2 }} {{ 'ab' * 3 }} {{ 3 * 'x' }} {{ n * 'y' }}").unwrap(),
            "42 5.0 ababab xxx yyyyyyy"
        );
        let one = "{% set one = [1] %}{% set none_ = [] %}";
        assert_eq!(
            render_source(&format!("{one}{{% for x in one * 3 %}}{{{{ x }}}}{{% endfor %}}|{{{{ none_ * 5 }}}}|{{{{ (one * 2) * 2 }}}}"))
                .unwrap(),
            "111|[]|[1, 1, 1, 1]"
        );
        assert!(render_source("{{ [1] * 'a' }}").is_err());
        assert!(render_source("{{ {} * 2 }}").is_err());
    }

    #[test]
    fn repeated_sequences_are_bounded_and_empty_ones_are_instant() {
        let e = "{% set e = [] %}{% set one = [0] %}";
        assert_eq!(render_source(&format!("{e}{{{{ ((e * 100000) * 100000) * 100000 }}}}")).unwrap(), "[]");
        let err = render_source(&format!("{e}{{{{ (one + one) * 50001 }}}}")).unwrap_err().to_string();
        assert!(err.contains("more than 100000"), "{err}");
        let err = render_source(&format!("{e}{{% for x in (((one * 1000) * 1000) * 1000) %}}{{% endfor %}}")).unwrap_err().to_string();
        assert!(err.contains("more than 100000"), "{err}");
        assert_eq!(render_source(&format!("{e}{{{{ (one * 100000) | length }}}}")).unwrap(), "100000");
    }

    #[test]
    fn constant_sequence_repetition_is_refused_before_the_compiler_folds_it() {
        // The fuzzed input (fuzz/regressions/chat_template/empty-tuple-repeated-2e16-times):
        // minijinja alone folds it into ~2.2e16 empty copies and walks them all.
        for source in [
            "{{44/4444.4444444444444*22*22244444224444444*()}}",
            "{{ ((() * 100000) * 100000) * 100000 }}",
            "{{ ((() * 10**16) ~ '') }}",
            "{% if x %}{{ 2 * [1, 2] }}{% endif %}",
        ] {
            let err = ChatTemplate::new(source, None, None).unwrap_err().to_string();
            assert!(err.contains("constant sequence repeated"), "{source}: {err}");
        }
    }

    #[test]
    fn printed_output_is_bounded() {
        let err = render_source("{% set s = 'x' * 1000000 %}{% for i in range(20) %}{{ s }}{% endfor %}").unwrap_err();
        assert!(err.to_string().contains("printed more than"), "{err}");
        assert_eq!(render_source("{% set s = 'x' * 1000000 %}{% for i in range(16) %}{{ s }}{% endfor %}").unwrap().len(), 16_000_000);
        // Non-strings print as minijinja prints them, escaped where asked.
        let source = "{{ none }}|{{ [1, 'a'] }}|{{ 1.5 }}|{{ undefined_name }}|{{ {'k': true} }}|{% autoescape true %}{{ '<b>' }}{% endautoescape %}";
        let plain = Environment::new().render_str(source, ()).unwrap();
        assert_eq!(render_source(source).unwrap(), plain);
        assert!(plain.ends_with("|&lt;b&gt;"), "{plain}");
    }

    #[test]
    fn runaway_loops_run_out_of_fuel() {
        let err = render_source("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").unwrap_err();
        assert!(err.to_string().contains("fuel"), "{err}");
        // A template cannot include itself unguarded: the rendering
        // environment holds no templates.
        assert!(render_source("{% include 'chat' %}").is_err());
    }
}
