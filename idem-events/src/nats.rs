//! NATS JetStream, with async-nats: the relay publishes each event to subject
//! `<prefix>.<topic>` of one stream with the event id as `Nats-Msg-Id` (JetStream drops a copy
//! published again within its duplicate window), awaiting JetStream's ack of each message; each
//! consumer reads the stream through a durable pull consumer of its own and acknowledges after
//! its commit, an acknowledgement the server confirms.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), idem_events::BrokerError> {
//! use idem_events::{CancellationToken, Relay, RelayOptions, nats::Nats};
//!
//! let broker = Nats::new("nats://127.0.0.1:4222,nats://127.0.0.1:4223", "idem.events")?;
//! let shutdown = CancellationToken::new();
//! Relay::new(pool, broker.publisher(), RelayOptions::default()).spawn(shutdown.clone());
//! // A consumer: Consumer::new(pool, Ledger, ConsumerOptions::new("ledger"))
//! //     .with_subscriber(broker.subscriber("ledger"))
//! //     .spawn(shutdown)
//! # Ok(())
//! # }
//! ```
//!
//! Names: the prefix given to [`Nats::new`] (`idem.events` by default in the docs) makes the
//! subjects `<prefix>.<topic>` and the stream, named after the prefix with its dots made
//! underscores (`idem_events`), which holds `<prefix>.>`. The stream is created when missing,
//! by the publisher or a subscriber, with as many replicas as the cluster has servers, at most
//! 3 (see [`Nats::with_replicas`]). A message's id is its `Nats-Msg-Id` header, its payload the
//! event's JSON.
//!
//! The consumer `name` is a durable pull consumer of the stream that starts at its first
//! message, so events published before the consumer first ran are delivered too. A message
//! given back for another attempt is negatively acknowledged (delivered again at once); one
//! left unsettled (its consumer died, or dropped it) is delivered again after the consumer's
//! [`NatsSubscriber::with_ack_wait`]. A delivery reports itself redelivered from JetStream's count of
//! its deliveries. One that failed for good is published to `<prefix>.dead.<topic>`, with the headers
//! `Idem-Event-Id`, `Idem-Consumer` and `Idem-Error`, and then terminated: JetStream does not
//! deliver it to that consumer again. The dead letters are in the same stream, and the
//! consumers pass over them: topics `dead` and `dead.…` are refused.
//!
//! The client reconnects by itself, to any server of the list or that the cluster told it of.
//! Its connections are named `idem-events relay <stream>` and
//! `idem-events consumer <name> <stream>` in the servers' monitoring.

use std::{sync::Arc, time::Duration};

use async_nats::{
    Client, ConnectOptions, Event, HeaderMap, ServerAddr,
    connection::State,
    jetstream::{
        self, AckKind, Context,
        consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull},
        message::PublishMessage,
        stream::{self, StorageType},
    },
};
use futures_util::StreamExt;
use tokio::sync::{Mutex, watch};

use crate::{
    broker::{BrokerError, Delivery, Publisher, Subscriber, Subscription, debug_showing},
    message::Message,
};

/// How long connecting may take before it counts as a failure.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long JetStream may take to answer a request or acknowledge a publish.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The most replicas the stream is given without [`Nats::with_replicas`].
const MAX_REPLICAS: usize = 3;

/// The header that carries the event id of a dead letter.
const EVENT_ID: &str = "Idem-Event-Id";
/// The header that names the consumer that gave a dead letter up.
const CONSUMER: &str = "Idem-Consumer";
/// The header that says why a dead letter failed.
const ERROR: &str = "Idem-Error";

/// A NATS server or cluster, and the subject prefix (and stream) events go through.
#[derive(Debug, Clone)]
pub struct Nats {
    servers: Arc<[ServerAddr]>,
    prefix: Arc<str>,
    stream: Arc<str>,
    replicas: Option<usize>,
    duplicate_window: Duration,
}

