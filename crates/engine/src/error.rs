//! The engine's error type, below every module that returns it.

use vellum_base::RequestId;

/// Why the engine refused or failed something.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request was refused.
    #[error(transparent)]
    Request(#[from] vellum_scheduler::Error),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] vellum_base::Error),
    /// Loading the model failed: its files, its tokenizer, or a backend
    /// taking its weights.
    #[error(transparent)]
    Model(#[from] vellum_models::Error),
    /// A forward pass failed (a backend fault such as an allocation
    /// failure): the requests it carried were aborted, their blocks freed,
    /// and the step retired, so the engine goes on with the others.
    #[error("the forward pass failed and its {} request(s) were aborted: {source}", requests.len())]
    StepFailed {
        /// The requests of the failed step.
        requests: Vec<RequestId>,
        /// What the backend reported.
        source: vellum_base::Error,
    },
    /// A request of the other task: a pooling (embedding) request to an
    /// engine that generates, or a generation request to one that pools.
    #[error("{0}")]
    Task(String),
    /// A feature this engine does not run yet.
    #[error("not supported yet: {0}")]
    Unsupported(&'static str),
    /// A structured-output constraint (JSON schema, regex, choice, grammar)
    /// that does not compile, or that this engine cannot apply.
    #[error("{field}: {message}")]
    StructuredOutput {
        /// The request field, as vLLM names it.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// A model file that cannot be found or read is a [`Error::Model`].
impl From<vellum_formats::Error> for Error {
    fn from(e: vellum_formats::Error) -> Self {
        Error::Model(e.into())
    }
}

/// A tokenizer or chat template that fails is a [`Error::Model`].
impl From<vellum_tokenizer::Error> for Error {
    fn from(e: vellum_tokenizer::Error) -> Self {
        Error::Model(e.into())
    }
}
