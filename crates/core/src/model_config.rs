//! A model's shape, parsed from a Hugging Face `config.json`.

use crate::{find_architecture, find_model_type, Architecture, Error, Result};
use serde::Deserialize;
use std::path::Path;

/// RoPE frequency scaling (`rope_scaling` in `config.json`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.x: low frequencies divided by `factor`, high ones kept, a
    /// smooth ramp between.
    Llama3 {
        /// Scale of the low frequencies.
        factor: f32,
        /// Wavelength threshold, as a fraction of the original context.
        low_freq_factor: f32,
        /// Wavelength threshold, as a fraction of the original context.
        high_freq_factor: f32,
        /// The context the model was trained with.
        original_max_position_embeddings: usize,
    },
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f32,
    },
}

/// The attention of one layer (`layer_types` in `config.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Full causal attention.
    FullAttention,
    /// Attention to the last `sliding_window` positions.
    SlidingAttention,
}

/// The fields of `config.json` the model definitions need.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `architectures[0]`, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Per-head width; `hidden_size / num_attention_heads` unless given.
    pub head_dim: usize,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// The norms' epsilon (RMSNorm; an encoder's LayerNorm,
    /// `layer_norm_eps`).
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// The LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2; Llama's `attention_bias`).
    pub attention_bias: bool,
    /// Per-head RMSNorm on queries and keys (Qwen3).
    pub qk_norm: bool,
    /// Sliding-window attention width (Mistral; Gemma's local layers), if any.
    pub sliding_window: Option<usize>,
    /// Per-layer attention kind where layers differ (Gemma 3's interleaved
    /// local and global layers); empty when every layer is alike.
    pub layer_types: Vec<LayerType>,
    /// RoPE base of the sliding-window layers when it differs from
    /// `rope_theta` (Gemma 3's `rope_local_base_freq`).
    pub rope_local_theta: Option<f32>,
    /// The attention scale is `query_pre_attn_scalar^-½` (Gemma) instead of
    /// `head_dim^-½`.
    pub query_pre_attn_scalar: Option<f32>,
    /// Soft-cap of the attention scores (Gemma 2).
    pub attn_logit_softcapping: Option<f32>,
    /// Soft-cap of the final logits (Gemma 2).
    pub final_logit_softcapping: Option<f32>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (some configs list several).
    pub eos_token_ids: Vec<u32>,
    /// Token types an encoder embeds (BERT's segments; 0 for decoders).
    pub type_vocab_size: usize,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f32>,
    query_pre_attn_scalar: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    layer_norm_eps: Option<f32>,
    type_vocab_size: Option<usize>,
    hidden_act: Option<String>,
    position_embedding_type: Option<String>,
}

impl ModelConfig {
    /// The weights a token multiplies in the decoder layers: q, k, v and o,
    /// and a gated MLP's gate, up and down, in every layer (the embedding
    /// and the LM head left out). `2 ·` this is a prompt token's FLOPs in
    /// the linears.
    pub fn layer_parameters(&self) -> u64 {
        let (h, d) = (self.hidden_size as u64, self.head_dim as u64);
        let q = h * self.num_attention_heads as u64 * d;
        let kv = 2 * h * self.num_key_value_heads as u64 * d;
        let mlp = 3 * h * self.intermediate_size as u64;
        self.num_hidden_layers as u64 * (2 * q + kv + mlp)
    }

