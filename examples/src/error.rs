//! The example's errors, answered as problem details like the layer's own.

use axum::{
    extract::{FromRequest, Request, rejection::JsonRejection},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use idem_runtime::Problem;
use serde::de::DeserializeOwned;

const TYPE_BASE: &str = "tag:payments.idem.example,2026:";

/// Everything a route can answer besides success.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 401: no or bad bearer token.
    #[error("{0}")]
    Unauthorized(String),
    /// 400: the body is well-formed JSON but its values are invalid.
    #[error("{0}")]
    Invalid(String),
    /// The JSON body could not be read (status as Axum decided: 400, 415 or 422).
    #[error("{1}")]
    BadJson(StatusCode, String),
    /// 402: the processor declined; final, stored and replayed.
    #[error("{0}")]
    Declined(String),
    /// 404: no such record for this tenant.
    #[error("{0}")]
    NotFound(String),
    /// 503: the processor is down; nothing recorded.
    #[error("{0}")]
    Unavailable(String),
    /// 500: the database failed.
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind, title) = match &self {
            Self::Unauthorized(_) => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Missing or invalid credentials",
            ),
            Self::Invalid(_) => (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request",
            ),
            Self::BadJson(status, _) => (
                *status,
                "invalid-json",
                "Request body is not valid JSON for this route",
            ),
            Self::Declined(_) => (
                StatusCode::PAYMENT_REQUIRED,
                "card-declined",
                "The card was declined",
            ),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not-found", "Not found"),
            Self::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "processor-unavailable",
                "The card processor is unavailable",
            ),
            Self::Database(error) => {
                tracing::error!(%error, "database error");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "Internal error",
                )
            }
        };
        let mut response = Problem::new(status, title)
            .with_type(format!("{TYPE_BASE}{kind}"))
            .with_detail(self.to_string())
            .into_response();
        if matches!(self, Self::Unauthorized(_)) {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// `axum::Json`, with rejections answered as problem details.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(bad_json(&rejection)),
        }
    }
}

fn bad_json(rejection: &JsonRejection) -> ApiError {
    ApiError::BadJson(rejection.status(), rejection.body_text())
}
