//! Demo authentication: `Authorization: Bearer <tenant>`, the token being the tenant's id.

use std::borrow::Cow;

use axum::{extract::FromRequestParts, http::request::Parts};
use idem_runtime::IdempotencyScope;

use crate::error::ApiError;

/// The longest tenant id, in bytes: the tables index it.
pub const MAX_TENANT_LEN: usize = 255;

/// The caller, taken from the bearer token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .map(axum::http::HeaderValue::as_bytes);
        Self::from_authorization(header).map_err(ApiError::Unauthorized)
    }
}

impl Tenant {
    /// The tenant of an `Authorization` header's (or gRPC metadata's) value, `Bearer <tenant>`;
    /// what is wrong with it otherwise.
    ///
    /// # Errors
    ///
    /// A message for the client when the value is missing, not text, not a bearer token, or
    /// longer than [`MAX_TENANT_LEN`].
    pub fn from_authorization(value: Option<&[u8]>) -> Result<Self, String> {
        let value = value.ok_or_else(|| "send `Authorization: Bearer <tenant>`".to_owned())?;
        let value = std::str::from_utf8(value)
            .ok()
            .filter(|value| value.is_ascii())
            .ok_or_else(|| "the Authorization header is not text".to_owned())?;
        let token = value
            .strip_prefix("Bearer ")
            .map(str::trim)
            .filter(|token| !token.is_empty())
            .ok_or_else(|| "the Authorization header must be `Bearer <tenant>`".to_owned())?;
        if token.len() > MAX_TENANT_LEN {
            return Err(format!(
                "the bearer token has {} characters; a tenant id has at most {MAX_TENANT_LEN}",
                token.len()
            ));
        }
        Ok(Self(token.to_owned()))
    }
}

impl IdempotencyScope for Tenant {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}
