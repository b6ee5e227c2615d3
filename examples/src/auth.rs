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
            .ok_or_else(|| {
                ApiError::Unauthorized("send `Authorization: Bearer <tenant>`".into())
            })?;
        let value = header
            .to_str()
            .map_err(|_| ApiError::Unauthorized("the Authorization header is not text".into()))?;
        let token = value
            .strip_prefix("Bearer ")
            .map(str::trim)
            .filter(|token| !token.is_empty())
            .ok_or_else(|| {
                ApiError::Unauthorized("the Authorization header must be `Bearer <tenant>`".into())
            })?;
        if token.len() > MAX_TENANT_LEN {
            return Err(ApiError::Unauthorized(format!(
                "the bearer token has {} characters; a tenant id has at most {MAX_TENANT_LEN}",
                token.len()
            )));
        }
        Ok(Self(token.to_owned()))
    }
}

impl IdempotencyScope for Tenant {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}
