//! The options of the idempotency layer: its limits and the answers it gives itself.

use std::time::Duration;

/// Limits and answers of the idempotency layer, given to [`Store::with_options`](super::Store::with_options).
///
/// ```
/// use idem_runtime::StoreOptions;
///
/// let options = StoreOptions::default().with_max_request_body(64 * 1024);
/// assert_eq!(options.max_request_body(), 64 * 1024);
/// ```
#[derive(Debug, Clone)]
pub struct StoreOptions {
    max_request_body: usize,
    max_response_body: usize,
    retry_after: Duration,
    acquire_timeout: Duration,
    database_timeout: Duration,
    problem_type_base: String,
    encryption_keys: Option<crate::seal::EncryptionKeys>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            max_request_body: 1 << 20,
            max_response_body: 1 << 20,
            retry_after: Duration::from_secs(1),
            acquire_timeout: Duration::from_secs(5),
            database_timeout: Duration::from_secs(10),
            problem_type_base: crate::problem::DEFAULT_PROBLEM_TYPE_BASE.to_owned(),
            encryption_keys: None,
        }
    }
}

impl StoreOptions {
    /// Sets [`StoreOptions::max_request_body`].
    #[must_use]
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// Sets [`StoreOptions::max_response_body`].
    #[must_use]
    pub fn with_max_response_body(mut self, bytes: usize) -> Self {
        self.max_response_body = bytes;
        self
    }

    /// Sets [`StoreOptions::retry_after`].
    #[must_use]
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// Sets [`StoreOptions::acquire_timeout`].
    #[must_use]
    pub fn with_acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Sets [`StoreOptions::database_timeout`].
    #[must_use]
    pub fn with_database_timeout(mut self, timeout: Duration) -> Self {
        self.database_timeout = timeout;
        self
    }

    /// Sets [`StoreOptions::problem_type_base`].
    #[must_use]
    pub fn with_problem_type_base(mut self, base: impl Into<String>) -> Self {
        self.problem_type_base = base.into();
        self
    }

    /// Sets [`StoreOptions::encryption_keys`]: every answer stored from now on is sealed with
    /// the first of `keys`, and answers sealed with any of them open.
    #[must_use]
    pub fn with_encryption_keys(mut self, keys: crate::seal::EncryptionKeys) -> Self {
        self.encryption_keys = Some(keys);
        self
    }

    /// The largest request body the layer buffers and fingerprints; larger bodies get 413 and
    /// nothing is stored. Default: 1 MiB.
    pub fn max_request_body(&self) -> usize {
        self.max_request_body
    }

    /// The largest response body the layer stores; a larger one is rolled back and answered
    /// with a 500 problem. Default: 1 MiB.
    pub fn max_response_body(&self) -> usize {
        self.max_response_body
    }

    /// The `Retry-After` sent with a 409 while the key is held by another request (in external
    /// mode, the lease's remaining time instead), and with every 503 of the layer's own (the
    /// store unavailable, a commit's outcome unknown, a handler past its `timeout`). Default:
    /// 1 s.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// The longest a request waits for a pooled connection before the claim is answered 503
    /// (`StoreUnavailable`). When the database is unreachable, sqlx keeps retrying the
    /// connection until the pool's own `acquire_timeout` (30 s by default); this bounds the
    /// wait for idem's requests whichever is shorter. Default: 5 s.
    pub fn acquire_timeout(&self) -> Duration {
        self.acquire_timeout
    }

    /// The longest a request waits on its database, past which its work is abandoned, its
    /// connection closed (not returned to the pool) and the answer is 503 with `Retry-After`.
    /// Default: 10 s.
    ///
    /// A transactional handler's request has one deadline, from asking the pool for a
    /// connection to the end of its `COMMIT`: the claim, the handler's own statements (they run
    /// in the layer's transaction), the completion and the commit. Past it before the `COMMIT`
    /// was sent, nothing was committed (`StoreUnavailable`); while the `COMMIT` was unanswered,
    /// the outcome is unknown (`OutcomeUnknown`) and a retry with the same key finds out: a
    /// replay if it committed, a first execution if not. In external mode, where the handler
    /// holds no transaction, the claim and the completion each have this long; so has each of a
    /// multi-step handler's steps, and each pass of the background tasks.
    ///
    /// It is the bound that notices a database that stopped answering without refusing (a
    /// partition, a frozen server): nothing else does within minutes. On PostgreSQL the claim
    /// also sets the server's `idle_in_transaction_session_timeout` to it for its transaction,
    /// so that a server that never hears its client go ends the transaction, and frees the key,
    /// by itself.
    pub fn database_timeout(&self) -> Duration {
        self.database_timeout
    }

    /// Where the `type` URIs of the layer's own problems point: the kind's fixed slug is
    /// appended (`KeyReused` → `<base>keyreused`). Default
    /// [`DEFAULT_PROBLEM_TYPE_BASE`](crate::problem::DEFAULT_PROBLEM_TYPE_BASE), the repository's
    /// `docs/problems.md`; point it at your own API documentation to publish them there.
    pub fn problem_type_base(&self) -> &str {
        &self.problem_type_base
    }

    /// The keys stored answers are sealed and opened with ([`crate::seal`]); `None` (the
    /// default): answers are stored in the clear, and an answer found sealed does not open.
    pub fn encryption_keys(&self) -> Option<&crate::seal::EncryptionKeys> {
        self.encryption_keys.as_ref()
    }
}
