//! # idem: retry-safe Axum handlers
//!
//! Clients retry: timeouts, dropped connections, a user tapping "Pay" twice. idem makes a POST
//! handler safe to retry with the `Idempotency-Key` header: the handler runs once per
//! `(scope, key)`, its response is stored in the same commit as its writes, and every retry
//! gets that response back.
//!
//! ```no_run
//! use axum::{Json, Router, extract::Path, http::StatusCode, routing::post};
//! use idem_runtime::{Store, idempotent};
//! use sqlx::{PgPool, Postgres, Transaction};
//!
//! #[derive(serde::Deserialize)]
//! struct NewPayment { amount: i64 }
//!
//! // In a real service the scope is the authenticated caller, from an extractor of your own.
//! #[idempotent(scope = "account", retention = "24h")]
//! async fn create_payment(
//!     Path(account): Path<String>,
//!     tx: &mut Transaction<'_, Postgres>, // begun, claimed and committed by the macro
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
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! idem_runtime::migrate(&pool).await?; // creates the key table, once per database
//! let app: Router = Router::new()
//!     .route("/accounts/{account}/payments", post(create_payment))
//!     .with_state(Store::new(pool));
//! # let _ = app; Ok(()) }
//! ```
//!
//! The handler only borrows the transaction, so it cannot commit half its work: the macro
//! commits the business writes and the completed key together, or neither. The router's state
//! provides the [`Store`], as the state itself or through [`FromRef`]
//! (write `state = AppState` in the attribute to have that checked at the handler).
//!
//! ## Features
//!
//! No database is on by default, as in sqlx; pick one (or several). With none, the crate builds
//! and offers its types and problems, but a handler has no database to store its keys in:
//!
//! - `postgres`: handlers on `Transaction<'_, sqlx::Postgres>` (PostgreSQL 13 or newer), and
//!   `postgres::check_pooler`, which says at start what a connection pooler in front lets
//!   through.
//! - `sqlite`: handlers on `Transaction<'_, sqlx::Sqlite>` (SQLite 3.35 or newer, bundled), and
//!   `sqlite::connect`, which opens a file the way idem expects. It pulls in no PostgreSQL
//!   driver.
//! - `mysql`: handlers on `Transaction<'_, sqlx::MySql>` on MariaDB 10.6 or newer (InnoDB;
//!   Galera clusters too). MySQL 8 itself is not supported yet: the claim uses MariaDB's
//!   per-statement lock wait.
//! - `grpc`: `#[idempotent]` on tonic service methods, with `#[idem_runtime::grpc]` on their
//!   impl (the `grpc` module has the status mapping).
//! - `uuid`: [`IdempotencyScope`] for `uuid::Uuid`.
//!
//! ```toml
//! [dependencies]
//! idem-runtime = { version = "0.1", features = ["sqlite"] }
//! sqlx = { version = "0.9", features = ["runtime-tokio", "sqlite"] }
//! ```
//!
//! ## What a request gets
//!
//! | Situation | Response |
//! |---|---|
//! | `Idempotency-Key` missing or malformed | 400 `application/problem+json`, handler not run |
//! | First request with this (scope, key) | the handler runs once; its response is returned and stored in the same commit as its writes |
//! | Retry after the first finished, same request | the stored status, body, `Content-Type` and `Location`, plus `Idempotent-Replayed: true`; handler not run |
//! | Retry while the first is still running | 409 problem with `Retry-After`, at once; handler not run |
//! | Same key, different request (method, path, query or body) | 422 problem, handler not run |
//! | Same key from another scope | an independent request |
//! | Outcome 2xx, 3xx, 4xx | final: stored and replayed, writes committed |
//! | Outcome 5xx | not stored, rolled back, a retry runs again; with `replay_5xx = true` the writes are undone and the 5xx is stored |
//! | Panic, crash, dropped connection | nothing committed; a retry runs the handler |
//! | Key past its `retention` | unknown: a reuse is a new request |
//!
//! Every answer of the layer's own is a [`Problem`] with a stable `type` URI per
//! [`ProblemKind`]. This example runs the table's main rows against a SQLite file:
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use idem_runtime::{Store, idempotent};
//! use sqlx::{Sqlite, Transaction};
//! use tower::ServiceExt;
//!
//! #[idempotent(global, retention = "1h")]
//! async fn create(tx: &mut Transaction<'_, Sqlite>, body: String) -> (StatusCode, String) {
//!     sqlx::query("INSERT INTO notes (body) VALUES ($1)").bind(&body).execute(&mut **tx)
//!         .await.expect("insert");
//!     (StatusCode::CREATED, format!("noted {body}"))
//! }
//!
//! let dir = tempfile::tempdir()?;
//! let pool = idem_runtime::sqlite::connect(dir.path().join("app.db")).await?;
//! idem_runtime::migrate(&pool).await?;
//! sqlx::query("CREATE TABLE notes (body TEXT)").execute(&pool).await?;
//! let app = Router::new().route("/notes", post(create)).with_state(Store::new(pool.clone()));
//! let send = async |key: Option<&str>, body: &str| {
//!     let mut request = Request::post("/notes");
//!     if let Some(key) = key {
//!         request = request.header("idempotency-key", key);
//!     }
//!     let response = app.clone().oneshot(request.body(Body::from(body.to_owned()))?).await?;
//!     Ok::<_, Box<dyn std::error::Error>>((
//!         response.status(),
//!         response.headers().contains_key("idempotent-replayed"),
//!     ))
//! };
//!
//! assert_eq!(send(Some("k1"), "a").await?, (StatusCode::CREATED, false)); // runs
//! assert_eq!(send(Some("k1"), "a").await?, (StatusCode::CREATED, true)); // replayed
//! assert_eq!(send(Some("k1"), "b").await?.0, StatusCode::UNPROCESSABLE_ENTITY); // reused
//! assert_eq!(send(None, "a").await?.0, StatusCode::BAD_REQUEST); // no key
//! let notes: i64 = sqlx::query_scalar("SELECT count(*) FROM notes").fetch_one(&pool).await?;
//! assert_eq!(notes, 1, "the handler ran once");
//! # Ok(()) }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! ## Three modes
//!
//! - **Transactional** (above): the handler takes `&mut Transaction<'_, DB>`; key and writes
//!   commit together.
//! - **External**, for a side effect in another system (a card processor, an email API): the
//!   handler takes no transaction and says `external` in the attribute. The key is claimed
//!   first with a `lease`, and [`IdempotencyContext::derive`] gives the downstream call a key of
//!   its own, so that the other system executes the side effect once.
//! - **Multi-step**, for work in several commits and calls (reserve, charge, ship): an
//!   `external` handler that takes [`Steps`]; each step is recorded on the key as it completes,
//!   and a retry resumes after the last one.
//!
//! The [`tasks`] purge expired keys and settle claims their process abandoned. Beside this
//! crate: `idem-events`, a transactional outbox and idempotent queue consumers; `idem-openapi`,
//! the idempotency part of a `utoipa` OpenAPI document, from the handlers' attributes;
//! `idem-client`, a client that retries by these rules.
//!
//! ## Read on
//!
//! The attribute's arguments and what the compiler refuses: [`idempotent`]. The guide, in the
//! repository's `docs/guide/`, has a chapter per subject: the attribute, what a request gets
//! (headers, fingerprints, every problem), external mode, multi-step handlers, events, the
//! client, operations (timeouts, metrics, the `idem` command), performance, limits, and a
//! glossary.

