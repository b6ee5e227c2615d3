//! Redis Streams: the relay appends to one stream with `XADD`, each consumer reads it through a
//! consumer group of its own, acknowledges with `XACK` after its commit, and takes over the
//! messages of a consumer that died with `XAUTOCLAIM`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_events::BrokerError> {
//! use idem_events::{CancellationToken, Relay, RelayOptions, redis::RedisStreams};
//!
//! let broker = RedisStreams::new("redis://127.0.0.1:6379", "idem.events")?;
//! let shutdown = CancellationToken::new();
//! Relay::new(pool, broker.publisher(), RelayOptions::default()).spawn(shutdown.clone());
//! // A consumer: Consumer::new(pool, Ledger, ConsumerOptions::new("ledger"))
//! //     .with_subscriber(broker.subscriber("ledger"))
//! //     .spawn(shutdown)
//! # Ok(())
//! # }
//! ```
//!
//! An entry holds the fields `id` (the event id), `topic` and `payload`. The consumer `name`
//! is the consumer group; the group starts at the stream's first entry, so events published
//! before the consumer first ran are delivered too. Within the group, a process reads as the
//! consumer `name` unless [`RedisSubscriber::with_consumer`] names it otherwise (give each process
//! of a group its own name). On subscribing it first reads what is still pending for its
//! name (what it had received before it stopped), then new entries.
//!
//! A message given back for another attempt stays pending and is claimed again after
//! [`RedisSubscriber::with_claim_idle`], as are the messages of a consumer that stopped for good;
//! one that failed for good is appended, with `group` and `error` fields, to `<stream>.dead`
//! and acknowledged in one `MULTI`. Streams are not trimmed.

use std::{collections::VecDeque, sync::Arc, time::Duration};

use redis::{
    AsyncCommands, AsyncConnectionConfig, Client,
    aio::MultiplexedConnection,
    streams::{
        StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
    },
};
use tokio::{sync::Mutex, time::Instant};

use crate::{
    broker::{BrokerError, Delivery, Publisher, Subscriber, Subscription, debug_showing},
    message::Message,
};

/// How long connecting may take before it counts as a failure.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long Redis may take to answer a command (a blocking read: beyond its own wait).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// A Redis server and the stream events go through.
#[derive(Debug, Clone)]
pub struct RedisStreams {
    client: Client,
    stream: Arc<str>,
}

impl RedisStreams {
    /// The server at `url` (`redis://host:port/db`), with events in the stream `stream`.
    ///
    /// # Errors
    ///
    /// [`BrokerError::Invalid`] when `url` is not a Redis URL.
    pub fn new(url: &str, stream: &str) -> Result<Self, BrokerError> {
        let client = Client::open(url).map_err(|error| {
            BrokerError::Invalid(format!("`{url}` is not a Redis URL: {error}"))
        })?;
        Ok(Self {
            client,
            stream: stream.into(),
        })
    }

    /// A [`Publisher`] for the relay.
    pub fn publisher(&self) -> RedisPublisher {
        RedisPublisher {
            broker: self.clone(),
            connection: Mutex::new(None),
        }
    }

    /// A [`Subscriber`] for the consumer `name` (its consumer group), reading as the consumer
    /// `name` within the group; messages pending for 30 s (see
    /// [`RedisSubscriber::with_claim_idle`]) are taken over.
    pub fn subscriber(&self, name: &str) -> RedisSubscriber {
        RedisSubscriber {
            broker: self.clone(),
            group: name.into(),
            consumer: name.to_owned(),
            claim_idle: Duration::from_secs(30),
            batch: 16,
        }
    }

    /// The stream failed messages are moved to.
    pub fn dead_letter_stream(&self) -> String {
        format!("{}.dead", self.stream)
    }

    async fn connect(
        &self,
        response_timeout: Option<Duration>,
    ) -> Result<MultiplexedConnection, BrokerError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(response_timeout);
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(BrokerError::unavailable)
    }
}

/// Appends the relay's batches to the stream, in order, in one pipeline; Redis's replies are
/// the confirms.
pub struct RedisPublisher {
    broker: RedisStreams,
    connection: Mutex<Option<MultiplexedConnection>>,
}

debug_showing!(RedisPublisher { broker });

