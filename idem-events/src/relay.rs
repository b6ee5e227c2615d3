//! The relay: publishes the outbox's events to a broker, each topic in order, and marks them
//! published once the broker confirmed them.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use idem_task::{Backoff, Next, PassContext, Schedule, TaskHandle, Work};
use sqlx::Pool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    backend::{Backend, Wanted},
    error::bounded,
};
use crate::{
    broker::{BrokerError, Publisher},
    message::Message,
};

/// How a [`Relay`] works; [`RelayOptions::default`] suits most services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayOptions {
    name: Option<String>,
    batch: u16,
    poll: Duration,
    retention: Duration,
    max_backoff: Duration,
    publish_timeout: Duration,
    database_timeout: Duration,
    lease: Duration,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            name: None,
            batch: 100,
            poll: Duration::from_millis(200),
            retention: Duration::from_secs(24 * 3600),
            max_backoff: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(20),
            database_timeout: Duration::from_secs(10),
            lease: Duration::from_secs(60),
        }
    }
}

impl RelayOptions {
    /// Sets [`RelayOptions::name`].
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Sets [`RelayOptions::batch`] (at least 1).
    #[must_use]
    pub fn with_batch(mut self, batch: u16) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Sets [`RelayOptions::poll`].
    #[must_use]
    pub fn with_poll(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// Sets [`RelayOptions::retention`].
    #[must_use]
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets [`RelayOptions::max_backoff`].
    #[must_use]
    pub fn with_max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// Sets [`RelayOptions::publish_timeout`].
    #[must_use]
    pub fn with_publish_timeout(mut self, publish_timeout: Duration) -> Self {
        self.publish_timeout = publish_timeout;
        self
    }

    /// Sets [`RelayOptions::database_timeout`].
    #[must_use]
    pub fn with_database_timeout(mut self, timeout: Duration) -> Self {
        self.database_timeout = timeout;
        self
    }

    /// Sets [`RelayOptions::lease`], which should be longer than
    /// [`RelayOptions::publish_timeout`].
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The relay's name (default: none, and the relay takes a random one). On SQLite a relay
    /// holds a topic under its name; one restarted under the same name takes its topics back at
    /// once, where another waits for [`RelayOptions::lease`]. Give each relay process its own
    /// name, kept across restarts: two relays running under one name would publish the same
    /// topic together.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The most events published in one batch (default 100).
    pub fn batch(&self) -> u16 {
        self.batch
    }

    /// How often an idle relay looks for new events (default 200 ms).
    pub fn poll(&self) -> Duration {
        self.poll
    }

    /// How long published events stay in the outbox before they are purged (default 24 h).
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// The longest wait between two attempts while the broker is away (default 30 s).
    pub fn max_backoff(&self) -> Duration {
        self.max_backoff
    }

    /// How long the broker has to confirm a batch before the relay gives up on it and tries
    /// again (default 20 s).
    pub fn publish_timeout(&self) -> Duration {
        self.publish_timeout
    }

    /// How long each of the relay's statements may wait on the database (default 10 s): past
    /// it the pass fails with [`Error::TimedOut`](crate::error::Error::TimedOut) and the relay
    /// retries with backoff, as after any database error. A database that stops answering
    /// without refusing (a partition) is noticed this way; the events keep waiting in the
    /// outbox, and a batch published but not marked is published again (consumers drop the
    /// duplicates).
    pub fn database_timeout(&self) -> Duration {
        self.database_timeout
    }

    /// On SQLite, how long a relay's lease on a topic lasts if it stops without letting go:
    /// another relay takes the topic over after it (default 60 s), a relay of the same
    /// [name](RelayOptions::name) at once. PostgreSQL and MySQL hold topics with row locks,
    /// which die with the relay's connection.
    pub fn lease(&self) -> Duration {
        self.lease
    }
}

/// What stopped a relay's pass.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The outbox's database failed; the events wait.
    #[error(transparent)]
    Database(#[from] crate::error::Error),
    /// The broker did not confirm the batch; its events wait and are published again.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// Publishes the outbox's events to a broker.
///
/// Each pass takes one topic that no other relay holds (several relays may run on one
/// database), publishes up to [`RelayOptions::batch`] of its events in order with the event id
/// as the message id, waits for the broker's confirms, and only then marks them published. A
/// relay that stops between the confirm and the mark publishes them again: delivery is at least
/// once, and consumers deduplicate on the id.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, publisher: impl idem_events::Publisher) {
/// use idem_events::{CancellationToken, Relay, RelayOptions};
///
/// let shutdown = CancellationToken::new();
/// let relay = Relay::new(pool, publisher, RelayOptions::default()).spawn(shutdown.clone());
/// // ... serve until shutdown is cancelled, then:
/// relay.await.ok();
/// # }
/// ```
pub struct Relay<DB: Backend, P> {
    pool: Pool<DB>,
    publisher: Arc<P>,
    options: RelayOptions,
    id: String,
    last_topic: Option<String>,
    on_confirmed: Option<Arc<ConfirmedObserver>>,
    /// Topics the broker refused, skipped until their wait is over.
    refused: HashMap<String, Refused>,
}

/// A topic the broker refused: when to try it again, and its own backoff.
#[derive(Debug)]
struct Refused {
    until: Instant,
    backoff: Backoff,
}

/// What [`Relay::on_confirmed`] calls.
type ConfirmedObserver = dyn Fn(&[Message]) + Send + Sync;

impl<DB: Backend, P> std::fmt::Debug for Relay<DB, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("id", &self.id)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// The outbox's backlog, as [`Relay::waiting`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// Events not published yet.
    pub events: u64,
    /// How long the oldest of them has waited.
    pub oldest: Option<Duration>,
}

/// What one [`Relay::pass`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pass {
    /// It published this many events of this topic.
    Published {
        /// The topic.
        topic: String,
        /// How many events.
        count: usize,
    },
    /// The topic it took had no event left: another relay published them in the meantime
    /// (SQLite, after a relay's lease on the topic ran out).
    NotReady {
        /// The topic.
        topic: String,
    },
    /// The broker refused the topic's batch (on RabbitMQ: no queue is bound to receive it).
    /// The topic is skipped, with a backoff of its own, while the others go on.
    Refused {
        /// The topic.
        topic: String,
        /// What the broker said.
        reason: String,
    },
    /// No topic with waiting events was free.
    Idle,
}

