//! RabbitMQ, with lapin: the relay publishes to a topic exchange with publisher confirms, and
//! each consumer reads its own durable queue with manual acknowledgements, a prefetch, and a
//! dead-letter queue beside it.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) {
//! use idem_events::{CancellationToken, Relay, RelayOptions, rabbitmq::RabbitMq};
//!
//! let broker = RabbitMq::new("amqp://guest:guest@127.0.0.1:5672/%2f", "idem.events");
//! let shutdown = CancellationToken::new();
//! Relay::new(pool, broker.publisher(), RelayOptions::default()).spawn(shutdown.clone());
//! // A consumer: Consumer::new(pool, Ledger, ConsumerOptions::new("ledger"))
//! //     .with_subscriber(broker.subscriber("ledger").bind("payment.succeeded"))
//! //     .spawn(shutdown)
//! # }
//! ```
//!
//! Names: the exchange is the one given to [`RabbitMq::new`] (type `topic`, durable); a
//! message's routing key is its topic, its `message_id` property the event id. The consumer
//! `name` reads queue `<exchange>.<name>`, whose failed messages go to `<exchange>.<name>.dead`.
//! Names longer than 255 bytes are refused.

use std::{sync::Arc, time::Duration};

use futures_util::StreamExt;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    message::Delivery as LapinDelivery,
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
        QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable, LongString, ShortString},
};
use tokio::sync::Mutex;

use crate::{
    broker::{BrokerError, Delivery, Publisher, Subscriber, Subscription, debug_showing},
    message::Message,
};

/// The longest name (exchange, queue, routing key, message id) AMQP carries, in bytes.
const MAX_NAME: usize = 255;

/// How long connecting may take before it counts as a failure.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A RabbitMQ broker: its URL (`amqp://user:password@host:port/vhost`) and the exchange
/// events go through.
#[derive(Debug, Clone)]
pub struct RabbitMq {
    url: Arc<str>,
    exchange: Arc<str>,
}

impl RabbitMq {
    /// The broker at `url`, with events going through the topic exchange `exchange`.
    pub fn new(url: &str, exchange: &str) -> Self {
        Self {
            url: url.into(),
            exchange: exchange.into(),
        }
    }

    /// A [`Publisher`] for the relay.
    pub fn publisher(&self) -> RabbitMqPublisher {
        RabbitMqPublisher {
            broker: self.clone(),
            channel: Mutex::new((None, false)),
        }
    }

    /// A [`Subscriber`] for the consumer `name`: queue `<exchange>.<name>`, bound with no
    /// topic yet (add them with [`RabbitMqSubscriber::bind`]), a prefetch of 16.
    pub fn subscriber(&self, name: &str) -> RabbitMqSubscriber {
        RabbitMqSubscriber {
            broker: self.clone(),
            queue: format!("{}.{name}", self.exchange),
            bindings: Vec::new(),
            prefetch: 16,
        }
    }

    /// The queue the consumer `name` reads.
    pub fn queue(&self, name: &str) -> String {
        format!("{}.{name}", self.exchange)
    }

    /// The dead-letter queue of the consumer `name`.
    pub fn dead_letter_queue(&self, name: &str) -> String {
        format!("{}.{name}.dead", self.exchange)
    }

