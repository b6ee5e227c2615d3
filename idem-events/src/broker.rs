//! What the relay and the consumers need from a broker: the whole of it, so that the core does
//! not know which broker it runs on. [`rabbitmq`](crate::rabbitmq) and [`redis`](crate::redis)
//! implement these traits; another broker can too.

use std::future::Future;

use crate::message::Message;

/// `impl Debug` for a broker's type that shows only the named fields (its settings, its
/// message) and marks the rest as left out (`..`): connections, channels and acknowledgers
/// print nothing useful. `debug_showing!(NatsPublisher { broker })` prints as
/// `NatsPublisher { broker: …, .. }`.
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "redis", feature = "nats")),
    expect(unused_macros, reason = "only a broker adapter uses it")
)]
macro_rules! debug_showing {
    ($type:ident { $($field:ident),* }) => {
        impl std::fmt::Debug for $type {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($type))
                    $(.field(stringify!($field), &self.$field))*
                    .finish_non_exhaustive()
            }
        }
    };
}
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "redis", feature = "nats")),
    expect(unused_imports, reason = "only a broker adapter uses it")
)]
pub(crate) use debug_showing;

/// What a broker said or failed to say.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker cannot be reached, or the connection to it broke. Try again later.
    #[error("the broker is not reachable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The broker answered but did not take the message (a negative confirm, or no queue is
    /// bound to its topic). Try again later: nothing was delivered.
    #[error("the broker did not take the message: {0}")]
    Refused(String),
    /// The broker's settings are not valid (a URL that does not parse, a name that is too
    /// long): retrying does not help.
    #[error("the broker's settings are not valid: {0}")]
    Invalid(String),
}

impl BrokerError {
    /// [`BrokerError::Unavailable`] from any error.
    pub fn unavailable(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Unavailable(error.into())
    }
}

/// Publishes the outbox's messages to a broker.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `messages` in their order and returns once the broker has confirmed every
    /// one of them (stored it, or handed it to a queue).
    ///
    /// An implementation reconnects on its own: after an error, the next call starts again
    /// from a fresh connection.
    ///
    /// # Errors
    ///
    /// When the broker cannot be reached or did not confirm every message; some of them may
    /// have been delivered all the same (the relay publishes them again: delivery is at least
    /// once).
    fn publish(&self, messages: &[Message])
    -> impl Future<Output = Result<(), BrokerError>> + Send;
}

/// Where a consumer's messages come from: a queue, or a consumer group of a stream.
pub trait Subscriber: Send + Sync + 'static {
    /// What [`Subscriber::subscribe`] opens.
    type Subscription: Subscription;

    /// Connects, declares what the consumer needs (its queue and dead-letter place), and starts
    /// receiving.
    ///
    /// # Errors
    ///
    /// When the broker cannot be reached or refuses the declarations.
    fn subscribe(&self) -> impl Future<Output = Result<Self::Subscription, BrokerError>> + Send;
}

/// An open subscription: the messages, one delivery at a time. Dropping it leaves the
/// unacknowledged ones to the broker: RabbitMQ delivers them again at once, Redis once they
/// are claimed (by the same consumer name subscribing again, or by another after
/// `redis::RedisSubscriber::with_claim_idle`).
pub trait Subscription: Send + 'static {
    /// One received message, to settle once.
    type Delivery: Delivery;

    /// Waits for the next message.
    ///
    /// # Errors
    ///
    /// When the connection broke; subscribe again.
    fn next(&mut self) -> impl Future<Output = Result<Self::Delivery, BrokerError>> + Send;
}

/// A received message that the consumer settles once: acknowledged, given back for a later
/// attempt, or moved to the dead-letter place.
pub trait Delivery: Send + 'static {
    /// The message.
    fn message(&self) -> &Message;

    /// Whether the broker says it delivered this message before (or cannot say it did not).
    fn redelivered(&self) -> bool {
        true
    }

    /// Done with: the broker drops it.
    ///
    /// # Errors
    ///
    /// When the acknowledgement did not reach the broker; it delivers the message again.
    fn ack(self) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Not done: the broker delivers it again later.
    ///
    /// # Errors
    ///
    /// When the broker could not be told; it delivers the message again all the same, once
    /// the connection is gone.
    fn retry(self) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Failed for good: the broker moves it to the dead-letter place, and it is not delivered
    /// to this consumer again.
    ///
    /// # Errors
    ///
    /// When the broker could not be told; it delivers the message again, and the consumer
    /// sends it to the dead-letter place again.
    fn dead_letter(self, reason: &str) -> impl Future<Output = Result<(), BrokerError>> + Send;
}
