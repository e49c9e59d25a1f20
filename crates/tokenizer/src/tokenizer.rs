//! Text ↔ token ids, built from a Hugging Face `tokenizer.json` or from a
//! GGUF file's vocabulary.
//!
//! GGUF `tokenizer.ggml.model = gpt2` becomes a byte-level BPE (the
//! `tokenizers` crate): the token list is the vocabulary,
//! `tokenizer.ggml.merges` the merges, tokens of type 3 (control) and 4
//! (user-defined) are special tokens matched whole before BPE, and the
//! pre-tokenizer follows `tokenizer.ggml.pre`. GGUF `tokenizer.ggml.model =
//! llama` is SentencePiece with scores and byte fallback ([`spm`]).

use crate::spm;
use crate::{Error, Result};
use spm::{SpmTokenizer, TokenType};
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};
use vellum_formats::gguf::{GgufFile, MetadataValue};

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
    model: Model,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    /// Prepend BOS when special tokens are requested. Only GGUF tokenizers
    /// set this; a `tokenizer.json` adds BOS through its post-processor.
    prepend_bos: bool,
    /// Append EOS when special tokens are requested (GGUF
    /// `tokenizer.ggml.add_eos_token`).
    append_eos: bool,
    /// Where the tokenizer came from, for error messages.
    source: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field(
                "model",
                &match self.model {
                    Model::Hf(_) => "tokenizers",
                    Model::Spm(_) => "sentencepiece",
                },
            )
            .field("vocab_size", &self.vocab_size())
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

/// The algorithm behind a [`Tokenizer`].
enum Model {
    /// Hugging Face `tokenizers` (tokenizer.json, GGUF byte-level BPE).
    Hf(Box<tokenizers::Tokenizer>),
    /// GGUF SentencePiece (`tokenizer.ggml.model = llama`).
    Spm(Box<SpmTokenizer>),
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let path = file.path();
        let unsupported = |what: String| Error::UnsupportedTokenizer { path: path.to_path_buf(), what };
        let model = file.get_str("tokenizer.ggml.model")?;
        let token_types: Vec<i64> = match file.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(v) => {
                let items = v.as_array().ok_or_else(|| file.bad_type("tokenizer.ggml.token_type", "an array", v))?;
                items
                    .iter()
                    .map(|t| t.as_i64().ok_or_else(|| file.bad_type("tokenizer.ggml.token_type", "integers", t).into()))
                    .collect::<Result<_>>()?
            }
        };
        let tokens = string_array(file, "tokenizer.ggml.tokens")?;
        let tokens_len = tokens.len();
        let flag = |key: &str| file.get(key).and_then(MetadataValue::as_bool);
        let context = path.display().to_string();
        let (model, default_add_bos) = match model {
            "gpt2" => (Model::Hf(Box::new(byte_level_bpe(file, &tokens, &token_types, &context)?)), false),
            "llama" => (Model::Spm(Box::new(sentencepiece(file, tokens, &token_types)?)), true),
            other => {
                return Err(unsupported(format!(
                    "model `tokenizer.ggml.model = {other}` (supported: gpt2 byte-level BPE, llama SentencePiece)"
                )))
            }
        };

        // A special token id must name a vocabulary entry: a bad file must
        // not feed an out-of-range id to the embedding.
        let vocab = tokens_len;
        let token_id = |key: &str| -> Result<Option<u32>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .filter(|&id| (id as usize) < vocab)
                    .map(Some)
                    .ok_or_else(|| file.bad_type(key, &format!("a token id below the vocabulary size {vocab}"), v).into()),
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
        // Gemma's chat turns end with `<end_of_turn>`, which its files do
        // not name as EOT: llama.cpp stops there too.
        if let Model::Spm(spm) = &model {
            for piece in ["<end_of_turn>", "<|eot_id|>", "<|im_end|>"] {
                if let Some(id) = spm.id(piece).filter(|&id| spm.is_control(id)) {
                    if !eos_token_ids.contains(&id) {
                        eos_token_ids.push(id);
                    }
                }
            }
        }
        // Absent means llama.cpp's default: BOS for SentencePiece, none for BPE.
        let prepend_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(default_add_bos) && bos_token_id.is_some();
        let append_eos = flag("tokenizer.ggml.add_eos_token").unwrap_or(false) && !eos_token_ids.is_empty();
        Ok(Self { model, bos_token_id, eos_token_ids, prepend_bos, append_eos, source: context })
    }

    /// Loads `tokenizer.json` from a Hugging Face directory; BOS/EOS ids come
    /// from `config.json` and `generation_config.json` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let context = path.display().to_string();
        let mut inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| tokenizer_error(&context, e))?;
        // Padding and truncation saved in tokenizer.json (sentence-transformers
        // files pad to a fixed length) are settings of a batch call, which
        // `transformers` resets per call: a prompt is its own tokens.
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| tokenizer_error(&context, e))?;
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
        Ok(Self { model: Model::Hf(Box::new(inner)), bos_token_id, eos_token_ids, prepend_bos: false, append_eos: false, source: context })
    }

    /// Token ids of `text`. With `add_special_tokens`, BOS (and EOS) are
    /// added when the model asks for them. Control tokens written in the text
    /// (such as `<|im_start|>`) are always matched whole.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if add_special_tokens && self.prepend_bos {
            ids.extend(self.bos_token_id);
        }
        match &self.model {
            Model::Hf(inner) => {
                let encoding = inner.encode(text, add_special_tokens).map_err(|e| tokenizer_error(&self.source, e))?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Model::Spm(spm) => ids.extend(spm.encode(text, true)),
        }
        if add_special_tokens && self.append_eos {
            ids.extend(self.eos_token_ids.first());
        }
        Ok(ids)
    }

    /// The text of `ids`; special tokens are dropped with `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        match &self.model {
            Model::Hf(inner) => inner.decode(ids, skip_special_tokens).map_err(|e| tokenizer_error(&self.source, e)),
            Model::Spm(spm) => Ok(spm.decode(ids, skip_special_tokens)),
        }
    }

    /// The vocabulary entry of `id` as stored (byte-level BPE pieces use
    /// `Ġ` for a space, SentencePiece `▁`), or `None` for an unknown id.
    pub fn token_to_piece(&self, id: u32) -> Option<String> {
        match &self.model {
            Model::Hf(inner) => inner.id_to_token(id),
            Model::Spm(spm) => spm.piece(id).map(str::to_string),
        }
    }

    /// The id of a vocabulary entry, e.g. `<|im_end|>`.
    pub fn token_to_id(&self, piece: &str) -> Option<u32> {
        match &self.model {
            Model::Hf(inner) => inner.token_to_id(piece),
            Model::Spm(spm) => spm.id(piece),
        }
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.model {
            Model::Hf(inner) => inner.get_vocab_size(true),
            Model::Spm(spm) => spm.vocab_size(),
        }
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Tokens that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Every token's bytes as generated text, for a SentencePiece
    /// tokenizer (special tokens are `0xFF` then their piece); `None` for a
    /// `tokenizers` one, whose `tokenizer.json` says how its pieces map to
    /// bytes ([`Tokenizer::hf_tokenizer`]).
    pub fn sentencepiece_token_bytes(&self) -> Option<Vec<Vec<u8>>> {
        match &self.model {
            Model::Spm(spm) => Some(spm.token_bytes()),
            Model::Hf(_) => None,
        }
    }

    /// The Hugging Face `tokenizers` tokenizer behind this one, when there is
    /// one (tokenizer.json and GGUF byte-level BPE; not SentencePiece GGUF).
    pub fn hf_tokenizer(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.model {
            Model::Hf(inner) => Some(inner),
            Model::Spm(_) => None,
        }
    }
}

