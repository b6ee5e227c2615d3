//! The request flow that `#[idempotent]` expands to: extract, claim, run, complete.
//!
//! 1. [`Input`] wraps the handler's last extractor. It reads and validates the
//!    `Idempotency-Key` header, buffers the body (up to [`Settings::max_request_body`]),
//!    fingerprints the request, then runs the wrapped extractor on the buffered request.
//! 2. [`Claim::acquire`] begins the handler's transaction and claims `(scope, key)` in it:
//!    either the transaction now holds the key, or the stored response is replayed, or the
//!    request is answered 409 / 422 at once.
//! 3. The handler body runs with `&mut Transaction` borrowed from the claim, so it cannot
//!    commit.
//! 4. [`Claim::complete`] stores the response in the same transaction and commits both, or
//!    rolls back both.
//!
//! [`Settings::max_request_body`]: crate::Settings::max_request_body

#![allow(
    clippy::result_large_err,
    reason = "an early answer is an axum `Response`, as axum's own rejections are"
)]

use std::time::Duration;

use axum::{
    body::Body,
    extract::{FromRef, FromRequest, FromRequestParts, Request},
    response::{IntoResponse, Response},
};
use http::Method;
use http_body_util::BodyExt;
use sqlx::Transaction;
use tracing::{Span, field::Empty};

use crate::{
    backend::{Backend, Begun},
    context::IdempotencyContext,
    fingerprint::Fingerprint,
    header::{self, IdempotencyKey, KeyError},
    problem::ProblemKind,
    record::{
        Completion, KeyRecord, KeyRef, KeyStatus, Start, Started, StoredResponse, fresh_token,
    },
    replay::{self, CaptureError, Captured},
    scope::IdempotencyScope,
    store::{HeldKey, Hold, Store},
};

/// Marks the [`FromRequest`] impl of [`Input`] whose inner extractor consumes the body.
#[derive(Debug)]
pub enum ViaBody {}

/// Marks the [`FromRequest`] impl of [`Input`] whose inner extractor reads only the parts.
#[derive(Debug)]
pub enum ViaParts {}

/// The handler's last extractor, run after the idempotency key and body have been taken.
#[derive(Debug)]
pub struct Input<T, DB: Backend> {
    /// What the wrapped extractor produced.
    pub value: T,
    /// The key, fingerprint and store of this request.
    pub request: IdemRequest<DB>,
}

/// A request that carries a valid key and has been fingerprinted.
pub struct IdemRequest<DB: Backend> {
    store: Store<DB>,
    key: IdempotencyKey,
    method: Method,
    path: String,
    fingerprint: Fingerprint,
    span: Span,
}

impl<DB: Backend> std::fmt::Debug for IdemRequest<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemRequest")
            .field("method", &self.method)
            .field("path", &self.path)
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> IdemRequest<DB> {
    /// The `idempotency` span of this request; the handler runs inside it.
    pub fn span(&self) -> Span {
        self.span.clone()
    }

    fn finish(&self, outcome: Outcome, response: Response) -> Response {
        finish(&self.span, outcome, response)
    }

    fn store_failed(&self, error: &sqlx::Error) -> Response {
        tracing::error!(parent: &self.span, %error, "idempotency store failed");
        self.finish(
            Outcome::Failed,
            ProblemKind::StoreUnavailable
                .with_detail(
                    "the idempotency store failed; nothing was stored, retry with the same key",
                )
                .into_response(),
        )
    }
}

/// How a request through the layer ended, as recorded on its span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The handler ran and its outcome was committed with the key.
    Executed,
    /// The handler ran, answered 5xx, and nothing was stored (`replay_5xx = false`).
    NotStored,
    /// A stored response was replayed.
    Replayed,
    /// Another request holds the key: 409.
    Conflict,
    /// The key was used before with another request: 422.
    Mismatch,
    /// The key, body or an extractor was refused before the handler ran.
    Rejected,
    /// The store failed or the response could not be stored; nothing was committed.
    Failed,
    /// The handler ran past its `timeout` and was stopped; nothing was stored.
    TimedOut,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::NotStored => "executed_not_stored",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
            Self::TimedOut => "timed_out",
        }
    }
}

fn finish(span: &Span, outcome: Outcome, response: Response) -> Response {
    let status = response.status().as_u16();
    span.record("outcome", outcome.as_str());
    span.record("status", status);
    tracing::info!(parent: span, outcome = outcome.as_str(), status, "idempotent request");
    response
}

