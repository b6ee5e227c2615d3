//! When to retry, and how long to wait.

use std::time::Duration;

use http::Method;
#[cfg(feature = "http")]
use http::StatusCode;

/// The retry rules: which requests get a key, how many attempts, and how long they may take.
///
/// Over HTTP, retried: network errors (the request may or may not have arrived: the key makes
/// the retry safe), `409 Conflict` (the first attempt is still running), `429 Too Many
/// Requests` and every `5xx`. Never retried: every other answer, `400`, `401`, `402`, `404`
/// and `422` included: the same request would get the same answer.
///
/// Over gRPC ([`grpc::GrpcRetry`](crate::grpc::GrpcRetry), feature `grpc`), the same attempts,
/// budget and backoff; what is retried is told by
/// [`grpc::retryable`](crate::grpc::retryable), and [`RetryPolicy::methods`] plays no part:
/// every call made through the caller is keyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    budget: Duration,
    base: Duration,
    cap: Duration,
    methods: Vec<Method>,
    prefer_wait: Option<Duration>,
}

impl Default for RetryPolicy {
    /// 5 attempts within 30 s, waits from 200 ms doubling up to 10 s with full jitter; keys
    /// on `POST` and `PATCH`.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            budget: Duration::from_secs(30),
            base: Duration::from_millis(200),
            cap: Duration::from_secs(10),
            methods: vec![Method::POST, Method::PATCH],
            prefer_wait: None,
        }
    }
}

impl RetryPolicy {
    /// Sets [`RetryPolicy::max_attempts`] (at least 1).
    #[must_use]
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// Sets [`RetryPolicy::budget`].
    #[must_use]
    pub fn with_budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// Sets [`RetryPolicy::backoff`]: its `base` and its `cap`.
    #[must_use]
    pub fn with_backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.base = base;
        self.cap = cap;
        self
    }

    /// Sets [`RetryPolicy::methods`].
    #[must_use]
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Sets [`RetryPolicy::prefer_wait`].
    #[must_use]
    pub fn with_prefer_wait(mut self, wait: Duration) -> Self {
        self.prefer_wait = Some(wait);
        self
    }

    /// How long a keyed request offers to wait for a duplicate still running on the server
    /// (default: not at all). With it, every keyed attempt says `Prefer: wait=<seconds>`
    /// (RFC 7240, whole seconds, rounded up): a server that honours it answers with the first
    /// attempt's outcome once it is there (`Preference-Applied`) instead of a 409. A server
    /// that does not, or whose own limit is shorter, still answers 409, retried as always.
    /// A request that carries its own `Prefer` header keeps it. Over gRPC, the same as
    /// `prefer` metadata.
    pub fn prefer_wait(&self) -> Option<Duration> {
        self.prefer_wait
    }

    /// At most this many attempts per logical request, the first included (default 5).
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// No attempt starts later than this after the first (default 30 s): a wait that would
    /// end past it is not made, and the last answer is returned.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// The backoff's `(base, cap)` (default 200 ms and 10 s): before retry `n` (from 1), a
    /// random wait between zero and `min(cap, base × 2^(n−1))` ("full jitter"), or the
    /// server's `Retry-After` (over gRPC, `grpc-retry-pushback-ms`, else `retry-after`) if
    /// longer.
    pub fn backoff(&self) -> (Duration, Duration) {
        (self.base, self.cap)
    }

    /// The methods that get an `Idempotency-Key` and are retried (default `POST` and
    /// `PATCH`). Methods idempotent by definition (`GET`, `PUT`, `DELETE`, ...) are retried
    /// without a key.
    pub fn methods(&self) -> &[Method] {
        &self.methods
    }

    /// Whether `method` gets a key.
    #[cfg(feature = "http")]
    pub(crate) fn keyed(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// The wait before retry `retry` (from 1), before the server's `Retry-After`.
    #[cfg(any(feature = "http", feature = "grpc"))]
    pub(crate) fn delay(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(30);
        let ceiling = self
            .base
            .saturating_mul(2u32.saturating_pow(doublings))
            .min(self.cap);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(fastrand::u64(0..=nanos))
    }
}

/// Whether an answer with `status` is worth another attempt.
#[cfg(feature = "http")]
pub(crate) fn retryable(status: StatusCode) -> bool {
    status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

#[cfg(all(test, any(feature = "http", feature = "grpc")))]
mod tests {
    use super::*;

    #[cfg(feature = "http")]
    #[test]
    fn only_409_429_and_5xx_are_retried() {
        for status in [409, 429, 500, 502, 503, 504] {
            assert!(retryable(StatusCode::from_u16(status).unwrap()), "{status}");
        }
        for status in [200, 201, 301, 400, 401, 402, 403, 404, 410, 412, 422] {
            assert!(
                !retryable(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
    }

    #[test]
    fn waits_are_full_jitter_under_a_doubling_ceiling_and_the_cap() {
        let policy = RetryPolicy::default()
            .with_backoff(Duration::from_millis(100), Duration::from_millis(700));
        for retry in 1..=10 {
            let ceiling =
                Duration::from_millis(100 * 2u64.pow(retry - 1)).min(Duration::from_millis(700));
            for _ in 0..100 {
                assert!(policy.delay(retry) <= ceiling, "retry {retry}");
            }
        }
    }
}