impl Nats {
    /// The servers at `url`, one URL or a comma-separated list of them
    /// (`nats://host:4222,nats://other:4222`, all used for reconnects), with events on the
    /// subjects `<prefix>.<topic>` of the stream named after `prefix`.
    ///
    /// # Errors
    ///
    /// [`BrokerError::Invalid`] when `url` holds no NATS URL or one that does not parse, or
    /// when `prefix` is not a subject of literal tokens (no wildcards, no spaces).
    pub fn new(url: &str, prefix: &str) -> Result<Self, BrokerError> {
        let servers = url
            .split(',')
            .map(str::trim)
            .filter(|server| !server.is_empty())
            .map(|server| {
                server.parse::<ServerAddr>().map_err(|error| {
                    BrokerError::Invalid(format!("`{server}` is not a NATS URL: {error}"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if servers.is_empty() {
            return Err(BrokerError::Invalid(format!(
                "`{url}` names no NATS server"
            )));
        }
        if !is_literal_subject(prefix) {
            return Err(BrokerError::Invalid(format!(
                "`{prefix}` is not a NATS subject of literal tokens"
            )));
        }
        Ok(Self {
            servers: servers.into(),
            prefix: prefix.into(),
            stream: prefix.replace('.', "_").into(),
            replicas: None,
            duplicate_window: Duration::from_secs(120),
        })
    }

    /// The replicas of the stream when this creates it (at least 1). Without it: as many as
    /// the cluster has servers (those the connected server is routed to then), at most 3. A
    /// stream that exists is left as it is.
    #[must_use]
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = Some(replicas.max(1));
        self
    }

    /// How long JetStream remembers a message id to drop copies published again (default
    /// 2 minutes, JetStream's own), when this creates the stream. Make it longer than the
    /// relay can take to publish an event again.
    #[must_use]
    pub fn with_duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// The stream's name: the prefix with its dots made underscores.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The subject of `topic`'s events.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}.{topic}", self.prefix)
    }

    /// The subject `topic`'s failed messages go to.
    pub fn dead_letter_subject(&self, topic: &str) -> String {
        format!("{}.dead.{topic}", self.prefix)
    }

    /// A [`Publisher`] for the relay.
    pub fn publisher(&self) -> NatsPublisher {
        NatsPublisher {
            broker: self.clone(),
            connection: Mutex::new(None),
        }
    }

    /// A [`Subscriber`] for the consumer `name` (its durable consumer; letters, digits, `-`
    /// and `_`), which takes 16 messages at a time and has 30 s to settle each
    /// ([`NatsSubscriber::with_ack_wait`]).
    pub fn subscriber(&self, name: &str) -> NatsSubscriber {
        NatsSubscriber {
            broker: self.clone(),
            name: name.into(),
            ack_wait: Duration::from_secs(30),
            batch: 16,
        }
    }

    /// Connects to the servers (a client of its own, which reconnects by itself) and its
    /// JetStream context.
    ///
    /// # Errors
    ///
    /// [`BrokerError::Unavailable`] when no server could be reached.
    pub async fn connect(&self) -> Result<(Client, Context), BrokerError> {
        self.connect_watched("idem-events")
            .await
            .map(|(client, js, _)| (client, js))
    }

    /// [`Nats::connect`], with the state of the client's link, which its events keep. The
    /// connection is named `name` (the server's monitoring shows it).
    async fn connect_watched(
        &self,
        name: &str,
    ) -> Result<(Client, Context, watch::Receiver<Link>), BrokerError> {
        let (link, watched) = watch::channel(Link {
            connected: true,
            disconnects: 0,
        });
        let link = Arc::new(link);
        let client = ConnectOptions::new()
            .name(name)
            .connection_timeout(CONNECT_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            .event_callback(move |event| {
                let link = Arc::clone(&link);
                async move {
                    match event {
                        Event::Disconnected => link.send_modify(|link| {
                            link.connected = false;
                            link.disconnects += 1;
                        }),
                        Event::Connected => link.send_modify(|link| link.connected = true),
                        _ => {}
                    }
                }
            })
            .connect(&*self.servers)
            .await
            .map_err(BrokerError::unavailable)?;
        let jetstream = jetstream::ContextBuilder::new()
            .timeout(REQUEST_TIMEOUT)
            .build(client.clone());
        Ok((client, jetstream, watched))
    }

    /// Creates the stream unless it exists, and returns it.
    ///
    /// # Errors
    ///
    /// When JetStream cannot be reached or refuses the stream (one whose subjects overlap it,
    /// more replicas than servers). A server that failed to create the stream's storage
    /// (`error creating store for stream`, a failure it explains only in its own log) is asked
    /// up to five times in all, with pauses from 100 ms doubling, before its error is returned.
    pub async fn declare_stream(
        &self,
        client: &Client,
        jetstream: &Context,
    ) -> Result<stream::Stream, BrokerError> {
        let replicas = self
            .replicas
            .unwrap_or_else(|| cluster_size(client).min(MAX_REPLICAS));
        let config = stream::Config {
            name: self.stream.to_string(),
            subjects: vec![format!("{}.>", self.prefix)],
            num_replicas: replicas,
            duplicate_window: self.duplicate_window,
            storage: StorageType::File,
            ..stream::Config::default()
        };
        let mut pause = STORE_CREATE_PAUSE;
        for _ in 1..STORE_CREATE_ATTEMPTS {
            match jetstream.get_or_create_stream(config.clone()).await {
                Err(error) if is_store_create_failure(&error) => {
                    tracing::warn!(stream = %self.stream, %error, "JetStream could not create the stream's storage; asking again");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                outcome => return outcome.map_err(BrokerError::unavailable),
            }
        }
        jetstream
            .get_or_create_stream(config)
            .await
            .map_err(BrokerError::unavailable)
    }
}

/// How many times [`Nats::declare_stream`] asks a server that failed to create a stream's
/// storage.
const STORE_CREATE_ATTEMPTS: u32 = 5;
/// The first pause between two of those asks, doubled after each.
const STORE_CREATE_PAUSE: Duration = Duration::from_millis(100);

/// Whether the server answered that it could not create the stream's storage: a failure of
/// its own (HTTP-like code 500, JetStream's generic stream-create code 10049), which it may
/// not meet on the next ask; a refusal of the stream's configuration has other codes.
fn is_store_create_failure(error: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        error.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(error)
            if error.code() == 500 && error.error_code() == jetstream::ErrorCode::STREAM_CREATE
    )
}

/// How many servers the cluster of the connected server has: the client URLs it advertises
/// (none when it runs alone): the servers it is routed to now, itself included.
fn cluster_size(client: &Client) -> usize {
    let mut urls = client.server_info().connect_urls;
    urls.sort();
    urls.dedup();
    urls.len().max(1)
}

/// Whether `subject` is made of literal tokens only: no wildcard, no empty token, no space.
fn is_literal_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty()
                && !token.contains(|c: char| c.is_whitespace() || matches!(c, '*' | '>'))
        })
}

/// Whether `name` can name a durable consumer.
fn is_consumer_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

/// The client's link to the servers, as its events tell it.
#[derive(Debug, Clone, Copy)]
struct Link {
    connected: bool,
    disconnects: u64,
}

/// How long a publish waits for a client that lost its connection to reconnect.
const RECONNECT_WAIT: Duration = Duration::from_secs(5);

/// What the publisher keeps between batches: a client that reconnects by itself.
struct Connected {
    client: Client,
    jetstream: Context,
    link: watch::Receiver<Link>,
    /// Whether the stream is known to exist.
    declared: bool,
}

/// Publishes the relay's batches to JetStream, one message after the other, each awaited until
/// JetStream acknowledged it: a message is sent only once the one before it is stored, so that
/// a connection lost in the middle of a batch never leaves a later message stored before an
/// earlier one of its topic.
pub struct NatsPublisher {
    broker: Nats,
    connection: Mutex<Option<Connected>>,
}

debug_showing!(NatsPublisher { broker });

impl NatsPublisher {
    async fn publish_on(
        broker: &Nats,
        connected: &mut Connected,
        messages: &[Message],
    ) -> Result<(), BrokerError> {
        if connected.client.connection_state() != State::Connected {
            // Reconnecting (to this server or another of the cluster): a moment's wait.
            let mut link = connected.link.clone();
            tokio::time::timeout(RECONNECT_WAIT, link.wait_for(|link| link.connected))
                .await
                .map_err(|_| {
                    BrokerError::unavailable(format!(
                        "not connected to NATS, and not reconnected within {RECONNECT_WAIT:?}"
                    ))
                })?
                .map_err(BrokerError::unavailable)?;
        }
        if !connected.declared {
            broker
                .declare_stream(&connected.client, &connected.jetstream)
                .await?;
            connected.declared = true;
        }
        let disconnects = connected.link.borrow_and_update().disconnects;
        for message in messages {
            let publish = PublishMessage::build()
                .payload(message.payload().clone())
                .message_id(message.id());
            let ack = connected
                .jetstream
                .send_publish(broker.subject(message.topic()), publish)
                .await
                .map_err(BrokerError::unavailable)?;
            // A disconnection fails the batch at once: the ack would only come after a
            // reconnection, if at all (the client does not send again what it had written).
            let acked = tokio::select! {
                acked = ack => acked,
                _ = connected.link.wait_for(|link| link.disconnects != disconnects) => {
                    return Err(BrokerError::unavailable(
                        "the connection to NATS broke before JetStream acknowledged the message",
                    ));
                }
            };
            let acked = acked.map_err(|error| {
                if error.kind() == jetstream::context::PublishErrorKind::StreamNotFound {
                    connected.declared = false;
                }
                BrokerError::unavailable(error)
            })?;
            if *acked.stream != *broker.stream {
                return Err(BrokerError::Refused(format!(
                    "message {} went to stream `{}`, not `{}`",
                    message.id(),
                    acked.stream,
                    broker.stream
                )));
            }
        }
        Ok(())
    }
}

impl Publisher for NatsPublisher {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        for message in messages {
            if message.topic() == "dead" || message.topic().starts_with("dead.") {
                return Err(BrokerError::Invalid(format!(
                    "topic `{}` is reserved for dead letters on NATS",
                    message.topic()
                )));
            }
            if !is_literal_subject(message.topic()) {
                return Err(BrokerError::Invalid(format!(
                    "topic `{}` is not a NATS subject of literal tokens",
                    message.topic()
                )));
            }
        }
        let mut held = self.connection.lock().await;
        let connected = match held.as_mut() {
            Some(connected) => connected,
            None => {
                let name = format!("idem-events relay {}", self.broker.stream);
                let (client, jetstream, link) = self.broker.connect_watched(&name).await?;
                held.insert(Connected {
                    client,
                    jetstream,
                    link,
                    declared: false,
                })
            }
        };
        Self::publish_on(&self.broker, connected, messages).await
    }
}

/// A durable pull consumer of the stream.
#[derive(Debug, Clone)]
pub struct NatsSubscriber {
    broker: Nats,
    name: Arc<str>,
    ack_wait: Duration,
    batch: usize,
}

impl NatsSubscriber {
    /// How long a delivered message may stay unsettled before JetStream delivers it again
    /// (default 30 s): the delay before the message of a consumer that died comes back, when
    /// this creates the consumer. Make it longer than a message takes to process.
    #[must_use]
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait.max(Duration::from_millis(1));
        self
    }

