//! Text ↔ token ids, built from a Hugging Face `tokenizer.json` or from a
//! GGUF file's vocabulary and merges.
//!
//! GGUF (`tokenizer.ggml.model = gpt2`) becomes a byte-level BPE: the token
//! list is the vocabulary, `tokenizer.ggml.merges` the merges, tokens of
//! type 3 (control) and 4 (user-defined) are special tokens matched whole
//! before BPE, and the pre-tokenizer follows `tokenizer.ggml.pre`.

use crate::gguf::{GgufFile, MetadataValue};
use crate::{Error, Result};
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// GGUF token types that are matched whole: control (3) and user-defined (4).
const SPECIAL_TOKEN_TYPES: [i64; 2] = [3, 4];

/// Llama 3's split regex (`tokenizer.ggml.pre = llama-bpe`).
const LLAMA3_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (`tokenizer.ggml.pre = qwen2`): digits one by one.
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the model's special token ids.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    /// Prepend BOS when special tokens are requested. Only GGUF tokenizers
    /// set this; a `tokenizer.json` adds BOS through its post-processor.
    prepend_bos: bool,
    /// Where the tokenizer came from, for error messages.
    source: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let path = file.path();
        let unsupported = |what: String| Error::UnsupportedTokenizer { path: path.to_path_buf(), what };
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(unsupported(format!("model `tokenizer.ggml.model = {model}` (only gpt2 byte-level BPE is supported)")));
        }
        let tokens = string_array(file, "tokenizer.ggml.tokens")?;
        let merges = string_array(file, "tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| Error::BadMetadata {
                    path: path.to_path_buf(),
                    key: "tokenizer.ggml.merges".into(),
                    what: format!("merge #{i} {m:?} has no space"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let token_types: Vec<i64> = match file.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(v) => {
                let items = v.as_array().ok_or_else(|| file.bad_type("tokenizer.ggml.token_type", "an array", v))?;
                items
                    .iter()
                    .map(|t| t.as_i64().ok_or_else(|| file.bad_type("tokenizer.ggml.token_type", "integers", t)))
                    .collect::<Result<_>>()?
            }
        };
        let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let context = path.display().to_string();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| tokenizer_error(&context, e))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = file.get("tokenizer.ggml.pre").and_then(MetadataValue::as_str).unwrap_or("default");
        inner.with_pre_tokenizer(Some(pre_tokenizer(pre).map_err(unsupported)?));
        inner.with_decoder(Some(ByteLevel::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, ty)| SPECIAL_TOKEN_TYPES.contains(ty))
            .map(|(t, _)| AddedToken::from(t.to_string(), true).normalized(false))
            .collect();
        inner.add_special_tokens(special).map_err(|e| tokenizer_error(&context, e))?;

        let token_id = |key: &str| -> Result<Option<u32>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => {
                    v.as_u64().and_then(|id| u32::try_from(id).ok()).map(Some).ok_or_else(|| file.bad_type(key, "a u32 token id", v))
                }
            }
        };
        let bos_token_id = token_id("tokenizer.ggml.bos_token_id")?;
        let mut eos_token_ids = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Some(id) = token_id(key)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        // Absent means no BOS: the files that want one say so.
        let prepend_bos =
            file.get("tokenizer.ggml.add_bos_token").and_then(MetadataValue::as_bool).unwrap_or(false) && bos_token_id.is_some();
        Ok(Self { inner, bos_token_id, eos_token_ids, prepend_bos, source: context })
    }

    /// Loads `tokenizer.json` from a Hugging Face directory; BOS/EOS ids come
    /// from `config.json` and `generation_config.json` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let context = path.display().to_string();
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| tokenizer_error(&context, e))?;
        let mut bos_token_id = None;
        let mut eos_token_ids = Vec::new();
        for name in ["config.json", "generation_config.json"] {
            let Some(json) = read_json_if_present(&dir.join(name))? else { continue };
            if bos_token_id.is_none() {
                bos_token_id = json.get("bos_token_id").and_then(|v| v.as_u64()).and_then(|v| u32::try_from(v).ok());
            }
            let ids = match json.get("eos_token_id") {
                Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).collect(),
                Some(v) => v.as_u64().into_iter().collect(),
                None => Vec::new(),
            };
            for id in ids.into_iter().filter_map(|v: u64| u32::try_from(v).ok()) {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        Ok(Self { inner, bos_token_id, eos_token_ids, prepend_bos: false, source: context })
    }

    /// Token ids of `text`. With `add_special_tokens`, BOS is prepended when
    /// the model asks for it. Control tokens written in the text (such as
    /// `<|im_start|>`) are always matched whole.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, add_special_tokens).map_err(|e| tokenizer_error(&self.source, e))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if add_special_tokens && self.prepend_bos {
            ids.extend(self.bos_token_id);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// The text of `ids`; special tokens are dropped with `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| tokenizer_error(&self.source, e))
    }

    /// The vocabulary entry of `id` as stored (byte-level BPE pieces use
    /// `Ġ` for a space), or `None` for an unknown id.
    pub fn token_to_piece(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry, e.g. `<|im_end|>`.
    pub fn token_to_id(&self, piece: &str) -> Option<u32> {
        self.inner.token_to_id(piece)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Tokens that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The underlying `tokenizers` tokenizer, e.g. for streaming decode.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` value.
fn pre_tokenizer(pre: &str) -> std::result::Result<PreTokenizerWrapper, String> {
    let byte_level_regex = ByteLevel::new(false, true, true);
    let split_then_bytes = |pattern: &str| -> std::result::Result<PreTokenizerWrapper, String> {
        let split = Split::new(SplitPattern::Regex(pattern.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| format!("pre-tokenizer regex for `{pre}`: {e}"))?;
        Ok(Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()]).into())
    };
    match pre {
        "smollm" => Ok(Sequence::new(vec![Digits::new(true).into(), byte_level_regex.into()]).into()),
        "gpt-2" | "default" => Ok(byte_level_regex.into()),
        "llama-bpe" | "llama3" => split_then_bytes(LLAMA3_PATTERN),
        "qwen2" => split_then_bytes(QWEN2_PATTERN),
        other => Err(format!("pre-tokenizer `tokenizer.ggml.pre = {other}` (supported: smollm, gpt-2, default, llama-bpe, qwen2)")),
    }
}

/// A GGUF array of strings.
fn string_array<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    file.get_array(key)?.iter().map(|v| v.as_str().ok_or_else(|| file.bad_type(key, "an array of strings", v))).collect()
}

fn read_json_if_present(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::Tokenizer { context: path.display().to_string(), message: e.to_string() })
}

fn tokenizer_error(context: &str, e: impl std::fmt::Display) -> Error {
    Error::Tokenizer { context: context.to_string(), message: e.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn split(pre: &str, text: &str) -> Vec<String> {
        let mut s = PreTokenizedString::from(text);
        pre_tokenizer(pre).unwrap().pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(p, _, _)| p.to_string()).collect()
    }

    #[test]
    fn pre_tokenizers_split_as_their_models_do() {
        assert_eq!(split("smollm", "Hi 2024!"), ["Hi", "Ġ", "2", "0", "2", "4", "!"]);
        assert_eq!(split("llama-bpe", "Hi 12345 it's"), ["Hi", "Ġ", "123", "45", "Ġit", "'s"]);
        assert_eq!(split("qwen2", "Hi 123"), ["Hi", "Ġ", "1", "2", "3"]);
        assert_eq!(split("gpt-2", "Hi 123"), ["Hi", "Ġ123"]);
        assert!(pre_tokenizer("falcon").unwrap_err().contains("falcon"));
    }
}