// Without a database feature the crate offers its types, traits and problems but no store: the
// code only a backend calls is then unused. (It builds, as sqlx and tokio do with no feature on,
// so that `cargo package` verifies it with its default features.)
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code, reason = "only a database backend calls it")
)]

pub mod admin;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod policy;
pub mod signature;
pub mod tasks;

mod attribute;
mod backend;
mod checkout;
mod context;
mod error;
mod flow;
mod key_source;
#[cfg(feature = "postgres")]
mod pooler;
mod prefer;
mod problem;
mod record;
mod rekey;
mod replay;
mod report;
mod scope;
pub mod seal;
#[cfg(feature = "sqlite")]
mod sqlite_file;
mod steps;
mod store;
#[cfg(feature = "grpc")]
mod stored_grpc;
mod transient;

pub use backend::{Backend, migrate};
pub use context::IdempotencyContext;
pub use error::Error;
pub use idem_key::BodyFields;
#[cfg(feature = "grpc")]
pub use idem_macros::grpc;
pub use idem_macros::idempotent;
pub use key_source::KeySource;
pub use problem::{DEFAULT_PROBLEM_TYPE_BASE, PROBLEM_JSON, Problem, ProblemKind};
pub use record::RecordedStep;
pub use scope::{IdempotencyScope, MAX_SCOPE_LEN};
pub use steps::{StepError, Steps};
pub use store::{Store, StoreOptions};
pub use transient::is_transient;

pub use tokio_util::sync::CancellationToken;

