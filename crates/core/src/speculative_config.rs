//! Configuration of speculative decoding, read from the JSON of vLLM's
//! `--speculative-config` flag.
//!
//! ```text
//! {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
//! {"method": "draft_model", "model": "path/or/hub-id", "num_speculative_tokens": 4}
//! {"model": "path/or/hub-id", "num_speculative_tokens": 4}      (method inferred: draft_model)
//! ```

use crate::{Error, Result};

/// Most tokens one speculation may propose (the per-position acceptance
/// counters have this many entries).
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Who proposes the draft tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpeculativeMethod {
    /// Prompt lookup: the continuation of the latest earlier occurrence of
    /// the sequence's last `n` tokens, for `n` from `prompt_lookup_max`
    /// down to `prompt_lookup_min`. No extra model.
    Ngram {
        /// Shortest suffix matched.
        prompt_lookup_min: usize,
        /// Longest suffix matched (tried first).
        prompt_lookup_max: usize,
    },
    /// A smaller model sharing the target's tokenizer, run by its own engine
    /// on its own paged KV cache, proposing its greedy continuation.
    DraftModel {
        /// The draft model: a `.gguf` file, a Hugging Face directory or a
        /// hub id in the local cache.
        model: String,
    },
}

/// Speculative decoding: who drafts, and how many tokens a step verifies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// The proposer.
    pub method: SpeculativeMethod,
    /// Most draft tokens proposed per sequence per step (1 to
    /// [`MAX_SPECULATIVE_TOKENS`]).
    pub num_speculative_tokens: usize,
}

/// The keys `--speculative-config` takes; any other is an error, not silence.
const KEYS: [&str; 5] = ["method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"];

impl SpeculativeConfig {
    /// Parses vLLM's `--speculative-config` JSON (see the module docs). The
    /// n-gram bounds default as vLLM's do: both 5 when neither is given,
    /// else the one given for both.
    pub fn from_json(text: &str) -> Result<Self> {
        let bad = |message: String| Error::InvalidConfig { field: "speculative_config", message };
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = value.as_object().ok_or_else(|| bad("must be a JSON object".into()))?;
        if let Some(key) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(bad(format!("unknown key {key:?} (supported: {})", KEYS.join(", "))));
        }
        let count = |key: &str| -> Result<Option<usize>> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => {
                    v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| bad(format!("{key} must be a non-negative integer, got {v}")))
                }
            }
        };
        let model = match obj.get("model") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(v) => return Err(bad(format!("model must be a non-empty string, got {v}"))),
        };
        let method = match obj.get("method").and_then(|m| m.as_str()) {
            Some(m) => m.to_string(),
            None if obj.get("method").is_some_and(|m| !m.is_null()) => return Err(bad("method must be a string".into())),
            None if model.is_some() => "draft_model".into(),
            None => return Err(bad("give a method (ngram or draft_model) or a draft model".into())),
        };
        let num_speculative_tokens = count("num_speculative_tokens")?.ok_or_else(|| bad("num_speculative_tokens is required".into()))?;
        let (min, max) = (count("prompt_lookup_min")?, count("prompt_lookup_max")?);
        let method = match method.as_str() {
            "ngram" => {
                if model.is_some() {
                    return Err(bad("the ngram method takes no model".into()));
                }
                let (prompt_lookup_min, prompt_lookup_max) = match (min, max) {
                    (None, None) => (5, 5),
                    (Some(n), None) | (None, Some(n)) => (n, n),
                    (Some(lo), Some(hi)) => (lo, hi),
                };
                SpeculativeMethod::Ngram { prompt_lookup_min, prompt_lookup_max }
            }
            "draft_model" => {
                if min.is_some() || max.is_some() {
                    return Err(bad("prompt_lookup_min/max apply to the ngram method only".into()));
                }
                SpeculativeMethod::DraftModel { model: model.ok_or_else(|| bad("the draft_model method needs a model".into()))? }
            }
            other => {
                return Err(bad(format!(
                    "method {other:?} is not supported (supported: ngram, draft_model; EAGLE, Medusa and MTP heads are not)"
                )))
            }
        };
        let config = Self { method, num_speculative_tokens };
        config.validate()?;
        Ok(config)
    }

    /// Checks the bounds.
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Err(Error::InvalidConfig { field: "speculative_config", message });
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&self.num_speculative_tokens) {
            return bad(format!("num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS}, got {}", self.num_speculative_tokens));
        }
        if let SpeculativeMethod::Ngram { prompt_lookup_min: lo, prompt_lookup_max: hi } = self.method {
            if lo == 0 || lo > hi {
                return bad(format!("need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllms_json() {
        let c = SpeculativeConfig::from_json(
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#,
        )
        .unwrap();
        assert_eq!(c.method, SpeculativeMethod::Ngram { prompt_lookup_min: 2, prompt_lookup_max: 4 });
        assert_eq!(c.num_speculative_tokens, 4);
        let c = SpeculativeConfig::from_json(r#"{"method": "ngram", "num_speculative_tokens": 3}"#).unwrap();
        assert_eq!(c.method, SpeculativeMethod::Ngram { prompt_lookup_min: 5, prompt_lookup_max: 5 });
        let c = SpeculativeConfig::from_json(r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}"#).unwrap();
        assert_eq!(c.method, SpeculativeMethod::Ngram { prompt_lookup_min: 3, prompt_lookup_max: 3 });
        let c = SpeculativeConfig::from_json(r#"{"model": "small.gguf", "num_speculative_tokens": 5}"#).unwrap();
        assert_eq!(c.method, SpeculativeMethod::DraftModel { model: "small.gguf".into() });
    }

    #[test]
    fn refuses_what_it_cannot_do_by_name() {
        for (json, says) in [
            ("[]", "JSON object"),
            ("{", "not JSON"),
            (r#"{"method": "ngram"}"#, "num_speculative_tokens is required"),
            (r#"{"method": "eagle", "model": "m", "num_speculative_tokens": 2}"#, "\"eagle\" is not supported"),
            (r#"{"method": "ngram", "num_speculative_tokens": 0}"#, "in 1..=16"),
            (r#"{"method": "ngram", "num_speculative_tokens": 99}"#, "in 1..=16"),
            (r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#, "prompt_lookup_min <="),
            (r#"{"method": "ngram", "num_speculative_tokens": -1}"#, "non-negative integer"),
            (r#"{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}"#, "unknown key"),
            (r#"{"method": "draft_model", "num_speculative_tokens": 2}"#, "needs a model"),
            (r#"{"num_speculative_tokens": 2}"#, "give a method"),
        ] {
            let e = SpeculativeConfig::from_json(json).unwrap_err().to_string();
            assert!(e.contains(says), "{json}: {e}");
        }
    }
}
