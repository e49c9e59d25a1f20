//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while finding, fetching or reading a
/// model's files. Each variant names the file, tensor or key involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A GGUF file is truncated or inconsistent.
    #[error("malformed GGUF file {}: {what}", path.display())]
    MalformedGguf {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        what: String,
    },
    /// A GGUF metadata key the loader needs is absent.
    #[error("GGUF file {} has no metadata key `{key}`", path.display())]
    MissingMetadata {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A GGUF metadata value has the wrong type or an unusable value.
    #[error("GGUF file {}: metadata key `{key}`: {what}", path.display())]
    BadMetadata {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What was expected and what was found.
        what: String,
    },
    /// A tensor is stored in a type this crate cannot convert to f32.
    #[error("tensor `{tensor}`{} has type {dtype}, which is not supported (supported: {supported})", in_file(path))]
    UnsupportedTensorType {
        /// The file (empty where a backend refused the tensor).
        path: PathBuf,
        /// The tensor's name as stored in the file.
        tensor: String,
        /// The stored type, e.g. `Q6_K` or `I64`.
        dtype: String,
        /// The types that are supported.
        supported: &'static str,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor `{tensor}` not found in {}", path.display())]
    MissingTensor {
        /// The file (or directory) searched.
        path: PathBuf,
        /// The tensor's Hugging Face name.
        tensor: String,
    },
    /// A tensor's shape differs from the one its reader expected.
    #[error("tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The tensor's Hugging Face name.
        tensor: String,
        /// The shape the caller expected.
        expected: Vec<usize>,
        /// The shape found.
        actual: Vec<usize>,
    },
    /// A safetensors file or its index is malformed.
    #[error("malformed safetensors checkpoint {}: {what}", path.display())]
    MalformedSafetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The model's architecture has no model definition.
    #[error("{}: unsupported architecture {architecture:?} (supported: {list})", path.display(), list = vellum_base::supported_architectures())]
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// The architecture as the file names it.
        architecture: String,
    },
    /// The model's `config.json` (or the config derived from GGUF metadata)
    /// is invalid.
    #[error("model config from {}: {source}", path.display())]
    ModelConfig {
        /// The file the config came from.
        path: PathBuf,
        /// The parser's error.
        source: vellum_base::Error,
    },
    /// Fetching the default model failed; the message says how to do it by hand.
    #[error("cannot fetch the default model: {reason}\nTo fetch it by hand, run:\n{manual}")]
    Fetch {
        /// What went wrong.
        reason: String,
        /// Shell commands that do the same by hand.
        manual: String,
    },
    /// A downloaded file's SHA-256 differs from the expected one.
    #[error("{}: sha256 is {actual}, expected {expected}", path.display())]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The expected digest, hex.
        expected: String,
        /// The digest found, hex.
        actual: String,
    },
    /// A weight view refused its bytes for a reason the variants above do
    /// not name (`vellum-ops`' checks).
    #[error(transparent)]
    Weight(vellum_ops::Error),
    /// A shape asked of [`crate::write_random_checkpoint`] that no model has.
    #[error("checkpoint shape: {0}")]
    CheckpointShape(String),
    /// A model specification matched nothing.
    #[error("cannot find model {spec:?}; tried:\n  {}", tried.join("\n  "))]
    ModelNotFound {
        /// What the user asked for.
        spec: String,
        /// Each place looked at, with why it did not match.
        tried: Vec<String>,
    },
}

/// This crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// A weight view's refusal keeps its kind: the loaders' variants carry the
/// same names (a view has no file path to give).
impl From<vellum_ops::Error> for Error {
    fn from(e: vellum_ops::Error) -> Self {
        match e {
            vellum_ops::Error::UnsupportedTensorType { tensor, dtype, supported } => {
                Error::UnsupportedTensorType { path: PathBuf::new(), tensor, dtype, supported }
            }
            vellum_ops::Error::ShapeMismatch { tensor, expected, actual } => Error::ShapeMismatch { tensor, expected, actual },
            other => Error::Weight(other),
        }
    }
}

/// ` in FILE`, or nothing for an empty path.
fn in_file(path: &std::path::Path) -> String {
    if path.as_os_str().is_empty() {
        String::new()
    } else {
        format!(" in {}", path.display())
    }
}
