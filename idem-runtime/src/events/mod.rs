//! Events: a transactional outbox on the producing side, idempotent consumers on the other.
//!
//! **Producing.** A handler calls [`enqueue`] with its transaction: the event is a row of the
//! outbox table, written with the handler's own writes, so it exists exactly when they do (a
//! rolled-back transaction enqueues nothing). A [`Relay`] publishes the outbox to a broker,
//! each topic in order, with the event's id as the message id, and marks events published only
//! after the broker confirmed them. Delivery is at least once: a relay stopped between the
//! confirm and the mark publishes those events again.
//!
//! **Consuming.** A [`Consumer`] runs a [`Handler`] for each message inside one transaction
//! that also records `(consumer name, message id)`, commits, and only then acknowledges. A
//! message recorded before is acknowledged and skipped, so the handler's writes happen once per
//! message (effectively once); anything it does outside its transaction happens at least once.
//! A message that fails [`DEFAULT_MAX_ATTEMPTS`] times goes to the broker's dead-letter place,
//! with an error in the log, and never blocks the others.
//!
//! **Brokers.** The relay and the consumers see a broker only through [`Publisher`],
//! [`Subscriber`], [`Subscription`] and [`Delivery`]. The `rabbitmq` feature implements them
//! with lapin ([`rabbitmq`]), the `redis` feature on Redis Streams ([`redis`](mod@redis)).
//!
//! Both ends work on PostgreSQL and SQLite; [`migrate`](crate::migrate) creates their tables.

mod backoff;
mod broker;
mod consumer;
mod message;
mod outbox;
mod relay;

#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;

pub use broker::{BrokerError, Delivery, Publisher, Subscriber, Subscription};
pub use consumer::{ConsumeError, Consumer, DEFAULT_MAX_ATTEMPTS, Handler, Processed};
pub use message::Message;
pub use outbox::{EventId, MAX_TOPIC_LEN, enqueue, enqueue_with_id};
pub use relay::{Pass, Relay, RelayError, RelayOptions, Waiting};
