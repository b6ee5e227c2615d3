//! The consuming side: each message applied once, in one transaction with the record of its id.

use std::{future::Future, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use futures_util::FutureExt;
use idem_task::{Next, PassContext, Schedule, TaskHandle, Work};
use sqlx::{Pool, Transaction};
use tokio_util::sync::CancellationToken;

use crate::{backend::Backend, error::bounded};
use crate::{
    broker::{BrokerError, Delivery, Subscriber, Subscription},
    message::Message,
};

/// How many times a message may fail before it goes to the dead-letter place, unless
/// [`ConsumerOptions::max_attempts`] says otherwise.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// How a [`Consumer`] works: its name, and [`ConsumerOptions::new`]'s defaults for the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerOptions {
    name: String,
    max_attempts: u32,
    retention: Duration,
    max_backoff: Duration,
    database_timeout: Duration,
    settle_timeout: Duration,
}

impl ConsumerOptions {
    /// The options of a consumer named `name` (the key its processed ids are recorded under:
    /// give each consumer its own). Processed ids are kept 7 days; a message may fail
    /// [`DEFAULT_MAX_ATTEMPTS`] times; the longest backoff is 30 s.
    ///
    /// # Panics
    ///
    /// If `name` is empty.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        assert!(!name.is_empty(), "a consumer needs a name");
        Self {
            name,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retention: Duration::from_secs(7 * 24 * 3600),
            max_backoff: Duration::from_secs(30),
            database_timeout: Duration::from_secs(10),
            settle_timeout: Duration::from_secs(10),
        }
    }

    /// Sets [`ConsumerOptions::max_attempts`] (at least 1).
    #[must_use]
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// Sets [`ConsumerOptions::retention`].
    #[must_use]
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets [`ConsumerOptions::max_backoff`].
    #[must_use]
    pub fn with_max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// Sets [`ConsumerOptions::database_timeout`].
    #[must_use]
    pub fn with_database_timeout(mut self, timeout: Duration) -> Self {
        self.database_timeout = timeout;
        self
    }

    /// Sets [`ConsumerOptions::settle_timeout`].
    #[must_use]
    pub fn with_settle_timeout(mut self, timeout: Duration) -> Self {
        self.settle_timeout = timeout;
        self
    }

    /// How long the broker has to take a message's settlement (its acknowledgement, its
    /// return for another attempt, or its move to the dead-letter place; default 10 s). Past
    /// it the consumer drops its connection and subscribes again; the broker then delivers
    /// the message again, and a message that was applied is acknowledged as a duplicate. A
    /// connection that breaks while a settlement is on its way is noticed this way: the
    /// RabbitMQ client may leave that settlement unanswered for good.
    pub fn settle_timeout(&self) -> Duration {
        self.settle_timeout
    }

    /// How long each of the consumer's database operations may take (default 10 s), the
    /// handler's transaction counted whole: past it the operation fails with
    /// [`Error::TimedOut`](crate::error::Error::TimedOut), its transaction is rolled back, and the
    /// message goes back to the broker to be delivered again (a transaction whose `COMMIT`
    /// went unanswered is found recorded then, and acknowledged as a duplicate). A database
    /// that stops answering without refusing (a partition) is noticed this way.
    pub fn database_timeout(&self) -> Duration {
        self.database_timeout
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many failures send a message to the dead-letter place (default
    /// [`DEFAULT_MAX_ATTEMPTS`]).
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// How long the ids of processed messages are kept (default 7 days). Make it longer than
    /// the broker may take to deliver a message again (its redelivery and retention settings).
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// The longest wait between two attempts to reach the broker or the database (default
    /// 30 s).
    pub fn max_backoff(&self) -> Duration {
        self.max_backoff
    }
}

/// What a consumer does with each message, in the transaction that also records the message's
/// id. Return an error (or panic) to roll it all back: the message is tried again, and goes to
/// the dead-letter place after [`ConsumerOptions::max_attempts`] failures.
///
/// ```no_run
/// use idem_events::{EventHandler, Message};
/// use sqlx::{Postgres, Transaction};
///
/// struct Ledger;
///
/// impl EventHandler<Postgres> for Ledger {
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
pub trait EventHandler<DB: Backend>: Send + Sync + 'static {
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
    Database(#[from] crate::error::Error),
    /// The broker was not told how the message ended.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl From<sqlx::Error> for ConsumeError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error.into())
    }
}

