//! The real brokers the event tests run against, behind one type: RabbitMQ at `$AMQP_URL`
//! (default `amqp://guest:guest@127.0.0.1:5672/%2f`) and Redis at `$REDIS_URL` (default
//! `redis://127.0.0.1:6379`) and NATS JetStream at `$NATS_URL` (default
//! `nats://127.0.0.1:4222`). Each test gets names of its own (an exchange, a stream, or a
//! subject prefix and its JetStream stream), so tests run side by side on one broker; they are
//! removed when the test's last [`TestBroker`] is dropped, whether the test passed or panicked.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use idem_events::{
    BrokerError, Delivery, Message, Publisher, Subscriber, Subscription,
    nats::{Nats, NatsDelivery, NatsPublisher, NatsSubscriber, NatsSubscription},
    rabbitmq::{
        RabbitMq, RabbitMqDelivery, RabbitMqPublisher, RabbitMqSubscriber, RabbitMqSubscription,
    },
    redis::{RedisDelivery, RedisPublisher, RedisStreams, RedisSubscriber, RedisSubscription},
};
use reqwest::Url;

use crate::TcpProxy;

/// How long a Redis consumer in the tests leaves a message pending before it claims it again:
/// the delay of a retry. Short, so that five attempts do not take minutes; the tests wait for
/// outcomes, not for this time.
pub const REDIS_CLAIM_IDLE: Duration = Duration::from_millis(200);

/// How long a NATS consumer in the tests may leave a message unsettled before JetStream
/// delivers it again: the delay before the message of a consumer that died without a word comes
/// back. Short, for the same reason as [`REDIS_CLAIM_IDLE`].
pub const NATS_ACK_WAIT: Duration = Duration::from_secs(2);

/// Which broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// RabbitMQ, through lapin.
    RabbitMq,
    /// Redis Streams.
    Redis,
    /// NATS JetStream.
    Nats,
}

/// How long dropping a [`TestBroker`] may spend removing its names from the broker.
const REMOVAL_TIMEOUT: Duration = Duration::from_secs(10);

/// A broker with names of the test's own. Its clones (and [`TestBroker::through`]) share the
/// names; when the last of them is dropped, the exchange or stream and the queues of the
/// consumers it was used with are removed from the broker.
#[derive(Debug, Clone)]
pub struct TestBroker {
    kind: BrokerKind,
    url: Url,
    names: Arc<Names>,
}

/// The names a test made on a broker, removed when dropped.
#[derive(Debug)]
struct Names {
    kind: BrokerKind,
    /// The broker itself, never a proxy in front of it (which may be down by then).
    url: Url,
    name: String,
    /// The consumers whose queues (RabbitMQ) to remove.
    consumers: Mutex<BTreeSet<String>>,
}

impl Drop for Names {
    /// Removes the names on a thread of its own with its own runtime, and waits for it: there
    /// is no async drop, and the test's runtime may be gone or shutting down (a panicking test
    /// drops its broker while unwinding). A broker that does not answer within
    /// [`REMOVAL_TIMEOUT`] leaves the names behind, and the drop says so.
    fn drop(&mut self) {
        let removal = Removal {
            kind: self.kind,
            url: self.url.clone(),
            name: std::mem::take(&mut self.name),
            consumers: std::mem::take(self.consumers.get_mut().unwrap_or_else(|e| e.into_inner())),
        };
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|error| format!("no runtime for the removal: {error}"))?;
            runtime.block_on(async {
                tokio::time::timeout(REMOVAL_TIMEOUT, removal.run())
                    .await
                    .map_err(|_| format!("the broker did not answer within {REMOVAL_TIMEOUT:?}"))?
            })
        });
        let outcome = thread
            .join()
            .unwrap_or_else(|_| Err("the removal panicked".to_owned()));
        if let Err(error) = outcome {
            eprintln!("test broker names left behind at {}: {error}", self.url);
        }
    }
}

