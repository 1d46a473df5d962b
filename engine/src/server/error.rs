//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.
//!
//! Engine errors are mapped to an HTTP status here and nowhere else, by whose fault they are
//! ([`ErrorClass`]): 4xx for the client's mistakes, 503 (with `Retry-After`) for overload and
//! shutdown, 500 for failures inside the engine.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::{EngineError, ErrorClass};
use crate::scheduler::SubmitError;

/// An HTTP error with an OpenAI-style body.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            code: None,
            param: None,
            message: message.into(),
        }
    }

    /// 400 for a bad parameter.
    pub fn param(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 500 for a failure inside the engine (or the server): not the request's fault.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            .with_code("internal_error")
    }

    /// 503 for a request that may succeed later: the engine is overloaded or stopping.
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).with_code(code)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e.class() {
            ErrorClass::Invalid => {
                let code = match e {
                    EngineError::PromptTooLong { .. } => Some("context_length_exceeded"),
                    _ => None,
                };
                let param = match e {
                    EngineError::InvalidParameter { name, .. } => Some(name),
                    _ => None,
                };
                Self {
                    code,
                    param,
                    ..Self::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        e.to_string(),
                    )
                }
            }
            ErrorClass::Unavailable => Self::unavailable("unavailable", e.to_string()),
            ErrorClass::Internal => {
                tracing::error!(error = %e, "request failed inside the engine");
                let code = match e {
                    EngineError::EngineStopped => "engine_stopped",
                    _ => "internal_error",
                };
                Self::internal(e.to_string()).with_code(code)
            }
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(e) | SubmitError::Failed(e) => e.into(),
            SubmitError::QueueFull(_) => Self::unavailable("queue_full", e.to_string()),
            SubmitError::OverBudget { .. } => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("{e}; ask for fewer max_tokens"),
            )
            .with_code("kv_budget_exceeded"),
            SubmitError::ShuttingDown => Self::unavailable("shutting_down", e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        // A 503 is a passing condition (a full queue drains in about a request's time, a
        // restarted server is back in seconds): clients back off by this much and retry.
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        resp
    }
}
