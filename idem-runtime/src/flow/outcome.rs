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
            let code = crate::grpc::code_name(super::grpc::code_of(&response));
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

#[cfg(all(test, feature = "grpc"))]
mod tests {
    use std::sync::{Arc, Mutex, PoisonError};

    use axum::response::IntoResponse;
    use tracing::field::Empty;

    use super::{Call, Outcome, end};
    use crate::{
        problem::ProblemKind,
        record::StoredResponse,
        stored_grpc::{GRPC_STATUS, StoredStatus},
    };

    /// The log line `end` writes for `response`, answered to a `call`.
    fn logged(call: Call, outcome: Outcome, response: axum::response::Response) -> String {
        let lines = Arc::new(Mutex::new(Vec::<u8>::new()));
        let writer = {
            let lines = Arc::clone(&lines);
            move || Writer(Arc::clone(&lines))
        };
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(writer)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "idempotency",
                outcome = Empty,
                status = Empty,
                grpc_status = Empty
            );
            end(&span, "/test.v1.Jobs/Send", call, outcome, response);
        });
        let lines = lines.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&lines).into_owned()
    }

    struct Writer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Writer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_grpc_calls_line_names_its_code_never_the_http_status_it_travels_under() {
        // Codes whose HTTP status maps back to another code (409 is ABORTED for the layer's
        // own answers; 400 is INVALID_ARGUMENT): the line must take the method's.
        let exists =
            crate::flow::grpc::into_http::<()>(Err(tonic::Status::already_exists("paid before")));
        let stored = StoredResponse {
            status: 400,
            headers: vec![("content-type".to_owned(), GRPC_STATUS.to_owned())],
            body: prost::Message::encode_to_vec(&StoredStatus {
                code: tonic::Code::OutOfRange as i32,
                message: "past the last page".to_owned(),
                details: bytes::Bytes::new(),
            }),
        };
        let base = crate::problem::DEFAULT_PROBLEM_TYPE_BASE;
        let cases = [
            (
                "the method's status",
                Outcome::Executed,
                exists,
                "ALREADY_EXISTS",
            ),
            (
                "a replay",
                Outcome::Replayed,
                crate::replay::replay(stored),
                "OUT_OF_RANGE",
            ),
            (
                "the method's message",
                Outcome::Executed,
                crate::flow::grpc::into_http::<()>(Ok(tonic::Response::new(()))),
                "OK",
            ),
            (
                "the layer's 422",
                Outcome::Mismatch,
                ProblemKind::KeyReused
                    .problem_under(base, "reused")
                    .into_response(),
                "FAILED_PRECONDITION",
            ),
            (
                "the layer's 503",
                Outcome::Failed,
                ProblemKind::StoreUnavailable
                    .problem_under(base, "down")
                    .into_response(),
                "UNAVAILABLE",
            ),
        ];
        for (what, outcome, response, code) in cases {
            let line = logged(Call::Grpc, outcome, response);
            assert!(
                line.contains(&format!("grpc_status={code}")) && !line.contains(" status="),
                "{what}: {line}"
            );
        }
        let line = logged(
            Call::Http,
            Outcome::Mismatch,
            ProblemKind::KeyReused
                .problem_under(base, "reused")
                .into_response(),
        );
        assert!(
            line.contains("status=422") && !line.contains("grpc_status"),
            "an HTTP request: {line}"
        );
    }
}
