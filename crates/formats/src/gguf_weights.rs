//! [`WeightSource`] over a GGUF file: GGUF names mapped to Hugging Face
//! names, and Llama's Q/K rows restored to Hugging Face order.
//!
//! llama.cpp's converter permutes the rows of Llama's `q_proj` and `k_proj`
//! so that its RoPE can rotate adjacent pairs. Within each head of
//! `head_dim` rows it stores Hugging Face row `t * head_dim/2 + j` at
//! position `2 * j + t` (t ∈ {0, 1}):
//!
//! ```text
//! HF rows of one head:   x0 x1 … x31 | y0 y1 … y31     (rotate_half pairs xj with yj)
//! GGUF rows:             x0 y0 x1 y1 … x31 y31         (adjacent pairs rotate)
//! ```
//!
//! [`GgufWeights`] undoes this at load, so one model definition with
//! rotate_half RoPE serves both loaders. Qwen2/Qwen3 files are not permuted.

use crate::gguf::{GgufFile, MetadataValue};
use crate::{Error, Result, WeightSource, WeightView};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use vellum_base::{find_gguf_architecture, Architecture, ModelConfig};

/// A GGUF checkpoint seen through Hugging Face names and layouts.
#[derive(Debug)]
pub struct GgufWeights {
    file: GgufFile,
    /// Hugging Face name → GGUF name, for every tensor with a known name.
    hf_to_gguf: BTreeMap<String, String>,
    /// `general.architecture`.
    architecture: String,
}

/// Which projection a tensor is, for Q/K un-permutation.
#[derive(Clone, Copy)]
enum Projection {
    Query,
    Key,
}

impl GgufWeights {
    /// Opens and validates a GGUF file.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_file(GgufFile::open(path)?)
    }

    /// Wraps an already open GGUF file.
    pub fn from_file(file: GgufFile) -> Result<Self> {
        let architecture = file.get_str("general.architecture")?.to_string();
        let arch = find_gguf_architecture(&architecture);
        let hf_to_gguf = file.tensors().iter().filter_map(|t| hf_name(&t.name, arch).map(|hf| (hf, t.name.clone()))).collect();
        Ok(Self { file, hf_to_gguf, architecture })
    }

    /// The underlying file (metadata, GGUF-named tensors).
    pub fn gguf(&self) -> &GgufFile {
        &self.file
    }

    /// The GGUF name of a Hugging Face-named tensor.
    pub fn gguf_name(&self, hf_name: &str) -> Option<&str> {
        self.hf_to_gguf.get(hf_name).map(String::as_str)
    }

    /// The tensor's stored blocks, rows in Hugging Face order. Borrowed from
    /// the map except for Llama Q/K projections, whose rows are reordered.
    fn view(&self, name: &str) -> Result<WeightView<'_>> {
        let gguf_name = self.require(name)?;
        let info = self.file.tensor_info(gguf_name).ok_or_else(|| self.missing(name))?;
        let bytes = self.file.tensor_bytes(gguf_name)?;
        let shape = info.shape();
        let data = match self.projection(name) {
            None => Cow::Borrowed(bytes),
            Some(p) => {
                let (block, block_bytes) = info.ggml_type.block_layout();
                let row_len = permuted_row_len(&info.ne);
                if !row_len.is_multiple_of(block) {
                    return Err(Error::ShapeMismatch {
                        tensor: name.to_string(),
                        expected: vec![row_len.next_multiple_of(block)],
                        actual: info.shape(),
                    });
                }
                Cow::Owned(unpermute_rows(bytes, row_len / block * block_bytes, self.n_heads_for(p)?, name)?)
            }
        };
        Ok(WeightView::new(name, shape, info.ggml_type, data)?)
    }

    fn require(&self, name: &str) -> Result<&str> {
        self.gguf_name(name).ok_or_else(|| self.missing(name))
    }

    fn missing(&self, name: &str) -> Error {
        Error::MissingTensor { path: self.file.path().to_path_buf(), tensor: name.to_string() }
    }

    /// Whether `name` is a Q or K projection whose rows GGUF permuted.
    fn projection(&self, name: &str) -> Option<Projection> {
        if !find_gguf_architecture(&self.architecture).is_some_and(|a| a.gguf_permuted_qk) {
            return None;
        }
        if name.ends_with(".self_attn.q_proj.weight") || name.ends_with(".self_attn.q_proj.bias") {
            Some(Projection::Query)
        } else if name.ends_with(".self_attn.k_proj.weight") || name.ends_with(".self_attn.k_proj.bias") {
            Some(Projection::Key)
        } else {
            None
        }
    }

    fn n_heads_for(&self, p: Projection) -> Result<usize> {
        let a = &self.architecture;
        let n_head = self.file.get_usize(&format!("{a}.attention.head_count"))?;
        Ok(match p {
            Projection::Query => n_head,
            Projection::Key => self.optional_usize(&format!("{a}.attention.head_count_kv"))?.unwrap_or(n_head),
        })
    }

    fn optional_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.file.get(key) {
            None => Ok(None),
            Some(_) => self.file.get_usize(key).map(Some),
        }
    }

    fn optional_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.file.get(key) {
            None => Ok(None),
            Some(_) => self.file.get_f64(key).map(Some),
        }
    }
}