fn key_problem(error: &KeyError) -> Response {
    let kind = if matches!(error, KeyError::Missing) {
        ProblemKind::MissingKey
    } else {
        ProblemKind::MalformedKey
    };
    kind.with_detail(error.to_string()).into_response()
}

async fn prepare<S, DB>(request: Request, state: &S) -> Result<(Request, IdemRequest<DB>), Response>
where
    S: Send + Sync,
    DB: Backend,
    Store<DB>: FromRef<S>,
{
    let store = Store::<DB>::from_ref(state);
    let (parts, body) = request.into_parts();
    // Inside `Router::nest` the handler sees its path without the prefix; the fingerprint must
    // see the whole path, or two resources under different prefixes would share keys.
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let span = tracing::info_span!(
        "idempotency",
        method = %parts.method,
        path = %path,
        key_id = Empty,
        outcome = Empty,
        status = Empty,
    );
    let key = match header::parse_key(&parts.headers) {
        Ok(key) => key,
        Err(error) => return Err(finish(&span, Outcome::Rejected, key_problem(&error))),
    };
    let limit = store.settings().max_request_body;
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            let problem = if error.is::<http_body_util::LengthLimitError>() {
                ProblemKind::BodyTooLarge.with_detail(format!(
                    "the request body is larger than {limit} bytes; nothing was stored"
                ))
            } else {
                axum_problem_bad_body(&error.to_string())
            };
            return Err(finish(&span, Outcome::Rejected, problem.into_response()));
        }
    };
    let fingerprint = Fingerprint::of(&parts.method, &path, &parts.headers, &bytes);
    let method = parts.method.clone();
    let request = Request::from_parts(parts, Body::from(bytes));
    Ok((
        request,
        IdemRequest {
            store,
            key,
            method,
            path,
            fingerprint,
            span,
        },
    ))
}

fn axum_problem_bad_body(reason: &str) -> crate::Problem {
    crate::Problem::new(
        http::StatusCode::BAD_REQUEST,
        "Request body could not be read",
    )
    .with_detail(format!("reading the request body failed: {reason}"))
}

impl<T, DB: Backend> Input<T, DB> {
    fn accept<R: IntoResponse>(
        extracted: Result<T, R>,
        request: IdemRequest<DB>,
    ) -> Result<Self, Response> {
        match extracted {
            Ok(value) => Ok(Self { value, request }),
            Err(rejection) => Err(request.finish(Outcome::Rejected, rejection.into_response())),
        }
    }
}

impl<S, T, DB> FromRequest<S, ViaBody> for Input<T, DB>
where
    S: Send + Sync,
    T: FromRequest<S>,
    DB: Backend,
    Store<DB>: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (request, idem) = prepare::<S, DB>(request, state).await?;
        Self::accept(T::from_request(request, state).await, idem)
    }
}

impl<S, T, DB> FromRequest<S, ViaParts> for Input<T, DB>
where
    S: Send + Sync,
    T: FromRequestParts<S>,
    DB: Backend,
    Store<DB>: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (request, idem) = prepare::<S, DB>(request, state).await?;
        let (mut parts, _) = request.into_parts();
        Self::accept(T::from_request_parts(&mut parts, state).await, idem)
    }
}

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

impl<DB: Backend> IdemRequest<DB> {
    /// The key under the handler's scope; an empty caller scope is refused.
    fn key_ref(&self, scope: Scope) -> Result<KeyRef, Response> {
        let scope = match scope {
            Scope::Global => String::new(),
            Scope::Caller(scope) => {
                let wrong = if scope.is_empty() {
                    Some("is empty".to_owned())
                } else if scope.contains('\0') {
                    Some("contains the character U+0000 (NUL)".to_owned())
                } else if scope.len() > crate::MAX_SCOPE_LEN {
                    Some(format!(
                        "is {} bytes long, over the limit of {}",
                        scope.len(),
                        crate::MAX_SCOPE_LEN
                    ))
                } else {
                    None
                };
                if let Some(wrong) = wrong {
                    return Err(self.finish(
                        Outcome::Rejected,
                        ProblemKind::InvalidScope
                            .with_detail(format!(
                                "the caller this request is scoped to {wrong}; nothing was stored"
                            ))
                            .into_response(),
                    ));
                }
                scope
            }
        };
        let key = KeyRef::new(scope, self.key.as_str().to_owned());
        self.span.record("key_id", key.log_id());
        Ok(key)
    }

