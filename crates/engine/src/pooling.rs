//! What an engine serves (vLLM's `--task`), and how an embedding model
//! pools: the defaults its checkpoint declares, overridden by
//! `--pooler-config`.
//!
//! A sentence-transformers checkpoint says how it pools in
//! `1_Pooling/config.json` (`pooling_mode_lasttoken`,
//! `pooling_mode_mean_tokens`, `pooling_mode_cls_token`) and whether it
//! normalizes in `modules.json` (a `Normalize` module). Without them a
//! decoder embedding model pools its last token and normalizes, as vLLM's
//! default for decoder models does.

use crate::error::Error;
use serde::Deserialize;
use std::path::Path;
use vellum_base::{PoolingParams, PoolingType};

/// What the engine serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Task {
    /// `Embed` for a checkpoint that declares itself an embedding model (a
    /// base model without LM head, or a sentence-transformers pooling
    /// configuration), else `Generate`.
    #[default]
    Auto,
    /// Text generation (completions, chat).
    Generate,
    /// Embeddings: prompts pooled into vectors, nothing generated.
    Embed,
}

/// `--pooler-config` (vLLM's JSON): overrides of the checkpoint's pooling.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolerConfig {
    /// `LAST`, `MEAN` or `CLS`.
    #[serde(default, deserialize_with = "pooling_type")]
    pub pooling_type: Option<PoolingType>,
    /// Divide each vector by its L2 norm.
    #[serde(default)]
    pub normalize: Option<bool>,
}

fn pooling_type<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<PoolingType>, D::Error> {
    let name: Option<String> = Option::deserialize(d)?;
    name.map(|n| PoolingType::parse(&n).ok_or_else(|| serde::de::Error::custom(format!("pooling_type {n:?}: use LAST, MEAN or CLS"))))
        .transpose()
}

impl PoolerConfig {
    /// Parses the flag's JSON; an unknown key or pooling type is an error
    /// naming it.
    pub fn from_json(json: &str) -> Result<Self, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }
}

/// How an embedding model pools, and what its requests may ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingSpec {
    /// What a request that asks nothing else gets.
    pub defaults: PoolingParams,
    /// The model was trained for Matryoshka truncation
    /// (`config.json`'s `matryoshka_dimensions` or `is_matryoshka`), so a
    /// request may ask for fewer `dimensions`.
    pub matryoshka: bool,
    /// Length of a pooled vector before truncation.
    pub hidden_size: usize,
    /// The model is an encoder (BERT): its inputs keep `[CLS]` … `[SEP]`
    /// when truncated.
    pub encoder: bool,
}

