//! How a request through the layer ended ([`Outcome`]), and recording it on the request's span
//! and in the metrics with the response that ends it ([`end`]). The answers themselves are
//! in [`answers`](super::answers).

use axum::response::{IntoResponse, Response};
use tracing::Span;

use crate::{
    key_source::{KeySource, Refused},
    problem::ProblemKind,
};

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
    /// The request carried no key where the handler's key is optional (`key_optional`): the
    /// handler ran once, unprotected, and nothing was stored.
    Unprotected,
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
            Self::Unprotected => "executed_unprotected",
        }
    }
}

/// What came in through the layer, which says how its answer is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    /// An HTTP request: its answer's HTTP status (`status=422`).
    Http,
    /// A gRPC call: its answer's gRPC code (`grpc_status=FAILED_PRECONDITION`), never the HTTP
    /// status the answer travels and is stored under on its way.
    #[cfg(feature = "grpc")]
    Grpc,
}

/// Records how the request ended on its span (the span's `outcome`, and its `status` or, for a
/// gRPC call, `grpc_status`), logs it, and counts it; returns `response`.
pub(super) fn end(
    span: &Span,
    route: &str,
    call: Call,
    outcome: Outcome,
    response: Response,
) -> Response {
    span.record("outcome", outcome.as_str());
    match call {
        Call::Http => {
            let status = response.status().as_u16();
            span.record("status", status);
            tracing::info!(parent: span, outcome = outcome.as_str(), status, "idempotent request");
        }
        #[cfg(feature = "grpc")]
        Call::Grpc => {
            let code = crate::grpc::code_name(crate::stored_grpc::code_of(&response));
            span.record("grpc_status", tracing::field::display(code));
            tracing::info!(
                parent: span,
                outcome = outcome.as_str(),
                grpc_status = %code,
                "idempotent request"
            );
        }
    }
    metrics::counter!(
        "idem_requests_total",
        "route" => route.to_owned(),
        "outcome" => outcome.as_str(),
    )
    .increment(1);
    response
}

/// 400: the key is missing or malformed; `base` is where problem types point.
pub(super) fn key_problem(source: KeySource, refused: &Refused, base: &str) -> Response {
    let kind = if refused.missing {
        ProblemKind::MissingKey
    } else {
        ProblemKind::MalformedKey
    };
    if source == KeySource::Standard {
        return kind
            .problem_under(base, refused.detail.clone())
            .into_response();
    }
    // The kind's title names the `Idempotency-Key` header; this key is elsewhere.
    let title = if refused.missing {
        "Idempotency key is missing"
    } else {
        "Idempotency key is malformed"
    };
    crate::problem::Problem::new(kind.status(), title)
        .with_type(kind.type_uri_under(base))
        .with_detail(refused.detail.clone())
        .into_response()
}