    /// The database refused the COMMIT (a deferred constraint, a serialization failure), or
    /// the connection broke during it and the outcome is unknown.
    fn commit_failed(&self, error: &sqlx::Error) -> Response {
        tracing::error!(parent: &self.span, %error, "committing the handler's transaction failed");
        let problem = match error {
            sqlx::Error::Database(refusal) => ProblemKind::CommitRefused.with_detail(format!(
                "the database refused to commit the handler's writes ({}); nothing was stored, retry with the same key",
                refusal.message()
            )),
            _ => ProblemKind::OutcomeUnknown.with_detail(
                "the connection failed while committing; retry with the same key to get the stored outcome, or to run the request if it was not committed",
            ),
        };
        self.finish(Outcome::Failed, problem.into_response())
    }

    /// 409: the key is held by another request, for about `retry_after`.
    fn in_progress(&self, retry_after: Option<Duration>) -> Response {
        let default = self.store.settings().retry_after;
        let seconds = retry_after.unwrap_or(default).as_secs_f64().ceil().max(1.0) as u64;
        self.finish(
            Outcome::Conflict,
            ProblemKind::InProgress
                .with_detail(format!(
                    "a request with this idempotency key is being processed; retry after {seconds}s to get its outcome"
                ))
                .with_retry_after(seconds)
                .into_response(),
        )
    }

    /// The answer to a request whose key has a live row: 422, a replay, or 409.
    fn answer_existing(&self, record: KeyRecord, lease_left: Option<Duration>) -> Response {
        if record.fingerprint != self.fingerprint {
            return self.finish(
                Outcome::Mismatch,
                ProblemKind::KeyReused
                    .with_detail(format!(
                        "this idempotency key was already used for a different request ({} {}); use a new key for a new request",
                        record.method, record.path
                    ))
                    .into_response(),
            );
        }
        match (record.status, record.response) {
            (KeyStatus::Completed, Some(stored)) => {
                self.finish(Outcome::Replayed, replay::replay(stored))
            }
            (KeyStatus::Started, _) => self.in_progress(lease_left),
            (KeyStatus::Completed, None) => self.store_failed(&sqlx::Error::Protocol(
                "a completed idempotency key has no stored response".into(),
            )),
        }
    }

    /// Reads the handler's response for storage.
    async fn capture(&self, response: Response) -> Result<Captured, Response> {
        let limit = self.store.settings().max_response_body;
        match Captured::read(response, limit).await {
            Ok(captured) => Ok(captured),
            Err(error @ CaptureError::TooLarge { .. }) => Err(self.finish(
                Outcome::Failed,
                ProblemKind::ResponseTooLarge
                    .with_detail(format!("{error}; the handler's outcome was not stored"))
                    .into_response(),
            )),
            Err(CaptureError::Body(error)) => {
                tracing::error!(parent: &self.span, %error, "response body failed");
                Err(self.finish(
                    Outcome::Failed,
                    crate::Problem::new(
                        http::StatusCode::INTERNAL_SERVER_ERROR,
                        "Response body failed",
                    )
                    .with_detail("the handler's response body failed; its outcome was not stored")
                    .into_response(),
                ))
            }
        }
    }

    fn completion<'a>(
        &'a self,
        key: &'a KeyRef,
        stored: &'a StoredResponse,
        retention: Duration,
    ) -> Completion<'a> {
        Completion {
            key,
            method: self.method.as_str(),
            path: &self.path,
            fingerprint: &self.fingerprint,
            response: stored,
            retention,
        }
    }
}

