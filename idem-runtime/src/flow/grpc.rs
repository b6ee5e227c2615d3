//! The request flow of a tonic method: the call enters as an [`IdemRequest`] (its key from the
//! metadata, its fingerprint over the method's full name and the message as re-encoded), runs
//! through the same claims as an HTTP request, and every answer is turned back into what a
//! gRPC client gets: the method's message, or a status with its metadata.
//!
//! Between the two the outcome travels as an HTTP response, the form the claims store and
//! replay: the message, protobuf-encoded, under [`GRPC_MESSAGE`](crate::stored_grpc::GRPC_MESSAGE), or the method's status under
//! [`GRPC_STATUS`](crate::stored_grpc::GRPC_STATUS), with an HTTP status that says whether it is final (a 4xx) or like a server
//! error (a 5xx, stored only with `replay_5xx`).

use std::sync::Arc;

use axum::{
    extract::FromRef,
    response::{IntoResponse, Response},
};
use http::{HeaderMap, HeaderValue, StatusCode, header::CONTENT_TYPE};
use http_body_util::BodyExt;
use idem_key::Fingerprint;
use tonic::{Code, Status, metadata::MetadataMap};
use tracing::field::Empty;

use super::{
    outcome::{Call, Outcome, end, key_problem},
    request::IdemRequest,
};
use crate::{
    backend::Backend,
    policy::HandlerPolicy,
    store::Store,
    stored_grpc::{AnsweredCode, GRPC_MESSAGE, GRPC_METHOD, GRPC_STATUS, StoredStatus},
};

/// Takes the call's key from its metadata and fingerprints it: the method's full name and the
/// message, re-encoded, so that two encodings of equal messages are the same request. A
/// missing or malformed key is answered `INVALID_ARGUMENT` and the method is not run.
///
/// # Errors
///
/// The status to answer the call with instead of running the method.
pub fn accept<DB, S, M>(
    service: &S,
    policy: &'static HandlerPolicy,
    request: tonic::Request<M>,
) -> Result<(tonic::Request<M>, IdemRequest<DB>), Status>
where
    DB: Backend,
    Store<DB>: FromRef<S>,
    M: prost::Message,
{
    accept_keyed(service, policy, request, |_| None)
}

/// [`accept`] for a method whose key is a field of its request message (`key_field`, as
/// AIP-155's `request_id`): `field` reads it.
///
/// # Errors
///
/// As [`accept`].
pub fn accept_keyed<DB, S, M>(
    service: &S,
    policy: &'static HandlerPolicy,
    request: tonic::Request<M>,
    field: fn(&M) -> Option<&str>,
) -> Result<(tonic::Request<M>, IdemRequest<DB>), Status>
where
    DB: Backend,
    Store<DB>: FromRef<S>,
    M: prost::Message,
{
    let store = Store::<DB>::from_ref(service);
    let path = policy
        .grpc()
        .map_or_else(String::new, |method| method.path());
    let route: Arc<str> = path.as_str().into();
    let span = tracing::info_span!(
        "idempotency",
        method = GRPC_METHOD,
        path = %path,
        key_id = Empty,
        outcome = Empty,
        grpc_status = Empty,
    );
    let headers = headers_of(request.metadata());
    let source = policy.key_source();
    let key = match source.take_grpc(&headers, field(request.get_ref())) {
        Ok(key) => Some(key),
        Err(refused) if refused.missing && policy.key_optional() => None,
        Err(refused) => {
            let problem = key_problem(source, &refused, store.options().problem_type_base());
            let problem = end(&span, &route, Call::Grpc, Outcome::Rejected, problem);
            return Err(status_of_problem(
                problem.status(),
                problem.headers(),
                refused.detail,
            ));
        }
    };
    let method = http::Method::from_bytes(GRPC_METHOD.as_bytes()).expect("a method token");
    let fingerprint = Fingerprint::of(
        &method,
        &path,
        &HeaderMap::new(),
        &request.get_ref().encode_to_vec(),
    );
    let idem = IdemRequest::new(
        store,
        key,
        (method, path),
        fingerprint,
        (span, route),
        &headers,
    );
    Ok((request, idem))
}

/// The metadata idem reads (`idempotency-key`, `prefer`), as the HTTP headers they are.
fn headers_of(metadata: &MetadataMap) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for name in [
        idem_key::IDEMPOTENCY_KEY,
        http::HeaderName::from_static("prefer"),
    ] {
        for value in metadata.get_all(name.as_str()).iter() {
            if let Ok(value) = HeaderValue::from_bytes(value.as_bytes()) {
                headers.append(name.clone(), value);
            }
        }
    }
    headers
}

