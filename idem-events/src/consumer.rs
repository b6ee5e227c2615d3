//! The consuming side: each message applied once, in one transaction with the record of its id.

use std::{future::Future, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use futures_util::FutureExt;
use sqlx::{Pool, Transaction};
use tokio::{task::JoinHandle, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{BrokerError, Delivery, Message, Subscriber, Subscription, backoff::Backoff};
use crate::Backend;

/// How many times a message may fail before it goes to the dead-letter place, unless
/// [`Consumer::max_attempts`] says otherwise.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// What a consumer does with each message, in the transaction that also records the message's
/// id. Return an error (or panic) to roll it all back: the message is tried again, and goes to
/// the dead-letter place after [`Consumer::max_attempts`] failures.
///
/// ```no_run
/// use idem_events::{Handler, Message};
/// use sqlx::{Postgres, Transaction};
///
/// struct Ledger;
///
/// impl Handler<Postgres> for Ledger {
///     type Error = sqlx::Error;
///
///     async fn handle(
///         &self,
///         message: &Message,
///         tx: &mut Transaction<'static, Postgres>,
///     ) -> Result<(), sqlx::Error> {
///         sqlx::query("INSERT INTO entries (event) VALUES ($1)")
///             .bind(message.id())
///             .execute(&mut **tx)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler<DB: Backend>: Send + Sync + 'static {
    /// Why a message could not be processed.
    type Error: std::fmt::Display + Send;

    /// Applies `message` in `tx`. Do not commit or roll back `tx`: the consumer does.
    ///
    /// # Errors
    ///
    /// When the message cannot be applied: the transaction rolls back and the failure counts.
    fn handle<'a>(
        &'a self,
        message: &'a Message,
        tx: &'a mut Transaction<'static, DB>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a;
}

/// What [`Consumer::process`] did with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed {
    /// The handler's writes and the message's id committed together; the message is
    /// acknowledged.
    Applied,
    /// The message was processed before: acknowledged and skipped.
    Duplicate,
    /// The handler failed; the message goes back to the broker for another attempt.
    Failed {
        /// Failures so far, this one included.
        attempts: u32,
    },
    /// The message failed too often (or has no id) and went to the dead-letter place.
    DeadLettered {
        /// Failures counted.
        attempts: u32,
    },
}

/// What kept [`Consumer::process`] from settling a message. The message is not acknowledged:
/// the broker delivers it again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The database failed (or a commit's outcome is unknown); the failure is not counted
    /// against the message.
    #[error(transparent)]
    Database(#[from] crate::Error),
    /// The broker was not told how the message ended.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl From<sqlx::Error> for ConsumeError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error.into())
    }
}

/// An idempotent consumer: a name, a database, and a [`Handler`].
///
/// For each message it begins a transaction, records `(name, message id)` in it (a message
/// recorded before is acknowledged and skipped), runs the handler, commits, and only then
/// acknowledges. The handler's writes therefore happen once per message id however often the
/// broker delivers it: effectively once. Effects outside the transaction (a call to another
/// service) happen at least once.
///
/// A failure (an error or a panic of the handler) rolls everything back and is counted in a
/// statement of its own; the message is given back to the broker and, after
/// [`Consumer::max_attempts`] failures, moved to the dead-letter place with an error in the
/// log. The ids of processed messages are kept for [`Consumer::retention`]: a redelivery later
/// than that would be applied again.
pub struct Consumer<DB: Backend, H> {
    name: Arc<str>,
    pool: Pool<DB>,
    handler: Arc<H>,
    max_attempts: u32,
    retention: Duration,
    max_backoff: Duration,
    on_committed: Option<Arc<CommittedObserver>>,
}

/// What [`Consumer::on_committed`] calls.
type CommittedObserver = dyn Fn(&Message) + Send + Sync;

impl<DB: Backend, H> Clone for Consumer<DB, H> {
    fn clone(&self) -> Self {
        Self {
            name: Arc::clone(&self.name),
            pool: self.pool.clone(),
            handler: Arc::clone(&self.handler),
            max_attempts: self.max_attempts,
            retention: self.retention,
            max_backoff: self.max_backoff,
            on_committed: self.on_committed.clone(),
        }
    }
}

