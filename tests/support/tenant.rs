//! The caller of the test handlers, as the example names its callers (`Authorization: Bearer
//! <tenant>`), but the suite's own: the library's tests do not lean on the example's code.

use std::borrow::Cow;

use axum::{
    extract::FromRequestParts,
    http::{StatusCode, header::AUTHORIZATION, request::Parts},
};
use idem_runtime::IdempotencyScope;

/// The tenant of a request: the bearer token, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get(AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .filter(|token| !token.is_empty())
            .map(|token| Self(token.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl IdempotencyScope for Tenant {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}
