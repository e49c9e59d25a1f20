//! The element and block formats weights arrive in (ggml's types: f32,
//! f16, bf16, the legacy 32-value quants and the K-quants), and their
//! conversion to f32.
//!
//! These are the formats of the bytes a [`crate::WeightView`] carries; the
//! GGUF reader that finds them in a file lives in the loaders
//! (`vellum-models`), so a backend reads blocks without depending on any
//! file parser.

mod dequantize;
mod ggml_type;

pub use dequantize::{dequantize, dequantize_into, scale_min_k4};
pub use ggml_type::{GgmlType, DEQUANTIZABLE};
