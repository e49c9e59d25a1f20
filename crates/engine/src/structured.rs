//! Structured outputs: decoding constrained to a JSON schema, a regular
//! expression, a list of choices or a Lark grammar, through `llguidance`
//! (the library vLLM and SGLang use).
//!
//! ```text
//!  tokenizer ──token bytes──▶ StructuredOutputs (token trie + parser factory, one per model)
//!  request's StructuredOutput ──compile (cached by spec)──▶ Constraint (one per sequence)
//!  each step:  mask = constraint.allowed()     logits outside the mask → −∞, then sample
//!              constraint.commit(token)        (forks clone the constraint with the sequence)
//! ```
//!
//! The end-of-sequence token is allowed exactly where the text is complete,
//! so a constrained output that stops on its own is always whole; one cut by
//! `max_tokens` is reported as `length`. Log-probabilities stay the model's
//! own, before the mask (as vLLM reports them by default).

use crate::error::Error;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use vellum_base::{StructuredOutput, TokenId};
use vellum_models::Tokenizer;

/// Compiled grammars kept for reuse (a server sees the same schema often).
const CACHE_ENTRIES: usize = 256;

/// The per-model part of structured outputs: the token trie and parser
/// factory, and the compiled constraints by spec. The trie and factory take
/// about a second to build for a 262k vocabulary, so they are built by the
/// first constraint compiled, not when the model loads.
pub struct StructuredOutputs {
    /// Every token's bytes, until the factory is built from them.
    token_bytes: Mutex<Vec<Vec<u8>>>,
    factory: OnceLock<Result<ParserFactory, String>>,
    compiled: Mutex<HashMap<StructuredOutput, Matcher>>,
    vocab: usize,
    eos: TokenId,
}

impl std::fmt::Debug for StructuredOutputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StructuredOutputs").field("vocab", &self.vocab).finish()
    }
}

fn compile_error(spec: &StructuredOutput, message: impl std::fmt::Display) -> Error {
    Error::StructuredOutput { field: spec.field(), message: message.to_string() }
}

impl StructuredOutputs {
    /// From every token's bytes (special tokens `0xFF` then their text) and
    /// the end-of-sequence token the grammar may emit when complete.
    pub fn new(token_bytes: Vec<Vec<u8>>, eos: TokenId) -> Result<Self, Error> {
        let vocab = token_bytes.len();
        if (eos as usize) >= vocab {
            return Err(Error::Unsupported("structured outputs need an end-of-sequence token in the vocabulary"));
        }
        Ok(Self { token_bytes: Mutex::new(token_bytes), factory: OnceLock::new(), compiled: Mutex::new(HashMap::new()), vocab, eos })
    }

