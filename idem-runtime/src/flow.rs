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
    backend::Backend,
    fingerprint::Fingerprint,
    header::{self, IdempotencyKey, KeyError},
    problem::ProblemKind,
    record::{Completion, KeyRef, KeyStatus},
    replay::{self, CaptureError, Captured},
    scope::IdempotencyScope,
    store::Store,
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
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
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
    #[allow(
        clippy::result_large_err,
        reason = "the extractor's rejection is a `Response`"
    )]
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
}

/// Gives the handler body's future its declared output type, so `?` and `return` inside it
/// behave as in the original function.
pub fn hint<T, F: std::future::Future<Output = T>>(future: F) -> F {
    future
}

/// A key held by this request's transaction, for as long as the transaction lives.
#[derive(Debug)]
pub struct Claim<DB: Backend> {
    tx: Transaction<'static, DB>,
    request: IdemRequest<DB>,
    key: KeyRef,
    options: Options,
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
        let scope = match scope {
            Scope::Global => String::new(),
            Scope::Caller(scope) if scope.is_empty() => {
                return Err(request.finish(
                    Outcome::Failed,
                    ProblemKind::InvalidScope
                        .with_detail("the handler's scope parameter produced an empty scope value")
                        .into_response(),
                ));
            }
            Scope::Caller(scope) => scope,
        };
        let key = KeyRef::new(scope, request.key.as_str().to_owned());
        request.span.record("key_id", key.log_id());

        let mut tx = DB::begin(request.store.pool())
            .await
            .map_err(|e| request.store_failed(&e))?;
        let lookup = DB::claim(&mut tx, &key)
            .await
            .map_err(|e| request.store_failed(&e))?;

        match lookup.record {
            None if lookup.acquired => {
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
                })
            }
            None
            | Some(crate::record::KeyRecord {
                status: KeyStatus::Started,
                ..
            }) => {
                drop(tx);
                let retry_after = request.store.settings().retry_after.as_secs().max(1);
                Err(request.finish(
                    Outcome::Conflict,
                    ProblemKind::InProgress
                        .with_detail(format!(
                            "a request with this idempotency key is being processed; retry after {retry_after}s to get its outcome"
                        ))
                        .with_retry_after(retry_after)
                        .into_response(),
                ))
            }
            Some(record) => {
                // A read-only transaction: ending it now frees the connection sooner.
                let _ = tx.rollback().await;
                if record.fingerprint != request.fingerprint {
                    return Err(request.finish(
                        Outcome::Mismatch,
                        ProblemKind::KeyReused
                            .with_detail(format!(
                                "this idempotency key was already used for a different request ({} {}); use a new key for a new request",
                                record.method, record.path
                            ))
                            .into_response(),
                    ));
                }
                match record.response {
                    Some(stored) => Err(request.finish(Outcome::Replayed, replay::replay(stored))),
                    None => Err(request.store_failed(&sqlx::Error::Protocol(
                        "a completed idempotency key has no stored response".into(),
                    ))),
                }
            }
        }
    }

    /// The transaction the handler body runs in.
    pub fn transaction(&mut self) -> &mut Transaction<'static, DB> {
        &mut self.tx
    }

    /// Stores the handler's response with the key and commits, or rolls everything back.
    pub async fn complete(self, response: Response) -> Response {
        let Self {
            mut tx,
            request,
            key,
            options,
        } = self;
        let status = response.status();
        if status.is_server_error() {
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
        let limit = request.store.settings().max_response_body;
        let captured = match Captured::read(response, limit).await {
            Ok(captured) => captured,
            Err(error @ CaptureError::TooLarge { .. }) => {
                return request.finish(
                    Outcome::Failed,
                    ProblemKind::ResponseTooLarge
                        .with_detail(format!("{error}; the handler's writes were rolled back"))
                        .into_response(),
                );
            }
            Err(CaptureError::Body(error)) => {
                tracing::error!(parent: &request.span, %error, "response body failed");
                return request.finish(
                    Outcome::Failed,
                    crate::Problem::new(
                        http::StatusCode::INTERNAL_SERVER_ERROR,
                        "Response body failed",
                    )
                    .with_detail("the handler's response body failed; its writes were rolled back")
                    .into_response(),
                );
            }
        };
        let stored = captured.to_stored();
        let method = request.method.as_str();
        let completion = Completion {
            key: &key,
            method,
            path: &request.path,
            fingerprint: &request.fingerprint,
            response: &stored,
            retention: options.retention,
        };
        match DB::complete(&mut tx, &completion).await {
            Ok(true) => {}
            Ok(false) => {
                return request.finish(
                    Outcome::Conflict,
                    ProblemKind::InProgress
                        .with_detail("another request completed this idempotency key first; retry to get its outcome")
                        .with_retry_after(1)
                        .into_response(),
                );
            }
            Err(error) => return request.store_failed(&error),
        }
        if let Err(error) = tx.commit().await {
            return request.store_failed(&error);
        }
        request.finish(Outcome::Executed, captured.into_response())
    }
}
