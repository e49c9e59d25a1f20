//! # vellum-formats — model files: finding them, fetching them, reading their weights
//!
//! Reads what a model's weights and shape are, from either of two formats:
//!
//! - **GGUF** files ([`gguf::GgufFile`], a small bounds-checked reader over a
//!   memory map; F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the K-quants
//!   Q2_K–Q6_K dequantize to f32, and the raw blocks stay reachable for
//!   quantized kernels), and
//! - **Hugging Face directories** (`config.json` + safetensors, sharded or not).
//!
//! Model code reads weights only through the [`WeightSource`] trait
//! (`tensor(name)`, `contains(name)`, `model_config()`), implemented by
//! [`GgufWeights`] and [`SafetensorsWeights`]. [`resolve_model`] turns a
//! user's model spec (nothing, a known name, a `.gguf` path, a directory, or
//! a hub id in the local cache) into a [`ModelSource`]; with nothing given it
//! fetches the default model, SmolLM2-135M-Instruct Q4_1
//! ([`fetch_default_model`]). [`write_random_checkpoint`] writes a
//! random-weight Hugging Face directory of a real shape (Llama 3 8B, …) for
//! benchmarks on machines that cannot download weights.
//!
//! The tokenizer and chat template a file carries are built by
//! `vellum-tokenizer` from [`gguf::GgufFile`]'s metadata or the directory's
//! `tokenizer.json`; the graphs that use the weights are `vellum-models`'.
//!
//! **The one decision to know: Hugging Face names and layouts everywhere.**
//! Tensors are named as in `transformers` (`model.layers.0.self_attn.q_proj.weight`),
//! matrices are row-major `[out, in]`, and Q/K projections are in Hugging
//! Face row order, which pairs with half-split ("rotate_half") RoPE. GGUF
//! files store Llama's Q/K rows permuted for interleaved-pair RoPE;
//! [`GgufWeights`] un-permutes them at load, so one model definition serves
//! both loaders.

#![deny(missing_docs)]

pub mod gguf;

mod default_model;
mod error;
mod gguf_weights;
mod model_source;
mod random_bert;
mod random_checkpoint;
mod safetensors_weights;
mod weight_source;

pub use default_model::{
    cache_dir, default_model_path, fetch_default_model, known_model, KnownModel, DEFAULT_MODEL, DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256,
    KNOWN_MODELS,
};
pub use error::{Error, Result};
pub use gguf_weights::{hf_name, unpermute_rows, GgufWeights};
pub use model_source::{resolve_model, ModelSource};
pub use random_bert::{write_random_bert, BertOptions, BertShape, BERT_WORDS};
pub use random_checkpoint::{write_random_checkpoint, write_random_gguf, CheckpointDtype, CheckpointShape, GgufWeightType, WriteReport};
pub use safetensors_weights::SafetensorsWeights;
pub use vellum_ops::{Tensor, WeightView};
pub use weight_source::WeightSource;
