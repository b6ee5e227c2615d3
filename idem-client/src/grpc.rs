//! The client's rules for tonic (feature `grpc`): one key per logical call, sent by each of its
//! retries, and retries of what may succeed the next time only.
//!
//! ```no_run
//! # use tonic::{Request, Response, Status};
//! # #[derive(Clone)]
//! # struct CreatePaymentRequest { amount: i64 }
//! # struct Payment;
//! # /// A client tonic generated, as `payments_client::PaymentsClient<Channel>`.
//! # #[derive(Clone)]
//! # struct PaymentsClient;
//! # impl PaymentsClient {
//! #     async fn create_payment(
//! #         &mut self,
//! #         _: Request<CreatePaymentRequest>,
//! #     ) -> Result<Response<Payment>, Status> {
//! #         unimplemented!()
//! #     }
//! # }
//! # async fn demo(payments: PaymentsClient) -> Result<(), Status> {
//! use idem_client::{RetryPolicy, grpc::GrpcRetry};
//! use tonic::metadata::MetadataMap;
//!
//! let mut metadata = MetadataMap::new();
//! metadata.insert("authorization", "Bearer tenant_1".parse().unwrap());
//! let retry = GrpcRetry::new(RetryPolicy::default()).with_metadata(metadata);
//! let answer = retry
//!     .call(CreatePaymentRequest { amount: 4200 }, |request| {
//!         // One attempt; every attempt carries the same `idempotency-key`.
//!         let mut payments = payments.clone();
//!         async move { payments.create_payment(request).await }
//!     })
//!     .await?;
//! println!("replayed: {}", idem_client::grpc::replayed(answer.metadata()));
//! # Ok(())
//! # }
//! ```
//!
//! What is retried ([`retryable`]):
//!
//! - `ABORTED` (a duplicate of the call is still running on the server) and `UNAVAILABLE`
//!   (nothing was committed; the connection could not be made), whatever their source;
//! - a transport failure ([`is_transport_error`]): the call may or may not have reached the
//!   service, and the retry, with the same key, gets its outcome or runs it;
//! - never `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `NOT_FOUND`, `UNAUTHENTICATED` or
//!   `PERMISSION_DENIED`, even with a transport error as their source: the same call gets the
//!   same answer;
//! - nor any other status the server sent (`INTERNAL`, `UNKNOWN`, `DEADLINE_EXCEEDED`,
//!   `RESOURCE_EXHAUSTED`, ...): gRPC retries only the codes it is told to, and these are
//!   idem's two.
//!
//! Before a retry, the caller waits the policy's backoff (full jitter), or the server's
//! `grpc-retry-pushback-ms` if longer, else its `retry-after` if longer. As gRFC A6 says, a
//! pushback that is not a non-negative number of milliseconds means "do not retry": the status
//! is returned.

use std::{future::Future, time::Duration};

use tonic::{
    Code, Extensions, Request, Response, Status,
    metadata::{Ascii, MetadataMap, MetadataValue},
};

use crate::{RetryPolicy, retry_after, schedule::Schedule};

/// The metadata that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The metadata a server built with idem sets on a replayed answer or status.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The metadata in which a server asks to wait before a retry, in milliseconds (gRFC A6).
pub const RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

/// The metadata in which a server asks to wait before a retry, as HTTP's `Retry-After`.
pub const RETRY_AFTER: &str = "retry-after";

/// The metadata that asks the server to wait for a duplicate still running (RFC 7240).
const PREFER: &str = "prefer";

