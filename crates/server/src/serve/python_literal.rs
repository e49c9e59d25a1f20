//! Python function calls with literal arguments, as the `pythonic` and
//! `gemma3` tool-call formats write them:
//! `[get_weather(city="Paris", days=3), get_time()]`.
//!
//! A small recursive-descent reader of Python's literal syntax (strings in
//! either quote, with prefixes `r`/`u`, escapes and implicit concatenation;
//! ints, floats, `True`/`False`/`None`; lists, tuples and sets as JSON
//! arrays; dicts as JSON objects) that turns keyword arguments into a JSON
//! object. Anything else (positional arguments, expressions, variables,
//! nesting deeper than [`MAX_DEPTH`]) is `None`: the caller shows the text as
//! content. [`to_python`] writes a JSON value back as a Python literal (the
//! default tool prompts render earlier calls with it).

use serde_json::{Map, Number, Value};

/// Deepest nesting of brackets read; deeper text is not a call.
pub const MAX_DEPTH: usize = 64;

/// One call: the function's name and its keyword arguments.
pub type Call = (String, Map<String, Value>);

/// `[f(a=1), g()]`: a list of calls (and nothing else but whitespace).
pub fn parse_call_list(text: &str) -> Option<Vec<Call>> {
    let mut r = Reader::new(text);
    r.skip_ws();
    r.expect(b'[')?;
    let mut calls = Vec::new();
    loop {
        r.skip_ws();
        if r.eat(b']') {
            break;
        }
        calls.push(r.call()?);
        r.skip_ws();
        if r.eat(b',') {
            continue;
        }
        r.expect(b']')?;
        break;
    }
    r.skip_ws();
    (r.at_end() && !calls.is_empty()).then_some(calls)
}

/// The calls of a code block: a list of calls, or calls one per line (or
/// separated by `;`), each perhaps wrapped in `print(...)`.
pub fn parse_call_block(text: &str) -> Option<Vec<Call>> {
    if text.trim_start().starts_with('[') {
        return parse_call_list(text);
    }
    let mut r = Reader::new(text);
    let mut calls = Vec::new();
    loop {
        r.skip_ws();
        while r.eat(b';') {
            r.skip_ws();
        }
        if r.at_end() {
            break;
        }
        calls.push(r.call()?);
    }
    (!calls.is_empty()).then_some(calls)
}

