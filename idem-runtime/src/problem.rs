//! RFC 9457 problem details (`application/problem+json`) for every answer the layer itself
//! gives, and a small builder that applications can use for their own errors.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

/// The media type of a problem details document.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Where the problem types of idem's own answers are documented: the repository's
/// `docs/problems.md`, one section per kind. [`Settings::problem_type_base`] replaces it.
///
/// [`Settings::problem_type_base`]: crate::Settings::problem_type_base
pub const DEFAULT_PROBLEM_TYPE_BASE: &str =
    "https://github.com/idem-rs/idem/blob/main/docs/problems.md#";

/// The kinds of problem the idempotency layer answers with. Each has a stable `type` URI that
/// points at its documentation here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProblemKind {
    /// 400: the route requires an `Idempotency-Key` header and the request has none.
    MissingKey,
    /// 400: the `Idempotency-Key` header is malformed (empty, over 255 characters, not visible
    /// ASCII, a bad Structured Field String, or sent twice).
    MalformedKey,
    /// 409: a request with this key is still being processed; retry after `Retry-After` seconds.
    InProgress,
    /// 422: the key was first used with a different request (method, path, query or body).
    KeyReused,
    /// 413: the request body is larger than the store's configured limit; nothing was stored.
    BodyTooLarge,
    /// 500: the handler's response is larger than the store's configured limit, so it could not
    /// be stored; its writes were rolled back.
    ResponseTooLarge,
    /// 400: the value of the handler's scope parameter cannot scope keys: it is empty, holds
    /// U+0000 (NUL), or is longer than [`MAX_SCOPE_LEN`](crate::MAX_SCOPE_LEN) bytes. It comes
    /// from the request (a path segment, a token), so the request is refused; nothing is stored.
    InvalidScope,
    /// 503: the idempotency store could not be reached or failed; nothing was stored.
    StoreUnavailable,
    /// 500: the database refused to commit the handler's writes (a deferred constraint, a
    /// serialization failure), or the handler ended its transaction itself; nothing was stored.
    CommitRefused,
    /// 503: the connection failed during the commit, so whether the handler's writes and the
    /// key were committed is unknown; a retry with the same key finds out.
    OutcomeUnknown,
    /// 503: the handler ran longer than its `timeout` and was stopped: its writes were rolled
    /// back (or, in external mode, its claim released) and nothing was stored; a retry with the
    /// same key runs it again.
    HandlerTimedOut,
    /// 500: a step of a multi-step handler could not run or be recorded because of a mistake in
    /// the handler: a step name used twice, steps run at the same time, or an output that does
    /// not serialize to JSON (or no longer reads back as the handler's type).
    StepFailed,
}

impl ProblemKind {
    /// The HTTP status this kind is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::MalformedKey | Self::InvalidScope => StatusCode::BAD_REQUEST,
            Self::InProgress => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::ResponseTooLarge | Self::CommitRefused | Self::StepFailed => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::StoreUnavailable | Self::OutcomeUnknown | Self::HandlerTimedOut => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The stable `type` URI of this kind under [`DEFAULT_PROBLEM_TYPE_BASE`]: the base and the
    /// kind's name in lower case (`…/docs/problems.md#keyreused`).
    pub fn type_uri(self) -> String {
        self.type_uri_under(DEFAULT_PROBLEM_TYPE_BASE)
    }

    /// The `type` URI of this kind under `base` (see [`Settings::problem_type_base`]).
    ///
    /// [`Settings::problem_type_base`]: crate::Settings::problem_type_base
    pub fn type_uri_under(self, base: &str) -> String {
        format!("{base}{}", format!("{self:?}").to_lowercase())
    }

    /// A problem of this kind with the given detail, its `type` under `base`.
    pub fn problem_under(self, base: &str, detail: impl Into<String>) -> Problem {
        Problem::new(self.status(), self.title())
            .with_type(self.type_uri_under(base))
            .with_detail(detail)
    }

    /// A short, human-readable summary that does not change from occurrence to occurrence.
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header is missing",
            Self::MalformedKey => "Idempotency-Key header is malformed",
            Self::InProgress => "A request with this idempotency key is in progress",
            Self::KeyReused => "Idempotency key reused with a different request",
            Self::BodyTooLarge => "Request body too large",
            Self::ResponseTooLarge => "Response too large to store",
            Self::InvalidScope => "Idempotency scope is invalid",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::CommitRefused => "The handler's writes could not be committed",
            Self::OutcomeUnknown => "The outcome of the commit is unknown",
            Self::HandlerTimedOut => "The handler did not finish in time",
            Self::StepFailed => "A step of the handler could not be recorded",
        }
    }

    /// A problem of this kind with the given detail, its `type` under
    /// [`DEFAULT_PROBLEM_TYPE_BASE`].
    pub fn with_detail(self, detail: impl Into<String>) -> Problem {
        self.problem_under(DEFAULT_PROBLEM_TYPE_BASE, detail)
    }
}

/// Marks a response as a problem of the layer made where the store's settings cannot be seen
/// (a [`StepError`](crate::StepError) the handler returns): the request flow answers it with
/// its `type` under the store's [`Settings::problem_type_base`](crate::Settings).
#[derive(Debug, Clone)]
pub(crate) struct Rebasable {
    pub(crate) kind: ProblemKind,
    pub(crate) detail: String,
}

/// An RFC 9457 problem details document, answered as `application/problem+json`.
///
/// # Examples
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idem_runtime::Problem;
///
/// let response = Problem::new(StatusCode::PAYMENT_REQUIRED, "Card declined")
///     .with_type("https://example.com/problems/card-declined")
///     .with_detail("the card issuer declined the payment")
///     .into_response();
/// assert_eq!(response.status(), StatusCode::PAYMENT_REQUIRED);
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: String,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    #[serde(skip)]
    retry_after: Option<u64>,
}

impl Problem {
    /// A problem with a status and title, of type `about:blank`.
    pub fn new(status: StatusCode, title: impl Into<String>) -> Self {
        Self {
            type_uri: "about:blank".to_owned(),
            title: title.into(),
            status: status.as_u16(),
            detail: None,
            retry_after: None,
        }
    }

    /// Sets the `type` URI.
    pub fn with_type(mut self, type_uri: impl Into<String>) -> Self {
        self.type_uri = type_uri.into();
        self
    }

    /// Sets the `detail`: what went wrong with this particular request.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds a `Retry-After` header, in seconds.
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// The status this problem is answered with.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut response = (self.status(), body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_uris_are_stable_and_distinct() {
        assert_eq!(
            ProblemKind::MissingKey.type_uri(),
            "https://github.com/idem-rs/idem/blob/main/docs/problems.md#missingkey"
        );
        assert_ne!(
            ProblemKind::InProgress.type_uri(),
            ProblemKind::KeyReused.type_uri()
        );
    }

    #[test]
    fn problem_serialises_per_rfc_9457() {
        let problem = ProblemKind::InProgress
            .with_detail("busy")
            .with_retry_after(2);
        let response = problem.clone().into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        let json = serde_json::to_value(&problem).unwrap();
        assert_eq!(json["status"], 409);
        assert_eq!(json["detail"], "busy");
        assert_eq!(json["title"], ProblemKind::InProgress.title());
    }
}
