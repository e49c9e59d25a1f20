//! # vellum-engine — the engine core
//!
//! [`EngineCore`] (thesis §4.1) steps the scheduler, the KV-cache manager,
//! an executor and the sampler in lockstep: each step asks the scheduler for
//! a batch, builds the backend's [`vellum_base::ForwardBatch`] (token ids,
//! positions, slot mapping, block tables kept in sync by incremental
//! updates), runs it, samples, and feeds the tokens back. [`Llm`] is the
//! offline API on top (thesis Listing 4.1).
//!
//! ```no_run
//! use vellum_base::SamplingParams;
//! use vellum_engine::{EngineArgs, LLM};
//! use vellum_models::ChatMessage;
//!
//! // No model given: the default SmolLM2-135M-Instruct is fetched and used.
//! let mut llm = LLM::new(EngineArgs::default())?;
//! let params = SamplingParams { temperature: 0.8, top_p: 0.95, max_tokens: Some(64), ..SamplingParams::default() };
//! for out in llm.generate(&["The capital of France is", "Paged attention is"], &params)? {
//!     println!("{}", out.outputs[0].text);
//! }
//! let chat = vec![ChatMessage::new("user", "Write a haiku about the sea.")];
//! let reply = llm.chat(&[chat], &params)?;
//! println!("{}", reply[0].outputs[0].text);
//! # Ok::<(), vellum_engine::Error>(())
//! ```
//!
//! For serving, [`Llm::into_client`] moves the engine onto its own thread:
//! an [`EngineClient`] takes requests from any number of callers and streams
//! each one's tokens back on its own [`RequestStream`].
//!
//! **The one decision to know:** the engine is generic over
//! [`vellum_base::ModelExecutor`]; backend selection (every backend `cfg`)
//! lives in [`backend::make_executor`] alone, driven by [`Device`].

#![deny(missing_docs)]

pub mod backend;
mod beam;
mod calibration;
mod client;
pub mod detokenizer;
mod engine_core;
mod error;
mod llm;
pub mod output_processor;
mod outputs;
pub mod pooling;
pub mod sampler;
mod sequences;
pub mod speculative;
pub mod structured;

#[cfg(feature = "cpu")]
pub use backend::CpuExecutor;
#[cfg(feature = "cuda")]
pub use backend::CudaExecutor;
#[cfg(feature = "wgpu")]
pub use backend::WgpuExecutor;
pub use backend::{make_executor, ComputeDtype, CpuOptions, CpuPrecision, CudaGraphs, Device, ExecutorOptions};
pub use calibration::calibration_token_ids;
pub use client::{EngineClient, EngineStats, RequestEvent, RequestStream, STREAM_BUFFER_EVENTS};
pub use engine_core::{EngineCore, EngineCounters, QueueStats, StepTimes, STEP_SECONDS_BUCKETS};
pub use error::Error;
pub use llm::{auto_kv_cache_dtype, EngineArgs, KvSharing, Llm};
pub use output_processor::{OutputPiece, OutputProcessor, Processed, TokenOutput};
pub use outputs::{beam_score, PromptLogprob, RequestOutput, SequenceDelta, SequenceOutput, StepOutputs};
pub use pooling::{EmbeddingSpec, PoolerConfig, Task};
pub use speculative::{DraftRequest, NgramProposer, Proposer, SpecDecodeCounters};

/// The offline API under the name thesis Listing 4.1 gives it.
pub use llm::Llm as LLM;