impl Publisher for RedisPublisher {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let mut held = self.connection.lock().await;
        let connection = match held.as_mut() {
            Some(connection) => connection,
            None => held.insert(self.broker.connect(Some(RESPONSE_TIMEOUT)).await?),
        };
        let mut pipe = redis::pipe();
        for message in messages {
            pipe.xadd(
                &*self.broker.stream,
                "*",
                &[
                    ("id", message.id().as_bytes()),
                    ("topic", message.topic().as_bytes()),
                    ("payload", &message.payload()[..]),
                ],
            );
        }
        let appended: Result<Vec<String>, _> = pipe.query_async(connection).await;
        match appended {
            Ok(ids) if ids.len() == messages.len() => Ok(()),
            Ok(ids) => Err(BrokerError::Refused(format!(
                "Redis appended {} of {} messages",
                ids.len(),
                messages.len()
            ))),
            Err(error) => {
                *held = None;
                Err(BrokerError::unavailable(error))
            }
        }
    }
}

/// A consumer group on the stream.
#[derive(Debug, Clone)]
pub struct RedisSubscriber {
    broker: RedisStreams,
    group: Arc<str>,
    consumer: String,
    claim_idle: Duration,
    batch: usize,
}

impl RedisSubscriber {
    /// How long a message stays pending (unacknowledged) before this consumer takes it over:
    /// the delay before a message given back for another attempt, or left by a consumer that
    /// died, is delivered again (default 30 s). Make it longer than a message takes to
    /// process.
    #[must_use]
    pub fn with_claim_idle(mut self, claim_idle: Duration) -> Self {
        self.claim_idle = claim_idle.max(Duration::from_millis(1));
        self
    }

    /// This process's name within the group (default: the group's name). Each process of a
    /// group should have its own, kept across restarts: a process that starts again reads what
    /// is still pending for its name at once.
    #[must_use]
    pub fn with_consumer(mut self, consumer: &str) -> Self {
        consumer.clone_into(&mut self.consumer);
        self
    }
}

impl RedisSubscriber {
    /// Creates the consumer group (and the stream) if they do not exist, without reading:
    /// the group starts at the stream's first entry either way.
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached or refuses the command.
    pub async fn declare(&self) -> Result<(), BrokerError> {
        let mut control = self.broker.connect(Some(RESPONSE_TIMEOUT)).await?;
        self.declare_on(&mut control).await
    }

    async fn declare_on(&self, control: &mut MultiplexedConnection) -> Result<(), BrokerError> {
        let created: Result<(), redis::RedisError> = control
            .xgroup_create_mkstream(&*self.broker.stream, &*self.group, "0")
            .await;
        match created {
            Ok(()) => Ok(()),
            Err(error) if error.code() == Some("BUSYGROUP") => Ok(()),
            Err(error) => Err(BrokerError::unavailable(error)),
        }
    }
}

impl Subscriber for RedisSubscriber {
    type Subscription = RedisSubscription;

    async fn subscribe(&self) -> Result<RedisSubscription, BrokerError> {
        // Blocking reads wait longer than any response timeout: they get a connection of
        // their own, whose reads are bounded one by one.
        let reads = self.broker.connect(None).await?;
        let mut control = self.broker.connect(Some(RESPONSE_TIMEOUT)).await?;
        self.declare_on(&mut control).await?;
        Ok(RedisSubscription {
            subscriber: self.clone(),
            reads,
            control,
            buffer: VecDeque::new(),
            backlog: Some("0".to_owned()),
            cursor: "0-0".to_owned(),
            next_claim: Instant::now(),
        })
    }
}

/// An open read of the consumer group.
pub struct RedisSubscription {
    subscriber: RedisSubscriber,
    reads: MultiplexedConnection,
    control: MultiplexedConnection,
    buffer: VecDeque<RedisDelivery>,
    /// While reading what is pending for this consumer: the id to read after.
    backlog: Option<String>,
    cursor: String,
    next_claim: Instant,
}

debug_showing!(RedisSubscription { subscriber });

impl RedisSubscription {
    fn delivery(&self, entry: StreamId, redelivered: bool) -> RedisDelivery {
        let field = |name: &str| entry.get::<Vec<u8>>(name).unwrap_or_default();
        let message = Message::new(
            String::from_utf8_lossy(&field("id")).into_owned(),
            String::from_utf8_lossy(&field("topic")).into_owned(),
            field("payload"),
        );
        RedisDelivery {
            message,
            entry: entry.id,
            redelivered,
            connection: self.control.clone(),
            stream: Arc::clone(&self.subscriber.broker.stream),
            group: Arc::clone(&self.subscriber.group),
        }
    }