/// What [`Names`] removes, moved to the thread that removes it.
struct Removal {
    kind: BrokerKind,
    url: Url,
    name: String,
    consumers: BTreeSet<String>,
}

impl Removal {
    async fn run(self) -> Result<(), String> {
        match self.kind {
            BrokerKind::RabbitMq => {
                let connection = lapin::Connection::connect(
                    self.url.as_str(),
                    lapin::ConnectionProperties::default(),
                )
                .await
                .map_err(|error| error.to_string())?;
                let channel = connection
                    .create_channel()
                    .await
                    .map_err(|error| error.to_string())?;
                let names = RabbitMq::new(self.url.as_str(), &self.name);
                let mut failed = Vec::new();
                for consumer in &self.consumers {
                    for queue in [names.queue(consumer), names.dead_letter_queue(consumer)] {
                        if let Err(error) = channel
                            .queue_delete(queue.as_str().into(), Default::default())
                            .await
                        {
                            failed.push(format!("queue {queue}: {error}"));
                        }
                    }
                }
                if let Err(error) = channel
                    .exchange_delete(self.name.as_str().into(), Default::default())
                    .await
                {
                    failed.push(format!("exchange {}: {error}", self.name));
                }
                let _ = connection.close(200, "removed".into()).await;
                if !failed.is_empty() {
                    return Err(failed.join("; "));
                }
            }
            BrokerKind::Redis => {
                let streams =
                    RedisStreams::new(self.url.as_str(), &self.name).map_err(|e| e.to_string())?;
                let mut conn = redis::Client::open(self.url.as_str())
                    .map_err(|error| error.to_string())?
                    .get_multiplexed_async_connection()
                    .await
                    .map_err(|error| error.to_string())?;
                redis::AsyncCommands::del::<_, ()>(
                    &mut conn,
                    &[self.name.clone(), streams.dead_letter_stream()],
                )
                .await
                .map_err(|error| error.to_string())?;
            }
            BrokerKind::Nats => {
                let nats = Nats::new(self.url.as_str(), &self.name).map_err(|e| e.to_string())?;
                let (_client, jetstream) = nats.connect().await.map_err(|e| e.to_string())?;
                match jetstream.delete_stream(nats.stream()).await {
                    Ok(_) => {}
                    // Never created: nothing to remove.
                    Err(error) if error.to_string().contains("not found") => {}
                    Err(error) => return Err(format!("stream {}: {error}", nats.stream())),
                }
            }
        }
        Ok(())
    }
}

/// The URL of `kind` from the environment, or the local default.
pub fn broker_url(kind: BrokerKind) -> String {
    match kind {
        BrokerKind::RabbitMq => std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned()),
        BrokerKind::Redis => {
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
        }
        BrokerKind::Nats => {
            std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
        }
    }
}

impl TestBroker {
    /// `kind`, with a fresh exchange or stream name.
    pub fn new(kind: BrokerKind) -> Self {
        let url = Url::parse(&broker_url(kind)).expect("a broker URL");
        Self::named(kind, url)
    }

    /// `kind` at `url`, with a fresh exchange or stream name.
    pub fn at(kind: BrokerKind, url: &str) -> Self {
        Self::named(kind, Url::parse(url).expect("a broker URL"))
    }

