//! The crate's error type.

/// What can go wrong while loading a model: its files, its tokenizer, or a
/// backend taking its weights.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Finding, fetching or reading the model's files (`vellum-formats`).
    #[error(transparent)]
    File(#[from] vellum_formats::Error),
    /// Building the tokenizer or the chat template (`vellum-tokenizer`).
    #[error(transparent)]
    Tokenizer(#[from] vellum_tokenizer::Error),
    /// The backend refused a weight: its type or shape (`vellum-ops`).
    #[error(transparent)]
    Weight(#[from] vellum_ops::Error),
    /// The backend failed while taking a weight (out of device memory, a
    /// lost device).
    #[error(transparent)]
    Backend(#[from] vellum_base::Error),
}

/// This crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