/// A key held by this request's transaction, for as long as the transaction lives.
#[derive(Debug)]
pub struct Claim<DB: Backend> {
    tx: Transaction<'static, DB>,
    request: IdemRequest<DB>,
    key: KeyRef,
    options: Options,
    /// Dropped after `tx` (fields drop in order): the process lets go of the key only once the
    /// database has.
    _held: HeldKey,
    /// Single-writer databases: this process's turn to write, held as long as the transaction.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<DB: Backend> Claim<DB> {
    /// Begins the handler's transaction and claims the key in it.
    ///
    /// # Errors
    ///
    /// The response to send instead of running the handler: the replay of a stored response,
    /// 409 while another request holds the key, 422 when the key was used for another request,
    /// or a problem when the store fails.
    pub async fn acquire(
        request: IdemRequest<DB>,
        scope: Scope,
        options: Options,
    ) -> Result<Self, Response> {
        let key = request.key_ref(scope)?;
        let held = match request.store.hold(key.lock_id) {
            Hold::Taken(held) => held,
            // A handler of this process runs with the key: 409 without touching the database,
            // so the answer comes at once even when every pooled connection is busy.
            Hold::Running => return Err(request.in_progress(None)),
            // Another request of this process is claiming the key or replaying it: a finished
            // key is replayed (concurrent replays must not turn each other into 409s).
            Hold::Claiming => {
                let looked_up = match request.store.connection().await {
                    Ok(mut conn) => DB::lookup(&mut conn, &key).await,
                    Err(error) => Err(error),
                };
                return match looked_up {
                    Ok(Some(record)) if record.status == KeyStatus::Completed => {
                        Err(request.answer_existing(record, None))
                    }
                    Ok(_) => Err(request.in_progress(None)),
                    Err(error) => Err(request.store_failed(&error)),
                };
            }
        };
        let mut permit = None;
        if DB::SINGLE_WRITER {
            // A finished key is answered without queueing for the single writer.
            let looked_up = match request.store.connection().await {
                Ok(mut conn) => DB::lookup(&mut conn, &key).await,
                Err(error) => Err(error),
            };
            match looked_up {
                Ok(Some(record)) if record.status == KeyStatus::Completed => {
                    return Err(request.answer_existing(record, None));
                }
                Ok(_) => {}
                Err(error) => return Err(request.store_failed(&error)),
            }
            // Writers of this process queue here, not inside the database while holding a
            // pooled connection: the pool stays free for replays and 409s.
            permit = request.store.write_permit().await;
        }
        let begun = match request.store.connection().await {
            Ok(conn) => DB::begin_claim(conn, &key).await,
            Err(error) => Err(error),
        };
        match begun {
            Ok(Begun::Acquired(mut tx)) => {
                held.running();
                if options.replay_5xx {
                    DB::savepoint(&mut tx)
                        .await
                        .map_err(|e| request.store_failed(&e))?;
                }
                Ok(Self {
                    tx,
                    request,
                    key,
                    options,
                    _held: held,
                    _permit: permit,
                })
            }
            Ok(Begun::Busy) => Err(request.in_progress(None)),
            Ok(Begun::Live(record)) => Err(request.answer_existing(record, None)),
            Err(error) => Err(request.store_failed(&error)),
        }
    }

    /// The transaction the handler body runs in.
    pub fn transaction(&mut self) -> &mut Transaction<'static, DB> {
        &mut self.tx
    }

    /// The handler's idempotency context.
    pub fn context(&self) -> IdempotencyContext {
        IdempotencyContext::new(&self.key.scope, &self.key.key)
    }

    /// Stores the handler's response with the key and commits, or rolls everything back.
    pub async fn complete(self, response: Response) -> Response {
        let Self {
            mut tx,
            request,
            key,
            options,
            _held,
            _permit,
        } = self;
        if response.status().is_server_error() {
            if !options.replay_5xx {
                if let Err(error) = tx.rollback().await {
                    tracing::warn!(parent: &request.span, %error, "rollback after a 5xx failed");
                }
                return request.finish(Outcome::NotStored, response);
            }
            if let Err(error) = DB::rollback_to_savepoint(&mut tx).await {
                return request.store_failed(&error);
            }
        }
        // On any early return below, dropping `tx` rolls back the writes and the claim.
        let captured = match request.capture(response).await {
            Ok(captured) => captured,
            Err(problem) => return problem,
        };
        let stored = captured.to_stored();
        let completion = request.completion(&key, &stored, options.retention);
        match DB::complete(&mut tx, &completion).await {
            Ok(true) => {}
            Ok(false) => {
                return request.finish(
                    Outcome::Failed,
                    ProblemKind::CommitRefused
                        .with_detail("the key's claim was gone at completion (did the handler run COMMIT or ROLLBACK itself?); the outcome was not stored")
                        .into_response(),
                );
            }
            Err(error) if DB::is_transaction_aborted(&error) => {
                // A statement of the handler failed and the handler answered anyway: its
                // answer stands, but nothing can be committed with it.
                tracing::warn!(parent: &request.span, "the handler's transaction was aborted by a failed statement; its answer was not stored");
                return request.finish(Outcome::NotStored, captured.into_response());
            }
            Err(error) => return request.store_failed(&error),
        }
        if let Err(error) = tx.commit().await {
            return request.commit_failed(&error);
        }
        request.finish(Outcome::Executed, captured.into_response())
    }
}