    fn named(kind: BrokerKind, url: Url) -> Self {
        let name = format!(
            "idem.test.{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let names = Arc::new(Names {
            kind,
            url: url.clone(),
            name,
            consumers: Mutex::default(),
        });
        Self { kind, url, names }
    }

    /// Notes that the consumer `consumer` reads from these names (from another process, say),
    /// so that its queues are removed with them. The methods here that take a consumer note it
    /// themselves.
    pub fn used_by(self, consumer: &str) -> Self {
        self.note(consumer);
        self
    }

    fn note(&self, consumer: &str) {
        self.names
            .consumers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(consumer.to_owned());
    }

    /// Which broker it is.
    pub fn kind(&self) -> BrokerKind {
        self.kind
    }

    /// The exchange (RabbitMQ) or stream (Redis) name.
    pub fn name(&self) -> &str {
        &self.names.name
    }

    /// The broker's `host:port`, for a proxy in front of it.
    pub fn address(&self) -> String {
        format!(
            "{}:{}",
            self.url.host_str().expect("a broker host"),
            self.url.port().unwrap_or(match self.kind {
                BrokerKind::RabbitMq => 5672,
                BrokerKind::Redis => 6379,
                BrokerKind::Nats => 4222,
            })
        )
    }

    /// The same broker and names, reached through `proxy`.
    pub fn through(&self, proxy: &TcpProxy) -> Self {
        let mut url = self.url.clone();
        url.set_host(Some("127.0.0.1")).expect("a host");
        url.set_port(Some(proxy.port())).expect("a port");
        Self {
            kind: self.kind,
            url,
            names: Arc::clone(&self.names),
        }
    }

    /// The publisher a relay uses.
    pub fn publisher(&self) -> AnyPublisher {
        match self.kind {
            BrokerKind::RabbitMq => AnyPublisher::RabbitMq(self.rabbitmq().publisher()),
            BrokerKind::Redis => AnyPublisher::Redis(self.redis().publisher()),
            BrokerKind::Nats => AnyPublisher::Nats(self.nats().publisher()),
        }
    }

    /// The subscriber of the consumer `consumer`, bound to every topic.
    pub fn subscriber(&self, consumer: &str) -> AnySubscriber {
        self.note(consumer);
        match self.kind {
            BrokerKind::RabbitMq => {
                AnySubscriber::RabbitMq(self.rabbitmq_subscriber(consumer, "#"))
            }
            BrokerKind::Redis => AnySubscriber::Redis(
                self.redis()
                    .subscriber(consumer)
                    .with_claim_idle(REDIS_CLAIM_IDLE),
            ),
            BrokerKind::Nats => AnySubscriber::Nats(self.nats_subscriber(consumer)),
        }
    }

    /// Declares the consumer's queue (RabbitMQ) or group (Redis) without reading from it, so
    /// that events published from now on reach it.
    pub async fn declare(&self, consumer: &str) {
        self.note(consumer);
        match self.kind {
            BrokerKind::RabbitMq => self.rabbitmq_subscriber(consumer, "#").declare().await,
            BrokerKind::Redis => self.redis().subscriber(consumer).declare().await,
            BrokerKind::Nats => self.nats_subscriber(consumer).declare().await,
        }
        .expect("declare the consumer");
    }

    /// The RabbitMQ subscriber of `consumer`, bound to `pattern` only.
    pub fn rabbitmq_subscriber(&self, consumer: &str, pattern: &str) -> RabbitMqSubscriber {
        self.note(consumer);
        self.rabbitmq().subscriber(consumer).bind(pattern)
    }

    fn rabbitmq(&self) -> RabbitMq {
        RabbitMq::new(self.url.as_str(), self.name())
    }

    /// The NATS subscriber of `consumer`, with the tests' short ack wait (`NATS_ACK_WAIT`).
    pub fn nats_subscriber(&self, consumer: &str) -> NatsSubscriber {
        self.note(consumer);
        self.nats()
            .subscriber(consumer)
            .with_ack_wait(NATS_ACK_WAIT)
    }

    /// The NATS names: the subject prefix is [`TestBroker::name`], the stream named after it.
    pub fn nats(&self) -> Nats {
        Nats::new(self.url.as_str(), self.name()).expect("a NATS URL")
    }

    /// Whether the broker itself drops a message published again with the same id (NATS
    /// JetStream, within its duplicate window).
    pub fn drops_republished_copies(&self) -> bool {
        self.kind == BrokerKind::Nats
    }

    /// NATS only: how many messages the test's stream holds.
    pub async fn nats_stored(&self) -> u64 {
        let nats = self.nats();
        let (_client, jetstream) = nats.connect().await.expect("connect to NATS");
        let stream = jetstream
            .get_stream(nats.stream())
            .await
            .expect("the test's stream");
        stream.get_info().await.expect("stream info").state.messages
    }

    fn redis(&self) -> RedisStreams {
        RedisStreams::new(self.url.as_str(), self.name()).expect("a Redis URL")
    }

    /// The ids of the messages in the consumer's dead-letter place, oldest first (read
    /// without taking them).
    pub async fn dead_letters(&self, consumer: &str) -> Vec<String> {
        match self.kind {
            BrokerKind::RabbitMq => {
                let queue = self.rabbitmq().dead_letter_queue(consumer);
                rabbitmq_peek(self.url.as_str(), &queue).await
            }
            BrokerKind::Redis => {
                let mut conn = self.redis_connection().await;
                let reply: redis::streams::StreamRangeReply =
                    redis::AsyncCommands::xrange_all(&mut conn, self.redis().dead_letter_stream())
                        .await
                        .expect("read the dead-letter stream");
                reply
                    .ids
                    .iter()
                    .filter(|entry| entry.get::<String>("group").as_deref() == Some(consumer))
                    .map(|entry| entry.get::<String>("id").unwrap_or_default())
                    .collect()
            }
            BrokerKind::Nats => self.nats_dead_letters(consumer).await,
        }
    }

    /// How many messages of the consumer wait to be delivered or acknowledged: ready in its
    /// queue (RabbitMQ, with no consumer connected), or pending in its group plus not yet read
    /// (Redis).
    pub async fn waiting(&self, consumer: &str) -> usize {
        match self.kind {
            BrokerKind::RabbitMq => {
                let connection = lapin::Connection::connect(
                    self.url.as_str(),
                    lapin::ConnectionProperties::default(),
                )
                .await
                .expect("connect to RabbitMQ");
                let channel = connection.create_channel().await.expect("a channel");
                // Unacknowledged messages count as ready only once their consumer's
                // connection is gone, which the broker learns a moment after it closes.
                let deadline = tokio::time::Instant::now() + crate::DEADLINE;
                loop {
                    let queue = channel
                        .queue_declare(
                            self.rabbitmq().queue(consumer).as_str().into(),
                            lapin::options::QueueDeclareOptions {
                                passive: true,
                                ..Default::default()
                            },
                            Default::default(),
                        )
                        .await
                        .expect("the consumer's queue");
                    if queue.consumer_count() == 0 {
                        break queue.message_count() as usize;
                    }
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the consumer's connection did not close within {:?}",
                        crate::DEADLINE
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            BrokerKind::Redis => {
                let mut conn = self.redis_connection().await;
                let groups: redis::streams::StreamInfoGroupsReply =
                    redis::AsyncCommands::xinfo_groups(&mut conn, self.name())
                        .await
                        .expect("XINFO GROUPS");
                groups
                    .groups
                    .iter()
                    .filter(|group| group.name == consumer)
                    .map(|group| group.pending + group.lag.unwrap_or(0))
                    .sum()
            }
            BrokerKind::Nats => {
                let nats = self.nats();
                let (_client, jetstream) = nats.connect().await.expect("connect to NATS");
                let stream = jetstream
                    .get_stream(nats.stream())
                    .await
                    .expect("the test's stream");
                let info = stream
                    .get_consumer::<async_nats::jetstream::consumer::pull::Config>(consumer)
                    .await
                    .expect("the consumer")
                    .get_info()
                    .await
                    .expect("consumer info");
                usize::try_from(info.num_pending).expect("a count") + info.num_ack_pending
            }
        }
    }

    /// The event ids of the dead letters the consumer published, oldest first: the messages of
    /// the stream on `<prefix>.dead.>` whose `Idem-Consumer` is `consumer`, read by sequence.
    async fn nats_dead_letters(&self, consumer: &str) -> Vec<String> {
        let nats = self.nats();
        let (_client, jetstream) = nats.connect().await.expect("connect to NATS");
        let stream = jetstream
            .get_stream(nats.stream())
            .await
            .expect("the test's stream");
        let state = stream.get_info().await.expect("stream info").state;
        let dead = format!("{}.dead.", self.name());
        let mut ids = Vec::new();
        if state.messages == 0 {
            return ids;
        }
        for sequence in state.first_sequence..=state.last_sequence {
            let Ok(message) = stream.get_raw_message(sequence).await else {
                continue;
            };
            let header = |name: &str| {
                message
                    .headers
                    .get_last(name)
                    .map(|value| value.as_str().to_owned())
            };
            if message.subject.starts_with(&dead)
                && header("Idem-Consumer").as_deref() == Some(consumer)
            {
                ids.push(header("Idem-Event-Id").unwrap_or_default());
            }
        }
        ids
    }

    async fn redis_connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .expect("a Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to Redis")
    }
}

