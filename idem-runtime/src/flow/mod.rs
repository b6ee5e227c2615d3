//! The request flow that `#[idempotent]` expands to, top to bottom:
//!
//! 1. [`extract`]: [`Input`] wraps the handler's last extractor. It validates the
//!    `Idempotency-Key` header (400), buffers the body up to
//!    [`Settings::max_request_body`] (413), fingerprints the request, then runs the wrapped
//!    extractor on the buffered request.
//! 2. The claim, in one of two modes:
//!    - [`transactional`]: [`Claim::acquire`] holds the key in the process, begins the
//!      handler's transaction and claims `(scope, key)` in it; [`Claim::complete`] stores the
//!      response in the same transaction and commits both, or rolls back both.
//!    - [`external`]: [`ExternalClaim::acquire`] commits a leased `started` row first;
//!      [`ExternalClaim::complete`] stores the response under the claim's token afterwards.
//! 3. The handler body runs between the two, within its `timeout` if it has one ([`within`]).
//! 4. [`outcome`]: every answer the layer gives itself (a replay, 409, 422, a problem) and
//!    how the request ended, recorded on its span.
//!
//! [`Settings::max_request_body`]: crate::Settings::max_request_body

#![allow(
    clippy::result_large_err,
    reason = "an early answer is an axum `Response`, as axum's own rejections are"
)]

mod external;
mod extract;
mod outcome;
mod transactional;

use std::time::Duration;

pub use external::ExternalClaim;
pub use extract::Input;
pub use transactional::Claim;

use crate::scope::IdempotencyScope;

/// Whose key it is: a caller's, or everyone's (`#[idempotent(global)]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Keys shared by all callers.
    Global,
    /// Keys of one caller.
    Caller(String),
}

/// The scope of the handler's scope parameter.
pub fn scope_of<T: IdempotencyScope + ?Sized>(value: &T) -> Scope {
    Scope::Caller(value.idempotency_scope().into_owned())
}

/// The attribute's arguments, as the macro parsed them.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// How long a completed key is kept and replayed.
    pub retention: Duration,
    /// Whether a 5xx outcome is stored and replayed (its writes undone) or rolled back.
    pub replay_5xx: bool,
    /// External mode: how long a claim is exclusive before a retry may take it over.
    pub lease: Duration,
    /// How long the handler body may run before it is stopped (`None`: unbounded).
    pub timeout: Option<Duration>,
}

/// Gives the handler body's future its declared output type, so `?` and `return` inside it
/// behave as in the original function.
pub fn hint<T, F: std::future::Future<Output = T>>(future: F) -> F {
    future
}

/// Runs the handler body for at most `limit`: `None` when it took longer, in which case the
/// body's future has been dropped (and with it whatever it borrowed, such as the transaction).
pub async fn within<F: std::future::Future>(limit: Duration, body: F) -> Option<F::Output> {
    tokio::time::timeout(limit, body).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn within_drops_a_body_that_runs_past_its_limit() {
        let limit = Duration::from_millis(10);
        assert_eq!(within(limit, async { 7 }).await, Some(7));
        assert_eq!(within(limit, std::future::pending::<()>()).await, None);
    }
}