    async fn channel(&self) -> Result<(Connection, Channel), BrokerError> {
        let connection = tokio::time::timeout(
            CONNECT_TIMEOUT,
            Connection::connect(&self.url, ConnectionProperties::default()),
        )
        .await
        .map_err(|_| BrokerError::unavailable("connecting to RabbitMQ timed out"))?
        .map_err(BrokerError::unavailable)?;
        let channel = connection
            .create_channel()
            .await
            .map_err(BrokerError::unavailable)?;
        channel
            .exchange_declare(
                short(&self.exchange)?,
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(BrokerError::unavailable)?;
        Ok((connection, channel))
    }
}

fn short(name: &str) -> Result<ShortString, BrokerError> {
    if name.len() > MAX_NAME {
        return Err(BrokerError::Invalid(format!(
            "`{name}` is {} bytes long; AMQP names hold at most {MAX_NAME}",
            name.len()
        )));
    }
    Ok(ShortString::from(name))
}

/// Publishes to the exchange with publisher confirms and `mandatory` set: a message that no
/// queue is bound to receive counts as not delivered, so events published before their
/// consumers' queues exist wait in the outbox instead of being lost.
pub struct RabbitMqPublisher {
    broker: RabbitMq,
    /// The channel, and whether a publish on it was cut short (its caller stopped waiting):
    /// such a channel is not used again.
    channel: Mutex<(Option<(Connection, Channel)>, bool)>,
}

debug_showing!(RabbitMqPublisher { broker });

impl RabbitMqPublisher {
    async fn publish_on(
        channel: &Channel,
        exchange: &str,
        messages: &[Message],
    ) -> Result<(), BrokerError> {
        let exchange = short(exchange)?;
        let mut confirms = Vec::with_capacity(messages.len());
        for message in messages {
            let properties = BasicProperties::default()
                .with_message_id(short(message.id())?)
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_type(short(message.topic())?);
            let confirm = channel
                .basic_publish(
                    exchange.clone(),
                    short(message.topic())?,
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    message.payload(),
                    properties,
                )
                .await
                .map_err(BrokerError::unavailable)?;
            confirms.push((message, confirm));
        }
        // Every confirm is awaited, the first failure kept: a confirm left behind would stay
        // in the channel's books.
        let mut outcome = Ok(());
        for (message, confirm) in confirms {
            let refused = match confirm.await {
                Ok(Confirmation::Ack(None)) => continue,
                Err(error) => BrokerError::unavailable(error),
                Ok(Confirmation::Ack(Some(_))) => BrokerError::Refused(format!(
                    "no queue is bound to topic `{}` on exchange `{}`; the event waits until a \
                     consumer declares its queue",
                    message.topic(),
                    exchange
                )),
                Ok(Confirmation::Nack(_)) => BrokerError::Refused(format!(
                    "RabbitMQ refused message {} (a negative confirm)",
                    message.id()
                )),
                Ok(Confirmation::NotRequested) => {
                    BrokerError::Refused("publisher confirms are off on the channel".to_owned())
                }
            };
            if outcome.is_ok() {
                outcome = Err(refused);
            }
        }
        outcome
    }
}

impl Publisher for RabbitMqPublisher {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let mut guard = self.channel.lock().await;
        let (held, in_doubt) = &mut *guard;
        let usable = !std::mem::replace(in_doubt, true)
            && held.as_ref().is_some_and(|(connection, channel)| {
                connection.status().connected() && channel.status().connected()
            });
        if !usable {
            *held = None;
            let (connection, channel) = self.broker.channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(BrokerError::unavailable)?;
            *held = Some((connection, channel));
        }
        let Some((_, channel)) = held.as_ref() else {
            unreachable!("a channel was just opened");
        };
        let published = Self::publish_on(channel, &self.broker.exchange, messages).await;
        if let Err(BrokerError::Unavailable(_)) = &published {
            // Start from a fresh connection next time.
            *held = None;
        }
        *in_doubt = false;
        published
    }
}

/// A consumer's queue on the exchange: durable, with its dead-letter queue, bound to topics.
#[derive(Debug, Clone)]
pub struct RabbitMqSubscriber {
    broker: RabbitMq,
    queue: String,
    bindings: Vec<String>,
    prefetch: u16,
}

impl RabbitMqSubscriber {
    /// Binds the queue to `pattern`: a topic, or an AMQP topic pattern (`payment.*`, `#`).
    #[must_use]
    pub fn bind(mut self, pattern: &str) -> Self {
        self.bindings.push(pattern.to_owned());
        self
    }

    /// How many unacknowledged messages the broker sends ahead (default 16).
    #[must_use]
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }
}