impl WeightSource for GgufWeights {
    fn tensor(&self, name: &str) -> Result<WeightView<'_>> {
        self.view(name)
    }

    fn contains(&self, name: &str) -> bool {
        self.hf_to_gguf.contains_key(name)
    }

    fn tensor_names(&self) -> Vec<String> {
        self.hf_to_gguf.keys().cloned().collect()
    }

    fn norms_hold_one_plus_w(&self) -> bool {
        true
    }

    fn model_config(&self) -> Result<ModelConfig> {
        let f = &self.file;
        let a = self.architecture.as_str();
        let path = f.path();
        let hf_arch = match find_gguf_architecture(a) {
            // The GGUF reader maps decoder tensor names; an encoder's
            // (llama.cpp's `bert`) loads from its Hugging Face directory.
            Some(arch) if arch.family.is_encoder() => {
                return Err(Error::UnsupportedArchitecture {
                    path: path.to_path_buf(),
                    architecture: format!("{a} (encoder models load from a Hugging Face directory, not GGUF)"),
                })
            }
            Some(arch) => arch.name,
            None => return Err(Error::UnsupportedArchitecture { path: path.to_path_buf(), architecture: a.to_string() }),
        };
        let key = |k: &str| format!("{a}.{k}");
        let hidden = f.get_usize(&key("embedding_length"))?;
        let n_head = f.get_usize(&key("attention.head_count"))?;
        let vocab_size = match f.get("tokenizer.ggml.tokens") {
            Some(MetadataValue::Array(tokens)) => tokens.len(),
            _ => match self.optional_usize(&key("vocab_size"))? {
                Some(v) => v,
                None => f
                    .tensor_info("token_embd.weight")
                    .and_then(|t| t.ne.get(1).copied())
                    .ok_or_else(|| Error::MissingMetadata { path: path.to_path_buf(), key: "tokenizer.ggml.tokens".into() })?,
            },
        };
        let mut eos = Vec::new();
        for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Some(id) = self.optional_usize(k)? {
                let id = u32::try_from(id).map_err(|_| Error::BadMetadata {
                    path: path.to_path_buf(),
                    key: k.to_string(),
                    what: format!("token id {id} does not fit in u32"),
                })?;
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        let mut json = serde_json::json!({
            "architectures": [hf_arch],
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": f.get_usize(&key("feed_forward_length"))?,
            "num_hidden_layers": f.get_usize(&key("block_count"))?,
            "num_attention_heads": n_head,
            "num_key_value_heads": self.optional_usize(&key("attention.head_count_kv"))?.unwrap_or(n_head),
            "max_position_embeddings": self.optional_usize(&key("context_length"))?,
            "rms_norm_eps": self.optional_f64(&key("attention.layer_norm_rms_epsilon"))?,
            "rope_theta": self.optional_f64(&key("rope.freq_base"))?,
            "tie_word_embeddings": f.tensor_info("output.weight").is_none(),
            "attention_bias": f.tensor_info("blk.0.attn_q.bias").is_some(),
            "bos_token_id": self.optional_usize("tokenizer.ggml.bos_token_id")?,
            "eos_token_id": eos,
        });
        if let Some(head_dim) = self.optional_usize(&key("attention.key_length"))? {
            json["head_dim"] = head_dim.into();
        }
        if let Some(window) = self.optional_usize(&key("attention.sliding_window"))? {
            json["sliding_window"] = window.into();
            json["use_sliding_window"] = true.into();
        }
        // Gemma: llama.cpp's names for what config.json calls
        // rope_local_base_freq and the soft-caps (absent: the defaults).
        json["rope_local_base_freq"] = self.optional_f64(&key("rope.freq_base_swa"))?.into();
        json["attn_logit_softcapping"] = self.optional_f64(&key("attn_logit_softcapping"))?.into();
        json["final_logit_softcapping"] = self.optional_f64(&key("final_logit_softcapping"))?.into();
        // llama.cpp's rule for Gemma 3 files, which do not store
        // query_pre_attn_scalar: hidden / heads for the 27B (62 layers),
        // head_dim otherwise.
        if a == "gemma3" && f.get_usize(&key("block_count"))? == 62 {
            json["query_pre_attn_scalar"] = (hidden / n_head.max(1)).into();
        }
        if let Some(MetadataValue::String(kind)) = f.get(&key("rope.scaling.type")) {
            if kind == "linear" {
                let factor = self.optional_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0);
                json["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": factor});
            }
        }
        // Drop the keys the file did not give, so config.json's defaults apply.
        if let Some(obj) = json.as_object_mut() {
            obj.retain(|_, v| !v.is_null());
        }
        ModelConfig::from_json_str(&json.to_string(), &path.display().to_string())
            .map_err(|source| Error::ModelConfig { path: path.to_path_buf(), source })
    }
}