/// External mode: a `started` row committed before the handler runs, owned by a token and
/// exclusive for a lease. The side effect is outside the database, so nothing can make it
/// atomic with the stored response; a retry after the lease takes the key over, and the
/// handler's [`IdempotencyContext::derive`] keys make the downstream call happen once.
#[derive(Debug)]
pub struct ExternalClaim<DB: Backend> {
    request: IdemRequest<DB>,
    key: KeyRef,
    options: Options,
    token: i64,
    /// Until completion, dropping the claim (a panic, a cancelled request) releases the key.
    armed: bool,
}

impl<DB: Backend> ExternalClaim<DB> {
    /// Commits a `started` claim with a lease.
    ///
    /// # Errors
    ///
    /// The response to send instead of running the handler, as for [`Claim::acquire`]; a 409
    /// carries the lease's remaining time in `Retry-After`.
    pub async fn acquire(
        request: IdemRequest<DB>,
        scope: Scope,
        options: Options,
    ) -> Result<Self, Response> {
        let key = request.key_ref(scope)?;
        // Armed before the claim is sent: if this request is cancelled while the claim is in
        // flight, dropping it releases whatever was committed under its token.
        let mut claim = Self {
            request,
            key,
            options,
            token: fresh_token(),
            armed: true,
        };
        let outcome = {
            let start = Start {
                key: &claim.key,
                method: claim.request.method.as_str(),
                path: &claim.request.path,
                fingerprint: &claim.request.fingerprint,
                lease: options.lease,
                retention: options.retention,
                token: claim.token,
            };
            let _permit = claim.request.store.write_permit().await;
            match claim.request.store.connection().await {
                Ok(mut conn) => DB::start(&mut conn, &start).await,
                Err(error) => Err(error),
            }
        };
        if !matches!(outcome, Ok(Started::Acquired { .. })) {
            claim.armed = false;
        }
        match outcome {
            Ok(Started::Acquired { taken_over }) => {
                if taken_over {
                    tracing::info!(parent: &claim.request.span, "took over an abandoned or expired claim");
                }
                Ok(claim)
            }
            Ok(Started::Found { record, lease_left }) => {
                Err(claim.request.answer_existing(record, lease_left))
            }
            Ok(Started::Busy) => Err(claim.request.in_progress(None)),
            Err(error) => Err(claim.request.store_failed(&error)),
        }
    }

    /// The handler's idempotency context.
    pub fn context(&self) -> IdempotencyContext {
        IdempotencyContext::new(&self.key.scope, &self.key.key)
    }

    /// Stores the handler's response (or releases the key after a 5xx that is not replayed).
    ///
    /// The claim stays armed until the database has the outcome: a request cancelled before
    /// that releases its key when the claim is dropped.
    pub async fn complete(mut self, response: Response) -> Response {
        let pool = self.request.store.pool().clone();
        if response.status().is_server_error() && !self.options.replay_5xx {
            let released = {
                let _permit = self.request.store.write_permit().await;
                DB::release(&pool, &self.key, self.token).await
            };
            self.armed = false;
            if let Err(error) = released {
                tracing::error!(parent: &self.request.span, %error, "releasing the key after a 5xx failed; it frees itself when the lease ends");
            }
            return self.request.finish(Outcome::NotStored, response);
        }
        let captured = match self.request.capture(response).await {
            Ok(captured) => captured,
            Err(problem) => {
                let _permit = self.request.store.write_permit().await;
                let _ = DB::release(&pool, &self.key, self.token).await;
                self.armed = false;
                return problem;
            }
        };
        let stored = captured.to_stored();
        let finished = {
            let completion = self
                .request
                .completion(&self.key, &stored, self.options.retention);
            let _permit = self.request.store.write_permit().await;
            DB::finish(&pool, &completion, self.token).await
        };
        self.armed = false;
        match finished {
            Ok(true) => self
                .request
                .finish(Outcome::Executed, captured.into_response()),
            Ok(false) => {
                // The lease ran out and another request took the key over; it will store its
                // own outcome. This client still gets what the handler answered.
                tracing::warn!(parent: &self.request.span, "the claim's lease ran out before completion; the outcome was not stored");
                self.request
                    .finish(Outcome::NotStored, captured.into_response())
            }
            Err(error) => {
                tracing::error!(parent: &self.request.span, %error, "storing the outcome failed");
                self.request
                    .finish(Outcome::NotStored, captured.into_response())
            }
        }
    }
}

