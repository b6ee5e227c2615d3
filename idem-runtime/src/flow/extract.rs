//! Extraction: the handler's last extractor, wrapped so that the `Idempotency-Key` header is
//! validated (400), the body buffered up to the limit (413) and the request fingerprinted
//! before the wrapped extractor runs on the buffered request.

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{FromRef, FromRequest, FromRequestParts, Request},
    response::{IntoResponse, Response},
};
use http::Method;
use http_body_util::BodyExt;
use tracing::{Span, field::Empty};

use idem_key::{Fingerprint, IdempotencyKey};

use super::{
    Scope,
    outcome::{Outcome, finish, key_problem},
};
use crate::{backend::Backend, problem::ProblemKind, record::KeyRef, store::Store};

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
    pub(super) store: Store<DB>,
    pub(super) key: IdempotencyKey,
    pub(super) method: Method,
    pub(super) path: String,
    pub(super) fingerprint: Fingerprint,
    pub(super) span: Span,
    /// The route's template (`/v1/payments/{id}`), the only label metrics get: never the
    /// path, key or scope.
    pub(super) route: Arc<str>,
    /// How long the client would rather wait than get a 409 (`Prefer: wait=<seconds>`).
    pub(super) prefer_wait: Option<std::time::Duration>,
    /// Once this request waits for a duplicate in flight: until when, and how.
    pub(super) waiting: Option<Waiting>,
}

/// A request waiting for the outcome of a duplicate in flight.
#[derive(Debug)]
pub(super) struct Waiting {
    /// When the wait ends, with a 409.
    pub(super) until: tokio::time::Instant,
    /// The wait applied, in seconds (`Preference-Applied: wait=<seconds>`).
    pub(super) seconds: u64,
    /// When it began.
    pub(super) since: tokio::time::Instant,
    /// The pauses between two looks at a key held in another process.
    pub(super) polls: idem_task::Backoff,
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
    /// Until when this request may wait for a duplicate in flight: the smaller of the client's
    /// `Prefer: wait` and the handler's `allowed` wait, counted from the first time it is asked;
    /// `None` when it may not wait (any more).
    pub(super) fn may_wait(
        &mut self,
        allowed: Option<std::time::Duration>,
    ) -> Option<tokio::time::Instant> {
        let now = tokio::time::Instant::now();
        if let Some(waiting) = &self.waiting {
            return (now < waiting.until).then_some(waiting.until);
        }
        let wait = self.prefer_wait?.min(allowed?);
        if wait.is_zero() {
            return None;
        }
        self.waiting = Some(Waiting {
            until: now + wait,
            seconds: wait.as_secs(),
            since: now,
            polls: idem_task::Backoff::new(
                std::time::Duration::from_millis(25),
                std::time::Duration::from_millis(500),
            ),
        });
        Some(now + wait)
    }

    /// Pauses before the next look at a key that another process holds, until `until` at the
    /// latest.
    pub(super) async fn pause(&mut self, until: tokio::time::Instant) {
        let pause = self
            .waiting
            .as_mut()
            .map_or(std::time::Duration::ZERO, |waiting| {
                waiting.polls.failed().0
            });
        let _counted = self.store.wait_counted();
        tokio::time::sleep_until((tokio::time::Instant::now() + pause).min(until)).await;
    }

    /// Waits for a request of this process to let go of the key, until `until` at the latest.
    pub(super) async fn wait_for(
        &self,
        holding: crate::store::Holding,
        until: tokio::time::Instant,
    ) {
        let _counted = self.store.wait_counted();
        holding.released(until).await;
    }

    /// The `idempotency` span of this request; the handler runs inside it.
    pub fn span(&self) -> Span {
        self.span.clone()
    }

    /// The key under the handler's scope; a scope that cannot hold keys is refused (400).
    pub(super) fn key_ref(&self, scope: Scope) -> Result<KeyRef, Response> {
        let scope =
            match scope {
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
                        self.problem(ProblemKind::InvalidScope, format!(
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
    let route: Arc<str> = parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".into(), |matched| matched.as_str().into());
    let span = tracing::info_span!(
        "idempotency",
        method = %parts.method,
        path = %path,
        key_id = Empty,
        outcome = Empty,
        status = Empty,
    );
    let key = match idem_key::parse_key(&parts.headers) {
        Ok(key) => key,
        Err(error) => {
            let problem = key_problem(&error, store.settings().problem_type_base());
            return Err(finish(&span, &route, Outcome::Rejected, problem));
        }
    };
    let limit = store.settings().max_request_body();
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            let problem = if error.is::<http_body_util::LengthLimitError>() {
                ProblemKind::BodyTooLarge.problem_under(
                    store.settings().problem_type_base(),
                    format!("the request body is larger than {limit} bytes; nothing was stored"),
                )
            } else {
                axum_problem_bad_body(&error.to_string())
            };
            return Err(finish(
                &span,
                &route,
                Outcome::Rejected,
                problem.into_response(),
            ));
        }
    };
    let fingerprint = Fingerprint::of(&parts.method, &path, &parts.headers, &bytes);
    let prefer_wait = crate::prefer::wait(&parts.headers);
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
            route,
            prefer_wait,
            waiting: None,
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
    pub(super) fn accept<R: IntoResponse>(
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