impl EmbeddingSpec {
    /// A request's pooling: `dimensions` (checked against the model), the
    /// rest from the defaults.
    pub fn request(&self, dimensions: Option<usize>) -> Result<PoolingParams, String> {
        if dimensions.is_some() && !self.matryoshka {
            return Err("this model does not support Matryoshka representation (dimensions)".into());
        }
        let p = PoolingParams { dimensions, ..self.defaults };
        p.validate(self.hidden_size).map_err(|e| e.to_string())?;
        Ok(p)
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StPooling {
    pooling_mode_cls_token: bool,
    pooling_mode_mean_tokens: bool,
    pooling_mode_lasttoken: bool,
    pooling_mode_max_tokens: bool,
    pooling_mode_mean_sqrt_len_tokens: bool,
    pooling_mode_weightedmean_tokens: bool,
}

#[derive(Deserialize)]
struct StModule {
    #[serde(rename = "type", default)]
    kind: String,
}

/// `sentence_bert_config.json`.
#[derive(Deserialize, Default)]
#[serde(default)]
struct StBertConfig {
    max_seq_length: Option<usize>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawConfig {
    architectures: Vec<String>,
    matryoshka_dimensions: Option<serde_json::Value>,
    is_matryoshka: Option<bool>,
}

/// What a checkpoint directory declares about pooling (the default, nothing
/// declared, for a GGUF file or a directory without these files).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeclaredPooling {
    /// From `1_Pooling/config.json`.
    pub pooling_type: Option<PoolingType>,
    /// From `modules.json`: a `Normalize` module.
    pub normalize: Option<bool>,
    /// `config.json` names a base model (no LM head).
    pub base_model: bool,
    /// `config.json` declares Matryoshka training.
    pub matryoshka: bool,
    /// `sentence_bert_config.json`'s `max_seq_length`: the input length the
    /// model was trained for (caps the context, as in vLLM).
    pub max_seq_length: Option<usize>,
}

impl DeclaredPooling {
    /// Reads a Hugging Face directory's declarations; absent files declare
    /// nothing. A malformed file, or a pooling this engine does not do
    /// (sentence-transformers' max, weighted-mean or mean/√len pooling, or
    /// several at once), is an error naming it.
    pub fn read(dir: &Path) -> Result<Self, Error> {
        fn parse<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> Result<Option<T>, Error> {
            let path = dir.join(name);
            let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
            serde_json::from_str(&text).map(Some).map_err(|e| Error::Task(format!("{}: {e}", path.display())))
        }
        let mut d = DeclaredPooling::default();
        if let Some(p) = parse::<StPooling>(dir, "1_Pooling/config.json")? {
            let unsupported = [
                ("max", p.pooling_mode_max_tokens),
                ("mean_sqrt_len", p.pooling_mode_mean_sqrt_len_tokens),
                ("weightedmean", p.pooling_mode_weightedmean_tokens),
            ];
            if let Some((mode, _)) = unsupported.iter().find(|(_, on)| *on) {
                return Err(Error::Task(format!("1_Pooling/config.json asks for {mode} pooling; LAST, MEAN and CLS are served")));
            }
            let modes = [
                (PoolingType::Last, p.pooling_mode_lasttoken),
                (PoolingType::Mean, p.pooling_mode_mean_tokens),
                (PoolingType::Cls, p.pooling_mode_cls_token),
            ];
            let on: Vec<PoolingType> = modes.iter().filter(|(_, on)| *on).map(|(t, _)| *t).collect();
            if on.len() > 1 {
                return Err(Error::Task(format!("1_Pooling/config.json asks for several poolings at once ({on:?}); one is served")));
            }
            d.pooling_type = on.first().copied();
        }
        if let Some(modules) = parse::<Vec<StModule>>(dir, "modules.json")? {
            d.normalize = Some(modules.iter().any(|m| m.kind.ends_with(".Normalize")));
        }
        if let Some(c) = parse::<StBertConfig>(dir, "sentence_bert_config.json")? {
            d.max_seq_length = c.max_seq_length;
        }
        if let Some(c) = parse::<RawConfig>(dir, "config.json")? {
            d.base_model = c.architectures.first().is_some_and(|a| vellum_base::is_base_model_architecture(a));
            d.matryoshka = c.is_matryoshka == Some(true) || c.matryoshka_dimensions.is_some_and(|v| !v.is_null());
        }
        Ok(d)
    }

    /// Whether the checkpoint is an embedding model ([`Task::Auto`]).
    pub fn is_embedding_model(&self) -> bool {
        self.base_model || self.pooling_type.is_some()
    }

    /// The model's pooling: `--pooler-config`, else what the checkpoint
    /// declares, else last-token pooling for a decoder and CLS for an
    /// `encoder` (vLLM's defaults), normalized.
    pub fn spec(&self, overrides: PoolerConfig, hidden_size: usize, encoder: bool) -> EmbeddingSpec {
        let default = if encoder { PoolingType::Cls } else { PoolingType::Last };
        EmbeddingSpec {
            encoder,
            defaults: PoolingParams {
                pooling_type: overrides.pooling_type.or(self.pooling_type).unwrap_or(default),
                normalize: overrides.normalize.or(self.normalize).unwrap_or(true),
                dimensions: None,
            },
            matryoshka: self.matryoshka,
            hidden_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> std::path::PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vellum-pooling-{}-{n}", std::process::id()));
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
        dir
    }

    #[test]
    fn sentence_transformers_declarations_set_the_defaults() {
        let dir = dir_with(&[
            ("config.json", r#"{"architectures": ["MistralModel"], "matryoshka_dimensions": [64, 128]}"#),
            ("1_Pooling/config.json", r#"{"word_embedding_dimension": 4096, "pooling_mode_mean_tokens": true}"#),
            (
                "modules.json",
                r#"[{"idx": 0, "type": "sentence_transformers.models.Transformer"}, {"idx": 1, "type": "sentence_transformers.models.Pooling"}]"#,
            ),
        ]);
        let d = DeclaredPooling::read(&dir).expect("reads");
        assert_eq!(
            d,
            DeclaredPooling {
                pooling_type: Some(PoolingType::Mean),
                normalize: Some(false),
                base_model: true,
                matryoshka: true,
                max_seq_length: None
            }
        );
        assert!(d.is_embedding_model());
        let spec = d.spec(PoolerConfig::default(), 8, false);
        assert_eq!(spec.defaults, PoolingParams { pooling_type: PoolingType::Mean, normalize: false, dimensions: None });
        assert_eq!(spec.request(Some(4)).expect("matryoshka").dimensions, Some(4));
        assert!(spec.request(Some(9)).unwrap_err().contains("dimensions"));
        // --pooler-config wins.
        let o = PoolerConfig::from_json(r#"{"pooling_type": "CLS", "normalize": true}"#).expect("parses");
        assert_eq!(d.spec(o, 8, false).defaults.pooling_type, PoolingType::Cls);
        assert!(d.spec(o, 8, false).defaults.normalize);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_causal_lm_declares_nothing_and_pools_its_last_token_normalized() {
        let dir = dir_with(&[("config.json", r#"{"architectures": ["LlamaForCausalLM"]}"#)]);
        let d = DeclaredPooling::read(&dir).expect("reads");
        assert!(!d.is_embedding_model());
        let spec = d.spec(PoolerConfig::default(), 8, false);
        assert_eq!(spec.defaults, PoolingParams { pooling_type: PoolingType::Last, normalize: true, dimensions: None });
        assert!(spec.request(Some(4)).unwrap_err().contains("Matryoshka"));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn poolings_not_served_and_malformed_files_are_errors() {
        let max = dir_with(&[("1_Pooling/config.json", r#"{"pooling_mode_max_tokens": true}"#)]);
        assert!(DeclaredPooling::read(&max).unwrap_err().to_string().contains("max pooling"));
        let two = dir_with(&[("1_Pooling/config.json", r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true}"#)]);
        assert!(DeclaredPooling::read(&two).unwrap_err().to_string().contains("several"));
        let bad = dir_with(&[("modules.json", r#"{"not": "a list"}"#)]);
        assert!(DeclaredPooling::read(&bad).unwrap_err().to_string().contains("modules.json"));
        for d in [max, two, bad] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn pooler_config_errors_name_the_field() {
        assert!(PoolerConfig::from_json(r#"{"pooling_type": "MAX"}"#).unwrap_err().contains("MAX"));
        assert!(PoolerConfig::from_json(r#"{"pooling": "MEAN"}"#).unwrap_err().contains("pooling"));
        assert_eq!(PoolerConfig::from_json("{}").expect("empty"), PoolerConfig::default());
    }
}
