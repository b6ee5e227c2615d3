//! The store handed to idempotent handlers through router state: a pool and its options.

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_key::Fingerprint;
use sqlx::Pool;
use tokio::{
    sync::{Notify, futures::OwnedNotified},
    time::Instant,
};

use crate::{
    backend::{Backend, Begun},
    checkout::{Checkout, Settle},
    record::{Completion, KeyRecord, KeyRef, RecordedStep, Start, Started},
};

/// Limits and answers of the idempotency layer, given to [`Store::with_options`].
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
    /// [`DEFAULT_PROBLEM_TYPE_BASE`](crate::DEFAULT_PROBLEM_TYPE_BASE), the repository's
    /// `docs/problems.md`; point it at your own API documentation to publish them there.
    pub fn problem_type_base(&self) -> &str {
        &self.problem_type_base
    }
}

/// The idempotency store: the database pool the handlers' transactions come from, and the
/// [`StoreOptions`] of the layer. Put it in your router state and implement
/// [`FromRef`](axum::extract::FromRef) for it (or use the store itself as the state).
///
/// Cloning is cheap: the pool and the options are shared.
///
/// # Examples
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::{StoreOptions, Store};
/// use sqlx::PgPool;
///
/// let pool = PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
/// idem_runtime::migrate(&pool).await?;
/// let store = Store::new(pool).with_options(StoreOptions::default().with_max_request_body(64 * 1024));
/// # Ok(()) }
/// ```
pub struct Store<DB: Backend> {
    pool: Pool<DB>,
    options: Arc<StoreOptions>,
    held: Arc<HeldKeys>,
    writers: Arc<tokio::sync::Semaphore>,
    queued_writers: Arc<AtomicUsize>,
    waiting: Arc<AtomicUsize>,
}

impl<DB: Backend> Clone for Store<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            options: Arc::clone(&self.options),
            held: Arc::clone(&self.held),
            writers: Arc::clone(&self.writers),
            queued_writers: Arc::clone(&self.queued_writers),
            waiting: Arc::clone(&self.waiting),
        }
    }
}

/// The keys this process's transactional handlers hold right now, and whether each one's
/// handler is running (its claim is taken) or the key is still being looked up. A duplicate of
/// a running key is answered 409 from here, without a database connection: SQLite has a single
/// writer, and an exhausted pool would make the duplicate wait for a connection. A duplicate
/// that may wait (`Prefer: wait`) waits here for the key to be let go, without a connection
/// either: the waiters of one key share one watch.
#[derive(Debug, Default)]
pub(crate) struct HeldKeys(Mutex<HashMap<i64, Holder>>);

/// The request of this process holding a key.
#[derive(Debug)]
struct Holder {
    /// Its handler is running (its claim is taken), rather than the key being looked up.
    running: bool,
    /// Its request's fingerprint: a duplicate that is another request is never made to wait.
    fingerprint: Fingerprint,
    /// Notified when the key is let go; made by the first duplicate that waits for it, so
    /// that a request nobody waits for allocates none.
    released: Option<Arc<Notify>>,
}