/// The message ids in `queue`, read with `basic.get` and given back (nothing is taken).
async fn rabbitmq_peek(url: &str, queue: &str) -> Vec<String> {
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    let mut ids = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), lapin::options::BasicGetOptions::default())
        .await
        .expect("basic.get")
    {
        ids.push(
            message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
        );
    }
    // Closing the connection gives the unacknowledged messages back to the queue.
    connection
        .close(200, "peeked".into())
        .await
        .expect("close the connection");
    ids
}

/// A [`Publisher`] on either broker.
#[derive(Debug)]
pub enum AnyPublisher {
    /// RabbitMQ.
    RabbitMq(RabbitMqPublisher),
    /// Redis.
    Redis(RedisPublisher),
    /// NATS.
    Nats(NatsPublisher),
}

impl Publisher for AnyPublisher {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        match self {
            Self::RabbitMq(publisher) => publisher.publish(messages).await,
            Self::Redis(publisher) => publisher.publish(messages).await,
            Self::Nats(publisher) => publisher.publish(messages).await,
        }
    }
}

/// A [`Subscriber`] on either broker.
#[derive(Debug, Clone)]
pub enum AnySubscriber {
    /// RabbitMQ.
    RabbitMq(RabbitMqSubscriber),
    /// Redis.
    Redis(RedisSubscriber),
    /// NATS.
    Nats(NatsSubscriber),
}