impl<DB: Backend, H> std::fmt::Debug for Consumer<DB, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.name)
            .field("max_attempts", &self.max_attempts)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, H: Handler<DB>> Consumer<DB, H> {
    /// A consumer named `name` (the key its processed ids are recorded under: give each
    /// consumer its own), over `pool`'s database, running `handler`. Processed ids are kept 7
    /// days; a message may fail [`DEFAULT_MAX_ATTEMPTS`] times.
    ///
    /// # Panics
    ///
    /// If `name` is empty.
    pub fn new(name: &str, pool: Pool<DB>, handler: H) -> Self {
        assert!(!name.is_empty(), "a consumer needs a name");
        Self {
            name: name.into(),
            pool,
            handler: Arc::new(handler),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retention: Duration::from_secs(7 * 24 * 3600),
            max_backoff: Duration::from_secs(30),
            on_committed: None,
        }
    }

    /// Calls `observer` with each message whose transaction committed, before the message is
    /// acknowledged: for counting, or for a test that stops the process right there.
    #[must_use]
    pub fn on_committed(mut self, observer: impl Fn(&Message) + Send + Sync + 'static) -> Self {
        self.on_committed = Some(Arc::new(observer));
        self
    }

    /// How many failures send a message to the dead-letter place (at least 1).
    #[must_use]
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// How long the ids of processed messages are kept. Make it longer than the broker may
    /// take to deliver a message again (its redelivery and retention settings).
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The longest wait between two attempts to reach the broker or the database (default
    /// 30 s).
    #[must_use]
    pub fn max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Processes one delivery and settles it with the broker.
    ///
    /// # Errors
    ///
    /// [`ConsumeError::Database`] when the database failed: the message was given back to the
    /// broker (or could not be, and comes back when the connection is gone) and the failure
    /// is not counted. [`ConsumeError::Broker`] when the broker was not told: it delivers the
    /// message again, and a message that was applied is then skipped as a duplicate.
    pub async fn process<D: Delivery>(&self, delivery: D) -> Result<Processed, ConsumeError> {
        let processed = self.settle(delivery).await;
        let outcome = match &processed {
            Ok(Processed::Applied) => "applied",
            Ok(Processed::Duplicate) => "duplicate",
            Ok(Processed::Failed { .. }) => "failed",
            Ok(Processed::DeadLettered { .. }) => "dead_lettered",
            Err(_) => "unsettled",
        };
        metrics::counter!(
            "idem_messages_total",
            "consumer" => self.name.to_string(),
            "outcome" => outcome,
        )
        .increment(1);
        processed
    }

    async fn settle<D: Delivery>(&self, delivery: D) -> Result<Processed, ConsumeError> {
        let message = delivery.message().clone();
        let id = message.id();
        if id.is_empty() {
            tracing::error!(
                consumer = %self.name,
                topic = message.topic(),
                "a message without an id cannot be deduplicated; moved to the dead-letter place"
            );
            delivery.dead_letter("the message has no id").await?;
            return Ok(Processed::DeadLettered { attempts: 0 });
        }
        // A message delivered again may have stopped the process that had it (an abort, an
        // OOM kill): its attempt is counted before it runs, so that such a message too ends in
        // the dead-letter place instead of stopping every process that takes it. A first
        // delivery is not counted ahead: the common path writes nothing more.
        let redelivered = delivery.redelivered();
        if redelivered {
            let attempts = match DB::attempts(&self.pool, &self.name, id).await {
                Ok(attempts) => attempts,
                Err(error) => return self.give_back(delivery, error).await,
            };
            if attempts >= self.max_attempts {
                return self
                    .dead_letter(delivery, attempts, "it failed too often before")
                    .await;
            }
            if let Err(error) = DB::count_failure(&self.pool, &self.name, id, UNFINISHED).await {
                return self.give_back(delivery, error).await;
            }
        }
        let failure = match self.apply(&message, redelivered).await {
            Ok(true) => {
                if let Some(observer) = &self.on_committed {
                    observer(&message);
                }
                delivery.ack().await?;
                return Ok(Processed::Applied);
            }
            Ok(false) => {
                if redelivered {
                    // The attempt counted ahead was not one.
                    if let Err(error) = DB::clear_failures_apart(&self.pool, &self.name, id).await {
                        tracing::debug!(%error, "forgetting a duplicate's attempt failed");
                    }
                }
                delivery.ack().await?;
                return Ok(Processed::Duplicate);
            }
            Err(Failure::Database(error)) => return self.give_back(delivery, error).await,
            Err(Failure::Handler(reason)) => reason,
        };
        let counted = if redelivered {
            DB::note_failure(&self.pool, &self.name, id, &failure).await
        } else {
            DB::count_failure(&self.pool, &self.name, id, &failure).await
        };
        let attempts = match counted {
            Ok(attempts) => attempts,
            Err(error) => return self.give_back(delivery, error).await,
        };
        if attempts >= self.max_attempts {
            return self.dead_letter(delivery, attempts, &failure).await;
        }
        tracing::warn!(
            consumer = %self.name,
            message_id = id,
            attempts,
            error = %failure,
            "processing a message failed; it will be tried again"
        );
        // A little later each time: a failure that passes (a deadlock, a service restarting)
        // gets time to pass before the attempts run out.
        tokio::time::sleep(retry_delay(attempts, self.max_backoff)).await;
        delivery.retry().await?;
        Ok(Processed::Failed { attempts })
    }

    /// Runs the handler in a transaction with the message's record; `Ok(false)` when it was
    /// recorded before.
    async fn apply(&self, message: &Message, redelivered: bool) -> Result<bool, Failure> {
        let conn = self.pool.acquire().await.map_err(crate::Error::from)?;
        let mut tx = DB::begin_write(conn).await?;
        if !DB::claim_message(&mut tx, &self.name, message.id()).await? {
            tx.rollback().await.map_err(crate::Error::from)?;
            return Ok(false);
        }
        let handled = AssertUnwindSafe(self.handler.handle(message, &mut tx))
            .catch_unwind()
            .await;
        let reason = match handled {
            Ok(Ok(())) => {
                if redelivered {
                    DB::clear_failures(&mut tx, &self.name, message.id()).await?;
                }
                tx.commit().await.map_err(crate::Error::from)?;
                return Ok(true);
            }
            Ok(Err(error)) => error.to_string(),
            Err(panic) => format!("the handler panicked: {}", panic_message(&*panic)),
        };
        // A rollback that fails leaves the transaction to die with its connection.
        if let Err(error) = tx.rollback().await {
            tracing::debug!(%error, "rolling back a failed message's transaction failed");
        }
        Err(Failure::Handler(reason))
    }

    async fn dead_letter<D: Delivery>(
        &self,
        delivery: D,
        attempts: u32,
        reason: &str,
    ) -> Result<Processed, ConsumeError> {
        tracing::error!(
            consumer = %self.name,
            message_id = delivery.message().id(),
            topic = delivery.message().topic(),
            attempts,
            error = reason,
            "a message failed {attempts} times; moved to the dead-letter place"
        );
        delivery
            .dead_letter(&format!("failed {attempts} times: {reason}"))
            .await?;
        Ok(Processed::DeadLettered { attempts })
    }

    async fn give_back<D: Delivery>(
        &self,
        delivery: D,
        error: crate::Error,
    ) -> Result<Processed, ConsumeError> {
        if let Err(broker) = delivery.retry().await {
            tracing::debug!(error = %broker, "giving a message back to the broker failed");
        }
        Err(error.into())
    }

    /// Deletes up to `limit` records older than [`Consumer::retention`].
    ///
    /// # Errors
    ///
    /// When the database failed.
    pub async fn purge(&self, limit: i64) -> Result<u64, crate::Error> {
        DB::purge_consumed(&self.pool, &self.name, self.retention, limit).await
    }

    /// Consumes from `subscriber` until `shutdown` is cancelled, one message at a time.
    ///
    /// It subscribes again whenever the connection breaks, with a capped backoff, logging one
    /// warning when the trouble starts and one line when it ends. After a cancellation it
    /// takes no new message; the message in flight is finished and settled first. Records
    /// past their retention are purged now and then.
    pub async fn run<S: Subscriber>(self, subscriber: S, shutdown: CancellationToken) {
        let mut broker = Backoff::new(Duration::from_millis(100), self.max_backoff);
        let mut store = Backoff::new(Duration::from_millis(100), self.max_backoff);
        let purge_every =
            (self.retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(3600));
        let mut next_purge = Instant::now();
        'subscribe: loop {
            let subscribed = tokio::select! {
                () = shutdown.cancelled() => return,
                subscribed = subscriber.subscribe() => subscribed,
            };
            let mut subscription = match subscribed {
                Ok(subscription) => subscription,
                Err(error) => {
                    if !self.pause(&mut broker, &error, &shutdown).await {
                        return;
                    }
                    continue 'subscribe;
                }
            };
            loop {
                if Instant::now() >= next_purge {
                    next_purge = Instant::now() + purge_every;
                    self.purge_all(&shutdown).await;
                }
                let next = tokio::select! {
                    () = shutdown.cancelled() => return,
                    next = subscription.next() => next,
                };
                let delivery = match next {
                    Ok(delivery) => {
                        // Only a delivery ends an outage: a subscription that opens and then
                        // breaks every time stays one outage, with one warning.
                        if broker.succeeded() {
                            tracing::info!(consumer = %self.name, "the consumer receives messages again");
                        }
                        delivery
                    }
                    Err(error) => {
                        if !self.pause(&mut broker, &error, &shutdown).await {
                            return;
                        }
                        continue 'subscribe;
                    }
                };
                // Not raced against the shutdown: the message in flight is settled first.
                match self.process(delivery).await {
                    Ok(_) => {
                        if store.succeeded() {
                            tracing::info!(consumer = %self.name, "the consumer's database answers again");
                        }
                    }
                    Err(ConsumeError::Database(error)) => {
                        if !self.pause(&mut store, &error, &shutdown).await {
                            return;
                        }
                    }
                    Err(ConsumeError::Broker(error)) => {
                        if !self.pause(&mut broker, &error, &shutdown).await {
                            return;
                        }
                        continue 'subscribe;
                    }
                }
            }
        }
    }

    /// Spawns [`Consumer::run`] on the current runtime.
    pub fn spawn<S: Subscriber>(
        self,
        subscriber: S,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        tokio::spawn(self.run(subscriber, shutdown))
    }

    /// Waits out one backoff step; `false` if `shutdown` was cancelled meanwhile.
    async fn pause(
        &self,
        backoff: &mut Backoff,
        error: &(dyn std::fmt::Display + Sync),
        shutdown: &CancellationToken,
    ) -> bool {
        let (wait, started) = backoff.failed();
        if started {
            tracing::warn!(
                consumer = %self.name,
                %error,
                "the consumer cannot go on; it retries with backoff"
            );
        } else {
            tracing::debug!(consumer = %self.name, %error, ?wait, "the consumer still cannot go on");
        }
        tokio::select! {
            () = shutdown.cancelled() => false,
            () = tokio::time::sleep(wait) => true,
        }
    }

    async fn purge_all(&self, shutdown: &CancellationToken) {
        const BATCH: i64 = 1000;
        loop {
            let purged = tokio::select! {
                () = shutdown.cancelled() => return,
                purged = self.purge(BATCH) => purged,
            };
            match purged {
                Ok(deleted) if deleted >= BATCH.unsigned_abs() => {}
                Ok(_) => return,
                Err(error) => {
                    tracing::debug!(consumer = %self.name, %error, "purging consumed ids failed");
                    return;
                }
            }
        }
    }
}

/// The error recorded for an attempt counted before it runs, until it ends.
const UNFINISHED: &str = "delivered again before an outcome was recorded: the consumer stopped, \
     or lost its connection, while processing it";

/// The wait before a failed message is given back: 100 ms after the first failure, doubling
/// with each, at most `cap`.
fn retry_delay(attempts: u32, cap: Duration) -> Duration {
    let doublings = attempts.saturating_sub(1).min(16);
    (Duration::from_millis(100) * 2u32.pow(doublings)).min(cap)
}

/// Why [`Consumer::apply`] did not commit.
enum Failure {
    /// The database failed: not the message's fault.
    Database(crate::Error),
    /// The handler returned an error or panicked: counted against the message.
    Handler(String),
}

impl From<crate::Error> for Failure {
    fn from(error: crate::Error) -> Self {
        Self::Database(error)
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}
