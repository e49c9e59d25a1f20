//! Errors as vLLM's OpenAI server returns them:
//! `{"error": {"message", "type", "param", "code"}}` with a matching status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use vellum_engine::Error as EngineError;
use vellum_scheduler::Error as SchedError;

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The parameter at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// 400 BadRequestError.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), param: param.map(str::to_string) }
    }

    /// 404 NotFoundError.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self { status: StatusCode::NOT_FOUND, message: message.into(), param: None }
    }

    /// 401.
    pub fn unauthorized() -> Self {
        Self { status: StatusCode::UNAUTHORIZED, message: "Unauthorized: a valid API key is required".into(), param: None }
    }

    /// 503 (the waiting queue is full, or the server is shutting down).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), param: None }
    }

    /// 500, for engine failures (never for bad input).
    pub fn internal(message: impl Into<String>) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), param: None }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
            StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLargeError",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "UnsupportedMediaTypeError",
            StatusCode::UNPROCESSABLE_ENTITY => "UnprocessableEntityError",
            s if s.is_client_error() => "BadRequestError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body (also sent as an SSE event mid-stream).
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.status.as_u16()}})
    }

    /// Maps an engine refusal to a client error; only genuine engine
    /// failures are 500s.
    pub fn from_engine(e: EngineError) -> Self {
        match e {
            EngineError::Request(SchedError::TooLong { num_prompt_tokens, max_tokens, max_model_len, .. }) => {
                too_long(num_prompt_tokens, max_tokens, max_model_len)
            }
            EngineError::Request(SchedError::InvalidParams(vellum_base::Error::InvalidSamplingParam { param, message })) => {
                Self::bad_request(format!("{param}: {message}"), Some(param))
            }
            EngineError::Request(SchedError::EmptyPrompt(_)) => Self::bad_request("The prompt is empty.", Some("prompt")),
            EngineError::Request(e @ SchedError::ExceedsKvCapacity { .. }) => Self::bad_request(e.to_string(), Some("max_tokens")),
            EngineError::Request(e) => Self::bad_request(e.to_string(), None),
            EngineError::Unsupported(what) if what.contains("shut") => Self::unavailable(format!("The server is {what}.")),
            EngineError::Unsupported(what) => Self::bad_request(format!("Not supported: {what}"), None),
            EngineError::StructuredOutput { field, message } => Self::bad_request(format!("{field}: {message}"), Some(field)),
            EngineError::Task(message) => Self::bad_request(message, Some("model")),
            other => Self::internal(other.to_string()),
        }
    }
}

/// vLLM's 400 for a request that cannot fit the context: how many tokens
/// were asked for, and how many are allowed.
pub fn too_long(num_prompt_tokens: usize, max_tokens: usize, max_model_len: usize) -> ApiError {
    if num_prompt_tokens >= max_model_len {
        ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has \
                 {num_prompt_tokens} input tokens. Please reduce the length of the input messages."
            ),
            Some("input_tokens"),
        )
    } else {
        let requested = num_prompt_tokens + max_tokens;
        ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested \
                 {requested} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the completion). \
                 Please reduce the length of the messages or completion."
            ),
            Some("max_tokens"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