/// An idempotent consumer: a database, an [`EventHandler`], its [`ConsumerOptions`] (its name
/// among them) and, to be spawned, the [`Subscriber`] it takes messages from.
///
/// For each message it begins a transaction, records `(name, message id)` in it (a message
/// recorded before is acknowledged and skipped), runs the handler, commits, and only then
/// acknowledges. The handler's writes therefore happen once per message id however often the
/// broker delivers it: effectively once. Effects outside the transaction (a call to another
/// service) happen at least once.
///
/// A failure (an error or a panic of the handler) rolls everything back and is counted in a
/// statement of its own; the message is given back to the broker and, after
/// [`ConsumerOptions::max_attempts`] failures, moved to the dead-letter place with an error in
/// the log. The ids of processed messages are kept for [`ConsumerOptions::retention`]: a
/// redelivery later than that would be applied again.
///
/// ```no_run
/// # async fn demo<H: idem_events::EventHandler<sqlx::Postgres>>(
/// #     pool: sqlx::PgPool, handler: H, subscriber: impl idem_events::Subscriber,
/// # ) {
/// use idem_events::{CancellationToken, Consumer, ConsumerOptions};
///
/// let shutdown = CancellationToken::new();
/// let consumer = Consumer::new(pool, handler, ConsumerOptions::new("ledger"))
///     .with_subscriber(subscriber)
///     .spawn(shutdown.clone());
/// // ... serve until shutdown is cancelled, then:
/// consumer.await.ok();
/// # }
/// ```
pub struct Consumer<DB: Backend, H, S = ()> {
    name: Arc<str>,
    pool: Pool<DB>,
    handler: Arc<H>,
    options: ConsumerOptions,
    subscriber: S,
    on_committed: Option<Arc<CommittedObserver>>,
}

/// What [`Consumer::on_committed`] calls.
type CommittedObserver = dyn Fn(&Message) + Send + Sync;

impl<DB: Backend, H, S: Clone> Clone for Consumer<DB, H, S> {
    fn clone(&self) -> Self {
        Self {
            name: Arc::clone(&self.name),
            pool: self.pool.clone(),
            handler: Arc::clone(&self.handler),
            options: self.options.clone(),
            subscriber: self.subscriber.clone(),
            on_committed: self.on_committed.clone(),
        }
    }
}

impl<DB: Backend, H, S> std::fmt::Debug for Consumer<DB, H, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, H: EventHandler<DB>> Consumer<DB, H> {
    /// A consumer over `pool`'s database, running `handler`, without a subscriber yet: it
    /// [processes](Consumer::process) deliveries handed to it, and
    /// [`Consumer::with_subscriber`] gives it the subscriber to [spawn](Consumer::spawn) it
    /// on.
    pub fn new(pool: Pool<DB>, handler: H, options: ConsumerOptions) -> Self {
        Self {
            name: options.name().into(),
            pool,
            handler: Arc::new(handler),
            options,
            subscriber: (),
            on_committed: None,
        }
    }
}

impl<DB: Backend, H: EventHandler<DB>, S> Consumer<DB, H, S> {
    /// The same consumer, taking its messages from `subscriber` once spawned.
    #[must_use]
    pub fn with_subscriber<T: Subscriber>(self, subscriber: T) -> Consumer<DB, H, T> {
        Consumer {
            name: self.name,
            pool: self.pool,
            handler: self.handler,
            options: self.options,
            subscriber,
            on_committed: self.on_committed,
        }
    }