/// The sqlx idem is built on: a handler's `Transaction` and the pool given to [`Store`] must be
/// this version's types.
pub use sqlx;

/// How a router's state, or a tonic service, hands handlers the [`Store`]: implement
/// `FromRef<YourState> for Store<DB>`. Re-exported from axum so that a service that serves only
/// gRPC needs no `axum` dependency of its own for it.
pub use axum::extract::FromRef;

#[cfg(feature = "postgres")]
pub mod postgres {
    //! PostgreSQL behind a connection pooler: what the pooler lets through, told at start instead
    //! of as a bare sqlx error under load.
    //!
    //! A pooler in session mode (PgBouncer's `pool_mode = session`) gives each client connection a
    //! server connection of its own for as long as it stays open: everything works as on a direct
    //! connection. In transaction mode it hands a server connection to a client for one transaction
    //! only, and to another client next. sqlx prepares every statement it sends under a name
    //! (`sqlx_s_<n>`, even with its statement cache off) and keeps it on the server connection, so
    //! two clients' names collide there (`prepared statement "sqlx_s_1" already exists`), and a
    //! statement's `Bind` can land on another server connection than its `Parse`. PgBouncer 1.21
    //! and newer keep clients' prepared statements apart when `max_prepared_statements` is set;
    //! older ones, and other poolers in transaction mode, do not.
    //!
    //! Before any of that, PgBouncer refuses a connection that sends a startup parameter it does
    //! not track and its `ignore_startup_parameters` does not list (`unsupported startup parameter:
    //! extra_float_digits`), in any mode; sqlx sends `extra_float_digits` unless told not to.
    //! [`connect_options`] leaves it out, and [`pooler_refusal`] explains the refusal.
    //!
    //! ```no_run
    //! # async fn example(pool: sqlx::PgPool) -> Result<(), idem_runtime::Error> {
    //! // Refuses a transaction-mode pooler that breaks sqlx's statements, with what to do.
    //! let pooling = idem_runtime::postgres::check_pooler(&pool).await?;
    //! if pooling == idem_runtime::postgres::Pooling::Shared {
    //!     // Serving works; run the migrations through a direct connection.
    //! }
    //! # Ok(()) }
    //! ```

    pub use crate::pooler::{Pooling, check_pooler, connect_options, pooler_refusal};
}

#[cfg(feature = "sqlite")]
pub mod sqlite {
    //! Opening a SQLite file as idem expects it: one writer at a time, readers beside it.
    //!
    //! ```no_run
    //! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
    //! use idem_runtime::Store;
    //!
    //! let pool = idem_runtime::sqlite::connect("app.db").await?;
    //! idem_runtime::migrate(&pool).await?;
    //! let store = Store::new(pool);
    //! # let _ = store;
    //! # Ok(()) }
    //! ```

    pub use crate::sqlite_file::{connect, connect_options};
}

/// What the `#[idempotent]` macro's output names. Not a public API: it may change in any
/// release, in step with the macro (which is pinned to this crate's exact version).
#[doc(hidden)]
pub mod __private {
    pub use crate::checkout::Checkout;
    pub use crate::flow::{
        Acquired, Attempt, Claim, ExternalClaim, Limit, StoredScope, run_until, typed_body,
    };
    pub use crate::key_source::KeySpec;
    pub use crate::policy::{HandlerPolicy, KeyScope, Mode, Registered};
    pub use idem_key::BodyFields;
    pub use inventory;
    /// The backend of `external` handlers that name none, when only one database feature is
    /// on (with several, the attribute requires `backend = ...`).
    #[cfg(feature = "postgres")]
    pub type DefaultBackend = sqlx::Postgres;
    /// The backend of `external` handlers that name none, when only one database feature is
    /// on (with several, the attribute requires `backend = ...`).
    #[cfg(all(feature = "sqlite", not(feature = "postgres")))]
    pub type DefaultBackend = sqlx::Sqlite;
    /// The backend of `external` handlers that name none, when only one database feature is
    /// on (with several, the attribute requires `backend = ...`).
    #[cfg(all(feature = "mysql", not(any(feature = "postgres", feature = "sqlite"))))]
    pub type DefaultBackend = sqlx::MySql;
    pub use axum::response::{IntoResponse, Response};
    pub use tracing::Instrument;
    /// What a tonic method's expansion names.
    #[cfg(feature = "grpc")]
    pub mod grpc {
        pub use crate::flow::grpc::{accept, accept_keyed, answer, into_http};
        pub use async_trait::async_trait;
        pub use tonic;
    }
}
