//! The store handed to idempotent handlers through router state: a pool and its options, and
//! the one gate from the request flow and the steps to the database. Every statement a request
//! runs goes through a method here, bounded by a deadline: the request's (a transactional
//! claim's, from the pool to the `COMMIT`), or the store's `database_timeout` from now for
//! each write of an external claim; a database step's statements are bounded by its caller.
//!
//! - [`options`]: [`StoreOptions`], the layer's limits and answers;
//! - [`held`]: the keys this process's requests hold right now.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_key::Fingerprint;
use sqlx::Pool;
use tokio::time::Instant;

use crate::{
    backend::{Backend, Begun, ClaimRequest, Undone},
    checkout::{Checkout, Settle},
    record::{Completion, KeyRecord, KeyRef, RecordedStep, Start, Started},
};

mod held;
mod options;

pub(crate) use held::{HeldKey, HeldKeys, Hold, Holding};
pub use options::StoreOptions;

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
    ///
    /// The first store of the process also sets `idem_purge_last_success_timestamp_seconds` to
    /// now, as if a purge pass had just got through: a process whose purge was never spawned,
    /// or whose passes have all failed, then shows the time since it started, and an alert on
    /// the gauge's age fires for it, as it would not on a series that never appears.
    pub fn new(pool: Pool<DB>) -> Self {
        metrics::counter!("idem_takeovers_total").increment(0);
        static PURGE_EXPECTED: std::sync::Once = std::sync::Once::new();
        PURGE_EXPECTED.call_once(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |since| since.as_secs_f64());
            metrics::gauge!("idem_purge_last_success_timestamp_seconds").set(now);
        });
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
        self.held.len()
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
        HeldKeys::hold(&self.held, lock_id, fingerprint)
    }

    /// When work on the database that starts now must be done: now plus
    /// [`StoreOptions::database_timeout`].
    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.options.database_timeout()
    }

    /// Awaits `work` until `deadline`: [`Error::TimedOut`](crate::error::Error::TimedOut) (reporting
    /// [`StoreOptions::database_timeout`]) if it is not done by then, in which case `work` has
    /// been dropped.
    pub(crate) async fn bounded<T>(
        &self,
        deadline: Instant,
        work: impl Future<Output = Result<T, crate::error::Error>>,
    ) -> Result<T, crate::error::Error> {
        idem_task::Deadline::new(deadline, self.options.database_timeout())
            .bound(work, |after| crate::error::Error::TimedOut { after })
            .await
    }

    /// A pooled connection, waited for at most [`StoreOptions::acquire_timeout`] and until
    /// `deadline`.
    pub(crate) async fn checkout(
        &self,
        deadline: Instant,
    ) -> Result<Checkout<DB>, crate::error::Error> {
        let limit = Instant::now() + self.options.acquire_timeout();
        match tokio::time::timeout_at(limit.min(deadline), self.pool.acquire()).await {
            Ok(acquired) => Ok(Checkout::new(acquired?)),
            Err(_) if deadline <= limit => Err(crate::error::Error::TimedOut {
                after: self.options.database_timeout(),
            }),
            Err(_) => Err(sqlx::Error::PoolTimedOut.into()),
        }
    }

    /// Runs one operation on a connection of its own, until `deadline`: settled when it
    /// returns, closed when the deadline passes first.
    pub(crate) async fn on_connection<T>(
        &self,
        deadline: Instant,
        operation: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, crate::error::Error>,
    ) -> Result<T, crate::error::Error> {
        let mut conn = self.checkout(deadline).await?;
        let done = self.bounded(deadline, operation(&mut conn)).await;
        if !matches!(done, Err(crate::error::Error::TimedOut { .. })) {
            conn.settle();
        }
        done
    }

    /// Runs one write on a connection of its own, in this process's turn to write, until the
    /// store's deadline from now.
    async fn in_turn<T>(
        &self,
        write: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, crate::error::Error>,
    ) -> Result<T, crate::error::Error> {
        let deadline = self.deadline();
        let _permit = self.write_permit(deadline).await?;
        self.on_connection(deadline, write).await
    }

    /// The live row of `key`, read without any lock.
    pub(crate) async fn lookup(
        &self,
        key: &KeyRef,
        deadline: Instant,
    ) -> Result<Option<KeyRecord>, crate::error::Error> {
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
    ) -> Result<(Begun<'c, DB>, Settle<'c>), crate::error::Error> {
        let started = std::time::Instant::now();
        let checkout = slot.insert(self.checkout(deadline).await?);
        let (conn, mut settle) = checkout.parts();
        let request = ClaimRequest {
            key,
            statement_timeout,
            idle_timeout: self.options.database_timeout(),
            undo_point,
        };
        let begun = self.bounded(deadline, DB::begin_claim(conn, request)).await;
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

    /// Begins the transaction of a request that runs without a key (`key_optional`) on a
    /// connection put into `slot`, as [`begin_claim`](Self::begin_claim) begins a claiming
    /// one (its isolation level and timeouts), but claiming nothing.
    pub(crate) async fn begin_unprotected<'c>(
        &self,
        slot: &'c mut Option<Checkout<DB>>,
        statement_timeout: Option<Duration>,
        deadline: Instant,
    ) -> Result<(sqlx::Transaction<'c, DB>, Settle<'c>), crate::error::Error> {
        let checkout = slot.insert(self.checkout(deadline).await?);
        let (conn, settle) = checkout.parts();
        let idle_timeout = self.options.database_timeout();
        let tx = self
            .bounded(
                deadline,
                DB::begin_handler(conn, statement_timeout, idle_timeout),
            )
            .await?;
        Ok((tx, settle))
    }

    /// Takes an external-mode claim (see `Storage::start`); the caller holds its turn to write.
    pub(crate) async fn start(
        &self,
        start: &Start<'_>,
        deadline: Instant,
    ) -> Result<Started, crate::error::Error> {
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
    pub(crate) async fn release(
        &self,
        key: &KeyRef,
        token: i64,
    ) -> Result<bool, crate::error::Error> {
        self.in_turn(async |conn| DB::release(conn, key, token).await)
            .await
    }

    /// The claims the recovery's gauges report (`Inspection::claim_counts`).
    pub(crate) async fn claim_counts(
        &self,
    ) -> Result<crate::backend::ClaimCounts, crate::error::Error> {
        let deadline = self.deadline();
        tokio::time::timeout_at(deadline, DB::claim_counts(self.pool()))
            .await
            .map_err(|_| crate::error::Error::TimedOut {
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
    ) -> Result<bool, crate::error::Error> {
        self.in_turn(async |conn| DB::unsettled_round(conn, key, token, reason, park).await)
            .await
    }

    /// Lets go of the `started` row owned by `token` (see `Storage::give_up`: deleted, or its
    /// lease ended where steps are recorded), in this process's turn to write.
    pub(crate) async fn give_up(
        &self,
        key: &KeyRef,
        token: i64,
    ) -> Result<bool, crate::error::Error> {
        self.in_turn(async |conn| DB::give_up(conn, key, token).await)
            .await
    }

    /// The steps recorded on the row owned by `token`.
    pub(crate) async fn recorded_steps(
        &self,
        key: &KeyRef,
        token: i64,
        deadline: Instant,
    ) -> Result<Vec<RecordedStep>, crate::error::Error> {
        let steps = self
            .on_connection(deadline, async |conn| {
                DB::recorded_steps(conn, key, token).await
            })
            .await?;
        Ok(self.opened_steps(steps, key)?)
    }

    /// `steps`, recorded under `key`, their outputs opened where they are sealed.
    ///
    /// # Errors
    ///
    /// [`Unopened`](crate::seal::Unopened) for a sealed output that does not open.
    pub(crate) fn opened_steps(
        &self,
        steps: Vec<RecordedStep>,
        key: &KeyRef,
    ) -> Result<Vec<RecordedStep>, crate::seal::Unopened> {
        crate::seal::open_steps(self.options.encryption_keys(), steps, key)
    }

    /// `response`, stored under `key`, opened where it is sealed.
    ///
    /// # Errors
    ///
    /// [`Unopened`](crate::seal::Unopened) when it is sealed and does not open.
    pub(crate) fn opened(
        &self,
        response: crate::record::StoredResponse,
        key: &KeyRef,
    ) -> Result<crate::record::StoredResponse, crate::seal::Unopened> {
        crate::seal::open_response(self.options.encryption_keys(), response, key)
    }

    /// `completion` as it is stored: its answer sealed where the store has keys.
    fn sealed<'c>(
        &self,
        completion: &Completion<'c>,
        sealed: &'c mut Option<crate::record::StoredResponse>,
    ) -> Completion<'c> {
        let mut completion = completion.clone();
        if let Some(keys) = self.options.encryption_keys() {
            completion.response =
                sealed.insert(keys.seal_response(completion.response, completion.row.key));
        }
        completion
    }

    /// `steps` as they are recorded: their outputs sealed where the store has keys.
    fn sealed_steps<'s>(
        &self,
        steps: &'s [RecordedStep],
        key: &KeyRef,
    ) -> std::borrow::Cow<'s, [RecordedStep]> {
        match self.options.encryption_keys() {
            Some(keys) => std::borrow::Cow::Owned(keys.seal_steps(steps, key)),
            None => std::borrow::Cow::Borrowed(steps),
        }
    }

    /// Completes the `started` row owned by `token`, in this process's turn to write; see
    /// `SharedStorage::complete_started` for `retention`.
    pub(crate) async fn complete_started(
        &self,
        completion: &Completion<'_>,
        token: i64,
        retention: Option<Duration>,
    ) -> Result<bool, crate::error::Error> {
        let mut sealed = None;
        let completion = &self.sealed(completion, &mut sealed);
        self.in_turn(async |conn| DB::complete_started(conn, completion, token, retention).await)
            .await
    }

    /// Whether the database admits one writing transaction at a time (SQLite): this process's
    /// writers then take turns ([`write_permit`](Self::write_permit)).
    pub(crate) fn single_writer(&self) -> bool {
        DB::SINGLE_WRITER
    }

    /// Prepares a claim's transaction for undoing the handler's writes (see
    /// `Storage::before_handler`), until `deadline`.
    pub(crate) async fn before_handler(
        &self,
        tx: &mut DB::Connection,
        deadline: Instant,
    ) -> Result<(), crate::error::Error> {
        self.bounded(deadline, DB::before_handler(tx)).await
    }

    /// Undoes the handler's writes for a 5xx outcome that is stored (see
    /// `Storage::undo_handler`), until `deadline`.
    pub(crate) async fn undo_handler(
        &self,
        tx: &mut DB::Connection,
        key: &KeyRef,
        mark: Option<&str>,
        statement_timeout: Option<Duration>,
        deadline: Instant,
    ) -> Result<Undone, crate::error::Error> {
        let request = ClaimRequest {
            key,
            statement_timeout,
            idle_timeout: self.options.database_timeout(),
            // Only a claim whose handler's writes may be undone has them undone.
            undo_point: true,
        };
        self.bounded(deadline, DB::undo_handler(tx, request, mark))
            .await
    }

    /// Stores the handler's response in the claim's transaction (see
    /// `SharedStorage::complete`), until `deadline`: whether it wrote the key's row.
    pub(crate) async fn complete(
        &self,
        tx: &mut DB::Connection,
        completion: &Completion<'_>,
        retention: Duration,
        deadline: Instant,
    ) -> Result<bool, crate::error::Error> {
        let mut sealed = None;
        let completion = &self.sealed(completion, &mut sealed);
        self.bounded(deadline, DB::complete(tx, completion, retention))
            .await
    }

    /// Whether `error` says the transaction was aborted by an earlier failed statement.
    pub(crate) fn aborted_by_a_failed_statement(&self, error: &crate::error::Error) -> bool {
        DB::is_transaction_aborted(error)
    }

    /// Whether the handler's transaction lost a conflict and the database rolled it back (see
    /// `Storage::lost_a_conflict`), until `deadline`.
    pub(crate) async fn lost_a_conflict(
        &self,
        tx: &mut DB::Connection,
        deadline: Instant,
    ) -> Result<bool, crate::error::Error> {
        self.bounded(deadline, DB::lost_a_conflict(tx)).await
    }

    /// Makes sure a transaction is open on `tx` before idem rolls it back (see
    /// `Storage::ensure_open`), until `deadline`.
    pub(crate) async fn ensure_open(
        &self,
        tx: &mut DB::Connection,
        deadline: Instant,
    ) -> Result<(), crate::error::Error> {
        self.bounded(deadline, DB::ensure_open(tx)).await
    }

    /// Begins a transaction that is going to write on `conn` (see `Storage::begin_write`): a
    /// database step's.
    pub(crate) async fn begin_write<'c>(
        &self,
        conn: &'c mut DB::Connection,
    ) -> Result<sqlx::Transaction<'c, DB>, crate::error::Error> {
        DB::begin_write(conn).await
    }

    /// Records `steps` on the `started` row owned by `token`, in the transaction open on `conn`
    /// (a database step's): whether the claim is still `token`'s.
    pub(crate) async fn record_steps_in(
        &self,
        conn: &mut DB::Connection,
        key: &KeyRef,
        token: i64,
        steps: &[RecordedStep],
    ) -> Result<bool, crate::error::Error> {
        let steps = self.sealed_steps(steps, key);
        DB::record_steps(conn, key, token, &steps).await
    }

    /// Records `steps` on the `started` row owned by `token` (an external step's), in this
    /// process's turn to write: whether the claim is still `token`'s.
    pub(crate) async fn record_steps(
        &self,
        key: &KeyRef,
        token: i64,
        steps: &[RecordedStep],
    ) -> Result<bool, crate::error::Error> {
        let steps = self.sealed_steps(steps, key);
        self.in_turn(async |conn| DB::record_steps(conn, key, token, &steps).await)
            .await
    }

    /// On a single-writer database, this process's turn to write; `None` elsewhere.
    /// Waited for until `deadline`: a writer of this process that stalls holding the turn (its
    /// handler hangs) makes the others time out rather than queue for ever.
    pub(crate) async fn write_permit(
        &self,
        deadline: Instant,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, crate::error::Error> {
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
        self.bounded(deadline, async {
            Ok(Arc::clone(&self.writers).acquire_owned().await.ok())
        })
        .await
    }
}