impl HeldKeys {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Holder>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What [`Store::hold`] found.
#[derive(Debug)]
pub(crate) enum Hold {
    /// This request holds the key now.
    Taken(HeldKey),
    /// A handler of this process is running with the key.
    Running(Holding),
    /// Another request of this process is claiming the key, replaying it, or waiting for it.
    Claiming(Holding),
}

/// Another request of this process holds the key.
#[derive(Debug)]
pub(crate) struct Holding {
    /// That request has this one's fingerprint (it is a duplicate, not another request).
    pub(crate) same_request: bool,
    /// Registered while the key was found held, so that a release in between is not missed.
    released: Pin<Box<OwnedNotified>>,
}

impl Holding {
    /// Waits until the key is let go, or until `until`; whether it was let go.
    pub(crate) async fn released(self, until: Instant) -> bool {
        tokio::time::timeout_at(until, self.released).await.is_ok()
    }
}

/// Releases a held key when dropped.
#[derive(Debug)]
pub(crate) struct HeldKey {
    keys: Arc<HeldKeys>,
    lock_id: i64,
}

impl HeldKey {
    /// Marks the key's handler as running: duplicates are refused without the database.
    pub(crate) fn running(&self) {
        if let Some(holder) = self.keys.lock().get_mut(&self.lock_id) {
            holder.running = true;
        }
    }
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        if let Some(released) = self
            .keys
            .lock()
            .remove(&self.lock_id)
            .and_then(|holder| holder.released)
        {
            released.notify_waiters();
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Store<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &<DB as sqlx::Database>::NAME)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Store<DB> {
    /// A store over `pool` with default [`StoreOptions`].
    ///
    /// Exports `idem_takeovers_total` at zero (with a `metrics` recorder installed before):
    /// a takeover is counted by the requests, in every process, whether or not it runs the
    /// recovery, and an alert on the counter's increase would miss the first one of a process
    /// whose series started at 1.
    pub fn new(pool: Pool<DB>) -> Self {
        metrics::counter!("idem_takeovers_total").increment(0);
        Self {
            pool,
            options: Arc::new(StoreOptions::default()),
            held: Arc::default(),
            writers: Arc::new(tokio::sync::Semaphore::new(1)),
            queued_writers: Arc::default(),
            waiting: Arc::default(),
        }
    }

    /// The same store with `options` in place of its own.
    #[must_use]
    pub fn with_options(mut self, options: StoreOptions) -> Self {
        self.options = Arc::new(options);
        self
    }

    /// The pool the handlers' transactions are taken from.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The layer's options.
    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    /// How many keys this process's transactional handlers hold right now (in flight). For
    /// tests; the metrics will report it.
    #[doc(hidden)]
    pub fn keys_in_flight(&self) -> usize {
        self.held.lock().len()
    }

    /// How many of this process's writers wait for their turn right now. Always 0 on
    /// databases that admit several writers (PostgreSQL); on SQLite, idem's writers queue in the
    /// process for the single write lock, and this is the length of that queue.
    #[doc(hidden)]
    pub fn queued_writers(&self) -> usize {
        self.queued_writers.load(Ordering::SeqCst)
    }

    /// How many of this process's requests wait right now for a duplicate in flight to end
    /// (`Prefer: wait`). For tests.
    #[doc(hidden)]
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Counts a request as waiting until the guard is dropped.
    pub(crate) fn wait_counted(&self) -> impl Drop + use<DB> {
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Counted(Arc::clone(&self.waiting))
    }

    /// Holds `lock_id` for this process, unless a request here holds it already.
    pub(crate) fn hold(&self, lock_id: i64, fingerprint: &Fingerprint) -> Hold {
        let mut held = self.held.lock();
        match held.get_mut(&lock_id) {
            Some(holder) => {
                let notify = holder
                    .released
                    .get_or_insert_with(|| Arc::new(Notify::new()));
                let mut released = Box::pin(Arc::clone(notify).notified_owned());
                // Registered now, under the map's lock: a release after this is seen.
                released.as_mut().enable();
                let holding = Holding {
                    same_request: holder.fingerprint == *fingerprint,
                    released,
                };
                if holder.running {
                    Hold::Running(holding)
                } else {
                    Hold::Claiming(holding)
                }
            }
            None => {
                held.insert(
                    lock_id,
                    Holder {
                        running: false,
                        fingerprint: *fingerprint,
                        released: None,
                    },
                );
                Hold::Taken(HeldKey {
                    keys: Arc::clone(&self.held),
                    lock_id,
                })
            }
        }
    }

    /// When work on the database that starts now must be done: now plus
    /// [`StoreOptions::database_timeout`].
    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.options.database_timeout
    }

    /// Awaits `work` until `deadline`: [`Error::TimedOut`](crate::Error::TimedOut) (reporting
    /// [`StoreOptions::database_timeout`]) if it is not done by then, in which case `work` has
    /// been dropped.
    pub(crate) async fn by<T>(
        &self,
        deadline: Instant,
        work: impl Future<Output = Result<T, crate::Error>>,
    ) -> Result<T, crate::Error> {
        idem_task::Deadline::new(deadline, self.options.database_timeout)
            .bound(work, |after| crate::Error::TimedOut { after })
            .await
    }

    /// A pooled connection, waited for at most [`StoreOptions::acquire_timeout`] and until
    /// `deadline`.
    pub(crate) async fn checkout(&self, deadline: Instant) -> Result<Checkout<DB>, crate::Error> {
        let limit = Instant::now() + self.options.acquire_timeout;
        match tokio::time::timeout_at(limit.min(deadline), self.pool.acquire()).await {
            Ok(acquired) => Ok(Checkout::new(acquired?)),
            Err(_) if deadline <= limit => Err(crate::Error::TimedOut {
                after: self.options.database_timeout,
            }),
            Err(_) => Err(sqlx::Error::PoolTimedOut.into()),
        }
    }

    /// Runs one operation on a connection of its own, until `deadline`: settled when it
    /// returns, closed when the deadline passes first.
    pub(crate) async fn on_connection<T>(
        &self,
        deadline: Instant,
        operation: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, crate::Error>,
    ) -> Result<T, crate::Error> {
        let mut conn = self.checkout(deadline).await?;
        let done = self.by(deadline, operation(&mut conn)).await;
        if !matches!(done, Err(crate::Error::TimedOut { .. })) {
            conn.settle();
        }
        done
    }

    /// The live row of `key`, read without any lock.
    pub(crate) async fn lookup(
        &self,
        key: &KeyRef,
        deadline: Instant,
    ) -> Result<Option<KeyRecord>, crate::Error> {
        self.on_connection(deadline, async |conn| DB::lookup(conn, key).await)
            .await
    }

