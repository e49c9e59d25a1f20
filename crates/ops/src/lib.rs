//! # vellum-ops — the seam between model code and backends
//!
//! Model code (`vellum-models`: the Llama and Gemma 3 graphs and the
//! `ModelRunner` that drives them) is written once against [`Ops`]; each
//! backend (`vellum-backend-cpu`, `-wgpu`, `-cuda`) implements it. This
//! crate holds only what both sides must agree on, so a backend depends on
//! it and on `vellum-base` and on nothing that parses files or text:
//!
//! | item | what it is |
//! |---|---|
//! | [`Ops`] | the dense operations of a transformer over the backend's own activations, on top of core's `AttentionBackend` (the paged KV cache and attention) |
//! | [`WeightView`] | a weight as its file stores it: shape, [`quant::GgmlType`], bytes |
//! | [`quant`] | the element and block formats (f32/f16/bf16, Q4_0…Q8_0, Q2_K…Q6_K) and their conversion to f32 |
//! | [`rope::RopeTable`] | RoPE frequencies (Llama 3 and linear scaling), turned into each backend's own table |
//! | [`Error`] | a weight a backend cannot take, named |
//!
//! Activations never cross the seam as a fixed type: [`Ops`]'s `Tensor` is
//! the backend's own (host `f32` rows on the CPU, device buffers on a GPU),
//! and only logits and argmax ids come back to the host.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod error;
pub mod ops;
pub mod quant;
pub mod rope;
mod tensor;
mod weight_view;

pub use error::{Error, Result};
pub use ops::{ActivationDtype, GatedActivation, HostIo, Norm, OpResult, Ops, GROUP_FAILED};
pub use tensor::Tensor;
pub use weight_view::WeightView;
