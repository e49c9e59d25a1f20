//! The loader-neutral interface model code reads weights through.

use crate::{Result, Tensor};
use vellum_base::ModelConfig;
pub use vellum_ops::WeightView;

/// A checkpoint's weights, by Hugging Face name and in Hugging Face layout,
/// whichever file format they came from.
///
/// Names: `model.embed_tokens.weight` `[vocab, hidden]`,
/// `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` `[out, in]` (and
/// `.bias` for Qwen2), `model.layers.{i}.self_attn.{q,k}_norm.weight` (Qwen3),
/// `model.layers.{i}.mlp.{gate,up,down}_proj.weight`,
/// `model.layers.{i}.{input,post_attention}_layernorm.weight`,
/// `model.norm.weight`, and `lm_head.weight` unless the embeddings are tied.
/// Q and K projections use the Hugging Face row order, which pairs with
/// half-split ("rotate_half") RoPE.
pub trait WeightSource: Send + Sync {
    /// The named tensor as stored.
    fn tensor(&self, name: &str) -> Result<WeightView<'_>>;

    /// Whether the checkpoint has the named tensor.
    fn contains(&self, name: &str) -> bool;

    /// The model's shape and special tokens.
    fn model_config(&self) -> Result<ModelConfig>;

    /// Names of all tensors, sorted.
    fn tensor_names(&self) -> Vec<String>;

    /// Whether Gemma's norm weights are stored as `1 + w` (llama.cpp's
    /// converter folds the offset in) rather than as `w` (Hugging Face).
    fn norms_hold_one_plus_w(&self) -> bool {
        false
    }

    /// The named tensor, checked to have shape `expected`.
    fn tensor_shaped(&self, name: &str, expected: &[usize]) -> Result<WeightView<'_>> {
        Ok(self.tensor(name)?.expect_shape(expected)?)
    }

    /// The named tensor, converted to f32.
    fn tensor_f32(&self, name: &str) -> Result<Tensor> {
        Ok(self.tensor(name)?.to_tensor()?)
    }

    /// The named tensor converted to f32, checked to have shape `expected`.
    fn tensor_f32_shaped(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        Ok(self.tensor_shaped(name, expected)?.to_tensor()?)
    }
}
