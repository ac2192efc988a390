//! Errors as OpenAI's API sends them: a status and
//! `{"error": {"message", "type", "param", "code"}}`, so clients written
//! for it raise their usual exceptions.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tessera_serve::driver::SubmitError;

/// An error answer.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What is wrong and what to do.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, ...).
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429 and 503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// 400: the request is wrong; `param` names the field if one is at fault.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// 404 for a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{asked}` does not exist here; this server serves `{served}` (GET /v1/models lists it)"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// 401 without the right API key.
    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "a valid API key is required: send `Authorization: Bearer <key>`".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 500: the engine failed on this request.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None, retry_after: None }
    }

    /// The error's JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        let (status, kind, code) = match e {
            SubmitError::QueueFull { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "queue_full"),
            SubmitError::Stopped { .. } => (StatusCode::SERVICE_UNAVAILABLE, "server_error", "engine_stopped"),
        };
        ApiError { status, message: e.to_string(), kind, param: None, code: Some(code), retry_after: Some(1) }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
