//! The model registry: every architecture Vellum runs, in one table.
//!
//! Config parsing, the GGUF loader, error messages and the model loader in
//! `vellum-models` all read [`ARCHITECTURES`]; adding an architecture means
//! adding a row here and, for a new [`ModelFamily`], its model definition.

/// A model definition in `vellum-models`, shared by several architectures.
/// Exhaustive on purpose: a new family must be matched by the loader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// Pre-norm decoder with RMSNorm, rotate-half RoPE, SwiGLU and
    /// grouped-query attention (`vellum_models::LlamaModel`).
    Llama,
    /// Gemma 3: embeddings scaled by √hidden, norms before and after both
    /// sublayers, q/k norms, GeGLU (tanh GELU), interleaved local
    /// (sliding-window) and global layers with their own RoPE bases
    /// (`vellum_models::Gemma3Model`).
    Gemma3,
    /// BERT: a post-norm encoder (LayerNorm with bias after each sublayer,
    /// learned absolute position and token-type embeddings, bidirectional
    /// attention, exact GELU), no LM head: an embedding model
    /// (`vellum_models::BertModel`).
    Bert,
}

impl ModelFamily {
    /// An encoder: every token attends to the whole prompt, so a prompt is
    /// computed in one step and never from a cached prefix.
    pub fn is_encoder(self) -> bool {
        self == ModelFamily::Bert
    }
}

/// One supported architecture and what sets it apart inside its family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Architecture {
    /// `architectures[0]` of a Hugging Face `config.json`.
    pub name: &'static str,
    /// `model_type` of `config.json`.
    pub model_type: &'static str,
    /// GGUF's `general.architecture` (llama.cpp's name; usually the
    /// `model_type`).
    pub gguf_architecture: &'static str,
    /// The model definition that runs it.
    pub family: ModelFamily,
    /// The q/k/v projections always carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on queries and keys (Qwen3).
    pub qk_norm: bool,
    /// `sliding_window` applies only with `use_sliding_window: true` (Qwen2).
    pub sliding_window_opt_in: bool,
    /// llama.cpp's converter permuted the Q/K rows of this architecture's
    /// GGUF files for interleaved RoPE (the loader undoes it).
    pub gguf_permuted_qk: bool,
    /// Every `n`-th layer is global, the others use the sliding window,
    /// unless `config.json` lists `layer_types` (Gemma 3: 6).
    pub sliding_window_pattern: Option<usize>,
}

const fn llama_like(name: &'static str, model_type: &'static str) -> Architecture {
    Architecture {
        name,
        model_type,
        gguf_architecture: model_type,
        family: ModelFamily::Llama,
        qkv_bias: false,
        qk_norm: false,
        sliding_window_opt_in: false,
        gguf_permuted_qk: false,
        sliding_window_pattern: None,
    }
}

/// Every architecture with a model definition.
pub const ARCHITECTURES: &[Architecture] = &[
    Architecture { gguf_permuted_qk: true, ..llama_like("LlamaForCausalLM", "llama") },
    Architecture { gguf_permuted_qk: true, ..llama_like("MistralForCausalLM", "mistral") },
    Architecture { qkv_bias: true, sliding_window_opt_in: true, ..llama_like("Qwen2ForCausalLM", "qwen2") },
    Architecture { qk_norm: true, ..llama_like("Qwen3ForCausalLM", "qwen3") },
    Architecture {
        gguf_architecture: "gemma3",
        family: ModelFamily::Gemma3,
        qk_norm: true,
        sliding_window_pattern: Some(6),
        ..llama_like("Gemma3ForCausalLM", "gemma3_text")
    },
    Architecture { family: ModelFamily::Bert, ..llama_like("BertModel", "bert") },
];

/// Base models without their LM head, as sentence-transformers embedding
/// checkpoints (e5-mistral, gte-Qwen) name themselves, and the causal LM
/// whose body each is.
const BASE_MODELS: &[(&str, &str)] = &[
    ("LlamaModel", "LlamaForCausalLM"),
    ("MistralModel", "MistralForCausalLM"),
    ("Qwen2Model", "Qwen2ForCausalLM"),
    ("Qwen3Model", "Qwen3ForCausalLM"),
];

/// The architecture named `name` (`config.json`'s `architectures[0]`); a
/// base model of [`BASE_MODELS`] is its causal LM's body.
pub fn find_architecture(name: &str) -> Option<&'static Architecture> {
    let name = BASE_MODELS.iter().find(|(base, _)| *base == name).map_or(name, |(_, causal)| causal);
    ARCHITECTURES.iter().find(|a| a.name == name)
}

/// Whether `name` is a base model's architecture (no LM head: an
/// embedding checkpoint), as [`find_architecture`] reads it; an encoder has
/// none either.
pub fn is_base_model_architecture(name: &str) -> bool {
    match find_architecture(name) {
        Some(a) => a.family.is_encoder() || !ARCHITECTURES.iter().any(|a| a.name == name),
        None => false,
    }
}

/// The architecture of `model_type` (`config.json`).
pub fn find_model_type(model_type: &str) -> Option<&'static Architecture> {
    ARCHITECTURES.iter().find(|a| a.model_type == model_type)
}

/// The architecture of a GGUF file's `general.architecture`.
pub fn find_gguf_architecture(name: &str) -> Option<&'static Architecture> {
    ARCHITECTURES.iter().find(|a| a.gguf_architecture == name)
}

/// The supported architectures, for error messages.
pub fn supported_architectures() -> String {
    ARCHITECTURES.iter().map(|a| format!("{} ({})", a.name, a.model_type)).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_model_types_are_unique() {
        for (i, a) in ARCHITECTURES.iter().enumerate() {
            for b in &ARCHITECTURES[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.model_type, b.model_type);
                assert_ne!(a.gguf_architecture, b.gguf_architecture);
            }
            assert_eq!(find_architecture(a.name), Some(a));
            assert_eq!(find_model_type(a.model_type), Some(a));
            assert_eq!(find_gguf_architecture(a.gguf_architecture), Some(a));
        }
        assert!(supported_architectures().contains("Qwen3ForCausalLM (qwen3)"));
        // Base models (embedding checkpoints) are their causal LM's body.
        assert_eq!(find_architecture("MistralModel").map(|a| a.name), Some("MistralForCausalLM"));
        assert_eq!(find_architecture("Qwen3Model").map(|a| a.name), Some("Qwen3ForCausalLM"));
        assert!(is_base_model_architecture("LlamaModel") && !is_base_model_architecture("LlamaForCausalLM"));
        // BERT is an encoder without LM head: an embedding model.
        assert!(find_architecture("BertModel").is_some_and(|a| a.family.is_encoder()) && is_base_model_architecture("BertModel"));
        // Gemma3Model is the multimodal wrapper, not Gemma3ForCausalLM's body.
        assert!(find_architecture("Gemma3Model").is_none());
        for (base, _) in BASE_MODELS {
            assert!(is_base_model_architecture(base), "{base}");
        }
    }
}