    /// Parses `config.json` text. `source_name` appears in errors.
    pub fn from_json_str(json: &str, source_name: &str) -> Result<Self> {
        let parse_err = |message: String| Error::ModelConfigParse { source_name: source_name.to_string(), message };
        let raw: RawConfig = serde_json::from_str(json).map_err(|e| parse_err(e.to_string()))?;
        let arch = match (&raw.architectures, &raw.model_type) {
            (Some(a), _) if !a.is_empty() => find_architecture(&a[0]).ok_or_else(|| Error::UnsupportedArchitecture(a[0].clone()))?,
            (_, Some(t)) => find_model_type(t).ok_or_else(|| Error::UnsupportedArchitecture(t.clone()))?,
            _ => return Err(parse_err("neither `architectures` nor `model_type` is given".into())),
        };
        if raw.num_attention_heads == 0 {
            return Err(parse_err("num_attention_heads is 0".into()));
        }
        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_key_value_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(parse_err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({num_key_value_heads})",
                raw.num_attention_heads
            )));
        }
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(parse_err(format!("head_dim must be even and non-zero, got {head_dim}")));
        }
        let rope_scaling = match raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(parse_rope_scaling(&v).map_err(parse_err)?),
        };
        // Qwen2 configs carry `sliding_window` but only use it with
        // `use_sliding_window: true`; Mistral uses it when it is a number.
        let sliding_window = match (raw.sliding_window, raw.use_sliding_window) {
            (_, Some(false)) => None,
            (Some(serde_json::Value::Number(n)), _) if !arch.sliding_window_opt_in || raw.use_sliding_window == Some(true) => {
                // A window of 0 means none (as in the references).
                n.as_u64().filter(|&w| w > 0).map(|w| w as usize)
            }
            _ => None,
        };
        let layer_types = match (&raw.layer_types, arch.sliding_window_pattern.or(raw.sliding_window_pattern)) {
            (Some(kinds), _) => {
                if kinds.len() != raw.num_hidden_layers {
                    return Err(parse_err(format!("layer_types has {} entries for {} layers", kinds.len(), raw.num_hidden_layers)));
                }
                kinds
                    .iter()
                    .map(|k| match k.as_str() {
                        "full_attention" => Ok(LayerType::FullAttention),
                        "sliding_attention" => Ok(LayerType::SlidingAttention),
                        other => Err(parse_err(format!("unsupported layer type {other:?} (full_attention, sliding_attention)"))),
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?
            }
            (None, Some(pattern)) if sliding_window.is_some() => {
                let pattern = raw.sliding_window_pattern.unwrap_or(pattern).max(1);
                (0..raw.num_hidden_layers)
                    .map(|i| if (i + 1) % pattern == 0 { LayerType::FullAttention } else { LayerType::SlidingAttention })
                    .collect()
            }
            _ => Vec::new(),
        };
        if layer_types.contains(&LayerType::SlidingAttention) && sliding_window.is_none() {
            return Err(parse_err("layer_types has sliding_attention layers but no sliding_window".into()));
        }
        let rope_local_theta = match arch.family {
            crate::ModelFamily::Gemma3 => Some(raw.rope_local_base_freq.unwrap_or(10_000.0)),
            crate::ModelFamily::Llama | crate::ModelFamily::Bert => raw.rope_local_base_freq,
        };
        if arch.family == crate::ModelFamily::Bert {
            // What the encoder implements: exact GELU, learned absolute positions.
            if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "gelu") {
                return Err(parse_err(format!("hidden_act {act:?} is not supported for BERT (gelu)")));
            }
            if let Some(kind) = raw.position_embedding_type.as_deref().filter(|k| *k != "absolute") {
                return Err(parse_err(format!("position_embedding_type {kind:?} is not supported for BERT (absolute)")));
            }
        }
        let norm_eps = match arch.family {
            crate::ModelFamily::Bert => raw.layer_norm_eps.unwrap_or(1e-12),
            _ => raw.rms_norm_eps.unwrap_or(1e-6),
        };
        Ok(Self {
            architecture: arch.name.to_string(),
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads,
            head_dim,
            // BERT's defaults where its config leaves them out.
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(if arch.family.is_encoder() { 512 } else { 2048 }),
            rms_norm_eps: norm_eps,
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: arch.qkv_bias || raw.attention_bias.unwrap_or(false),
            qk_norm: arch.qk_norm,
            sliding_window,
            layer_types,
            rope_local_theta,
            query_pre_attn_scalar: raw.query_pre_attn_scalar,
            attn_logit_softcapping: raw.attn_logit_softcapping,
            final_logit_softcapping: raw.final_logit_softcapping,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: match raw.eos_token_id {
                None => Vec::new(),
                Some(OneOrMany::One(t)) => vec![t],
                Some(OneOrMany::Many(ts)) => ts,
            },
            type_vocab_size: raw.type_vocab_size.unwrap_or(if arch.family.is_encoder() { 2 } else { 0 }),
        })
    }

    /// Reads and parses a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::ModelConfigParse { source_name: path.display().to_string(), message: e.to_string() })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// The registry entry of [`ModelConfig::architecture`] (parsing only
    /// accepts registered architectures).
    pub fn arch(&self) -> Option<&'static Architecture> {
        find_architecture(&self.architecture)
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match self.layer_types.get(layer) {
            Some(LayerType::FullAttention) => None,
            Some(LayerType::SlidingAttention) | None => self.sliding_window,
        }
    }

    /// Query heads per key/value head.
    pub fn num_queries_per_kv(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Elements of K plus V one token occupies across all layers.
    pub fn kv_elements_per_token(&self) -> usize {
        2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
    }
}