impl Subscriber for AnySubscriber {
    type Subscription = AnySubscription;

    async fn subscribe(&self) -> Result<AnySubscription, BrokerError> {
        Ok(match self {
            Self::RabbitMq(subscriber) => AnySubscription::RabbitMq(subscriber.subscribe().await?),
            Self::Redis(subscriber) => AnySubscription::Redis(subscriber.subscribe().await?),
            Self::Nats(subscriber) => {
                AnySubscription::Nats(Box::new(subscriber.subscribe().await?))
            }
        })
    }
}

/// A [`Subscription`] on either broker.
#[derive(Debug)]
pub enum AnySubscription {
    /// RabbitMQ.
    RabbitMq(RabbitMqSubscription),
    /// Redis.
    Redis(RedisSubscription),
    /// NATS.
    Nats(Box<NatsSubscription>),
}

impl Subscription for AnySubscription {
    type Delivery = AnyDelivery;

    async fn next(&mut self) -> Result<AnyDelivery, BrokerError> {
        Ok(match self {
            Self::RabbitMq(subscription) => {
                AnyDelivery::RabbitMq(Box::new(subscription.next().await?))
            }
            Self::Redis(subscription) => AnyDelivery::Redis(subscription.next().await?),
            Self::Nats(subscription) => AnyDelivery::Nats(Box::new(subscription.next().await?)),
        })
    }
}

