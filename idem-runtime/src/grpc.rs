//! `#[idempotent]` on the methods of a tonic service (feature `grpc`).
//!
//! Mark the service's impl with [`#[grpc]`](macro@crate::grpc), above tonic's
//! `#[tonic::async_trait]`, and each method to make retry-safe with `#[idempotent(...)]`, with
//! the same arguments as on an Axum handler. The method takes, after `&self`, the values it
//! reads from the call's metadata ([`FromMetadata`], such as the caller its keys are scoped to),
//! the transaction (or nothing, in external mode), and last the `tonic::Request`:
//!
//! ```ignore
//! #[idem_runtime::grpc]
//! #[tonic::async_trait]
//! impl Payments for PaymentsApi {
//!     #[idempotent(scope = "tenant", retention = "24h", wait = "10s")]
//!     async fn create_payment(
//!         &self,
//!         Tenant(tenant): Tenant, // FromMetadata, from `authorization`
//!         tx: &mut Transaction<'_, Postgres>,
//!         request: Request<CreatePaymentRequest>,
//!     ) -> Result<Response<Payment>, Status> {
//!         // ... writes through `tx`; the message or the final status commits with them
//!     }
//! }
//! ```
//!
//! The service provides the [`Store`](crate::store::Store) as an Axum router's state does, through
//! [`FromRef`](axum::extract::FromRef). The key comes from the `idempotency-key` metadata (the
//! syntax and limits of the HTTP header), or, with `key_field = "request_id"`, from a string field
//! of the request message, as Google's AIP-155 puts it ([`KeyField`]; an empty field is a
//! missing key), `prefer: wait=<seconds>` asks to wait as on HTTP, and
//! the fingerprint covers the method's full name and the message re-encoded: two encodings of
//! equal messages (fields in another order, default values written or left out) are the same
//! request. Map fields must be generated as `BTreeMap` (tonic-prost-build's
//! `.btree_map(".")`) for their entries' order not to count: a `HashMap` re-encodes in an order
//! of its own.
//!
//! | Situation | Status |
//! |---|---|
//! | Key missing or malformed | `INVALID_ARGUMENT`, method not run |
//! | First call | the method runs once; its message (or its final status) is stored with its writes |
//! | Retry after the first finished | the stored message or status again, with metadata `idempotent-replayed: true` |
//! | Retry while the first runs | `ABORTED` with `retry-after` and `grpc-retry-pushback-ms`, at once |
//! | Same key, another request (another method or message, or an HTTP request) | `FAILED_PRECONDITION`, method not run |
//! | Store unavailable, transient fault | `UNAVAILABLE` with `retry-after` and `grpc-retry-pushback-ms` |
//! | Method's status `UNKNOWN`, `INTERNAL`, `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `DATA_LOSS`, `RESOURCE_EXHAUSTED`, `ABORTED` | like an HTTP 5xx: rolled back, stored only with `replay_5xx = true` |
//! | Any other status of the method | final: stored and replayed, its writes committed |
//!
//! A replay carries the message, or the status's code, message and details; metadata the
//! method set on its answer goes to the client with the first answer, and is not stored.

pub use crate::key_source::KeyField;

use tonic::{Extensions, Status, metadata::MetadataMap};

/// A value an `#[idempotent]` tonic method takes from the call's metadata or extensions (what
/// an interceptor put there), before its key is claimed: the caller its keys are scoped to,
/// typically.
pub trait FromMetadata: Sized {
    /// Reads the value.
    ///
    /// # Errors
    ///
    /// The status the call is answered with (`UNAUTHENTICATED` for a caller that cannot be
    /// told, say); the method is not run and nothing is stored.
    fn from_metadata(metadata: &MetadataMap, extensions: &Extensions) -> Result<Self, Status>;
}

/// A status that asks the caller to retry after `after`: metadata `retry-after` (whole
/// seconds, at least one) and gRFC A6's `grpc-retry-pushback-ms`, which idem's client and the
/// retry policies of grpc-go and grpc-java honour. idem answers its own `ABORTED` and `UNAVAILABLE` this way; a
/// method answers a fault that passes (its database failing over, say) the same way:
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::grpc::retry_later;
///
/// let status = retry_later(tonic::Code::Unavailable, "the database failed over", Duration::from_secs(1));
/// assert_eq!(status.metadata().get("grpc-retry-pushback-ms").unwrap(), "1000");
/// ```
pub fn retry_later(
    code: tonic::Code,
    message: impl Into<String>,
    after: std::time::Duration,
) -> Status {
    let seconds = after
        .as_secs()
        .saturating_add(u64::from(after.subsec_nanos() > 0));
    let seconds = seconds.max(1);
    let mut metadata = MetadataMap::new();
    metadata.insert("retry-after", seconds.into());
    metadata.insert(
        "grpc-retry-pushback-ms",
        seconds.saturating_mul(1000).into(),
    );
    Status::with_metadata(code, message, metadata)
}

/// `code` as gRPC spells it (`FAILED_PRECONDITION`), as idem's log lines and the `idem`
/// command name a call's answer.
///
/// ```
/// assert_eq!(idem_runtime::grpc::code_name(tonic::Code::FailedPrecondition), "FAILED_PRECONDITION");
/// ```
#[must_use]
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
