//! # idem: retry-safe Axum handlers
//!
//! Clients retry: timeouts, dropped connections, a user tapping "Pay" twice. idem makes a POST
//! handler safe to retry with the `Idempotency-Key` header: the handler runs once per
//! `(scope, key)`, its response is stored in the same commit as its writes, and every retry
//! gets that response back.
//!
//! ```no_run
//! use axum::{Json, extract::Path, http::StatusCode};
//! use idem_runtime::idempotent;
//! use sqlx::{Postgres, Transaction};
//!
//! #[derive(serde::Deserialize)]
//! struct NewPayment { amount: i64 }
//!
//! // POST /accounts/{account}/payments; in a real service the scope is the authenticated
//! // caller, from an extractor of your own.
//! #[idempotent(scope = "account", retention = "24h")]
//! async fn create_payment(
//!     Path(account): Path<String>,
//!     tx: &mut Transaction<'_, Postgres>,
//!     Json(body): Json<NewPayment>,
//! ) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO payments (account, amount) VALUES ($1, $2)")
//!         .bind(&account)
//!         .bind(body.amount)
//!         .execute(&mut **tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED)
//! }
//! ```
//!
//! The handler's router state must provide a [`Store`] through
//! [`FromRef`](axum::extract::FromRef), and [`migrate`] must have created the key table.
//! The guide's chapter "What a request gets" (`docs/guide/requests.md` in the repository) has
//! the full behaviour table.
//!
//! A handler without a transaction parameter is in external mode, for a side effect in another
//! system: the key is claimed with a lease first, and [`IdempotencyContext::derive`] gives the
//! downstream call a key of its own. Work in several steps (reserve, charge, ship) takes a
//! [`Steps`] parameter: each step is recorded on the key as it completes, and a retry resumes
//! after the last one. The [`tasks`] purge expired keys and settle abandoned claims. The
//! crate `idem-events` adds a transactional outbox and idempotent queue consumers.

#[cfg(feature = "openapi")]
pub mod openapi;
pub mod policy;

#[cfg(not(any(feature = "postgres", feature = "sqlite")))]
compile_error!(
    "idem-runtime needs a database: enable its feature `postgres` or `sqlite` (or both), e.g. `idem-runtime = { version = \"0.1\", features = [\"sqlite\"] }`"
);
pub mod tasks;

mod backend;
mod context;
mod error;
mod flow;
mod problem;
mod record;
mod replay;
mod run_to_end;
mod scope;
mod steps;
mod store;

pub use backend::{Backend, migrate};
pub use context::IdempotencyContext;
pub use error::Error;
pub use idem_macros::idempotent;
pub use problem::{DEFAULT_PROBLEM_TYPE_BASE, Problem, ProblemKind};
pub use record::RecordedStep;
pub use scope::IdempotencyScope;
pub use steps::{StepError, Steps};
pub use store::{Settings, Store};

/// The longest scope value keys can be stored under, in bytes; a longer one is answered 400
/// [`ProblemKind::InvalidScope`]. It keeps `(scope, key)` within what a PostgreSQL index entry
/// holds.
pub const MAX_SCOPE_LEN: usize = 1024;
pub use tokio_util::sync::CancellationToken;

/// The sqlx idem is built on: a handler's `Transaction` and the pool given to [`Store`] must be
/// this version's types.
pub use sqlx;

/// What the `#[idempotent]` macro's output names. Not a public API: it may change in any
/// release, in step with the macro (which is pinned to this crate's exact version).
#[doc(hidden)]
pub mod __private {
    pub use crate::flow::{Claim, ExternalClaim, Input, Scope, hint, scope_of, within};
    pub use crate::policy::{HandlerPolicy, KeyScope, Mode, Registered};
    pub use inventory;
    /// The backend of handlers that have no transaction parameter to name one: PostgreSQL
    /// when its feature is on, else SQLite.
    #[cfg(feature = "postgres")]
    pub type DefaultBackend = sqlx::Postgres;
    /// The backend of handlers that have no transaction parameter to name one: PostgreSQL
    /// when its feature is on, else SQLite.
    #[cfg(all(feature = "sqlite", not(feature = "postgres")))]
    pub type DefaultBackend = sqlx::Sqlite;
    pub use axum::response::{IntoResponse, Response};
    pub use tracing::Instrument;

    /// `#[idempotent(state = S)]`: the router state `S` provides the store. A trait bound on
    /// `S` (rather than a `where` on `Store`), so that the compiler's error points at the state
    /// type; it names `Store<DB>` and `FromRef<S>`.
    pub trait ProvidesStore<DB: crate::Backend> {}
    impl<S, DB: crate::Backend> ProvidesStore<DB> for S where crate::Store<DB>: axum::extract::FromRef<S>
    {}

    /// Compiles only when `S` provides `Store<DB>`.
    pub fn state_provides_store<S: ProvidesStore<DB>, DB: crate::Backend>() {}

    /// `#[idempotent(state = S)]`: every argument but the last reads only the request's parts.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not the last argument, but it is not an extractor of the request's parts",
        label = "only the last argument may read the request body; move this one last",
        note = "every argument but the last must implement `axum::extract::FromRequestParts<{S}>`"
    )]
    pub trait PartsExtractor<S> {}
    impl<S, T: axum::extract::FromRequestParts<S>> PartsExtractor<S> for T {}

    /// Compiles only when `T` is an extractor of the request's parts for state `S`.
    pub fn reads_only_parts<T: PartsExtractor<S>, S>() {}
}
