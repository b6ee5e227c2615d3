//! The middleware: a key per logical request, and the retries.

use std::{sync::Arc, time::Duration};

use http::Extensions;
use reqwest::{
    Request, Response,
    header::{HeaderName, HeaderValue},
};
use reqwest_middleware::{Middleware, Next};

use crate::{
    KeyStore, RetryPolicy, StoredKey, policy::retryable, retry_after::retry_after,
    schedule::Schedule,
};

/// RFC 7240's request header, where a client says it would rather wait.
const PREFER: HeaderName = HeaderName::from_static("prefer");

/// The request header idem reads.
pub use idem_key::IDEMPOTENCY_KEY;

/// A request extension: the user action this request performs, under which its key is kept in
/// the middleware's [`KeyStore`] until the action has a final answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action(pub String);

/// A request extension: the key to send, chosen by the caller (for example derived from a
/// message id), instead of a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(pub String);

/// An [`Action`] on a request whose body is a stream: it cannot be fingerprinted, so its key
/// cannot be kept safely.
#[derive(Debug, thiserror::Error)]
#[error(
    "a request with a streamed body cannot be kept under an action: its body cannot be compared"
)]
pub struct StreamedAction;

/// The time budget ran out while waiting for the next attempt (the timer woke past it).
#[derive(Debug, thiserror::Error)]
#[error("the retry budget ran out after {attempts} attempts without a final answer")]
pub struct BudgetSpent {
    /// Attempts made.
    pub attempts: u32,
}

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
    forget_on_final: bool,
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
            forget_on_final: true,
        }
    }

    /// Keeps the keys of requests that carry an [`Action`] in `store`. Without a store, an
    /// [`Action`] is ignored. With one, the action's key wins over an [`IdempotencyKey`].
    #[must_use]
    pub fn with_store(self, store: impl KeyStore) -> Self {
        self.with_shared_store(Arc::new(store))
    }

    /// [`IdempotentRetry::with_store`] with a store the caller keeps a handle on, to forget an
    /// action's key itself (see [`IdempotentRetry::with_forget_on_final`]).
    #[must_use]
    pub fn with_shared_store(mut self, store: Arc<dyn KeyStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Whether an action's key is forgotten as soon as a final answer's head arrives (default
    /// `true`). Turn it off to forget it yourself once the answer's body is read, so that a
    /// connection cut in the middle of the body leaves the key for the next run.
    #[must_use]
    pub fn with_forget_on_final(mut self, forget: bool) -> Self {
        self.forget_on_final = forget;
        self
    }

    /// The key of `request`: kept for its action, given by the caller, or new.
    fn key_for(
        &self,
        request: &Request,
        extensions: &Extensions,
    ) -> reqwest_middleware::Result<String> {
        if let (Some(Action(action)), Some(store)) = (extensions.get::<Action>(), &self.store) {
            let candidate = StoredKey {
                key: uuid::Uuid::new_v4().to_string(),
                fingerprint: fingerprint(request),
            };
            let kept = store
                .load_or_save(action, &candidate)
                .map_err(reqwest_middleware::Error::middleware)?;
            return if kept.fingerprint == candidate.fingerprint {
                Ok(kept.key)
            } else {
                Err(reqwest_middleware::Error::middleware(KeyReused {
                    action: action.clone(),
                }))
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

/// The request's fingerprint as the server computes it ([`idem_key::Fingerprint`]: a JSON body
/// canonicalised, so that key order and whitespace do not make another action), over the whole
/// URL rather than its path, in hex.
fn fingerprint(request: &Request) -> String {
    let body = request
        .body()
        .and_then(reqwest::Body::as_bytes)
        .unwrap_or_default();
    let fingerprint = idem_key::Fingerprint::of(
        request.method(),
        request.url().as_str(),
        request.headers(),
        body,
    );
    fingerprint
        .as_bytes()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// The largest problem body [`parked`] reads to tell its type.
const PROBLEM_PEEK: u64 = 16 * 1024;

/// Whether `outcome` is idem's answer that the key's first request was parked by the
/// server's recovery (a 500 problem whose type ends in `#claimparked` or `/claimparked`,
/// whatever base the server gives its types): final, though a 5xx, since no
/// retry gets another answer until a person acts. The problem's body is read to tell (when it
/// declares a length of at most [`PROBLEM_PEEK`] bytes), and the response rebuilt around it:
/// the caller reads the same status, headers, URL and body (not the connection's extensions,
/// such as its remote address).
async fn parked(
    outcome: reqwest_middleware::Result<Response>,
) -> (reqwest_middleware::Result<Response>, bool) {
    let response = match outcome {
        Ok(response)
            if response.status() == reqwest::StatusCode::INTERNAL_SERVER_ERROR
                && response
                    .headers()
                    .get(reqwest::header::CONTENT_TYPE)
                    .is_some_and(|value| {
                        value.as_bytes().starts_with(b"application/problem+json")
                    })
                && response
                    .content_length()
                    .is_some_and(|length| length <= PROBLEM_PEEK) =>
        {
            response
        }
        other => return (other, false),
    };
    let mut builder = http::Response::builder()
        .status(response.status())
        .version(response.version());
    builder = reqwest::ResponseBuilderExt::url(builder, response.url().clone());
    if let Some(headers) = builder.headers_mut() {
        *headers = response.headers().clone();
    }
    let body = match response.bytes().await {
        Ok(body) => body,
        Err(error) => return (Err(error.into()), false),
    };
    let is_parked = serde_json::from_slice::<crate::Problem>(&body)
        .ok()
        .and_then(|problem| problem.kind)
        .is_some_and(|kind| kind.rsplit(['#', '/']).next() == Some("claimparked"));
    match builder.body(body) {
        Ok(rebuilt) => (Ok(Response::from(rebuilt)), is_parked),
        Err(error) => (Err(reqwest_middleware::Error::middleware(error)), false),
    }
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
        let streamed = request.body().is_some_and(|body| body.as_bytes().is_none());
        if streamed && extensions.get::<Action>().is_some() && self.store.is_some() {
            // Its body cannot be fingerprinted: a kept key could go out with another body.
            return Err(reqwest_middleware::Error::middleware(StreamedAction));
        }
        if keyed && !request.headers().contains_key(IDEMPOTENCY_KEY) {
            let key = self.key_for(&request, extensions)?;
            let value =
                HeaderValue::from_str(&key).map_err(reqwest_middleware::Error::middleware)?;
            request.headers_mut().insert(IDEMPOTENCY_KEY, value);
            // A retry made by a middleware in front of this one sends the same key.
            extensions.insert(IdempotencyKey(key));
        }
        if keyed
            && let Some(wait) = self.policy.prefer_wait()
            && !request.headers().contains_key(PREFER)
        {
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            if let Ok(value) = HeaderValue::try_from(format!("wait={seconds}")) {
                request.headers_mut().insert(PREFER, value);
            }
        }
        let mut schedule = Schedule::start(&self.policy);
        if !keyed && !request.method().is_idempotent() {
            // A request the server cannot deduplicate is sent once.
            extensions.insert(schedule.attempt());
            return next.run(request, extensions).await;
        }
        loop {
            extensions.insert(schedule.attempt());
            let Some(copy) = request.try_clone() else {
                return next.run(request, extensions).await;
            };
            let outcome = next.clone().run(copy, extensions).await;
            let (outcome, parked) = parked(outcome).await;
            if parked {
                // Not the action's answer: its key is kept, so that a later run of the action
                // gets the outcome once a person has resumed or abandoned the claim.
                return outcome;
            }
            let (again, asked) = assess(&outcome);
            if !again {
                if outcome.is_ok() && self.forget_on_final {
                    // The answer is the caller's whatever the store does: an action that got
                    // its answer must not look unanswered.
                    if let Err(error) = self.finished(extensions) {
                        tracing::warn!(%error, "forgetting a finished action's key failed");
                    }
                }
                return outcome;
            }
            let Some(wait) = schedule.next_wait(asked) else {
                return outcome;
            };
            // Not kept through the wait: its connection goes back or away now.
            drop(outcome);
            if !schedule.wait(wait).await {
                // The timer woke late: no attempt starts past the budget. The last answer
                // was let go; say what happened.
                return Err(reqwest_middleware::Error::middleware(BudgetSpent {
                    attempts: schedule.attempt().number,
                }));
            }
        }
    }
}