impl RabbitMqSubscriber {
    /// Declares the exchange, the queue, its dead-letter queue and the bindings, without
    /// consuming: events published from then on reach the queue even before the consumer
    /// first runs.
    ///
    /// # Errors
    ///
    /// When the broker cannot be reached or refuses a declaration (a queue that exists with
    /// other settings).
    pub async fn declare(&self) -> Result<(), BrokerError> {
        let (connection, channel) = self.broker.channel().await?;
        self.declare_on(&channel).await?;
        // The connection closes when dropped.
        drop((channel, connection));
        Ok(())
    }

    async fn declare_on(&self, channel: &Channel) -> Result<(), BrokerError> {
        let dead = format!("{}.dead", self.queue);
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(short(&dead)?, durable, FieldTable::default())
            .await
            .map_err(BrokerError::unavailable)?;
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from("")),
        );
        arguments.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(LongString::from(dead.as_str())),
        );
        channel
            .queue_declare(short(&self.queue)?, durable, arguments)
            .await
            .map_err(BrokerError::unavailable)?;
        for pattern in &self.bindings {
            channel
                .queue_bind(
                    short(&self.queue)?,
                    short(&self.broker.exchange)?,
                    short(pattern)?,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(BrokerError::unavailable)?;
        }
        Ok(())
    }
}

impl Subscriber for RabbitMqSubscriber {
    type Subscription = RabbitMqSubscription;

    async fn subscribe(&self) -> Result<RabbitMqSubscription, BrokerError> {
        let (connection, channel) = self.broker.channel().await?;
        self.declare_on(&channel).await?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(BrokerError::unavailable)?;
        let consumer = channel
            .basic_consume(
                short(&self.queue)?,
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(BrokerError::unavailable)?;
        Ok(RabbitMqSubscription {
            _connection: connection,
            consumer,
        })
    }
}

/// An open consumer on the queue; dropping it closes the connection, and RabbitMQ gives the
/// unacknowledged messages to another consumer.
pub struct RabbitMqSubscription {
    _connection: Connection,
    consumer: lapin::Consumer,
}

debug_showing!(RabbitMqSubscription {});

impl Subscription for RabbitMqSubscription {
    type Delivery = RabbitMqDelivery;

    async fn next(&mut self) -> Result<RabbitMqDelivery, BrokerError> {
        match self.consumer.next().await {
            Some(Ok(delivery)) => Ok(RabbitMqDelivery::new(delivery)),
            Some(Err(error)) => Err(BrokerError::unavailable(error)),
            None => Err(BrokerError::unavailable("RabbitMQ cancelled the consumer")),
        }
    }
}

/// A message received from the queue.
pub struct RabbitMqDelivery {
    message: Message,
    delivery: LapinDelivery,
}

debug_showing!(RabbitMqDelivery { message });

impl RabbitMqDelivery {
    fn new(mut delivery: LapinDelivery) -> Self {
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        let message = Message::new(
            id,
            delivery.routing_key.to_string(),
            std::mem::take(&mut delivery.data),
        );
        Self { message, delivery }
    }

    /// Rejects the message: back to the queue with `requeue`, else to its dead-letter place.
    async fn nack(self, requeue: bool) -> Result<(), BrokerError> {
        Self::settled(
            self.delivery
                .acker
                .nack(BasicNackOptions {
                    requeue,
                    ..BasicNackOptions::default()
                })
                .await,
        )
    }

    fn settled(sent: Result<bool, lapin::Error>) -> Result<(), BrokerError> {
        match sent {
            Ok(true) => Ok(()),
            Ok(false) => Err(BrokerError::unavailable(
                "the channel closed before the message was settled",
            )),
            Err(error) => Err(BrokerError::unavailable(error)),
        }
    }
}

impl Delivery for RabbitMqDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn redelivered(&self) -> bool {
        self.delivery.redelivered
    }

    async fn ack(self) -> Result<(), BrokerError> {
        Self::settled(self.delivery.acker.ack(BasicAckOptions::default()).await)
    }

    async fn retry(self) -> Result<(), BrokerError> {
        self.nack(true).await
    }

    async fn dead_letter(self, _reason: &str) -> Result<(), BrokerError> {
        // Rejected without requeue, the queue's dead-letter settings move it to
        // `<queue>.dead`; the reason is in the consumer's log.
        self.nack(false).await
    }
}
