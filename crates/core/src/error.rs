//! The crate's error type.

/// Everything that can go wrong in `vellum-base`: invalid input from a caller
/// or a configuration file. Each variant names what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A sampling parameter is out of range or inconsistent with another.
    #[error("invalid sampling parameter `{param}`: {message}")]
    InvalidSamplingParam {
        /// The parameter's name as the OpenAI / vLLM API spells it.
        param: &'static str,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid configuration `{field}`: {message}")]
    InvalidConfig {
        /// The configuration field.
        field: &'static str,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// A model's `config.json` could not be parsed.
    #[error("cannot parse model config ({source_name}): {message}")]
    ModelConfigParse {
        /// Where the config came from (a path, or `"<string>"`).
        source_name: String,
        /// The parser's message.
        message: String,
    },
    /// A model architecture that no model definition implements.
    #[error("unsupported architecture {0:?}; supported: {list}", list = crate::supported_architectures())]
    UnsupportedArchitecture(String),
    /// A request-state transition that the unified model forbids (e.g.
    /// scheduling more tokens than remain).
    #[error("invalid request-state transition: {0}")]
    InvalidTransition(String),
    /// A backend failed (a kernel error, a lost device, ...).
    #[error("backend error: {0}")]
    Backend(String),
    /// A device allocation failed.
    #[error("out of device memory: {what} needs {bytes} bytes")]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Bytes asked for.
        bytes: u64,
    },
    /// A backend's kernels do not support a configuration the model or a
    /// flag asks for (see [`crate::Capabilities`]).
    #[error("the {} backend does not support {} {} (supported: {})", .0.backend, .0.what, .0.value, .0.supported)]
    Unsupported(Box<Unsupported>),
    /// This build lacks what a request asks for (a backend left out at
    /// compile time, a device that is not present).
    #[error("{what} is not available: {hint}")]
    Unavailable {
        /// What was asked for.
        what: String,
        /// How to get it.
        hint: String,
    },
}

/// What [`Error::Unsupported`] names (boxed: errors stay small to move).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupported {
    /// The backend, as `--device` names it.
    pub backend: String,
    /// What was asked for (`head size`, `block size (--block-size)`, ...).
    pub what: String,
    /// The value asked for.
    pub value: String,
    /// The values it supports.
    pub supported: String,
}
