//! The seam's error type: what can go wrong while a backend prepares a
//! weight or parameter.

/// A weight a backend cannot take, or a backend failing while it prepares
/// one. Each variant names the tensor involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor is stored in a type that cannot be converted or used.
    #[error("tensor `{tensor}` has type {dtype}, which is not supported (supported: {supported})")]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// The stored type, e.g. `Q6_K` or `I64`.
        dtype: String,
        /// The types that are supported.
        supported: &'static str,
    },
    /// A tensor's shape (or its byte length) differs from what its reader
    /// expected.
    #[error("tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The tensor's name.
        tensor: String,
        /// The shape the caller expected.
        expected: Vec<usize>,
        /// The shape found.
        actual: Vec<usize>,
    },
    /// The backend failed (device lost, allocation refused, a weight layout
    /// its kernels lack).
    #[error(transparent)]
    Backend(#[from] vellum_base::Error),
}

/// `Result` with the seam's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