impl<DB: Backend> Drop for ExternalClaim<DB> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // The handler panicked or its request was cancelled: it is not running any more, so
        // the key can be released at once (the derived downstream keys keep a retry safe).
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.request.store.clone();
        let key = self.key.clone();
        let token = self.token;
        runtime.spawn(async move {
            let _permit = store.write_permit().await;
            if let Err(error) = DB::release(store.pool(), &key, token).await {
                tracing::warn!(%error, "releasing an interrupted claim failed; it frees itself when the lease ends");
            }
        });
    }
}

/// Runs the handler body for at most `limit`: `None` when it took longer, in which case the
/// body's future has been dropped (and with it whatever it borrowed, such as the transaction).
pub async fn within<F: std::future::Future>(limit: Duration, body: F) -> Option<F::Output> {
    tokio::time::timeout(limit, body).await.ok()
}

/// A duration in the attribute's syntax: `"1h30m"`, `"45s"`.
fn attribute_duration(duration: Duration) -> String {
    let mut left = duration.as_secs();
    if left == 0 {
        return format!("{}ms", duration.as_millis());
    }
    let mut text = String::new();
    for (unit, secs) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if left >= secs {
            text.push_str(&format!("{}{unit}", left / secs));
            left %= secs;
        }
    }
    text
}

impl<DB: Backend> IdemRequest<DB> {
    /// 503: the handler ran past its `timeout` and was stopped.
    fn timed_out(&self, timeout: Option<Duration>, undone: &str) -> Response {
        let limit = timeout.map_or_else(|| "its timeout".to_owned(), attribute_duration);
        tracing::warn!(parent: &self.span, timeout = %limit, "the handler ran past its timeout and was stopped");
        self.finish(
            Outcome::TimedOut,
            ProblemKind::HandlerTimedOut
                .with_detail(format!(
                    "the handler took longer than {limit} and was stopped; {undone} and nothing was stored, retry with the same key"
                ))
                .into_response(),
        )
    }
}

impl<DB: Backend> Claim<DB> {
    /// The handler body ran past its `timeout` and its future was dropped: rolls back its
    /// writes and the claim, and answers 503.
    pub async fn timed_out(self) -> Response {
        let Self {
            tx,
            request,
            options,
            _held,
            _permit,
            ..
        } = self;
        // Rolled back here rather than on drop, so that the connection is back in the pool
        // and the key free before the client hears about it.
        if let Err(error) = tx.rollback().await {
            tracing::warn!(parent: &request.span, %error, "rollback after a timeout failed");
        }
        request.timed_out(options.timeout, "its writes were rolled back")
    }
}

impl<DB: Backend> ExternalClaim<DB> {
    /// The handler body ran past its `timeout` and its future was dropped: releases the
    /// claim under its token, as a cancelled request does, and answers 503.
    ///
    /// The claim stays armed until the release returns: if this request is cancelled
    /// meanwhile, dropping the claim releases it.
    pub async fn timed_out(mut self) -> Response {
        let released = {
            let _permit = self.request.store.write_permit().await;
            DB::release(self.request.store.pool(), &self.key, self.token).await
        };
        self.armed = false;
        if let Err(error) = released {
            tracing::error!(parent: &self.request.span, %error, "releasing the key after a timeout failed; it frees itself when the lease ends");
        }
        self.request
            .timed_out(self.options.timeout, "the key was released")
    }
}

#[cfg(test)]
mod timeout_tests {
    use super::*;

    #[test]
    fn timeouts_are_written_in_the_attribute_syntax() {
        let text = |secs| attribute_duration(Duration::from_secs(secs));
        assert_eq!(text(1), "1s");
        assert_eq!(text(90), "1m30s");
        assert_eq!(text(3600), "1h");
        assert_eq!(text(86_401), "1d1s");
        assert_eq!(attribute_duration(Duration::from_millis(250)), "250ms");
    }

    #[tokio::test]
    async fn within_drops_a_body_that_runs_past_its_limit() {
        let limit = Duration::from_millis(10);
        assert_eq!(within(limit, async { 7 }).await, Some(7));
        assert_eq!(within(limit, std::future::pending::<()>()).await, None);
    }
}