/// A JSON value as a Python literal (`true` as `True`, `null` as `None`).
pub fn to_python(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => n.to_string(),
        // A JSON string literal is a valid Python one.
        Value::String(s) => Value::String(s.clone()).to_string(),
        Value::Array(items) => format!("[{}]", items.iter().map(to_python).collect::<Vec<_>>().join(", ")),
        Value::Object(m) => {
            let items: Vec<String> = m.iter().map(|(k, v)| format!("{}: {}", Value::String(k.clone()), to_python(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

/// A call written back in Python: `name(key=value, ...)`.
pub fn call_to_python(name: &str, arguments: &Value) -> String {
    let args: Vec<String> = match arguments {
        Value::Object(m) => m.iter().map(|(k, v)| format!("{k}={}", to_python(v))).collect(),
        _ => Vec::new(),
    };
    format!("{name}({})", args.join(", "))
}

/// A cursor over the text.
struct Reader<'a> {
    text: &'a str,
    pos: usize,
    depth: usize,
}

impl<'a> Reader<'a> {
    fn new(text: &'a str) -> Self {
        Self { text, pos: 0, depth: 0 }
    }

    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn at_end(&self) -> bool {
        self.pos >= self.text.len()
    }

    fn skip_ws(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, b: u8) -> bool {
        if self.peek() == Some(b) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, b: u8) -> Option<()> {
        self.eat(b).then_some(())
    }

    /// Enters a bracket; `None` past [`MAX_DEPTH`].
    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= MAX_DEPTH).then_some(())
    }

    fn leave(&mut self) {
        self.depth = self.depth.saturating_sub(1);
    }

    /// An identifier (ASCII letters, digits, `_`, not starting with a digit).
    fn ident(&mut self) -> Option<&'a str> {
        let rest = self.rest();
        let n = rest.bytes().take_while(|b| b.is_ascii_alphanumeric() || *b == b'_').count();
        if n == 0 || rest.as_bytes()[0].is_ascii_digit() {
            return None;
        }
        self.pos += n;
        Some(&rest[..n])
    }

    /// `name(key=literal, ...)`, a dotted name keeping its last part, and
    /// `print(call)` read as the call.
    fn call(&mut self) -> Option<Call> {
        let mut name = self.ident()?;
        while self.eat(b'.') {
            name = self.ident()?;
        }
        self.skip_ws();
        self.expect(b'(')?;
        self.enter()?;
        self.skip_ws();
        if name == "print" && !self.rest().starts_with(')') {
            let inner = self.call()?;
            self.skip_ws();
            self.eat(b',');
            self.skip_ws();
            self.expect(b')')?;
            self.leave();
            return Some(inner);
        }
        let mut args = Map::new();
        loop {
            self.skip_ws();
            if self.eat(b')') {
                break;
            }
            let key = self.ident()?;
            self.skip_ws();
            self.expect(b'=')?;
            if self.peek() == Some(b'=') {
                return None;
            }
            self.skip_ws();
            let value = self.literal()?;
            args.insert(key.to_string(), value);
            self.skip_ws();
            if self.eat(b',') {
                continue;
            }
            self.expect(b')')?;
            break;
        }
        self.leave();
        Some((name.to_string(), args))
    }

    /// One literal.
    fn literal(&mut self) -> Option<Value> {
        self.skip_ws();
        match self.peek()? {
            b'[' => self.sequence(b'[', b']').map(Value::Array),
            b'(' => self.sequence(b'(', b')').map(Value::Array),
            b'{' => self.braces(),
            b'"' | b'\'' => self.strings(),
            b'r' | b'R' | b'u' | b'U' if matches!(self.rest().as_bytes().get(1), Some(b'"' | b'\'')) => self.strings(),
            b'-' | b'+' | b'.' | b'0'..=b'9' => self.number(),
            _ => match self.ident()? {
                "True" => Some(Value::Bool(true)),
                "False" => Some(Value::Bool(false)),
                "None" => Some(Value::Null),
                _ => None,
            },
        }
    }

    /// `[a, b]` or `(a, b)` (a trailing comma allowed).
    fn sequence(&mut self, open: u8, close: u8) -> Option<Vec<Value>> {
        self.expect(open)?;
        self.enter()?;
        let mut items = Vec::new();
        loop {
            self.skip_ws();
            if self.eat(close) {
                break;
            }
            items.push(self.literal()?);
            self.skip_ws();
            if self.eat(b',') {
                continue;
            }
            self.expect(close)?;
            break;
        }
        self.leave();
        Some(items)
    }

    /// `{key: value, ...}` (an object; keys that are not strings become
    /// their JSON text, as `json.dumps` writes them) or `{a, b}` (a set, as
    /// an array).
    fn braces(&mut self) -> Option<Value> {
        self.expect(b'{')?;
        self.enter()?;
        let mut object = Map::new();
        let mut set = Vec::new();
        loop {
            self.skip_ws();
            if self.eat(b'}') {
                break;
            }
            let key = self.literal()?;
            self.skip_ws();
            if self.eat(b':') {
                if !set.is_empty() {
                    return None;
                }
                let value = self.literal()?;
                let key = match key {
                    Value::String(s) => s,
                    Value::Array(_) | Value::Object(_) => return None,
                    other => other.to_string(),
                };
                object.insert(key, value);
            } else {
                if !object.is_empty() {
                    return None;
                }
                set.push(key);
            }
            self.skip_ws();
            if self.eat(b',') {
                continue;
            }
            self.expect(b'}')?;
            break;
        }
        self.leave();
        Some(if set.is_empty() { Value::Object(object) } else { Value::Array(set) })
    }

    /// One or more adjacent string literals, concatenated.
    fn strings(&mut self) -> Option<Value> {
        let mut out = self.string()?;
        loop {
            let save = self.pos;
            self.skip_ws();
            match self.peek() {
                Some(b'"' | b'\'') => out.push_str(&self.string()?),
                Some(b'r' | b'R' | b'u' | b'U') if matches!(self.rest().as_bytes().get(1), Some(b'"' | b'\'')) => {
                    out.push_str(&self.string()?)
                }
                _ => {
                    self.pos = save;
                    return Some(Value::String(out));
                }
            }
        }
    }

    /// One string literal: an optional `r`/`u` prefix, then `'…'`, `"…"`
    /// or their tripled forms.
    fn string(&mut self) -> Option<String> {
        let mut raw = false;
        match self.peek()? {
            b'r' | b'R' => {
                raw = true;
                self.pos += 1;
            }
            b'u' | b'U' => self.pos += 1,
            _ => {}
        }
        let quote = self.peek().filter(|q| *q == b'"' || *q == b'\'')?;
        let q = quote as char;
        let triple: String = [q, q, q].iter().collect();
        let long = self.rest().starts_with(&triple);
        self.pos += if long { 3 } else { 1 };
        let mut out = String::new();
        let mut chars = self.rest().char_indices();
        while let Some((i, c)) = chars.next() {
            if c == q && (!long || self.rest()[i..].starts_with(&triple)) {
                self.pos += i + if long { 3 } else { 1 };
                return Some(out);
            }
            if c == '\n' && !long {
                return None;
            }
            if c != '\\' {
                out.push(c);
                continue;
            }
            let (_, e) = chars.next()?;
            if raw {
                out.push('\\');
                out.push(e);
                continue;
            }
            match e {
                '\n' => {}
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                '0' => out.push('\0'),
                'a' => out.push('\u{7}'),
                'b' => out.push('\u{8}'),
                'f' => out.push('\u{c}'),
                'v' => out.push('\u{b}'),
                '\\' | '\'' | '"' => out.push(e),
                'x' | 'u' | 'U' => {
                    let n = match e {
                        'x' => 2,
                        'u' => 4,
                        _ => 8,
                    };
                    let hex: String = (0..n).map(|_| chars.next().map(|(_, h)| h)).collect::<Option<String>>()?;
                    let code = u32::from_str_radix(&hex, 16).ok()?;
                    out.push(char::from_u32(code)?);
                }
                // Python keeps an unknown escape as written.
                other => {
                    out.push('\\');
                    out.push(other);
                }
            }
        }
        None
    }

    /// An int or a float, with an optional sign and `_` separators.
    fn number(&mut self) -> Option<Value> {
        let rest = self.rest();
        let n = rest
            .char_indices()
            .take_while(|&(i, c)| {
                c.is_ascii_alphanumeric()
                    || c == '_'
                    || c == '.'
                    || ((c == '-' || c == '+') && (i == 0 || matches!(rest.as_bytes()[i - 1], b'e' | b'E')))
            })
            .count();
        let token: String = rest[..n].chars().filter(|&c| c != '_').collect();
        self.pos += n;
        let digits = token.trim_start_matches(['-', '+']);
        let negative = token.starts_with('-');
        let radix = match digits.get(..2) {
            Some("0x" | "0X") => Some(16),
            Some("0o" | "0O") => Some(8),
            Some("0b" | "0B") => Some(2),
            _ => None,
        };
        if let Some(radix) = radix {
            let v = i64::from_str_radix(&digits[2..], radix).ok()?;
            return Some(Value::Number(Number::from(if negative { -v } else { v })));
        }
        if !digits.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
            return None;
        }
        if let Ok(i) = token.parse::<i64>() {
            return Some(Value::Number(Number::from(i)));
        }
        if let Ok(u) = token.parse::<u64>() {
            return Some(Value::Number(Number::from(u)));
        }
        // `inf`/`nan` are not literals (and JSON has no such numbers).
        if digits.bytes().any(|b| b.is_ascii_alphabetic() && b != b'e' && b != b'E') {
            return None;
        }
        let f: f64 = token.parse().ok()?;
        Number::from_f64(f).map(Value::Number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(calls: &[Call]) -> Vec<(String, Value)> {
        calls.iter().map(|(n, a)| (n.clone(), Value::Object(a.clone()))).collect()
    }

    #[test]
    fn a_list_of_calls_with_nested_literals() {
        let text = r#"[get_weather(city="Paris", days=3, units='metric'), search(q='it\'s "quoted"\n', tags=["a", 'b'], opts={"deep": True, 'k': None, 1: 2.5}, pair=(1, -2,), big=1_000, f=1e-3, x=0x1F, s="a" 'b', e=[], raw=r"\d+"), noop()]"#;
        let calls = parse_call_list(text).expect("parses");
        assert_eq!(
            args(&calls),
            vec![
                ("get_weather".to_string(), json!({"city": "Paris", "days": 3, "units": "metric"})),
                (
                    "search".to_string(),
                    json!({"q": "it's \"quoted\"\n", "tags": ["a", "b"], "opts": {"deep": true, "k": null, "1": 2.5},
                           "pair": [1, -2], "big": 1000, "f": 0.001, "x": 31, "s": "ab", "e": [], "raw": "\\d+"})
                ),
                ("noop".to_string(), json!({})),
            ]
        );
    }

    #[test]
    fn blocks_of_bare_calls_print_wrappers_and_dotted_names() {
        let calls = parse_call_block("print(default_api.get_weather(city=\"Oslo\"))\nget_time(tz=\"UTC\")\n").expect("parses");
        assert_eq!(args(&calls), vec![("get_weather".into(), json!({"city": "Oslo"})), ("get_time".into(), json!({"tz": "UTC"}))]);
        assert_eq!(parse_call_block(" [f(a=1)] ").map(|c| c.len()), Some(1));
    }

    #[test]
    fn what_is_not_a_call_list_is_none_and_never_panics() {
        for text in [
            "",
            "[]",
            "[1, 2]",
            "[f(1)]",
            "[f(a=b)]",
            "[f(a=1) g()]",
            "[f(a=1)] trailing",
            "[f(a='unterminated)]",
            "[f(a=\"x\\",
            "[f(a=1 == 2)]",
            "[f(a=inf)]",
            "[f(a=\"\\xZZ\")]",
            "[f(a=\"\\ud800\")]",
            "[f(a={1, 'k': 2})]",
            "[f(a=float('nan'))]",
            "[9f(a=1)]",
            "[f(a=-)]",
            "[f(a=0x)]",
            "[f(a=é)]",
            "[f(a=\"é\u{1F600}\"",
        ] {
            assert!(parse_call_list(text).is_none(), "{text:?}");
        }
        let deep = format!("[f(a={}{})]", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(parse_call_list(&deep).is_none());
        // Every prefix of a valid list is handled without a panic.
        let text = "[f(a=\"é\\u00e9\", b=[1.5, {'k': (True,)}]), g()]";
        for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let _ = parse_call_list(&text[..i]);
            let _ = parse_call_block(&text[..i]);
        }
        assert!(parse_call_list(text).is_some());
    }

    #[test]
    fn json_values_round_trip_through_python_literals() {
        let v = json!({"city": "Pa\"ris\n", "n": [1, 2.5, true, null], "o": {"k": false}});
        let text = format!("[{}]", call_to_python("f", &v));
        assert_eq!(text, r#"[f(city="Pa\"ris\n", n=[1, 2.5, True, None], o={"k": False})]"#);
        assert_eq!(parse_call_list(&text).map(|c| Value::Object(c[0].1.clone())), Some(v));
    }
}
