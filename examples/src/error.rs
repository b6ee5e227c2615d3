//! The example's errors, answered as problem details like the layer's own.

use axum::{
    body::{Body, Bytes},
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
    /// 401: a webhook whose Standard Webhooks signature does not verify (missing, wrong, or
    /// its timestamp more than 5 minutes from this server's clock); nothing was stored.
    #[error("{0}")]
    BadSignature(String),
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
    /// 503 with `Retry-After`: the database did not answer in time, could not be reached, or
    /// its connection broke; nothing was read or written.
    #[error("{detail}")]
    DatabaseUnavailable {
        /// What happened, for the client.
        detail: String,
        /// When to retry.
        retry_after: std::time::Duration,
    },
    /// 500: the database refused a statement; a fault that passes (a broken connection, a
    /// failover: [`idem_runtime::is_transient`]) is answered as
    /// [`ApiError::DatabaseUnavailable`] instead.
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// 500: something that cannot happen with a correct service did.
    #[error("internal error: {0}")]
    Internal(String),
    /// A step of a multi-step handler could not run or be recorded: answered as idem's problem
    /// (409 when another request took the key over, 503 when the store failed, 500 otherwise).
    #[error(transparent)]
    Step(#[from] idem_runtime::StepError),
}

impl From<idem_runtime::Error> for ApiError {
    fn from(error: idem_runtime::Error) -> Self {
        match error {
            idem_runtime::Error::Database(error) => Self::Database(error),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<idem_events::Error> for ApiError {
    fn from(error: idem_events::Error) -> Self {
        match error {
            idem_events::Error::Database(error) => Self::Database(error),
            other => Self::Internal(other.to_string()),
        }
    }
}

/// The `Retry-After` of a route's own 503 for a passing database fault, as idem's default.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.transient_as_unavailable().answer()
    }
}

impl ApiError {
    /// A database fault that passes (a broken connection, a failover:
    /// [`idem_runtime::is_transient`]) as [`ApiError::DatabaseUnavailable`], to be retried;
    /// any other error as it is.
    pub(crate) fn transient_as_unavailable(self) -> Self {
        match self {
            Self::Database(error) if idem_runtime::is_transient(&error) => {
                tracing::warn!(%error, "the database connection failed");
                Self::DatabaseUnavailable {
                    detail: "the connection to the database failed; nothing was written, retry \
                             later"
                        .to_owned(),
                    retry_after: RETRY_AFTER,
                }
            }
            other => other,
        }
    }
}

impl ApiError {
    fn answer(self) -> Response {
        let (status, kind, title) = match &self {
            Self::Step(_) => {
                let Self::Step(error) = self else {
                    unreachable!("matched above")
                };
                return error.into_response();
            }
            Self::Internal(error) => {
                tracing::error!(%error, "internal error");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "Internal error",
                )
            }
            Self::Unauthorized(_) => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Missing or invalid credentials",
            ),
            Self::BadSignature(_) => (
                StatusCode::UNAUTHORIZED,
                "bad-webhook-signature",
                "The webhook's signature does not verify",
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
            Self::DatabaseUnavailable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "database-unavailable",
                "The database is unavailable",
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
        let mut problem = Problem::new(status, title)
            .with_type(format!("{TYPE_BASE}{kind}"))
            .with_detail(self.to_string());
        if let Self::DatabaseUnavailable { retry_after, .. } = &self {
            problem = problem.with_retry_after(retry_after.as_secs_f64().ceil().max(1.0) as u64);
        }
        let mut response = problem.into_response();
        if matches!(self, Self::Unauthorized(_)) {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// `axum::Json`, with rejections answered as problem details, that also refuses (400) a body
/// with U+0000 (NUL) in any string or object key: PostgreSQL's `text` cannot hold NUL (storing
/// or even looking up such a value fails as a database error), and no field of this API has a use
/// for it. Refused here, where every request body is read, it covers every field of every route
/// on both databases alike, before the handler runs, and nothing is stored.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let headers = request.headers().clone();
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| ApiError::BadJson(rejection.status(), rejection.body_text()))?;
        // Axum still decides content type (415), syntax (400) and shape (422), as before.
        let mut buffered = Request::new(Body::from(bytes.clone()));
        *buffered.headers_mut() = headers;
        let value = match axum::Json::<T>::from_request(buffered, state).await {
            Ok(axum::Json(value)) => value,
            Err(rejection) => return Err(bad_json(&rejection)),
        };
        if let Some(at) = nul_in_strings(&bytes) {
            return Err(ApiError::BadJson(
                StatusCode::BAD_REQUEST,
                format!(
                    "{at} contains the character U+0000 (NUL), which no string in this API may contain; nothing was stored"
                ),
            ));
        }
        Ok(Self(value))
    }
}

fn bad_json(rejection: &JsonRejection) -> ApiError {
    ApiError::BadJson(rejection.status(), rejection.body_text())
}

/// Where the valid JSON `body` has a string or object key containing NUL, described for the
/// client (`` the string at `customer` ``), or `None`.
fn nul_in_strings(body: &[u8]) -> Option<String> {
    // JSON can only spell NUL as the escape `\u0000` (raw control characters are invalid), and
    // in valid JSON a backslash only occurs in strings: an escape is one preceded by an even
    // number of other backslashes (`\\u0000` is a backslash and the text `u0000`). The raw
    // scan also sees strings that deserialising dropped (a member repeated, an unknown field).
    let escaped = body.windows(6).enumerate().any(|(at, window)| {
        window == br"\u0000"
            && body[..at].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 0
    });
    if !escaped {
        return None;
    }
    let described = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|value| find_nul(&value, &mut String::new()));
    Some(described.unwrap_or_else(|| "a string of the body".to_owned()))
}

fn find_nul(value: &serde_json::Value, path: &mut String) -> Option<String> {
    match value {
        serde_json::Value::String(text) if text.contains('\0') => Some(if path.is_empty() {
            "the body".to_owned()
        } else {
            format!("the string at `{path}`")
        }),
        serde_json::Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            let found = find_nul(item, path);
            path.truncate(len);
            found
        }),
        serde_json::Value::Object(map) => map.iter().find_map(|(key, item)| {
            if key.contains('\0') {
                return Some(if path.is_empty() {
                    "a key of the body".to_owned()
                } else {
                    format!("a key of the object at `{path}`")
                });
            }
            let len = path.len();
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(&key.escape_debug().to_string());
            let found = find_nul(item, path);
            path.truncate(len);
            found
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::nul_in_strings;

    #[test]
    fn only_an_escaped_nul_is_a_nul() {
        let nul = |body: &str| nul_in_strings(body.as_bytes());
        assert_eq!(nul(r#"{"customer": "cus_1"}"#), None);
        // A backslash, then the text `u0000`.
        assert_eq!(nul(r#"{"customer": "cus_\\u0000"}"#), None);
        assert_eq!(
            nul(r#"{"customer": "cus_\u0000"}"#).as_deref(),
            Some("the string at `customer`")
        );
        assert_eq!(
            nul(r#"{"customer": "cus_\\\u0000"}"#).as_deref(),
            Some("the string at `customer`")
        );
        assert_eq!(
            nul(r#"{"a": [{"b": ["x", "\u0000"]}]}"#).as_deref(),
            Some("the string at `a[0].b[1]`")
        );
        assert_eq!(
            nul(r#"{"a": {"k\u0000": 1}}"#).as_deref(),
            Some("a key of the object at `a`")
        );
        assert_eq!(nul(r#""\u0000""#).as_deref(), Some("the body"));
        // A repeated member whose first value deserialising drops is still refused.
        assert_eq!(
            nul(r#"{"note": "\u0000", "note": "x"}"#).as_deref(),
            Some("a string of the body")
        );
    }
}