/// A [`Delivery`] from either broker.
#[derive(Debug)]
pub enum AnyDelivery {
    /// RabbitMQ.
    RabbitMq(Box<RabbitMqDelivery>),
    /// Redis.
    Redis(RedisDelivery),
    /// NATS.
    Nats(Box<NatsDelivery>),
}

impl Delivery for AnyDelivery {
    fn message(&self) -> &Message {
        match self {
            Self::RabbitMq(delivery) => delivery.message(),
            Self::Redis(delivery) => delivery.message(),
            Self::Nats(delivery) => delivery.message(),
        }
    }

    fn redelivered(&self) -> bool {
        match self {
            Self::RabbitMq(delivery) => delivery.redelivered(),
            Self::Redis(delivery) => delivery.redelivered(),
            Self::Nats(delivery) => delivery.redelivered(),
        }
    }

    async fn ack(self) -> Result<(), BrokerError> {
        match self {
            Self::RabbitMq(delivery) => (*delivery).ack().await,
            Self::Redis(delivery) => delivery.ack().await,
            Self::Nats(delivery) => (*delivery).ack().await,
        }
    }

    async fn retry(self) -> Result<(), BrokerError> {
        match self {
            Self::RabbitMq(delivery) => (*delivery).retry().await,
            Self::Redis(delivery) => delivery.retry().await,
            Self::Nats(delivery) => (*delivery).retry().await,
        }
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        match self {
            Self::RabbitMq(delivery) => (*delivery).dead_letter(reason).await,
            Self::Redis(delivery) => delivery.dead_letter(reason).await,
            Self::Nats(delivery) => (*delivery).dead_letter(reason).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the exchange (RabbitMQ) or the stream (Redis) `name` is on the broker.
    async fn on_the_broker(kind: BrokerKind, name: &str) -> bool {
        let url = broker_url(kind);
        match kind {
            BrokerKind::RabbitMq => {
                let connection =
                    lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
                        .await
                        .expect("connect to RabbitMQ");
                let channel = connection.create_channel().await.expect("a channel");
                // A passive declaration of a missing exchange fails (and closes the channel).
                channel
                    .exchange_declare(
                        name.into(),
                        lapin::ExchangeKind::Topic,
                        lapin::options::ExchangeDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        Default::default(),
                    )
                    .await
                    .is_ok()
            }
            BrokerKind::Redis => {
                let mut conn = redis::Client::open(url)
                    .expect("a Redis URL")
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to Redis");
                redis::AsyncCommands::exists(&mut conn, name)
                    .await
                    .expect("EXISTS")
            }
            BrokerKind::Nats => {
                let nats = Nats::new(&url, name).expect("a NATS URL");
                let (_client, jetstream) = nats.connect().await.expect("connect to NATS");
                jetstream.get_stream(nats.stream()).await.is_ok()
            }
        }
    }

    async fn names_are_removed_when_a_panicking_test_drops_them(kind: BrokerKind) {
        let broker = TestBroker::new(kind);
        broker.declare("ledger").await;
        let name = broker.name().to_owned();
        assert!(on_the_broker(kind, &name).await, "{name} declared");
        let test = tokio::spawn(async move {
            let _broker = broker;
            panic!("a failing test");
        });
        assert!(test.await.expect_err("the test panics").is_panic());
        assert!(
            !on_the_broker(kind, &name).await,
            "{name} is left on the broker"
        );
    }

    #[tokio::test]
    async fn rabbitmq_names_are_removed_when_a_panicking_test_drops_them() {
        names_are_removed_when_a_panicking_test_drops_them(BrokerKind::RabbitMq).await;
    }

    #[tokio::test]
    async fn redis_names_are_removed_when_a_panicking_test_drops_them() {
        names_are_removed_when_a_panicking_test_drops_them(BrokerKind::Redis).await;
    }

    #[tokio::test]
    async fn nats_names_are_removed_when_a_panicking_test_drops_them() {
        names_are_removed_when_a_panicking_test_drops_them(BrokerKind::Nats).await;
    }
}