/// The SentencePiece tokenizer of a `tokenizer.ggml.model = llama` file.
fn sentencepiece(file: &GgufFile, tokens: Vec<&str>, token_types: &[i64]) -> Result<SpmTokenizer> {
    let key = "tokenizer.ggml.scores";
    let scores: Vec<f32> = file
        .get_array(key)?
        .iter()
        .map(|v| v.as_f64().map(|s| s as f32).ok_or_else(|| file.bad_type(key, "numbers", v).into()))
        .collect::<Result<_>>()?;
    let bad_len = |key: &str, n: usize| Error::bad_metadata(file.path(), key, format!("{n} entries for {} tokens", tokens.len()));
    if scores.len() != tokens.len() {
        return Err(bad_len(key, scores.len()));
    }
    if token_types.len() != tokens.len() {
        return Err(bad_len("tokenizer.ggml.token_type", token_types.len()));
    }
    let types = token_types.iter().map(|&t| TokenType::from_gguf(t)).collect();
    let add_space_prefix = file.get("tokenizer.ggml.add_space_prefix").and_then(MetadataValue::as_bool).unwrap_or(true);
    Ok(SpmTokenizer::new(tokens.into_iter().map(str::to_string).collect(), scores, types, add_space_prefix))
}

/// The byte-level BPE of a `tokenizer.ggml.model = gpt2` file.
fn byte_level_bpe(file: &GgufFile, tokens: &[&str], token_types: &[i64], context: &str) -> Result<tokenizers::Tokenizer> {
    let path = file.path();
    let unsupported = |what: String| Error::UnsupportedTokenizer { path: path.to_path_buf(), what };
    let merges = string_array(file, "tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| Error::bad_metadata(path, "tokenizer.ggml.merges", format!("merge #{i} {m:?} has no space")))
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| tokenizer_error(context, e))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let pre = file.get("tokenizer.ggml.pre").and_then(MetadataValue::as_str).unwrap_or("default");
    inner.with_pre_tokenizer(Some(pre_tokenizer(pre).map_err(unsupported)?));
    inner.with_decoder(Some(ByteLevel::default()));
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(token_types)
        .filter(|(_, ty)| SPECIAL_TOKEN_TYPES.contains(ty))
        .map(|(t, _)| AddedToken::from(t.to_string(), true).normalized(false))
        .collect();
    inner.add_special_tokens(special).map_err(|e| tokenizer_error(context, e))?;
    Ok(inner)
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
    file.get_array(key)?.iter().map(|v| v.as_str().ok_or_else(|| file.bad_type(key, "an array of strings", v).into())).collect()
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
