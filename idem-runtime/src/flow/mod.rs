//! The request flow that `#[idempotent]` expands to, top to bottom:
//!
//! 1. [`extract`]: [`Input`] wraps the handler's last extractor. It validates the
//!    `Idempotency-Key` header (400), buffers the body up to
//!    [`StoreOptions::max_request_body`] (413), fingerprints the request, then runs the wrapped
//!    extractor on the buffered request.
//! 2. The claim, in one of two modes:
//!    - [`transactional`]: [`Claim::acquire`] holds the key in the process, begins the
//!      handler's transaction and claims `(scope, key)` in it; [`Claim::complete`] stores the
//!      response in the same transaction and commits both, or rolls back both.
//!    - [`external`]: [`ExternalClaim::acquire`] commits a leased `started` row first;
//!      [`ExternalClaim::complete`] stores the response under the claim's token afterwards.
//! 3. The handler body runs between the two, within its `timeout` if it has one ([`run_until`]).
//! 4. [`capture`]: the handler's response read for storage and the completion that writes it.
//! 5. [`answers`]: every answer the layer gives itself (a replay, 409, 422, a problem), each
//!    ending the request ([`request`]) with an [`outcome`] recorded on its span.
//!
//! [`StoreOptions::max_request_body`]: crate::store::StoreOptions::max_request_body

#![allow(
    clippy::result_large_err,
    reason = "an early answer is an axum `Response`, as axum's own rejections are"
)]

mod answers;
mod capture;
mod external;
mod extract;
#[cfg(feature = "grpc")]
pub mod grpc;
mod outcome;
mod request;
mod transactional;

use std::time::Duration;

use tokio::time::Instant;

pub use external::ExternalClaim;
pub use extract::Input;
pub use transactional::{Acquired, Attempt, Claim};

/// The stored scope of one request: the value its keys are stored under, a caller's, or
/// everyone's (`#[idempotent(global)]`). What the handler declared is `policy::KeyScope`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredScope {
    /// Keys shared by all callers.
    Global,
    /// Keys of one caller.
    Caller(String),
}

/// Gives the handler body's future its declared output type, so `?` and `return` inside it
/// behave as in the original function.
pub fn typed_body<T, F: std::future::Future<Output = T>>(future: F) -> F {
    future
}

/// How long a handler body may run: until its `timeout`, and in transactional mode until the
/// request's database deadline, whichever comes first.
#[derive(Debug, Clone, Copy)]
pub struct Limit {
    at: Option<Instant>,
    deadline: bool,
}

impl Limit {
    /// The earlier of `timeout` from now and `deadline`.
    pub(crate) fn earlier_of(timeout: Option<Duration>, deadline: Option<Instant>) -> Self {
        let timeout = timeout.map(|limit| Instant::now() + limit);
        match (timeout, deadline) {
            (Some(at), Some(deadline)) if deadline < at => Self {
                at: Some(deadline),
                deadline: true,
            },
            (Some(at), _) => Self {
                at: Some(at),
                deadline: false,
            },
            (None, deadline) => Self {
                at: deadline,
                deadline: deadline.is_some(),
            },
        }
    }

    /// Whether the limit is the request's database deadline rather than the handler's
    /// `timeout`.
    pub(crate) fn is_deadline(&self) -> bool {
        self.deadline
    }
}

/// Runs the handler body until `limit`: `None` when it ran longer, in which case the body's
/// future has been dropped (and with it whatever it borrowed, such as the transaction).
pub async fn run_until<F: std::future::Future>(limit: Limit, body: F) -> Option<F::Output> {
    match limit.at {
        Some(at) => tokio::time::timeout_at(at, body).await.ok(),
        None => Some(body.await),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn within_drops_a_body_that_runs_past_its_limit() {
        let limit = Limit::earlier_of(Some(Duration::from_millis(10)), None);
        assert_eq!(run_until(limit, async { 7 }).await, Some(7));
        assert_eq!(run_until(limit, std::future::pending::<()>()).await, None);
    }

    #[tokio::test]
    async fn a_limit_is_the_earlier_of_the_timeout_and_the_deadline() {
        let soon = Instant::now() + Duration::from_secs(1);
        let late = Instant::now() + Duration::from_secs(3600);
        assert!(Limit::earlier_of(Some(Duration::from_secs(60)), Some(soon)).is_deadline());
        assert!(!Limit::earlier_of(Some(Duration::from_secs(60)), Some(late)).is_deadline());
        assert!(Limit::earlier_of(None, Some(late)).is_deadline());
        let unbounded = Limit::earlier_of(None, None);
        assert!(!unbounded.is_deadline());
        assert_eq!(run_until(unbounded, async { 7 }).await, Some(7));
    }
}
