//! How a gRPC call's answer is kept in the key table: the method it is stored under, the
//! `Content-Type`s that tell a message from a status, and the status read back.

use bytes::Bytes;
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