impl<DB: Backend, P: Publisher> Relay<DB, P> {
    /// A relay of the outbox in `pool`'s database to `publisher`.
    pub fn new(pool: Pool<DB>, publisher: P, options: RelayOptions) -> Self {
        let id = options
            .name()
            .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
        Self {
            pool,
            publisher: Arc::new(publisher),
            options,
            id,
            last_topic: None,
            on_confirmed: None,
            refused: HashMap::new(),
        }
    }

    /// Calls `observer` with each batch the broker confirmed, before the batch is marked
    /// published: for counting, or for a test that stops the process right there.
    #[must_use]
    pub fn on_confirmed(mut self, observer: impl Fn(&[Message]) + Send + Sync + 'static) -> Self {
        self.on_confirmed = Some(Arc::new(observer));
        self
    }

    /// The name the relay holds topics under: [`RelayOptions::name`], or the random one it
    /// took.
    pub fn name(&self) -> &str {
        &self.id
    }

    /// The relay's options.
    pub fn options(&self) -> &RelayOptions {
        &self.options
    }

    /// Publishes one batch of one topic.
    ///
    /// # Errors
    ///
    /// [`RelayError::Database`] when the database failed, [`RelayError::Broker`] when the broker
    /// cannot be reached or did not confirm the batch within
    /// [`RelayOptions::publish_timeout`]; the batch's events are still waiting either way. A
    /// batch the broker answered but refused is [`Pass::Refused`], not an error.
    pub async fn pass(&mut self) -> Result<Pass, RelayError> {
        let now = Instant::now();
        let skip: Vec<String> = self
            .refused
            .iter()
            .filter(|(_, refused)| refused.until > now)
            .map(|(topic, _)| topic.clone())
            .collect();
        let limit = self.options.database_timeout;
        let Some(batch) = bounded(
            limit,
            DB::take_batch(
                &self.pool,
                Wanted {
                    relay: &self.id,
                    after: self.last_topic.as_deref(),
                    skip: &skip,
                    limit: i64::from(self.options.batch),
                    lease: self.options.lease,
                },
            ),
        )
        .await?
        else {
            return Ok(Pass::Idle);
        };
        let topic = batch.topic.clone();
        self.last_topic = Some(topic.clone());
        if batch.messages.is_empty() {
            bounded(limit, DB::abandon(batch)).await?;
            return Ok(Pass::NotReady { topic });
        }
        let published = tokio::time::timeout(
            self.options.publish_timeout,
            self.publisher.publish(&batch.messages),
        )
        .await
        .unwrap_or_else(|_| {
            Err(BrokerError::unavailable(format!(
                "the broker did not confirm the batch within {:?}",
                self.options.publish_timeout
            )))
        });
        if let Err(error) = published {
            if let Err(store) = bounded(limit, DB::abandon(batch)).await {
                tracing::debug!(error = %store, "letting go of an outbox topic failed");
            }
            return match error {
                BrokerError::Refused(reason) | BrokerError::Invalid(reason) => {
                    Ok(self.refuse(topic, reason))
                }
                unavailable => Err(unavailable.into()),
            };
        }
        if let Some(observer) = &self.on_confirmed {
            observer(&batch.messages);
        }
        let count = batch.messages.len();
        bounded(limit, DB::mark_published(batch)).await?;
        metrics::counter!("idem_outbox_published_total", "topic" => topic.clone())
            .increment(count as u64);
        // At zero from the topic's first batch: an alert on its `increase()` sees the first
        // refusal.
        metrics::counter!("idem_outbox_refused_total", "topic" => topic.clone()).increment(0);
        if self.refused.remove(&topic).is_some() {
            tracing::info!(%topic, "the broker takes the topic's events again");
        }
        tracing::debug!(%topic, count, "published outbox events");
        Ok(Pass::Published { topic, count })
    }

