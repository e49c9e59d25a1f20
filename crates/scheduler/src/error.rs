//! The scheduler's error type: requests it refuses to accept.

use vellum_base::RequestId;

/// Why `add_request` refused a request. Nothing was queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The sampling parameters are invalid.
    #[error(transparent)]
    InvalidParams(#[from] vellum_base::Error),
    /// The prompt is empty.
    #[error("{0}: the prompt is empty")]
    EmptyPrompt(RequestId),
    /// Prompt plus requested output exceed the model's context.
    #[error(
        "{request_id}: this model's maximum context length is {max_model_len} tokens, but \
         {requested} tokens were requested ({num_prompt_tokens} in the prompt, {max_tokens} for the completion)"
    )]
    TooLong {
        /// The request.
        request_id: RequestId,
        /// Prompt plus `max_tokens`.
        requested: usize,
        /// Tokens in the prompt.
        num_prompt_tokens: usize,
        /// Tokens asked for.
        max_tokens: usize,
        /// The limit.
        max_model_len: usize,
    },
    /// One sequence of the request would not fit in the whole KV cache.
    #[error("{request_id}: {needed_blocks} KV blocks are needed but the cache holds only {num_blocks}")]
    ExceedsKvCapacity {
        /// The request.
        request_id: RequestId,
        /// Blocks one sequence needs at its longest.
        needed_blocks: usize,
        /// Blocks in the pool.
        num_blocks: usize,
    },
    /// No live request has this id.
    #[error("{0} is not a live request")]
    UnknownRequest(RequestId),
    /// A request with this id is already known.
    #[error("{0} already exists")]
    DuplicateRequest(RequestId),
}