/// Whether an answer's or a status's `metadata` says it is the replay of an earlier attempt's
/// outcome (`idempotent-replayed: true`).
pub fn replayed(metadata: &MetadataMap) -> bool {
    metadata
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// Whether a call that ended with `status` is worth another attempt with the same key: see the
/// [module's documentation](self).
pub fn retryable(status: &Status) -> bool {
    match status.code() {
        Code::InvalidArgument
        | Code::FailedPrecondition
        | Code::NotFound
        | Code::Unauthenticated
        | Code::PermissionDenied => false,
        Code::Aborted | Code::Unavailable => true,
        _ => is_transport_error(status),
    }
}

/// Whether `status` was made on the client's side from a transport failure, not sent by the
/// server: among its sources, a `hyper` or `h2` error (a connection closed or reset, a stream
/// reset), an I/O error, [`tonic::ConnectError`] (the connection could not be made) or
/// [`tonic::TimeoutExpired`] (the channel's own timeout for the attempt passed).
///
/// tonic gives such a status the code `UNAVAILABLE`, `UNKNOWN`, `INTERNAL` or `CANCELLED`,
/// depending on the failure and on its own features; a status the server sent has no source.
pub fn is_transport_error(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<hyper::Error>()
            || error.is::<h2::Error>()
            || error.is::<std::io::Error>()
            || error.is::<tonic::ConnectError>()
            || error.is::<tonic::TimeoutExpired>()
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// What the server asked before a retry.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    /// Wait this long at least (`None`: as the policy says).
    Wait(Option<Duration>),
    /// A pushback that is not a wait: no retry (gRFC A6).
    NoRetry,
}

/// `grpc-retry-pushback-ms` first, else `retry-after` (seconds or a date).
fn asked(metadata: &MetadataMap) -> Asked {
    if let Some(pushback) = metadata.get(RETRY_PUSHBACK_MS) {
        return match pushback
            .to_str()
            .ok()
            .and_then(|value| value.trim().parse::<u64>().ok())
        {
            // Beyond a day is no retry worth waiting for; the budget refuses it either way.
            Some(millis) => Asked::Wait(Some(Duration::from_millis(millis.min(86_400_000)))),
            None => Asked::NoRetry,
        };
    }
    Asked::Wait(
        metadata
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(retry_after::parse),
    )
}

/// A key the server would refuse (it must be 1 to 255 visible ASCII characters).
#[derive(Debug, thiserror::Error)]
#[error("this idempotency key cannot be sent: {0}")]
pub struct InvalidKey(#[from] pub idem_key::KeyError);

/// Makes tonic calls retry safely: each logical call gets one key (a UUID v4) before its first
/// attempt, sent as `idempotency-key` metadata by every attempt of it, and is retried by the
/// [module's](self) rules within the policy's attempts and budget.
///
/// One `GrpcRetry` serves any number of calls, on any generated client: the closure given to
/// [`GrpcRetry::call`] sends one attempt. Each attempt is bounded by the channel's own timeout
/// (`Endpoint::timeout`) or the closure's; the budget bounds when the last attempt may start.
#[derive(Clone)]
pub struct GrpcRetry {
    policy: RetryPolicy,
    metadata: MetadataMap,
}

impl std::fmt::Debug for GrpcRetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Metadata names only: their values may be credentials.
        f.debug_struct("GrpcRetry")
            .field("policy", &self.policy)
            .field("metadata", &names(&self.metadata))
            .finish()
    }
}

fn names(metadata: &MetadataMap) -> Vec<String> {
    metadata
        .keys()
        .map(|key| match key {
            tonic::metadata::KeyRef::Ascii(key) => key.as_str().to_owned(),
            tonic::metadata::KeyRef::Binary(key) => key.as_str().to_owned(),
        })
        .collect()
}

impl GrpcRetry {
    /// The caller with `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            metadata: MetadataMap::new(),
        }
    }

    /// Metadata that every attempt of every call carries (`authorization`, ...), before a
    /// call's own ([`IdempotentCall::with_metadata`]) and the key.
    #[must_use]
    pub fn with_metadata(mut self, metadata: MetadataMap) -> Self {
        self.metadata = metadata;
        self
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// A logical call of `message`, with its new key, to be sent by [`IdempotentCall::send`]
    /// after the caller chose another key or added metadata.
    pub fn prepare<M>(&self, message: M) -> IdempotentCall<'_, M> {
        let key = uuid::Uuid::new_v4().to_string();
        IdempotentCall {
            retry: self,
            message,
            key: MetadataValue::try_from(key.as_str()).expect("a UUID is visible ASCII"),
            metadata: MetadataMap::new(),
        }
    }

    /// Sends `message` as one logical call with a new key: `send` makes each attempt (see the
    /// [module's example](self)) from a `tonic::Request`
    /// that carries a clone of `message`, the metadata, the key and the [`Attempt`](crate::Attempt)
    /// as an extension.
    ///
    /// # Errors
    ///
    /// The last attempt's status: a final one, or a retryable one when the attempts or the
    /// budget ran out (or the server's pushback said not to retry).
    pub async fn call<M, T, F, Fut>(&self, message: M, send: F) -> Result<Response<T>, Status>
    where
        M: Clone,
        F: FnMut(Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        self.prepare(message).send(send).await
    }
}