    /// Skips `topic` for a while: one warning when the broker starts refusing it.
    fn refuse(&mut self, topic: String, reason: String) -> Pass {
        let refused = self
            .refused
            .entry(topic.clone())
            .or_insert_with(|| Refused {
                until: Instant::now(),
                backoff: Backoff::new(
                    self.options.poll.max(Duration::from_millis(50)),
                    self.options.max_backoff,
                ),
            });
        let (wait, started) = refused.backoff.failed();
        refused.until = Instant::now() + wait;
        metrics::counter!("idem_outbox_refused_total", "topic" => topic.clone()).increment(1);
        if started {
            tracing::warn!(
                %topic,
                %reason,
                "the broker refuses the topic's events; they wait in the outbox and the relay \
                 retries with backoff, publishing the other topics meanwhile"
            );
        } else {
            tracing::debug!(%topic, %reason, ?wait, "the broker still refuses the topic's events");
        }
        Pass::Refused { topic, reason }
    }

    /// Publishes until no event is ready; returns how many it published.
    ///
    /// # Errors
    ///
    /// As [`Relay::pass`]; what was published before the error stays published.
    pub async fn drain(&mut self) -> Result<usize, RelayError> {
        let mut published = 0;
        let mut passed_over = HashSet::new();
        loop {
            match self.pass().await? {
                Pass::Published { count, .. } => {
                    published += count;
                    passed_over.clear();
                }
                Pass::NotReady { topic } | Pass::Refused { topic, .. } => {
                    if !passed_over.insert(topic) {
                        return Ok(published);
                    }
                }
                Pass::Idle => return Ok(published),
            }
        }
    }

    /// How many events wait in the outbox, and how long the oldest has waited: the relay's
    /// lag.
    ///
    /// # Errors
    ///
    /// When the database failed.
    pub async fn waiting(&self) -> Result<Waiting, crate::error::Error> {
        let (events, oldest_ms) =
            bounded(self.options.database_timeout, DB::waiting(&self.pool)).await?;
        Ok(Waiting {
            events: u64::try_from(events).unwrap_or(0),
            oldest: oldest_ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        })
    }

