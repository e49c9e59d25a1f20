//! # vellum-engine — the engine core
//!
//! Will hold `EngineCore` (thesis §4.1): each step asks the scheduler for a
//! batch, has the executor run it, samples, and feeds the sampled tokens back;
//! an `EngineClient` for token-in/token-out streaming; the sampler, the
//! incremental detokenizer and the offline `LLM` API.
//!
//! Status: empty. It is filled by the "Engine, sampling, offline API and
//! CLI" issue. Backend selection (all backend `cfg`s) will live here.