fn parse_rope_scaling(v: &serde_json::Value) -> std::result::Result<RopeScaling, String> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .ok_or_else(|| "rope_scaling has no `rope_type`".to_string())?;
    let num = |key: &str| -> std::result::Result<f64, String> {
        v.get(key).and_then(|x| x.as_f64()).ok_or_else(|| format!("rope_scaling.{key} is missing"))
    };
    match kind {
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")? as f32,
            low_freq_factor: num("low_freq_factor")? as f32,
            high_freq_factor: num("high_freq_factor")? as f32,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        }),
        "linear" => Ok(RopeScaling::Linear { factor: num("factor")? as f32 }),
        // "default" means no scaling.
        other => Err(format!("unsupported rope_scaling type {other:?} (supported: llama3, linear)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
      "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
      "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": null,
      "rope_theta": 100000, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "vocab_size": 49152 }"#;

    #[test]
    fn parses_llama_with_gqa() {
        let c = ModelConfig::from_json_str(SMOLLM2, "smollm2").unwrap();
        assert_eq!(c.architecture, "LlamaForCausalLM");
        assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (9, 3, 64));
        assert_eq!(c.num_queries_per_kv(), 3);
        assert!(c.tie_word_embeddings && !c.attention_bias && !c.qk_norm);
        assert_eq!(c.rope_theta, 100000.0);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.kv_elements_per_token(), 2 * 30 * 3 * 64);
    }

    #[test]
    fn parses_llama3_rope_scaling_and_eos_list() {
        let json = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":128256,"hidden_size":2048,
          "intermediate_size":8192,"num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,
          "rope_theta":500000.0,"eos_token_id":[128001,128008,128009],
          "rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
          "original_max_position_embeddings":8192,"rope_type":"llama3"}}"#;
        let c = ModelConfig::from_json_str(json, "llama3.2").unwrap();
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, original_max_position_embeddings: 8192, .. }) if factor == 32.0)
        );
    }

    #[test]
    fn layer_parameters_count_the_linears_a_token_multiplies() {
        // Llama 3 8B's config.json: 6.98 G of its 8.03 G weights are in the
        // layers' linears (the rest: embeddings and LM head, norms).
        let json = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":128256,"hidden_size":4096,
          "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8}"#;
        let c = ModelConfig::from_json_str(json, "llama3-8b").unwrap();
        assert_eq!(c.layer_parameters(), 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336));
        assert_eq!(c.layer_parameters() / 10_000_000, 697);
        // SmolLM2-135M: 30 layers of 576 × (576 + 192 + 192 + 576) + 3 · 576 · 1536.
        let c = ModelConfig::from_json_str(SMOLLM2, "smollm2").unwrap();
        assert_eq!(c.layer_parameters(), 30 * (576 * 1536 + 3 * 576 * 1536));
    }

    #[test]
    fn qwen_flags() {
        let base = r#""vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2"#;
        let q2 = ModelConfig::from_json_str(
            &format!(r#"{{"architectures":["Qwen2ForCausalLM"],{base},"sliding_window":4096,"use_sliding_window":false}}"#),
            "q2",
        )
        .unwrap();
        assert!(q2.attention_bias && !q2.qk_norm && q2.sliding_window.is_none());
        let q3 = ModelConfig::from_json_str(&format!(r#"{{"architectures":["Qwen3ForCausalLM"],{base},"head_dim":32}}"#), "q3").unwrap();
        assert!(q3.qk_norm && !q3.attention_bias && q3.head_dim == 32);
        let m = ModelConfig::from_json_str(&format!(r#"{{"architectures":["MistralForCausalLM"],{base},"sliding_window":4096}}"#), "m")
            .unwrap();
        assert_eq!(m.sliding_window, Some(4096));
    }

    #[test]
    fn gemma3_interleaves_local_and_global_layers() {
        let json = r#"{"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text","vocab_size":262144,
          "hidden_size":640,"intermediate_size":2048,"num_hidden_layers":18,"num_attention_heads":4,
          "num_key_value_heads":1,"head_dim":256,"query_pre_attn_scalar":256,"rope_theta":1000000.0,
          "rope_local_base_freq":10000.0,"sliding_window":512,"final_logit_softcapping":null}"#;
        let c = ModelConfig::from_json_str(json, "gemma").unwrap();
        let global: Vec<usize> = (0..18).filter(|&l| c.layer_window(l).is_none()).collect();
        assert_eq!(global, [5, 11, 17]);
        assert_eq!(c.layer_window(0), Some(512));
        assert_eq!((c.rope_local_theta, c.query_pre_attn_scalar, c.final_logit_softcapping), (Some(10000.0), Some(256.0), None));
        let listed =
            json.replace(r#""sliding_window":512"#, r#""sliding_window":512,"layer_types":["full_attention","sliding_attention"]"#);
        assert!(matches!(ModelConfig::from_json_str(&listed, "g"), Err(Error::ModelConfigParse { .. })));
    }

    #[test]
    fn errors_are_typed() {
        assert!(matches!(
            ModelConfig::from_json_str(r#"{"architectures":["GPT2LMHeadModel"],"vocab_size":1,"hidden_size":2,"intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":1}"#, "x"),
            Err(Error::UnsupportedArchitecture(a)) if a == "GPT2LMHeadModel"
        ));
        assert!(matches!(ModelConfig::from_json_str("{not json", "x"), Err(Error::ModelConfigParse { .. })));
        assert!(matches!(
            ModelConfig::from_json_str(
                r#"{"architectures":["LlamaForCausalLM"],"vocab_size":1,"hidden_size":64,"intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":3}"#,
                "x"
            ),
            Err(Error::ModelConfigParse { .. })
        ));
    }
}
