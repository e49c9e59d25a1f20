//! # vellum-scheduler — continuous batching in the unified token model
//!
//! Every request is `num_computed_tokens` chasing `num_total_tokens` (thesis
//! §4.4); each step the [`Scheduler`] hands out Δ tokens per request under a
//! token budget, and prefill, decode, chunked prefill, prefix hits and
//! preemption all fall out of that one rule. Policies: FCFS (Algorithm 1),
//! the thesis's two-level FIFO + shortest-remaining-tokens-first (Algorithm 2,
//! §4.5.3) and priority.
//!
//! **The one design decision to know:** the scheduler is pure logic over a
//! [`vellum_base::BlockAllocator`] — no tensors, no clocks, no threads. The
//! same code runs under the engine and under the `vellum-simulator` crate,
//! which replays hour-long traces in seconds against the paged manager or
//! the Orca baselines. What a step changed comes back from
//! [`Scheduler::update_from_output`] as a [`StepUpdate`], from which a caller
//! keeps its own view of the sequences.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod batcher;
mod error;
mod scheduler_output;
mod sequence_group;

pub use batcher::{NewRequest, Scheduler};
pub use error::Error;
pub use scheduler_output::{BlockTableUpdate, RequestSamples, ScheduledSeq, SchedulerOutput, SeqFork, StepSamples, StepUpdate};
pub use sequence_group::{FinishReason, Request, RequestStatus, Sequence};