/// The Hugging Face name of a GGUF tensor, for the names Llama, Qwen2,
/// Qwen3 and Gemma 3 files use. `ffn_norm` is the norm before the MLP:
/// `post_attention_layernorm` in Llama, `pre_feedforward_layernorm` in Gemma
/// (whose `post_attention_norm` follows the attention output).
pub fn hf_name(gguf_name: &str, arch: Option<&Architecture>) -> Option<String> {
    let sandwich = arch.is_some_and(|a| a.family == vellum_base::ModelFamily::Gemma3);
    let global = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = global {
        return Some(name.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" if sandwich => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if sandwich => "post_attention_layernorm",
        "post_ffw_norm" if sandwich => "post_feedforward_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Elements per permuted row: a weight's row length, or 1 for a bias.
fn permuted_row_len(ne: &[usize]) -> usize {
    if ne.len() == 1 {
        1
    } else {
        ne[0]
    }
}

/// Restores Hugging Face row order of a GGUF Q/K projection (see the module
/// doc). `data` holds rows of `row_len` elements; `n_head` heads of
/// `head_dim` rows each.
pub fn unpermute_rows<T: Copy>(data: &[T], row_len: usize, n_head: usize, name: &str) -> Result<Vec<T>> {
    let n_rows = data.len().checked_div(row_len).unwrap_or(0);
    if n_head == 0 || row_len == 0 || !n_rows.is_multiple_of(n_head) || !(n_rows / n_head).is_multiple_of(2) {
        return Err(Error::ShapeMismatch { tensor: name.to_string(), expected: vec![n_head, 2, row_len], actual: vec![n_rows, row_len] });
    }
    let head_dim = n_rows / n_head;
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..n_head {
        for t in 0..2 {
            for j in 0..half {
                let src = h * head_dim + 2 * j + t;
                out.extend_from_slice(&data[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_names() {
        let llama = find_gguf_architecture("llama");
        assert_eq!(hf_name("token_embd.weight", llama).as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.12.attn_q.bias", llama).as_deref(), Some("model.layers.12.self_attn.q_proj.bias"));
        assert_eq!(hf_name("blk.0.ffn_down.weight", llama).as_deref(), Some("model.layers.0.mlp.down_proj.weight"));
        assert_eq!(hf_name("blk.3.attn_k_norm.weight", llama).as_deref(), Some("model.layers.3.self_attn.k_norm.weight"));
        assert_eq!(hf_name("blk.1.ffn_norm.weight", llama).as_deref(), Some("model.layers.1.post_attention_layernorm.weight"));
        assert_eq!(hf_name("blk.1.post_ffw_norm.weight", llama), None);
        assert_eq!(hf_name("rope_freqs.weight", llama), None);
        assert_eq!(hf_name("blk.x.attn_q.weight", llama), None);
        let gemma = find_gguf_architecture("gemma3");
        assert_eq!(hf_name("blk.1.ffn_norm.weight", gemma).as_deref(), Some("model.layers.1.pre_feedforward_layernorm.weight"));
        assert_eq!(hf_name("blk.1.post_attention_norm.weight", gemma).as_deref(), Some("model.layers.1.post_attention_layernorm.weight"));
        assert_eq!(hf_name("blk.1.post_ffw_norm.weight", gemma).as_deref(), Some("model.layers.1.post_feedforward_layernorm.weight"));
    }

    /// The inverse of llama.cpp's `permute`:
    /// `w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2).reshape(out, in)`.
    fn permute(rows: &[usize], n_head: usize) -> Vec<usize> {
        let hd = rows.len() / n_head;
        let mut out = Vec::new();
        for h in 0..n_head {
            for j in 0..hd / 2 {
                for t in 0..2 {
                    out.push(rows[h * hd + t * hd / 2 + j]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let rows: Vec<usize> = (0..24).collect();
        for n_head in [1, 2, 3, 6] {
            let permuted = permute(&rows, n_head);
            assert_eq!(unpermute_rows(&permuted, 1, n_head, "q").unwrap(), rows);
        }
        assert!(unpermute_rows(&rows, 1, 5, "q").is_err());
        assert!(unpermute_rows(&rows, 1, 0, "q").is_err());
    }
}
