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
    Weight(vellum_ops::Error),
    /// The backend failed while taking a weight (out of device memory, a
    /// lost device).
    #[error(transparent)]
    Backend(#[from] vellum_base::Error),
}

/// This crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// A weight the backend refused is [`Error::Weight`]; a backend failing
/// while it takes one (out of memory, a lost device) stays
/// [`Error::Backend`].
impl From<vellum_ops::Error> for Error {
    fn from(e: vellum_ops::Error) -> Self {
        match e {
            vellum_ops::Error::Backend(e) => Error::Backend(e),
            other => Error::Weight(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_failure_while_taking_a_weight_stays_a_backend_error() {
        let oom = vellum_ops::Error::Backend(vellum_base::Error::Backend("out of device memory".into()));
        assert!(matches!(Error::from(oom), Error::Backend(_)));
        let refused = vellum_ops::Error::UnsupportedTensorType { tensor: "w".into(), dtype: "I64".into(), supported: "F32" };
        assert!(matches!(Error::from(refused), Error::Weight(vellum_ops::Error::UnsupportedTensorType { .. })));
    }
}
