//! A model's files opened together: weights, config, tokenizer and chat
//! template, from either format.

use crate::{Result, WeightSource};
use vellum_base::ModelConfig;
use vellum_formats::{GgufWeights, ModelSource, SafetensorsWeights};
use vellum_tokenizer::{ChatTemplate, Tokenizer};

/// Everything needed to serve a model, opened from a [`ModelSource`].
pub struct LoadedModel {
    /// The model's shape.
    pub config: ModelConfig,
    /// The weights.
    pub weights: Box<dyn WeightSource>,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, if the model has one.
    pub chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("config", &self.config)
            .field("tokenizer", &self.tokenizer)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl LoadedModel {
    /// Opens the weights, config, tokenizer and chat template `source`
    /// points at.
    pub fn open(source: &ModelSource) -> Result<LoadedModel> {
        match source {
            ModelSource::Gguf(path) => {
                let weights = GgufWeights::open(path)?;
                let tokenizer = Tokenizer::from_gguf(weights.gguf())?;
                let chat_template = ChatTemplate::from_gguf(weights.gguf())?;
                let config = weights.model_config()?;
                Ok(LoadedModel { config, weights: Box::new(weights), tokenizer, chat_template })
            }
            ModelSource::HfDir(dir) => {
                let weights = SafetensorsWeights::open(dir)?;
                let tokenizer = Tokenizer::from_hf_dir(dir)?;
                let chat_template = ChatTemplate::from_hf_dir(dir)?;
                let config = weights.model_config()?;
                Ok(LoadedModel { config, weights: Box::new(weights), tokenizer, chat_template })
            }
        }
    }
}