    /// Deletes up to `limit` events published more than [`RelayOptions::retention`] ago.
    ///
    /// # Errors
    ///
    /// When the database failed.
    pub async fn purge(&self, limit: i64) -> Result<u64, crate::error::Error> {
        bounded(
            self.options.database_timeout,
            DB::purge_published(&self.pool, self.options.retention, limit),
        )
        .await
    }

    /// Purges in batches until no published event is past its retention.
    async fn purge_all(&self) -> Result<u64, crate::error::Error> {
        const BATCH: i64 = 1000;
        let mut purged = 0;
        loop {
            let deleted = self.purge(BATCH).await?;
            purged += deleted;
            if deleted < BATCH.unsigned_abs() {
                return Ok(purged);
            }
        }
    }

    /// Runs the relay in a task of its own until `shutdown` is cancelled: batch after batch
    /// while events wait, then a look every [`RelayOptions::poll`]; published events past
    /// their retention are purged now and then.
    ///
    /// While the broker or the database is away, events wait in the outbox and the relay
    /// retries with a capped backoff. It logs one warning when the trouble starts and one line
    /// when it ends, not one per attempt; a topic the broker refuses is skipped with a backoff
    /// (and a warning) of its own. A cancellation stops it at once: a batch it was publishing
    /// stays unmarked and is published again by the next relay.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(self, shutdown: CancellationToken) -> TaskHandle {
        // Exported from the start, at zero, so that an alert on its increase can fire.
        metrics::counter!("idem_outbox_pass_failures_total").increment(0);
        let schedule = Schedule::new(self.options.poll)
            .with_backoff(
                self.options.poll.max(Duration::from_millis(50)),
                self.options.max_backoff,
            )
            .with_housekeeping(
                (self.options.retention / 10)
                    .clamp(Duration::from_secs(1), Duration::from_secs(3600)),
            );
        let relaying = Relaying {
            relay: self,
            passed_over: HashSet::new(),
        };
        idem_task::spawn(relaying, schedule, shutdown)
    }
}

/// A spawned relay: the relay, and the topics passed over since the last published batch.
struct Relaying<DB: Backend, P> {
    relay: Relay<DB, P>,
    passed_over: HashSet<String>,
}

impl<DB: Backend, P: Publisher> Work for Relaying<DB, P> {
    type Error = RelayError;

    async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, RelayError> {
        match self.relay.pass().await {
            Ok(Pass::Published { .. }) => {
                self.passed_over.clear();
                Ok(Next::Busy)
            }
            // Another topic may be ready: go on until one comes round again.
            Ok(Pass::NotReady { topic } | Pass::Refused { topic, .. })
                if self.passed_over.insert(topic.clone()) =>
            {
                Ok(Next::Busy)
            }
            Ok(_) => {
                self.passed_over.clear();
                Ok(Next::Idle)
            }
            Err(error) => {
                metrics::counter!("idem_outbox_pass_failures_total").increment(1);
                Err(error)
            }
        }
    }

    async fn housekeep(&mut self) {
        if let Err(error) = self.relay.purge_all().await {
            tracing::debug!(%error, "purging published outbox events failed");
        }
    }

    async fn before_wait(&mut self) {
        // Idle or held up: a good time to report the backlog.
        if let Ok(waiting) = self.relay.waiting().await {
            metrics::gauge!("idem_outbox_waiting_events").set(waiting.events as f64);
            metrics::gauge!("idem_outbox_oldest_waiting_seconds")
                .set(waiting.oldest.unwrap_or_default().as_secs_f64());
        }
    }

    fn outage_started(&self, error: &RelayError) {
        tracing::warn!(
            %error,
            "the outbox relay cannot publish; events wait in the outbox \
             and the relay retries with backoff"
        );
    }

    fn still_failing(&self, error: &RelayError, wait: Duration) {
        tracing::debug!(%error, ?wait, "the outbox relay still cannot publish");
    }

    fn outage_ended(&self, _outage: usize) {
        tracing::info!("the outbox relay publishes again");
    }
}
