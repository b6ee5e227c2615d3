//! How a request through the layer ended ([`Outcome`]), and recording it on the request's span
//! and in the metrics with the response that ends it ([`end`]). The answers themselves are
//! in [`answers`](super::answers).

use axum::response::{IntoResponse, Response};
use idem_key::KeyError;
use tracing::Span;

use crate::problem::ProblemKind;

/// How a request through the layer ended, as recorded on its span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The handler ran and its outcome was committed with the key.
    Executed,
    /// The handler ran, answered 5xx, and nothing was stored (`replay_5xx = false`).
    NotStored,
    /// A stored response was replayed.
    Replayed,
    /// Another request holds the key: 409.
    Conflict,
    /// The key was used before with another request: 422.
    Mismatch,
    /// The key, body or an extractor was refused before the handler ran.
    Rejected,
    /// The store failed or the response could not be stored; nothing was committed.
    Failed,
    /// The handler ran past its `timeout` and was stopped; nothing was stored.
    TimedOut,
    /// The key's first request was parked by the recovery: it waits for an operator.
    Parked,
}

impl Outcome {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::NotStored => "executed_not_stored",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
            Self::TimedOut => "timed_out",
            Self::Parked => "parked",
        }
    }
}

pub(super) fn end(span: &Span, route: &str, outcome: Outcome, response: Response) -> Response {
    let status = response.status().as_u16();
    span.record("outcome", outcome.as_str());
    span.record("status", status);
    tracing::info!(parent: span, outcome = outcome.as_str(), status, "idempotent request");
    metrics::counter!(
        "idem_requests_total",
        "route" => route.to_owned(),
        "outcome" => outcome.as_str(),
    )
    .increment(1);
    response
}

/// 400: the key is missing or malformed; `base` is where problem types point.
pub(super) fn key_problem(error: &KeyError, base: &str) -> Response {
    let kind = if matches!(error, KeyError::Missing) {
        ProblemKind::MissingKey
    } else {
        ProblemKind::MalformedKey
    };
    kind.problem_under(base, error.to_string()).into_response()
}
