//! # vellum-tokenizer — text in, token ids out, and conversations to prompts
//!
//! - [`Tokenizer`]: text ↔ token ids, built from a Hugging Face
//!   `tokenizer.json` ([`Tokenizer::from_hf_dir`]) or from a GGUF file's
//!   vocabulary ([`Tokenizer::from_gguf`]): byte-level BPE for
//!   `tokenizer.ggml.model = gpt2`, SentencePiece with scores and byte
//!   fallback for `llama`.
//! - [`ChatTemplate`]: a model's Jinja chat template rendered as
//!   `transformers` renders it, bounded against hostile templates (a
//!   template comes with a model file, so it is untrusted input).
//!
//! Both are built from the files `vellum-formats` opens, and nothing here
//! knows about weights or backends.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod chat_template;
mod error;
mod spm;
mod tokenizer;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use error::{Error, Result};
pub use tokenizer::Tokenizer;
