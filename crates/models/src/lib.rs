//! # vellum-models — the model graphs and the runner that executes them
//!
//! The transformer graphs ([`LlamaModel`] for Llama, Mistral, Qwen2/Qwen3
//! and SmolLM; [`Gemma3Model`]; the [`BertModel`] encoder, for embeddings)
//! are written once against the backend seam
//! ([`ops::Ops`], from `vellum-ops`), read their weights through
//! `vellum-formats`' [`WeightSource`], and are picked by architecture in
//! [`load_model`]. [`ModelRunner`] is the one `ModelExecutor`: it owns a
//! backend's ops, the model and its paged KV cache, and runs one scheduled
//! batch per step; split over a tensor-parallel group
//! ([`ModelRunner::load_tensor_parallel`]), it holds one rank per backend
//! instance, each with its [`TensorParallel`] shard of the model and its own
//! KV cache, and runs each step on every rank at once. [`LoadedModel::open`]
//! opens everything a model's files hold (weights, config, tokenizer, chat
//! template) from a [`ModelSource`].
//!
//! The file readers (`vellum-formats`) and the tokenizer and chat template
//! (`vellum-tokenizer`) are crates of their own, re-exported here so that an
//! application needs one dependency to go from a model spec to a runner.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod bert;
mod error;
mod gemma3;
mod llama;
mod loaded_model;
mod registry;
mod runner;
mod tensor_parallel;

pub use bert::BertModel;
pub use error::{Error, Result};
pub use gemma3::Gemma3Model;
pub use llama::LlamaModel;
pub use loaded_model::LoadedModel;
pub use registry::{load_model, load_model_shard, CausalLm};
pub use runner::{check_supported, ModelRunner, RunnerOptions};
pub use tensor_parallel::TensorParallel;

/// The seam to the backends, re-exported: model code here is written against
/// [`ops::Ops`], and backends implement it from `vellum-ops` alone.
pub use vellum_ops::{ops, rope, Tensor, WeightView};

/// The file readers, re-exported from `vellum-formats`.
pub use vellum_formats::{
    cache_dir, default_model_path, fetch_default_model, gguf, hf_name, known_model, resolve_model, unpermute_rows, write_random_bert,
    BertOptions, BertShape, GgufWeights, KnownModel, ModelSource, SafetensorsWeights, WeightSource, BERT_WORDS, DEFAULT_MODEL,
    DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256, KNOWN_MODELS,
};
/// The tokenizer and chat template, re-exported from `vellum-tokenizer`.
pub use vellum_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