    /// Calls `observer` with each message whose transaction committed, before the message is
    /// acknowledged: for counting, or for a test that stops the process right there.
    #[must_use]
    pub fn on_committed(mut self, observer: impl Fn(&Message) + Send + Sync + 'static) -> Self {
        self.on_committed = Some(Arc::new(observer));
        self
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The consumer's options.
    pub fn options(&self) -> &ConsumerOptions {
        &self.options
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
            self.settled(delivery.dead_letter("the message has no id"))
                .await?;
            return Ok(Processed::DeadLettered { attempts: 0 });
        }
        // A message delivered again may have stopped the process that had it (an abort, an
        // OOM kill): its attempt is counted before it runs, so that such a message too ends in
        // the dead-letter place instead of stopping every process that takes it. A first
        // delivery is not counted ahead: the common path writes nothing more.
        let redelivered = delivery.redelivered();
        if redelivered {
            let attempts = match bounded(
                self.options.database_timeout,
                DB::attempts(&self.pool, &self.name, id),
            )
            .await
            {
                Ok(attempts) => attempts,
                Err(error) => return self.give_back(delivery, error).await,
            };
            if attempts >= self.options.max_attempts {
                return self
                    .dead_letter(delivery, attempts, "it failed too often before")
                    .await;
            }
            if let Err(error) = bounded(
                self.options.database_timeout,
                DB::count_failure(&self.pool, &self.name, id, UNFINISHED),
            )
            .await
            {
                return self.give_back(delivery, error).await;
            }
        }
        let timeout = self.options.database_timeout;
        let applied = tokio::time::timeout(timeout, self.apply(&message, redelivered))
            .await
            .unwrap_or(Err(Failure::Database(crate::error::Error::TimedOut {
                after: timeout,
            })));
        let failure = match applied {
            Ok(true) => {
                if let Some(observer) = &self.on_committed {
                    observer(&message);
                }
                self.settled(delivery.ack()).await?;
                return Ok(Processed::Applied);
            }
            Ok(false) => {
                if redelivered {
                    // The attempt counted ahead was not one.
                    if let Err(error) = bounded(
                        self.options.database_timeout,
                        DB::clear_failures_apart(&self.pool, &self.name, id),
                    )
                    .await
                    {
                        tracing::debug!(%error, "forgetting a duplicate's attempt failed");
                    }
                }
                self.settled(delivery.ack()).await?;
                return Ok(Processed::Duplicate);
            }
            Err(Failure::Database(error)) => return self.give_back(delivery, error).await,
            Err(Failure::Handler(reason)) => reason,
        };
        let counted = if redelivered {
            bounded(
                self.options.database_timeout,
                DB::note_failure(&self.pool, &self.name, id, &failure),
            )
            .await
        } else {
            bounded(
                self.options.database_timeout,
                DB::count_failure(&self.pool, &self.name, id, &failure),
            )
            .await
        };
        let attempts = match counted {
            Ok(attempts) => attempts,
            Err(error) => return self.give_back(delivery, error).await,
        };
        if attempts >= self.options.max_attempts {
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
        tokio::time::sleep(retry_delay(attempts, self.options.max_backoff)).await;
        self.settled(delivery.retry()).await?;
        Ok(Processed::Failed { attempts })
    }

    /// Runs the handler in a transaction with the message's record; `Ok(false)` when it was
    /// recorded before.
    async fn apply(&self, message: &Message, redelivered: bool) -> Result<bool, Failure> {
        let conn = self
            .pool
            .acquire()
            .await
            .map_err(crate::error::Error::from)?;
        let mut tx = DB::begin_write(conn).await?;
        if !DB::record_processed(&mut tx, &self.name, message.id()).await? {
            tx.rollback().await.map_err(crate::error::Error::from)?;
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
                tx.commit().await.map_err(crate::error::Error::from)?;
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
        self.settled(delivery.dead_letter(&format!("failed {attempts} times: {reason}")))
            .await?;
        Ok(Processed::DeadLettered { attempts })
    }

    async fn give_back<D: Delivery>(
        &self,
        delivery: D,
        error: crate::error::Error,
    ) -> Result<Processed, ConsumeError> {
        if let Err(broker) = self.settled(delivery.retry()).await {
            tracing::debug!(error = %broker, "giving a message back to the broker failed");
        }
        Err(error.into())
    }

    /// Waits for a settlement sent to the broker, at most
    /// [`ConsumerOptions::settle_timeout`].
    async fn settled(
        &self,
        settlement: impl Future<Output = Result<(), BrokerError>>,
    ) -> Result<(), BrokerError> {
        let timeout = self.options.settle_timeout;
        tokio::time::timeout(timeout, settlement)
            .await
            .unwrap_or_else(|_| {
                Err(BrokerError::unavailable(format!(
                    "the broker did not take the message's settlement within {timeout:?}"
                )))
            })
    }

    /// Deletes up to `limit` records older than [`ConsumerOptions::retention`].
    ///
    /// # Errors
    ///
    /// When the database failed.
    pub async fn purge(&self, limit: i64) -> Result<u64, crate::error::Error> {
        bounded(
            self.options.database_timeout,
            DB::purge_consumed(&self.pool, &self.name, self.options.retention, limit),
        )
        .await
    }

    /// Purges in batches until no record is past its retention.
    async fn purge_all(&self) {
        const BATCH: i64 = 1000;
        loop {
            match self.purge(BATCH).await {
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

impl<DB: Backend, H: EventHandler<DB>, S: Subscriber> Consumer<DB, H, S> {
    /// Consumes from the subscriber in a task of its own until `shutdown` is cancelled, one
    /// message at a time.
    ///
    /// It subscribes again whenever the connection breaks, with a capped backoff, logging one
    /// warning when the trouble starts and one line when it ends (the broker's and the
    /// database's troubles each their own). After a cancellation it takes no new message; the
    /// message in flight is finished and settled first. Records past their retention are
    /// purged now and then.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(self, shutdown: CancellationToken) -> TaskHandle {
        // Every outcome exported from the start, at zero: an alert on the increase of a series
        // that appears only with its first event (a dead letter) would never fire.
        for outcome in [
            "applied",
            "duplicate",
            "failed",
            "dead_lettered",
            "unsettled",
        ] {
            metrics::counter!(
                "idem_messages_total",
                "consumer" => self.name.to_string(),
                "outcome" => outcome,
            )
            .increment(0);
        }
        let schedule = Schedule::new(Duration::ZERO)
            .with_backoff(Duration::from_millis(100), self.options.max_backoff)
            .with_housekeeping(
                (self.options.retention / 10)
                    .clamp(Duration::from_secs(1), Duration::from_secs(3600)),
            )
            // Not cut short: the message in flight is settled first.
            .with_interrupt(false);
        let consuming = Consuming {
            consumer: self,
            subscription: None,
        };
        idem_task::spawn(consuming, schedule, shutdown)
    }
}

/// A spawned consumer: the consumer, and its subscription while it has one.
struct Consuming<DB: Backend, H, S: Subscriber> {
    consumer: Consumer<DB, H, S>,
    subscription: Option<S::Subscription>,
}

/// What held a spawned consumer up.
#[derive(Debug, thiserror::Error)]
enum Stalled {
    #[error(transparent)]
    Broker(BrokerError),
    #[error(transparent)]
    Database(crate::error::Error),
}

/// The outage of a spawned consumer's broker.
const BROKER: usize = 0;
/// The outage of a spawned consumer's database.
const DATABASE: usize = 1;

impl<DB: Backend, H: EventHandler<DB>, S: Subscriber> Work for Consuming<DB, H, S> {
    type Error = Stalled;

    async fn pass(&mut self, cx: &mut PassContext<'_>) -> Result<Next, Stalled> {
        let shutdown = cx.shutdown().clone();
        if self.subscription.is_none() {
            let subscribed = tokio::select! {
                () = shutdown.cancelled() => return Ok(Next::Busy),
                subscribed = self.consumer.subscriber.subscribe() => subscribed,
            };
            self.subscription = Some(subscribed.map_err(Stalled::Broker)?);
        }
        let Some(subscription) = self.subscription.as_mut() else {
            return Ok(Next::Busy);
        };
        let next = tokio::select! {
            () = shutdown.cancelled() => return Ok(Next::Busy),
            next = subscription.next() => next,
        };
        let delivery = match next {
            Ok(delivery) => delivery,
            Err(error) => {
                self.subscription = None;
                return Err(Stalled::Broker(error));
            }
        };
        // Only a delivery ends the broker's outage: a subscription that opens and then breaks
        // every time stays one outage, with one warning.
        cx.recovered(BROKER);
        match self.consumer.process(delivery).await {
            Ok(_) => Ok(Next::Busy),
            Err(ConsumeError::Database(error)) => Err(Stalled::Database(error)),
            Err(ConsumeError::Broker(error)) => {
                self.subscription = None;
                Err(Stalled::Broker(error))
            }
        }
    }

    fn outage(&self, error: &Stalled) -> usize {
        match error {
            Stalled::Broker(_) => BROKER,
            Stalled::Database(_) => DATABASE,
        }
    }

    async fn housekeep(&mut self) {
        self.consumer.purge_all().await;
    }

    fn outage_started(&self, error: &Stalled) {
        tracing::warn!(
            consumer = %self.consumer.name,
            %error,
            "the consumer cannot go on; it retries with backoff"
        );
    }

    fn still_failing(&self, error: &Stalled, wait: Duration) {
        tracing::debug!(consumer = %self.consumer.name, %error, ?wait, "the consumer still cannot go on");
    }

    fn outage_ended(&self, outage: usize) {
        if outage == BROKER {
            tracing::info!(consumer = %self.consumer.name, "the consumer receives messages again");
        } else {
            tracing::info!(consumer = %self.consumer.name, "the consumer's database answers again");
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
    Database(crate::error::Error),
    /// The handler returned an error or panicked: counted against the message.
    Handler(String),
}

impl From<crate::error::Error> for Failure {
    fn from(error: crate::error::Error) -> Self {
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
