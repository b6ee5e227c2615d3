//! How a gRPC call's answer is kept in the key table: the method it is stored under, the
//! `Content-Type`s that tell a message from a status, and the status read back.

use axum::response::Response;
use bytes::Bytes;
use http::{StatusCode, header::CONTENT_TYPE};
use tonic::Code;

/// The `Content-Type` of a stored message: its protobuf encoding.
pub(crate) const GRPC_MESSAGE: &str = "application/grpc+proto";

/// The `Content-Type` of a stored status: [`StoredStatus`], protobuf-encoded.
pub(crate) const GRPC_STATUS: &str = "application/x-idem-grpc-status+proto";

/// The request method gRPC calls are stored under: no HTTP request has it, so a key used on
/// HTTP and then on gRPC (or the other way) is always another request.
pub(crate) const GRPC_METHOD: &str = "GRPC";

/// A method's final status as stored.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct StoredStatus {
    #[prost(int32, tag = "1")]
    pub(crate) code: i32,
    #[prost(string, tag = "2")]
    pub(crate) message: String,
    #[prost(bytes = "bytes", tag = "3")]
    pub(crate) details: Bytes,
}

/// The code and message of a status stored by the gRPC flow (`flow::grpc::into_http`), or `None` for a body that is not
/// one.
pub(crate) fn stored_status(body: &[u8]) -> Option<(Code, String)> {
    let stored = <StoredStatus as prost::Message>::decode(body).ok()?;
    Some((Code::from_i32(stored.code), stored.message))
}

/// The code of a gRPC call's answer in HTTP form, beside it (a response extension), for its
/// log line: set on the method's answer and on a replayed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AnsweredCode(pub(crate) Code);

impl AnsweredCode {
    /// The code of a stored answer whose `Content-Type` is `content_type`: `OK` for a message,
    /// the status's for a status; `None` for an HTTP response.
    pub(crate) fn of_stored(content_type: Option<&str>, body: &[u8]) -> Option<Self> {
        match content_type? {
            GRPC_MESSAGE => Some(Self(Code::Ok)),
            GRPC_STATUS => stored_status(body).map(|(code, _)| Self(code)),
            _ => None,
        }
    }
}

/// The code the caller gets for `response`, an answer of the claims: the method's (first run
/// or replay, [`AnsweredCode`]), `OK` for its message, or the code of one of the layer's own
/// answers (an HTTP problem) by its HTTP status.
pub(crate) fn code_of(response: &Response) -> Code {
    if let Some(&AnsweredCode(code)) = response.extensions().get::<AnsweredCode>() {
        return code;
    }
    let message = response
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|value| value == GRPC_MESSAGE);
    if message {
        Code::Ok
    } else {
        problem_code(response.status())
    }
}

/// The code of one of the layer's own answers (an HTTP problem), by its HTTP status.
pub(crate) fn problem_code(status: StatusCode) -> Code {
    match status {
        StatusCode::BAD_REQUEST => Code::InvalidArgument,
        StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        StatusCode::FORBIDDEN => Code::PermissionDenied,
        StatusCode::NOT_FOUND => Code::NotFound,
        StatusCode::CONFLICT => Code::Aborted,
        StatusCode::PAYLOAD_TOO_LARGE | StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
        StatusCode::UNPROCESSABLE_ENTITY => Code::FailedPrecondition,
        StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
        StatusCode::GATEWAY_TIMEOUT => Code::DeadlineExceeded,
        _ if status.is_client_error() => Code::FailedPrecondition,
        _ => Code::Internal,
    }
}