    /// How many messages are pulled at a time, and may wait unsettled (default 16).
    #[must_use]
    pub fn with_batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Creates the stream and the durable consumer if they do not exist, without reading: the
    /// consumer starts at the stream's first message either way.
    ///
    /// # Errors
    ///
    /// [`BrokerError::Invalid`] when the consumer's name is not one NATS takes; otherwise when
    /// JetStream cannot be reached or refuses them.
    pub async fn declare(&self) -> Result<(), BrokerError> {
        let (client, jetstream) = self.broker.connect().await?;
        self.declare_on(&client, &jetstream).await.map(|_| ())
    }

    async fn declare_on(
        &self,
        client: &Client,
        jetstream: &Context,
    ) -> Result<PullConsumer, BrokerError> {
        if !is_consumer_name(&self.name) {
            return Err(BrokerError::Invalid(format!(
                "`{}` cannot name a NATS consumer: use letters, digits, `-` and `_`",
                self.name
            )));
        }
        let stream = self.broker.declare_stream(client, jetstream).await?;
        let max_ack_pending = i64::try_from(self.batch).unwrap_or(i64::MAX);
        stream
            .get_or_create_consumer(
                &self.name,
                pull::Config {
                    durable_name: Some(self.name.to_string()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    deliver_policy: DeliverPolicy::All,
                    filter_subject: format!("{}.>", self.broker.prefix),
                    max_ack_pending,
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(BrokerError::unavailable)
    }
}

impl Subscriber for NatsSubscriber {
    type Subscription = NatsSubscription;

    async fn subscribe(&self) -> Result<NatsSubscription, BrokerError> {
        let name = format!("idem-events consumer {} {}", self.name, self.broker.stream);
        let (client, jetstream, _) = self.broker.connect_watched(&name).await?;
        let consumer = self.declare_on(&client, &jetstream).await?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.batch)
            .messages()
            .await
            .map_err(BrokerError::unavailable)?;
        Ok(NatsSubscription {
            subscriber: self.clone(),
            jetstream,
            messages,
            dead_prefix: format!("{}.dead.", self.broker.prefix),
            prefix: format!("{}.", self.broker.prefix),
        })
    }
}

/// An open pull of the durable consumer.
pub struct NatsSubscription {
    subscriber: NatsSubscriber,
    jetstream: Context,
    messages: pull::Stream,
    prefix: String,
    dead_prefix: String,
}

debug_showing!(NatsSubscription { subscriber });

impl Subscription for NatsSubscription {
    type Delivery = NatsDelivery;

    async fn next(&mut self) -> Result<NatsDelivery, BrokerError> {
        loop {
            let received = self
                .messages
                .next()
                .await
                .ok_or_else(|| BrokerError::unavailable("the NATS pull ended"))?
                .map_err(BrokerError::unavailable)?;
            let subject = received.message.subject.to_string();
            if subject.starts_with(&self.dead_prefix) {
                // A dead letter, in the same stream: not for the consumers.
                received.ack().await.map_err(BrokerError::unavailable)?;
                continue;
            }
            let topic = subject.strip_prefix(&self.prefix).unwrap_or(&subject);
            let id = received
                .message
                .headers
                .as_ref()
                .and_then(|headers| headers.get_last(async_nats::header::NATS_MESSAGE_ID))
                .map(|id| id.as_str().to_owned())
                .unwrap_or_default();
            let message = Message::new(id, topic, received.message.payload.clone());
            let redelivered = received.info().map_or(true, |info| info.delivered > 1);
            return Ok(NatsDelivery {
                message,
                redelivered,
                received,
                jetstream: self.jetstream.clone(),
                dead_letter_subject: self.subscriber.broker.dead_letter_subject(topic),
                consumer: Arc::clone(&self.subscriber.name),
            });
        }
    }
}

/// A message pulled through the durable consumer. Dropped unsettled, it is delivered again
/// once the consumer's [`NatsSubscriber::with_ack_wait`] is over, as the message of a process that
/// died. (Not negatively acknowledged on the way out: a JetStream server of the 2.9 line that
/// redelivers it to a pull request whose client is leaving counts that delivery back, and
/// reports the next one as a first delivery; the consumer would then not count the attempt of a
/// message that stops its process every time.)
pub struct NatsDelivery {
    message: Message,
    redelivered: bool,
    received: jetstream::Message,
    jetstream: Context,
    dead_letter_subject: String,
    consumer: Arc<str>,
}

debug_showing!(NatsDelivery {
    message,
    redelivered
});

impl Delivery for NatsDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn redelivered(&self) -> bool {
        self.redelivered
    }

    async fn ack(self) -> Result<(), BrokerError> {
        self.received
            .double_ack()
            .await
            .map_err(BrokerError::unavailable)
    }

    async fn retry(self) -> Result<(), BrokerError> {
        self.received
            .ack_with(AckKind::Nak(None))
            .await
            .map_err(BrokerError::unavailable)
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        let mut headers = HeaderMap::new();
        headers.insert(EVENT_ID, self.message.id());
        headers.insert(CONSUMER, &*self.consumer);
        headers.insert(ERROR, header_value(reason).as_str());
        let publish = PublishMessage::build()
            .payload(self.message.payload().clone())
            .headers(headers)
            .message_id(format!("{}:dead:{}", self.message.id(), self.consumer));
        let ack = self
            .jetstream
            .send_publish(self.dead_letter_subject.clone(), publish)
            .await
            .map_err(BrokerError::unavailable)?;
        ack.await.map_err(BrokerError::unavailable)?;
        self.received
            .double_ack_with(AckKind::Term)
            .await
            .map_err(BrokerError::unavailable)
    }
}

/// `text` on one line, as a header value must be.
fn header_value(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_named_after_the_prefix_and_each_topic_has_its_subject() {
        let broker = Nats::new("nats://127.0.0.1:4222", "idem.events").expect("valid");
        assert_eq!(broker.stream(), "idem_events");
        assert_eq!(
            broker.subject("payment.succeeded"),
            "idem.events.payment.succeeded"
        );
        assert_eq!(
            broker.dead_letter_subject("payment.succeeded"),
            "idem.events.dead.payment.succeeded"
        );
    }

    #[test]
    fn a_comma_separated_list_of_servers_is_taken_and_nonsense_refused() {
        let broker = Nats::new(
            "nats://127.0.0.1:4222, nats://127.0.0.1:4223,nats://127.0.0.1:4224",
            "idem.events",
        )
        .expect("valid");
        assert_eq!(broker.servers.len(), 3);
        for (url, prefix) in [
            ("", "idem.events"),
            (" , ", "idem.events"),
            ("nats://127.0.0.1:4222", "idem.*"),
            ("nats://127.0.0.1:4222", "idem..events"),
            ("nats://127.0.0.1:4222", "idem events"),
        ] {
            assert!(
                matches!(Nats::new(url, prefix), Err(BrokerError::Invalid(_))),
                "{url:?} {prefix:?} taken"
            );
        }
    }

    #[test]
    fn consumer_names_are_those_jetstream_takes() {
        assert!(is_consumer_name("ledger-2_a"));
        for name in ["", "led.ger", "led ger", "a*", "a>"] {
            assert!(!is_consumer_name(name), "{name:?}");
        }
    }
}
