//! # idem-client: retries that are safe
//!
//! A [`reqwest_middleware`] middleware (feature `http`, on by default) and a caller for tonic
//! (feature `grpc`, [`grpc`]) that follow the client's side of the `Idempotency-Key` rules:
//!
//! - one key per logical request (a UUID v4), made before the first attempt and sent by every
//!   retry of it, never with another request;
//! - retries on network errors, `409`, `429` and `5xx` only, with exponential backoff and full
//!   jitter, honouring `Retry-After`, within a number of attempts and a total time budget;
//! - never a retry of `400`, `401`, `402`, `404`, `422` or any other final answer, nor of
//!   idem's `500` whose problem type is `claimparked` (a person must act first);
//! - keys of user actions kept in a [`KeyStore`] until the action has a final answer, across
//!   restarts of the client.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_client::Error> {
//! use idem_client::{IdempotentRetry, RetryPolicy};
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotentRetry::new(RetryPolicy::default()))
//!     .build();
//! let answer = client
//!     .post("http://127.0.0.1:3000/v1/payments")
//!     .bearer_auth("tenant_1")
//!     .json(&serde_json::json!({"amount": 4200, "currency": "usd", "customer": "cus_123"}))
//!     .send()
//!     .await?;
//! let answer = idem_client::check(answer).await?; // a problem+json error becomes Error::Problem
//! println!("replayed: {}", idem_client::replayed(&answer));
//! # Ok(())
//! # }
//! ```
//!
//! Errors of the middleware itself ([`KeyReused`], [`StreamedAction`], [`BudgetSpent`],
//! [`KeyStoreError`]) arrive as `reqwest_middleware::Error::Middleware`; find them with
//! `error.downcast_ref::<KeyReused>()` on its `anyhow::Error`. Place this middleware last in
//! the stack, nearest the network: a retry of an outer middleware then sends the same key.
//! Each attempt is bounded by the client's own timeout (set one); the budget bounds when the
//! last attempt may start.
//!
//! To keep a key across restarts, give the middleware a store and the request an [`Action`]:
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_client::Error> {
//! use idem_client::{Action, FileKeyStore, IdempotentRetry, RetryPolicy};
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotentRetry::new(RetryPolicy::default()).with_store(FileKeyStore::new("pay.key")))
//!     .build();
//! let answer = client
//!     .post("http://127.0.0.1:3000/v1/payments")
//!     .json(&serde_json::json!({"amount": 4200}))
//!     .with_extension(Action("pay".into()))
//!     .send()
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## gRPC
//!
//! With the feature `grpc`, [`grpc::GrpcRetry`] applies the same rules to tonic calls: one
//! key per logical call (`idempotency-key` metadata), made before its first attempt and sent by
//! each retry; retries of `ABORTED`, `UNAVAILABLE` and transport failures, after the policy's
//! backoff or the server's `grpc-retry-pushback-ms` (else `retry-after`) if longer; never a
//! retry of `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `NOT_FOUND`, `UNAUTHENTICATED` or
//! `PERMISSION_DENIED`. It works with any generated client, through a closure that sends one
//! attempt; [`grpc::replayed`] tells a replay. Without the default feature
//! (`default-features = false, features = ["grpc"]`), reqwest is not built.
//!
//! See [`grpc`] for an example.

// A build without one of the features has no page for the items it leaves out: their links
// are text there (the workspace's build, with both, checks them).
#![cfg_attr(
    not(all(feature = "http", feature = "grpc")),
    allow(rustdoc::broken_intra_doc_links)
)]

#[cfg(feature = "grpc")]
pub mod grpc;
mod key_store;
#[cfg(feature = "http")]
mod middleware;
mod policy;
#[cfg(feature = "http")]
mod problem;
#[cfg(any(feature = "http", feature = "grpc"))]
mod retry_after;
#[cfg(any(feature = "http", feature = "grpc"))]
mod schedule;

pub use key_store::{FileKeyStore, KeyStore, KeyStoreError, StoredKey};
#[cfg(feature = "http")]
pub use middleware::{
    Action, BudgetSpent, IDEMPOTENCY_KEY, IdempotencyKey, IdempotentRetry, KeyReused,
    StreamedAction,
};
pub use policy::RetryPolicy;
#[cfg(feature = "http")]
pub use problem::{Error, IDEMPOTENT_REPLAYED, Problem, check, replayed};
#[cfg(feature = "http")]
pub use reqwest_middleware;
#[cfg(any(feature = "http", feature = "grpc"))]
pub use schedule::Attempt;
