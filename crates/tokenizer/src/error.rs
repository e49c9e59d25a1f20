//! The crate's error type.

use std::path::PathBuf;

/// What can go wrong while building a tokenizer or chat template from a
/// model's files, or while using one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading the file, or a GGUF metadata key, failed (`vellum-formats`).
    #[error(transparent)]
    File(#[from] vellum_formats::Error),
    /// The tokenizer could not be built, or failed on an input.
    #[error("tokenizer ({context}): {message}")]
    Tokenizer {
        /// Where: the file it was built from, or the operation.
        context: String,
        /// The tokenizer library's message.
        message: String,
    },
    /// The GGUF file asks for a tokenizer this crate cannot build.
    #[error("{}: unsupported tokenizer {what}", path.display())]
    UnsupportedTokenizer {
        /// The file.
        path: PathBuf,
        /// Which setting, and its value.
        what: String,
    },
    /// The chat template failed to compile or to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

/// This crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// A failed read of `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::File(vellum_formats::Error::io(path, source))
    }

    /// A GGUF metadata value with the wrong type or an unusable value.
    pub(crate) fn bad_metadata(path: impl Into<PathBuf>, key: impl Into<String>, what: impl Into<String>) -> Self {
        Error::File(vellum_formats::Error::BadMetadata { path: path.into(), key: key.into(), what: what.into() })
    }
}
