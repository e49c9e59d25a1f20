//! # vellum-base — the backend-neutral vocabulary
//!
//! Every other crate speaks these types. Nothing here knows about tensors,
//! threads or devices:
//!
//! * [`RequestState`] — a request in the unified representation of the vLLM
//!   thesis (§4.4, Table 4.1): `num_computed_tokens` chasing
//!   `num_total_tokens`. Prefill, decode, chunked prefill, prefix-cache hits,
//!   preemption and speculative acceptance are all updates of those two
//!   counters.
//! * [`SamplingParams`] — what a caller asks for, validated into a typed
//!   [`Error`] before anything is scheduled.
//! * [`ModelConfig`], [`CacheConfig`], [`SchedulerConfig`] — configuration.
//! * The three traits of the design card: [`BlockAllocator`] (implemented by
//!   the paged KV-cache manager and the Orca baselines in `vellum-kvcache`),
//!   [`AttentionBackend`] and [`ModelExecutor`] (implemented by the backends).
//!
//! **The one design decision to know:** KV memory belongs to the backend and
//! is addressed only by [`BlockId`]. Everything that crosses from the engine
//! to a backend per step ([`ForwardBatch`], [`BlockOps`]) is plain host data
//! that a GPU backend uploads as is; no type here assumes that tensors live in
//! host memory.

#![deny(missing_docs)]

mod architecture;
mod attention_backend;
mod block_allocator;
mod cache_config;
mod capabilities;
mod compilation_config;
mod error;
mod fast_math;
mod forward_batch;
pub mod fp8;
mod id_map;
mod id_slab;
mod ids;
mod kv_cache_groups;
mod model_config;
mod model_executor;
mod pooling;
mod request;
mod sampling_params;
mod scheduler_config;
mod seeded_rng;
mod speculative_config;
mod weight_copies;

pub use architecture::{
    find_architecture, find_gguf_architecture, find_model_type, is_base_model_architecture, supported_architectures, Architecture,
    ModelFamily, ARCHITECTURES,
};
pub use attention_backend::{AttentionBackend, AttentionMetadata, AttentionShape, DeviceMemory, KvCacheSpec, KvMemory};
pub use block_allocator::{AllocatedSlots, BlockAllocator, ComputedBlocks, KvCacheStats, LengthHint, SeqTokens};
pub use cache_config::{AutoKvLimit, CacheConfig, KvAbsmax, KvCacheDtype, KvCacheSize, KvScale, AUTO_KV_CACHE_CAP_BYTES};
pub use capabilities::{AttentionRequirements, Capabilities, Sizes};
pub use compilation_config::{default_capture_sizes, CompilationConfig, CudaGraphMode, DEFAULT_MAX_CAPTURE_SIZE};
pub use error::{Error, Unsupported};
pub use fast_math::exp_f32;
pub use forward_batch::{BlockCopy, BlockOps, BlockSwap, ForwardBatch, PenaltyEntry, RowSampling, StepBounds};
pub use id_map::{IdHasher, IdMap, IdSet};
pub use id_slab::{prefetch, IdSlab};
pub use ids::{BlockId, HostBlockId, RequestId, SeqId, TokenId};
pub use kv_cache_groups::{KvCacheGroup, KvCacheGroups, KvLayerSlot};
pub use model_config::{LayerType, ModelConfig, RopeScaling};
pub use model_executor::{DeviceSample, GraphCapture, ModelExecutor, StepOutput};
pub use pooling::{Pooler, PoolingParams, PoolingType};
pub use request::RequestState;
pub use sampling_params::{BeamSearchParams, SamplingParams, StructuredOutput};
pub use scheduler_config::{prefill_budget_for, PreemptionMode, SchedulerConfig, SchedulingPolicy, MIN_AUTO_PREFILL_TOKENS};
pub use seeded_rng::SeededRng;
pub use speculative_config::{SpeculativeConfig, SpeculativeMethod, MAX_SPECULATIVE_TOKENS};
pub use weight_copies::WeightCopies;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
