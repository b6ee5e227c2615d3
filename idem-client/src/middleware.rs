//! The middleware: a key per logical request, and the retries.

use std::{sync::Arc, time::Duration};

use http::Extensions;
use reqwest::{
    Request, Response,
    header::{HeaderName, HeaderValue},
};
use reqwest_middleware::{Middleware, Next};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::{KeyStore, RetryPolicy, StoredKey, policy::retryable, retry_after::retry_after};

/// The request header idem reads.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A request extension: the user action this request performs, under which its key is kept in
/// the middleware's [`KeyStore`] until the action has a final answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action(pub String);

/// A request extension: the key to send, chosen by the caller (for example derived from a
/// message id), instead of a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(pub String);

/// A key store's key belongs to another request: same action, other method, URL or body.
#[derive(Debug, thiserror::Error)]
#[error(
    "the key kept for action `{action}` was made for another request (method, URL or body); \
     a key is never sent with another request: finish or forget that action first"
)]
pub struct KeyReused {
    /// The action.
    pub action: String,
}

/// Retries requests safely: every `POST` and `PATCH` (see [`RetryPolicy::methods`]) gets one
/// `Idempotency-Key`, a UUID v4 made before the first attempt and sent by every retry of it,
/// so that the server runs it once however often it arrives.
///
/// See [`RetryPolicy`] for what is retried. A request whose body cannot be cloned (a stream)
/// is sent once. The final answer is returned as it is: use [`check`](crate::check) for a
/// typed error, [`replayed`](crate::replayed) to know whether it was a replay.
#[derive(Clone)]
pub struct IdempotentRetry {
    policy: RetryPolicy,
    store: Option<Arc<dyn KeyStore>>,
}

impl std::fmt::Debug for IdempotentRetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentRetry")
            .field("policy", &self.policy)
            .field("store", &self.store.is_some())
            .finish()
    }
}

impl IdempotentRetry {
    /// The middleware with `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            store: None,
        }
    }

    /// Keeps the keys of requests that carry an [`Action`] in `store`.
    #[must_use]
    pub fn with_store(mut self, store: impl KeyStore) -> Self {
        self.store = Some(Arc::new(store));
        self
    }

    /// The key of `request`: kept for its action, given by the caller, or new.
    fn key_for(
        &self,
        request: &Request,
        extensions: &Extensions,
    ) -> reqwest_middleware::Result<String> {
        if let (Some(Action(action)), Some(store)) = (extensions.get::<Action>(), &self.store) {
            let fingerprint = fingerprint(request);
            return match store
                .load(action)
                .map_err(reqwest_middleware::Error::middleware)?
            {
                Some(kept) if kept.fingerprint == fingerprint => Ok(kept.key),
                Some(_) => Err(reqwest_middleware::Error::middleware(KeyReused {
                    action: action.clone(),
                })),
                None => {
                    let key = uuid::Uuid::new_v4().to_string();
                    let kept = StoredKey {
                        key: key.clone(),
                        fingerprint,
                    };
                    store
                        .save(action, &kept)
                        .map_err(reqwest_middleware::Error::middleware)?;
                    Ok(key)
                }
            };
        }
        Ok(extensions
            .get::<IdempotencyKey>()
            .map_or_else(|| uuid::Uuid::new_v4().to_string(), |key| key.0.clone()))
    }

    /// The action is over: its key is forgotten.
    fn finished(&self, extensions: &Extensions) -> reqwest_middleware::Result<()> {
        if let (Some(Action(action)), Some(store)) = (extensions.get::<Action>(), &self.store) {
            store
                .remove(action)
                .map_err(reqwest_middleware::Error::middleware)?;
        }
        Ok(())
    }
}

/// SHA-256 of the method, the URL and the body.
fn fingerprint(request: &Request) -> String {
    let mut hash = Sha256::new();
    hash.update(request.method().as_str());
    hash.update([0]);
    hash.update(request.url().as_str());
    hash.update([0]);
    if let Some(body) = request.body().and_then(reqwest::Body::as_bytes) {
        hash.update(body);
    }
    hash.finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Whether an attempt's outcome is worth another, and how long the server asked to wait.
fn assess(outcome: &reqwest_middleware::Result<Response>) -> (bool, Option<Duration>) {
    match outcome {
        Ok(response) => (
            retryable(response.status()),
            retry_after(response.headers()),
        ),
        // No answer: it may or may not have arrived. A request that could not even be built
        // would fail the same way again.
        Err(reqwest_middleware::Error::Reqwest(error)) => (!error.is_builder(), None),
        Err(reqwest_middleware::Error::Middleware(_)) => (false, None),
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotentRetry {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let keyed = self.policy.keyed(request.method());
        if keyed && !request.headers().contains_key(IDEMPOTENCY_KEY) {
            let key = self.key_for(&request, extensions)?;
            let value =
                HeaderValue::from_str(&key).map_err(reqwest_middleware::Error::middleware)?;
            request.headers_mut().insert(IDEMPOTENCY_KEY, value);
        }
        if !keyed && !request.method().is_idempotent() {
            // A request the server cannot deduplicate is sent once.
            return next.run(request, extensions).await;
        }
        let started = Instant::now();
        let mut attempt = 1;
        loop {
            let Some(copy) = request.try_clone() else {
                return next.run(request, extensions).await;
            };
            let outcome = next.clone().run(copy, extensions).await;
            let (again, asked) = assess(&outcome);
            if !again {
                if outcome.is_ok() {
                    self.finished(extensions)?;
                }
                return outcome;
            }
            if attempt >= self.policy.max_attempts {
                return outcome;
            }
            let wait = self.policy.delay(attempt).max(asked.unwrap_or_default());
            if started.elapsed() + wait > self.policy.budget {
                return outcome;
            }
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }
}
