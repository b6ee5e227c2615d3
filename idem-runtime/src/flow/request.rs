//! The request as the layer holds it between the extractor and the answer: its key, scope,
//! fingerprint, route and span, and what it is waiting for.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use http::Method;
use idem_key::{Fingerprint, IdempotencyKey};
use tracing::Span;

use super::{StoredScope, outcome::Outcome};
use crate::{backend::Backend, problem::ProblemKind, record::KeyRef, store::Store};

/// A request that has been fingerprinted, with its valid key (`None`: the handler's key is
/// optional and the request came without one, so it runs unprotected).
pub struct IdemRequest<DB: Backend> {
    pub(super) store: Store<DB>,
    pub(super) key: Option<IdempotencyKey>,
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
    pub(super) waiting: Option<DuplicateWait>,
    /// What the fingerprint was taken from, until the claim: a handler whose attribute counts
    /// only some fields of the body takes it again from them ([`IdemRequest::count_fields`]).
    pub(super) fingerprinted: Option<Fingerprinted>,
}

/// The parts of a request its fingerprint is taken from.
#[derive(Debug)]
pub(super) struct Fingerprinted {
    /// The request's `Content-Type`, which says whether the body is JSON.
    pub(super) headers: http::HeaderMap,
    /// The body, as buffered.
    pub(super) body: bytes::Bytes,
}

/// A request waiting for the outcome of a duplicate in flight.
#[derive(Debug)]
pub(super) struct DuplicateWait {
    /// When the wait ends, with a 409.
    pub(super) until: tokio::time::Instant,
    /// The wait applied, in seconds (`Preference-Applied: wait=<seconds>`).
    pub(super) seconds: u64,
    /// When it began.
    pub(super) since: tokio::time::Instant,
    /// The pauses between two looks at a key held in another process.
    pub(super) polls: idem_task::Backoff,
}

impl<DB: Backend> IdemRequest<DB> {
    /// A request with a valid `key` (or none, where the key is optional), fingerprinted, on
    /// `route` and traced by `span`; the client's `Prefer: wait` read from `headers`.
    pub(super) fn new(
        store: Store<DB>,
        key: Option<IdempotencyKey>,
        (method, path): (Method, String),
        fingerprint: Fingerprint,
        (span, route): (Span, Arc<str>),
        headers: &http::HeaderMap,
    ) -> Self {
        Self {
            store,
            key,
            method,
            path,
            fingerprint,
            span,
            route,
            prefer_wait: crate::prefer::wait(headers),
            waiting: None,
            fingerprinted: None,
        }
    }

    /// The same request, keeping what its fingerprint was taken from for a handler that counts
    /// only some fields of the body.
    pub(super) fn with_fingerprinted(mut self, fingerprinted: Fingerprinted) -> Self {
        self.fingerprinted = Some(fingerprinted);
        self
    }
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
    /// Takes the fingerprint again over the fields of the body the handler counts
    /// (`fingerprint_only`, `fingerprint_except`), the first time a claim is tried; the
    /// buffered body is let go either way.
    pub(super) fn count_fields(&mut self, fields: idem_key::BodyFields) {
        let Some(Fingerprinted { headers, body }) = self.fingerprinted.take() else {
            return;
        };
        if fields != idem_key::BodyFields::All {
            self.fingerprint =
                Fingerprint::of_fields(&self.method, &self.path, &headers, &body, fields);
        }
    }

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
        self.start_waiting(allowed, now)
    }

    /// The wait this request may make: the smaller of the client's `Prefer: wait` and the
    /// handler's `allowed`; `None` when either is absent or zero.
    pub(super) fn wait_allowed(
        &self,
        allowed: Option<std::time::Duration>,
    ) -> Option<std::time::Duration> {
        let wait = self.prefer_wait?.min(allowed?);
        (!wait.is_zero()).then_some(wait)
    }

    /// Records that this request has waited since `since` for a duplicate in flight, without
    /// having asked [`may_wait`](Self::may_wait) first: on a single-writer database (SQLite) a
    /// duplicate in another process waits for the file's write lock inside the database, and
    /// learns only afterwards, finding the outcome stored, that it waited for one. Its replay
    /// then says so (`Preference-Applied`) and its wait is measured, as any waiter's.
    pub(super) fn waited_since(
        &mut self,
        allowed: Option<std::time::Duration>,
        since: tokio::time::Instant,
    ) {
        if self.waiting.is_none() {
            self.start_waiting(allowed, since);
        }
    }

    fn start_waiting(
        &mut self,
        allowed: Option<std::time::Duration>,
        since: tokio::time::Instant,
    ) -> Option<tokio::time::Instant> {
        let wait = self.wait_allowed(allowed)?;
        self.waiting = Some(DuplicateWait {
            until: since + wait,
            seconds: wait.as_secs(),
            since,
            polls: idem_task::Backoff::new(
                std::time::Duration::from_millis(25),
                std::time::Duration::from_millis(500),
            ),
        });
        Some(since + wait)
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

    /// This request under `key`, as its row records it.
    pub(super) fn row_of<'a>(&'a self, key: &'a KeyRef) -> crate::record::RowOf<'a> {
        crate::record::RowOf {
            key,
            method: self.method.as_str(),
            path: &self.path,
            fingerprint: &self.fingerprint,
        }
    }

    /// Whether the request came without a key where the handler's key is optional: it runs
    /// once, unprotected, and nothing is stored.
    pub(super) fn is_unprotected(&self) -> bool {
        self.key.is_none()
    }

    /// The key under the handler's scope; a scope that cannot hold keys is refused (400).
    /// Asked only of a request with a key ([`is_unprotected`](Self::is_unprotected)).
    pub(super) fn key_ref(&self, scope: StoredScope) -> Result<KeyRef, Response> {
        let scope =
            match scope {
                StoredScope::Global => String::new(),
                StoredScope::Caller(scope) => {
                    let wrong = if scope.is_empty() {
                        Some("is empty".to_owned())
                    } else if scope.contains('\0') {
                        Some("contains the character U+0000 (NUL)".to_owned())
                    } else if scope.len() > crate::scope::MAX_SCOPE_LEN {
                        Some(format!(
                            "is {} bytes long, over the limit of {}",
                            scope.len(),
                            crate::scope::MAX_SCOPE_LEN
                        ))
                    } else {
                        None
                    };
                    if let Some(wrong) = wrong {
                        return Err(self.end(
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
        let key = self
            .key
            .as_ref()
            .expect("an unprotected request is never claimed")
            .as_str()
            .to_owned();
        let key = KeyRef::new(scope, key);
        self.span.record("key_id", key.log_id());
        Ok(key)
    }
}