/// One logical call, its key made: see [`GrpcRetry::prepare`].
pub struct IdempotentCall<'a, M> {
    retry: &'a GrpcRetry,
    message: M,
    key: MetadataValue<Ascii>,
    metadata: MetadataMap,
}

impl<M> std::fmt::Debug for IdempotentCall<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Neither the key nor the metadata's values: they are secrets of a kind.
        f.debug_struct("IdempotentCall")
            .field("retry", self.retry)
            .field("metadata", &names(&self.metadata))
            .finish_non_exhaustive()
    }
}

impl<M> IdempotentCall<'_, M> {
    /// Sends `key` instead of the new one: a key kept from an earlier run of the same action
    /// (see [`KeyStore`](crate::KeyStore)), or one derived from a message's id.
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] when `key` is not 1 to 255 visible ASCII characters.
    pub fn with_key(mut self, key: &str) -> Result<Self, InvalidKey> {
        let key = idem_key::IdempotencyKey::new(key)?;
        self.key = MetadataValue::try_from(key.as_str()).expect("visible ASCII");
        Ok(self)
    }

    /// Metadata for this call's attempts, over the caller's ([`GrpcRetry::with_metadata`]):
    /// an entry named in both is this one's.
    #[must_use]
    pub fn with_metadata(mut self, metadata: MetadataMap) -> Self {
        self.metadata = metadata;
        self
    }

    /// The key every attempt sends.
    pub fn key(&self) -> &str {
        self.key.to_str().expect("visible ASCII")
    }
}