    /// The parser factory over the token trie, built on first use.
    fn factory(&self) -> Result<&ParserFactory, Error> {
        let built = self.factory.get_or_init(|| {
            let started = std::time::Instant::now();
            let token_bytes = std::mem::take(&mut *self.token_bytes.lock().unwrap_or_else(|p| p.into_inner()));
            let trie = TokTrie::from(&TokRxInfo::new(self.vocab as u32, self.eos), &token_bytes);
            let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("parser setup: {e}"))?;
            factory.quiet();
            tracing::debug!(ms = started.elapsed().as_millis() as u64, vocab = self.vocab, "structured outputs: token trie built");
            Ok(factory)
        });
        built.as_ref().map_err(|message| Error::StructuredOutput { field: "structured_outputs", message: message.clone() })
    }

    /// For `tokenizer`'s vocabulary and its first end-of-sequence token.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self, Error> {
        let bytes = match tokenizer.sentencepiece_token_bytes() {
            Some(b) => b,
            None => {
                let hf = tokenizer.hf_tokenizer().ok_or(Error::Unsupported("structured outputs for this tokenizer"))?;
                let setup = |e: &dyn std::fmt::Display| Error::StructuredOutput {
                    field: "structured_outputs",
                    message: format!("reading the tokenizer's vocabulary: {e}"),
                };
                let text = hf.to_string(false).map_err(|e| setup(&e))?;
                let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| setup(&e))?;
                let mut bytes = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| setup(&e))?;
                bytes.resize(tokenizer.vocab_size().max(bytes.len()), Vec::new());
                bytes
            }
        };
        let eos = *tokenizer.eos_token_ids().first().ok_or(Error::Unsupported("structured outputs without an EOS token"))?;
        Self::new(bytes, eos)
    }

    /// A fresh constraint for `spec`, compiled once per distinct spec. An
    /// invalid schema, regex or grammar is a typed error naming the field.
    pub fn compile(&self, spec: &StructuredOutput) -> Result<Constraint, Error> {
        if let Some(m) = self.compiled.lock().unwrap_or_else(|p| p.into_inner()).get(spec) {
            return Ok(Constraint { matcher: m.deep_clone(), eos: self.eos, vocab: self.vocab });
        }
        let grammar = match spec {
            StructuredOutput::Json(schema) => {
                let v: serde_json::Value =
                    serde_json::from_str(schema).map_err(|e| compile_error(spec, format!("the JSON schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(with_json_layout(v))
            }
            StructuredOutput::JsonObject => TopLevelGrammar::from_json_schema(with_json_layout(serde_json::json!({"type": "object"}))),
            StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
            StructuredOutput::Choice(choices) => {
                let alts: Vec<String> = choices.iter().map(|c| serde_json::Value::from(c.as_str()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            StructuredOutput::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self.factory()?.create_parser(grammar).map_err(|e| compile_error(spec, e))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(compile_error(spec, e));
        }
        let mut cache = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(spec.clone(), matcher.deep_clone());
        Ok(Constraint { matcher, eos: self.eos, vocab: self.vocab })
    }
}

/// The JSON layout a constrained output takes unless the schema says
/// otherwise (llguidance's `x-guidance` options): `", "` and `": "`
/// between items and keys and no other whitespace — a small model given
/// free whitespace can spend its whole budget on newlines (a bug class
/// reported against every engine that allows it).
fn with_json_layout(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// One sequence's position in its grammar. Cloning copies the state (a
/// parallel sample forked off a sequence continues from the same place).
pub struct Constraint {
    matcher: Matcher,
    eos: TokenId,
    vocab: usize,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint { matcher: self.matcher.deep_clone(), eos: self.eos, vocab: self.vocab }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Constraint {
    /// The tokens allowed next: the grammar's continuations (with the
    /// end-of-sequence token where the text is complete), and only the
    /// end-of-sequence token once the grammar is finished (or, should it
    /// fail, to end the sequence rather than run unconstrained).
    pub fn allowed(&mut self) -> SimpleVob {
        if !self.matcher.is_stopped() && !self.matcher.is_error() {
            match self.matcher.compute_mask() {
                Ok(m) => return m,
                Err(e) => tracing::warn!(error = %e, "structured output: no mask; ending the sequence"),
            }
        }
        let mut only_eos = SimpleVob::alloc(self.vocab);
        only_eos.allow_token(self.eos);
        only_eos
    }

    /// Advances past the sampled `token`.
    pub fn commit(&mut self, token: TokenId) {
        if self.matcher.is_stopped() || self.matcher.is_error() {
            return;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            tracing::warn!(error = %e, token, "structured output: token refused; the sequence will end");
        }
    }

    /// Whether the text so far is a complete string of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Tokens the constraint knows (logits past it are never allowed).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: single bytes, some multi-byte pieces, and EOS.
    fn vocab() -> (Vec<Vec<u8>>, TokenId) {
        let mut v: Vec<Vec<u8>> = (b'a'..=b'z').map(|c| vec![c]).collect();
        for piece in [" ", "ye", "yes", "no", "ma", "may", "be", " so", "es", "o s"] {
            v.push(piece.as_bytes().to_vec());
        }
        let mut eos = vec![0xFF];
        eos.extend_from_slice(b"</s>");
        v.push(eos);
        let eos_id = (v.len() - 1) as TokenId;
        (v, eos_id)
    }

    /// Brute force: token t may follow `text` iff `text + t` is a prefix of
    /// some choice; EOS iff `text` is a choice.
    fn brute(text: &[u8], vocab: &[Vec<u8>], eos: TokenId, choices: &[&str]) -> Vec<bool> {
        vocab
            .iter()
            .enumerate()
            .map(|(t, bytes)| {
                if t as TokenId == eos {
                    return choices.iter().any(|c| c.as_bytes() == text);
                }
                let mut next = text.to_vec();
                next.extend_from_slice(bytes);
                choices.iter().any(|c| c.as_bytes().starts_with(&next))
            })
            .collect()
    }

    #[test]
    fn masks_equal_brute_force_over_every_path_and_clones_are_independent() {
        let (vocab, eos) = vocab();
        let so = StructuredOutputs::new(vocab.clone(), eos).expect("factory");
        let choices = ["yes", "no", "maybe so"];
        let spec = StructuredOutput::Choice(choices.iter().map(|s| s.to_string()).collect());
        // Depth-first over every allowed path, checking the mask at each node.
        let mut stack = vec![(so.compile(&spec).expect("compiles"), Vec::<u8>::new())];
        let mut nodes = 0;
        while let Some((mut c, text)) = stack.pop() {
            nodes += 1;
            let mask = c.allowed();
            let expected = brute(&text, &vocab, eos, &choices);
            for (t, &want) in expected.iter().enumerate() {
                assert_eq!(mask.is_allowed(t as TokenId), want, "after {:?}: token {:?}", String::from_utf8_lossy(&text), vocab[t]);
            }
            for (t, &ok) in expected.iter().enumerate() {
                if ok && t as TokenId != eos {
                    // A clone advances on its own; `c` stays where it is.
                    let mut child = c.clone();
                    child.commit(t as TokenId);
                    let mut next = text.clone();
                    next.extend_from_slice(&vocab[t]);
                    stack.push((child, next));
                }
            }
            assert_eq!(c.is_accepting(), choices.iter().any(|ch| ch.as_bytes() == text.as_slice()));
        }
        assert!(nodes > 10, "{nodes} nodes visited");
        // Once a choice is complete only EOS remains.
        let mut c = so.compile(&spec).expect("compiles");
        c.commit(vocab.iter().position(|v| v == b"no").expect("no") as TokenId);
        let m = c.allowed();
        assert!((0..vocab.len() as TokenId).all(|t| m.is_allowed(t) == (t == eos)));
    }

    #[test]
    fn invalid_constraints_are_typed_errors_naming_the_field() {
        let (vocab, eos) = vocab();
        let so = StructuredOutputs::new(vocab, eos).expect("factory");
        for (spec, field) in [
            (StructuredOutput::Json("{not json".into()), "structured_outputs.json"),
            (StructuredOutput::Json(r#"{"type": "no-such-type"}"#.into()), "structured_outputs.json"),
            (StructuredOutput::Regex("(unclosed".into()), "structured_outputs.regex"),
            (StructuredOutput::Grammar("start: undefined_rule".into()), "structured_outputs.grammar"),
        ] {
            match so.compile(&spec) {
                Err(Error::StructuredOutput { field: f, message }) => assert_eq!(f, field, "{message}"),
                other => panic!("{spec:?}: expected a typed error, got {other:?}"),
            }
        }
    }
}