    /// Takes a pooled connection into `slot` and begins a handler's transaction on it, claiming
    /// `key` (see `Storage::begin_claim`, and its `undo_point` for a handler whose 5xx outcomes
    /// are stored), until `deadline`.
    ///
    /// The transaction borrows the connection from `slot`, which closes it unless the claim's
    /// work settles it: a claim cut off anywhere (its deadline, a cancelled request) leaves no
    /// transaction and no lock behind on a pooled connection.
    pub(crate) async fn begin_claim<'c>(
        &self,
        slot: &'c mut Option<Checkout<DB>>,
        key: &KeyRef,
        statement_timeout: Option<Duration>,
        deadline: Instant,
        undo_point: bool,
    ) -> Result<(Begun<'c, DB>, Settle<'c>), crate::Error> {
        let started = std::time::Instant::now();
        let checkout = slot.insert(self.checkout(deadline).await?);
        let (conn, mut settle) = checkout.parts();
        let session_timeout = self.options.database_timeout;
        let begun = self
            .by(
                deadline,
                DB::begin_claim(conn, key, statement_timeout, session_timeout, undo_point),
            )
            .await;
        metrics::histogram!("idem_claim_duration_seconds", "mode" => "transactional")
            .record(started.elapsed());
        let begun = begun?;
        if !matches!(begun, Begun::Acquired(..)) {
            // Every answer was read and the dropped transaction's rollback is queued: the
            // connection is in a known state, and goes back to the pool.
            settle.settle();
        }
        Ok((begun, settle))
    }

    /// Takes an external-mode claim (see `Storage::start`); the caller holds its turn to write.
    pub(crate) async fn start(
        &self,
        start: &Start<'_>,
        deadline: Instant,
    ) -> Result<Started, crate::Error> {
        let started = std::time::Instant::now();
        let outcome = self
            .on_connection(deadline, async |conn| DB::start(conn, start).await)
            .await;
        metrics::histogram!("idem_claim_duration_seconds", "mode" => "external")
            .record(started.elapsed());
        outcome
    }

    /// Deletes the `started` row of `key` owned by `token` (an external claim), in this
    /// process's turn to write.
    pub(crate) async fn release(&self, key: &KeyRef, token: i64) -> Result<bool, crate::Error> {
        let deadline = self.deadline();
        let _permit = self.write_permit(deadline).await?;
        self.on_connection(deadline, async |conn| DB::release(conn, key, token).await)
            .await
    }

    /// The claims the recovery's gauges report (`Inspection::claim_counts`).
    pub(crate) async fn claim_counts(&self) -> Result<crate::backend::ClaimCounts, crate::Error> {
        let deadline = self.deadline();
        tokio::time::timeout_at(deadline, DB::claim_counts(self.pool()))
            .await
            .map_err(|_| crate::Error::TimedOut {
                after: self.options().database_timeout(),
            })?
    }

    /// Records a recovery round the hook did not settle (see
    /// `SharedStorage::unsettled_round`), in this process's turn to write.
    pub(crate) async fn unsettled_round(
        &self,
        key: &KeyRef,
        token: i64,
        reason: Option<&str>,
        park: bool,
    ) -> Result<bool, crate::Error> {
        let deadline = self.deadline();
        let _permit = self.write_permit(deadline).await?;
        self.on_connection(deadline, async |conn| {
            DB::unsettled_round(conn, key, token, reason, park).await
        })
        .await
    }

    /// Lets go of the `started` row owned by `token` (see `Storage::give_up`: deleted, or its
    /// lease ended where steps are recorded), in this process's turn to write.
    pub(crate) async fn give_up(&self, key: &KeyRef, token: i64) -> Result<bool, crate::Error> {
        let deadline = self.deadline();
        let _permit = self.write_permit(deadline).await?;
        self.on_connection(deadline, async |conn| DB::give_up(conn, key, token).await)
            .await
    }

    /// The steps recorded on the row owned by `token`.
    pub(crate) async fn recorded_steps(
        &self,
        key: &KeyRef,
        token: i64,
        deadline: Instant,
    ) -> Result<Vec<RecordedStep>, crate::Error> {
        self.on_connection(deadline, async |conn| {
            DB::recorded_steps(conn, key, token).await
        })
        .await
    }

    /// Completes the `started` row owned by `token`, in this process's turn to write; see
    /// `Storage::finish` for `retention`.
    pub(crate) async fn finish(
        &self,
        completion: &Completion<'_>,
        token: i64,
        retention: Option<Duration>,
    ) -> Result<bool, crate::Error> {
        let deadline = self.deadline();
        let _permit = self.write_permit(deadline).await?;
        self.on_connection(deadline, async |conn| {
            DB::finish(conn, completion, token, retention).await
        })
        .await
    }

    /// On a single-writer database, this process's turn to write; `None` elsewhere.
    /// Waited for until `deadline`: a writer of this process that stalls holding the turn (its
    /// handler hangs) makes the others time out rather than queue for ever.
    pub(crate) async fn write_permit(
        &self,
        deadline: Instant,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, crate::Error> {
        if !DB::SINGLE_WRITER {
            return Ok(None);
        }
        // Counted down when the wait ends, however it ends (a cancelled request too).
        struct Queued<'a>(&'a AtomicUsize);
        impl Drop for Queued<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.queued_writers.fetch_add(1, Ordering::SeqCst);
        let _queued = Queued(&self.queued_writers);
        self.by(deadline, async {
            Ok(Arc::clone(&self.writers).acquire_owned().await.ok())
        })
        .await
    }
}