    /// Reads the next page of what is pending for this consumer's name.
    async fn read_backlog(&mut self, after: String) -> Result<(), BrokerError> {
        let s = &self.subscriber;
        let options = StreamReadOptions::default()
            .group(&*s.group, &s.consumer)
            .count(s.batch);
        let reply: Option<StreamReadReply> = self
            .control
            .xread_options(&[&*s.broker.stream], &[&after], &options)
            .await
            .map_err(BrokerError::unavailable)?;
        let entries: Vec<StreamId> = reply
            .map(|reply| reply.keys.into_iter().flat_map(|key| key.ids).collect())
            .unwrap_or_default();
        self.backlog = entries.last().map(|entry| entry.id.clone());
        for entry in entries {
            let delivery = self.delivery(entry, true);
            self.buffer.push_back(delivery);
        }
        Ok(())
    }

    /// Takes over entries pending for longer than `claim_idle`, a page at a time.
    async fn claim(&mut self) -> Result<(), BrokerError> {
        let s = &self.subscriber;
        let idle = u64::try_from(s.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let reply: StreamAutoClaimReply = self
            .control
            .xautoclaim_options(
                &*s.broker.stream,
                &*s.group,
                &s.consumer,
                idle,
                &self.cursor,
                StreamAutoClaimOptions::default().count(s.batch),
            )
            .await
            .map_err(BrokerError::unavailable)?;
        if reply.next_stream_id == "0-0" {
            self.next_claim = Instant::now() + s.claim_idle / 2;
        }
        self.cursor = reply.next_stream_id;
        for entry in reply.claimed {
            let delivery = self.delivery(entry, true);
            self.buffer.push_back(delivery);
        }
        Ok(())
    }
}

impl Subscription for RedisSubscription {
    type Delivery = RedisDelivery;

    async fn next(&mut self) -> Result<RedisDelivery, BrokerError> {
        loop {
            if let Some(delivery) = self.buffer.pop_front() {
                return Ok(delivery);
            }
            if let Some(after) = self.backlog.take() {
                self.read_backlog(after).await?;
                continue;
            }
            let now = Instant::now();
            if now >= self.next_claim {
                self.claim().await?;
                continue;
            }
            let wait = (self.next_claim - now).max(Duration::from_millis(1));
            let s = &self.subscriber;
            let options = StreamReadOptions::default()
                .group(&*s.group, &s.consumer)
                .count(s.batch)
                .block(usize::try_from(wait.as_millis()).unwrap_or(usize::MAX));
            // Bounded, so that a connection that died without a word (a half-open TCP
            // connection) is noticed.
            let reply: Option<StreamReadReply> = tokio::time::timeout(
                wait + RESPONSE_TIMEOUT,
                self.reads
                    .xread_options(&[&*s.broker.stream], &[">"], &options),
            )
            .await
            .map_err(|_| BrokerError::unavailable("Redis did not answer a blocking read in time"))?
            .map_err(BrokerError::unavailable)?;
            for key in reply.map(|reply| reply.keys).unwrap_or_default() {
                for entry in key.ids {
                    let delivery = self.delivery(entry, false);
                    self.buffer.push_back(delivery);
                }
            }
        }
    }
}

/// An entry read through the consumer group.
pub struct RedisDelivery {
    message: Message,
    entry: String,
    redelivered: bool,
    connection: MultiplexedConnection,
    stream: Arc<str>,
    group: Arc<str>,
}

debug_showing!(RedisDelivery { message, entry });

impl Delivery for RedisDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn redelivered(&self) -> bool {
        self.redelivered
    }

    async fn ack(mut self) -> Result<(), BrokerError> {
        let _: usize = self
            .connection
            .xack(&*self.stream, &*self.group, &[&self.entry])
            .await
            .map_err(BrokerError::unavailable)?;
        Ok(())
    }

    async fn retry(self) -> Result<(), BrokerError> {
        // Left pending: claimed again once idle for `claim_idle`.
        Ok(())
    }

    async fn dead_letter(mut self, reason: &str) -> Result<(), BrokerError> {
        let dead = format!("{}.dead", self.stream);
        let _: () = redis::pipe()
            .atomic()
            .xadd(
                &dead,
                "*",
                &[
                    ("id", self.message.id().as_bytes()),
                    ("topic", self.message.topic().as_bytes()),
                    ("payload", &self.message.payload()[..]),
                    ("group", self.group.as_bytes()),
                    ("error", reason.as_bytes()),
                ],
            )
            .ignore()
            .xack(&*self.stream, &*self.group, &[&self.entry])
            .ignore()
            .query_async(&mut self.connection)
            .await
            .map_err(BrokerError::unavailable)?;
        Ok(())
    }
}
