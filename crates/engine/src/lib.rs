//! # vellum-engine — the engine core
//!
//! [`EngineCore`] (thesis §4.1) steps the scheduler, the KV-cache manager,
//! an executor and the sampler in lockstep: each step asks the scheduler for
//! a batch, builds the backend's [`vellum_core::ForwardBatch`] (token ids,
//! positions, slot mapping, block tables kept in sync by incremental
//! updates), runs it, samples, and feeds the tokens back. [`Llm`] is the
//! offline API on top (thesis Listing 4.1).
//!
//! **The one decision to know:** the engine is generic over
//! [`vellum_core::ModelExecutor`]; backend selection (every backend `cfg`)
//! lives in [`Llm`] alone.

mod client;
pub mod detokenizer;
mod engine_core;
mod llm;
pub mod sampler;

pub use engine_core::{EngineCore, EngineCounters, Error, PromptLogprob, RequestOutput, SequenceDelta, SequenceOutput, StepOutputs};
pub use client::{EngineClient, EngineStats, RequestEvent, RequestStream};
pub use llm::{available_memory_bytes, EngineArgs, KvSharing, Llm};