impl<M: Clone> IdempotentCall<'_, M> {
    /// Sends the call: `send` makes one attempt from the `tonic::Request` it is given, which
    /// carries a clone of the message, the metadata, the key and the attempt's
    /// [`Attempt`](crate::Attempt) as an extension; the closure may add more (a timeout).
    ///
    /// # Errors
    ///
    /// The last attempt's status: a final one, or a retryable one when the attempts or the
    /// budget ran out (or the server's pushback said not to retry).
    pub async fn send<T, F, Fut>(self, mut send: F) -> Result<Response<T>, Status>
    where
        F: FnMut(Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let policy = &self.retry.policy;
        let mut headers = self.retry.metadata.clone().into_headers();
        // An entry of the call's own replaces the caller's of the same name.
        headers.extend(self.metadata.into_headers());
        let mut metadata = MetadataMap::from_headers(headers);
        metadata.insert(IDEMPOTENCY_KEY, self.key);
        if let Some(wait) = policy.prefer_wait()
            && !metadata.contains_key(PREFER)
        {
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            if let Ok(value) = MetadataValue::try_from(format!("wait={seconds}")) {
                metadata.insert(PREFER, value);
            }
        }
        let mut schedule = Schedule::start(policy);
        loop {
            let mut extensions = Extensions::new();
            extensions.insert(schedule.attempt());
            let request = Request::from_parts(metadata.clone(), extensions, self.message.clone());
            let outcome = send(request).await;
            let status = match &outcome {
                Err(status) if retryable(status) => status,
                _ => return outcome,
            };
            let Asked::Wait(asked) = asked(status.metadata()) else {
                return outcome;
            };
            let Some(wait) = schedule.next_wait(asked) else {
                return outcome;
            };
            tracing::debug!(
                attempt = schedule.attempt().number,
                code = ?status.code(),
                ?wait,
                "retrying a gRPC call with the same key"
            );
            // The last status is kept through the wait: it is the answer if none follows.
            if !schedule.wait(wait).await {
                return outcome;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(entries: &[(&'static str, &str)]) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        for (name, value) in entries {
            metadata.insert(*name, value.parse().unwrap());
        }
        metadata
    }

    #[test]
    fn aborted_and_unavailable_are_retried_final_codes_never() {
        for code in [Code::Aborted, Code::Unavailable] {
            assert!(retryable(&Status::new(code, "")), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::NotFound,
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::Internal,
            Code::Unknown,
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::AlreadyExists,
            Code::Unimplemented,
        ] {
            assert!(!retryable(&Status::new(code, "")), "{code:?}");
        }
    }

    #[test]
    fn a_transport_failure_is_retried_whatever_its_code_but_a_final_one() {
        let reset = || std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        // tonic makes an UNKNOWN status of an error it does not know, keeping it as its source.
        let unknown = Status::from_error(Box::new(reset()));
        assert_eq!(unknown.code(), Code::Unknown);
        assert!(is_transport_error(&unknown) && retryable(&unknown));
        let refused = Status::from_error(Box::new(tonic::ConnectError(Box::new(reset()))));
        assert_eq!(refused.code(), Code::Unavailable);
        assert!(is_transport_error(&refused) && retryable(&refused));
        let timeout = Status::from_error(Box::new(tonic::TimeoutExpired(())));
        assert_eq!(timeout.code(), Code::Cancelled);
        assert!(is_transport_error(&timeout) && retryable(&timeout));
        // The same code from the server (no source) is final.
        assert!(!retryable(&Status::cancelled("Timeout expired")));
        // A final code stays final even when a transport error is among its sources.
        let denied = Status::from_error(Box::new(std::io::Error::other(Via(
            Status::permission_denied("no"),
        ))));
        assert_eq!(denied.code(), Code::PermissionDenied);
        assert!(is_transport_error(&denied) && !retryable(&denied));
    }

    /// An error whose source is a status: an I/O error made of it has the status as its
    /// source, which tonic finds.
    #[derive(Debug)]
    struct Via(Status);

    impl std::fmt::Display for Via {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("via")
        }
    }

    impl std::error::Error for Via {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn the_pushback_comes_first_then_retry_after_and_a_bad_pushback_stops() {
        assert_eq!(
            asked(&with(&[(RETRY_PUSHBACK_MS, "250"), (RETRY_AFTER, "60")])),
            Asked::Wait(Some(Duration::from_millis(250)))
        );
        assert_eq!(
            asked(&with(&[(RETRY_AFTER, "2")])),
            Asked::Wait(Some(Duration::from_secs(2)))
        );
        assert_eq!(asked(&with(&[])), Asked::Wait(None));
        assert_eq!(asked(&with(&[(RETRY_AFTER, "soon")])), Asked::Wait(None));
        for bad in ["-1", "soon", ""] {
            assert_eq!(
                asked(&with(&[(RETRY_PUSHBACK_MS, bad)])),
                Asked::NoRetry,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn replayed_reads_the_servers_metadata() {
        assert!(replayed(&with(&[(IDEMPOTENT_REPLAYED, "true")])));
        assert!(!replayed(&with(&[(IDEMPOTENT_REPLAYED, "false")])));
        assert!(!replayed(&with(&[])));
    }

    #[test]
    fn a_chosen_key_is_checked_and_debug_shows_no_secret() {
        let retry = GrpcRetry::new(RetryPolicy::default())
            .with_metadata(with(&[("authorization", "Bearer secret")]));
        let call = retry.prepare(()).with_key("k-1").unwrap();
        assert_eq!(call.key(), "k-1");
        let shown = format!("{call:?}");
        assert!(
            !shown.contains("k-1") && !shown.contains("secret"),
            "{shown}"
        );
        assert!(retry.prepare(()).with_key("").is_err());
        assert!(retry.prepare(()).with_key("a b").is_err());
        let fresh = (
            retry.prepare(()).key().to_owned(),
            retry.prepare(()).key().to_owned(),
        );
        assert_ne!(fresh.0, fresh.1, "each logical call has its own key");
    }
}