/// The method's outcome in the form the claims store: its message under `GRPC_MESSAGE` with
/// 200, or its status under `GRPC_STATUS` with an HTTP status that is a 5xx for the codes
/// that are worth retrying (not stored unless `replay_5xx`) and a 4xx for the others (final).
pub fn into_http<T: prost::Message>(outcome: Result<tonic::Response<T>, Status>) -> Response {
    let code = outcome.as_ref().map_or_else(Status::code, |_| Code::Ok);
    let (metadata, mut response) = match outcome {
        Ok(response) => {
            let (metadata, message, _) = response.into_parts();
            let response = (
                StatusCode::OK,
                [(CONTENT_TYPE, GRPC_MESSAGE)],
                message.encode_to_vec(),
            )
                .into_response();
            (metadata, response)
        }
        Err(status) => {
            let stored = StoredStatus {
                code: status.code() as i32,
                message: status.message().to_owned(),
                details: status.details().to_vec().into(),
            };
            let response = (
                http_status(status.code()),
                [(CONTENT_TYPE, GRPC_STATUS)],
                prost::Message::encode_to_vec(&stored),
            )
                .into_response();
            (status.metadata().clone(), response)
        }
    };
    response.extensions_mut().insert(AnsweredCode(code));
    // The method's own metadata goes to the client with the first answer; it is not stored
    // (only the content type is), so a replay does not carry it.
    for (name, value) in &metadata.into_headers() {
        if name != CONTENT_TYPE && name != http::header::CONTENT_LENGTH {
            response.headers_mut().append(name.clone(), value.clone());
        }
    }
    response
}

/// The HTTP status a method's gRPC status is stored under: 5xx for the codes a retry may
/// change (`UNKNOWN`, `INTERNAL`, `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `DATA_LOSS`,
/// `RESOURCE_EXHAUSTED`, `ABORTED`), 4xx for the final ones.
pub(crate) fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Unavailable | Code::ResourceExhausted | Code::Aborted => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Unimplemented => StatusCode::METHOD_NOT_ALLOWED,
        Code::Cancelled | Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
    }
}

/// What the client gets for `response`, an answer of the claims: the method's message or
/// status (first run or replay, with `idempotent-replayed: true` and `preference-applied` as
/// the HTTP answer has them), or the status for one of the layer's own answers.
pub async fn answer<T: prost::Message + Default>(
    response: Response,
) -> Result<tonic::Response<T>, Status> {
    let (parts, body) = response.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            return Err(Status::internal(format!(
                "the method's outcome could not be read: {error}"
            )));
        }
    };
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    let metadata = answer_metadata(&parts.headers);
    match content_type {
        GRPC_MESSAGE => match T::decode(body) {
            Ok(message) => Ok(tonic::Response::from_parts(
                metadata,
                message,
                tonic::Extensions::default(),
            )),
            Err(error) => Err(corrupt(&error)),
        },
        GRPC_STATUS => match <StoredStatus as prost::Message>::decode(body) {
            Ok(stored) => Err(Status::with_details_and_metadata(
                Code::from_i32(stored.code),
                stored.message,
                stored.details,
                metadata,
            )),
            Err(error) => Err(corrupt(&error)),
        },
        _ => Err(status_of_problem(
            parts.status,
            &parts.headers,
            problem_detail(&body),
        )),
    }
}

fn corrupt(error: &prost::DecodeError) -> Status {
    tracing::error!(%error, "a stored gRPC outcome could not be decoded");
    Status::internal(format!(
        "the stored outcome of this call could not be decoded ({error}); it was not run again"
    ))
}

/// The answer's metadata: what the method set on its first answer, or on a replay
/// `idempotent-replayed` (and `preference-applied` after a wait); the HTTP form's own headers
/// left out.
fn answer_metadata(headers: &HeaderMap) -> MetadataMap {
    let mut headers = headers.clone();
    headers.remove(CONTENT_TYPE);
    headers.remove(http::header::CONTENT_LENGTH);
    MetadataMap::from_headers(headers)
}

/// The problem's `detail` (its `title` without one), from its JSON body.
fn problem_detail(body: &[u8]) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    parsed
        .as_ref()
        .and_then(|problem| problem.get("detail").or_else(|| problem.get("title")))
        .and_then(serde_json::Value::as_str)
        .map_or_else(|| String::from_utf8_lossy(body).into_owned(), str::to_owned)
}

/// The status for one of the layer's own answers (an HTTP problem): its code by the problem's
/// HTTP status, its detail as the message, and a `Retry-After` as both `retry-after` and
/// gRFC A6's `grpc-retry-pushback-ms`.
fn status_of_problem(status: StatusCode, headers: &HeaderMap, detail: String) -> Status {
    let code = crate::stored_grpc::problem_code(status);
    let retry_after = headers
        .get(http::header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    match retry_after {
        Some(seconds) => {
            crate::grpc::retry_later(code, detail, std::time::Duration::from_secs(seconds))
        }
        None => Status::new(code, detail),
    }
}

#[cfg(test)]
mod log_tests {
    use std::sync::{Arc, Mutex, PoisonError};

    use axum::response::IntoResponse;
    use tracing::field::Empty;

    use super::super::outcome::{Call, Outcome, end};
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
        let exists = super::into_http::<()>(Err(tonic::Status::already_exists("paid before")));
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
                super::into_http::<()>(Ok(tonic::Response::new(()))),
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
