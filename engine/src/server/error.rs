//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::EngineError;
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

    /// 400 for a request the engine refused (template, tokenizer, prompt too long…).
    pub fn invalid(e: EngineError) -> Self {
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

    /// 500 for a failure inside the engine.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
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

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(e) => ApiError::invalid(e),
            SubmitError::QueueFull(_) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                e.to_string(),
            )
            .with_code("queue_full"),
            SubmitError::OverBudget { .. } => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("{e}; ask for fewer max_tokens"),
            )
            .with_code("kv_budget_exceeded"),
            other => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                other.to_string(),
            )
            .with_code("shutting_down"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        // A full queue drains in about a request's time; clients back off by this much.
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        resp
    }
}
