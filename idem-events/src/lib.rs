//! # idem-events: a transactional outbox and idempotent consumers
//!
//! Events on the producing side, written with the writes they tell about; consumers on the
//! other side whose writes happen once per message. On PostgreSQL, SQLite or MySQL (MariaDB)
//! with sqlx, and RabbitMQ, Redis Streams or NATS JetStream as the broker.
//!
//! **Producing.** A handler calls [`enqueue`] with its transaction: the event is a row of the
//! outbox table, written with the handler's own writes, so it exists exactly when they do (a
//! rolled-back transaction enqueues nothing). A [`Relay`] publishes the outbox to a broker,
//! each topic in order, with the event's id as the message id, and marks events published only
//! after the broker confirmed them. Delivery is at least once: a relay stopped between the
//! confirm and the mark publishes those events again.
//!
//! **Consuming.** A [`Consumer`] runs an [`EventHandler`] for each message inside one transaction
//! that also records `(consumer name, message id)`, commits, and only then acknowledges. A
//! message recorded before is acknowledged and skipped, so the handler's writes happen once per
//! message (effectively once); anything it does outside its transaction happens at least once.
//! A message that fails [`DEFAULT_MAX_ATTEMPTS`] times goes to the broker's dead-letter place,
//! with an error in the log, and never blocks the others.
//!
//! **Brokers.** The relay and the consumers see a broker only through [`Publisher`],
//! [`Subscriber`], [`Subscription`] and [`Delivery`]. The `rabbitmq` feature implements them
//! with lapin (module `rabbitmq`), the `redis` feature on Redis Streams (module `redis`), the `nats` feature on NATS JetStream
//! with async-nats (module `nats`).
//!
//! **Running.** The relay and the consumers are built from their parts and an options value
//! ([`RelayOptions`], [`ConsumerOptions`]) and run by `spawn(shutdown)`, which returns a
//! [`TaskHandle`]: cancel the token (the server's graceful shutdown) or call
//! [`TaskHandle::stop`] to end them. [`Relay::pass`] and [`Consumer::process`] do one step by
//! hand. They run the loop of crate `idem-task`, as the background tasks of `idem-runtime` do.
//!
//! Both ends work on PostgreSQL, SQLite and MySQL 8 or MariaDB 10.11; [`migrate`] creates
//! their tables.
//!
//! # Features
//!
//! - `postgres`, `sqlite`, `mysql`: the databases (`mysql` is MySQL 8 or MariaDB 10.11). None
//!   is on by default, as in sqlx; with none the crate builds and offers its messages, brokers
//!   and traits, but no outbox or consumer records: turn one on.
//! - `rabbitmq`: the RabbitMQ adapter, with lapin.
//! - `redis`: the Redis Streams adapter.
//! - `nats`: the NATS JetStream adapter, with async-nats.
//!
//! The crate stands alone: [`enqueue`] takes any sqlx transaction, whether or not an
//! idempotent handler (crate `idem-runtime`) runs in it.

// Without a database feature the crate offers its messages, brokers and traits but no outbox
// or consumer storage: the code only a database backend calls is then unused. (It builds, as sqlx
// and tokio do with no feature on, so that `cargo package` verifies it with its default
// features.)
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code, reason = "only a database backend calls it")
)]

mod backend;
mod broker;
mod consumer;
mod error;
mod message;
mod outbox;
mod relay;

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;

pub use backend::{Backend, migrate};
pub use broker::{BrokerError, Delivery, Publisher, Subscriber, Subscription};
pub use consumer::{
    ConsumeError, Consumer, ConsumerOptions, DEFAULT_MAX_ATTEMPTS, EventHandler, Processed,
};
pub use error::Error;
pub use idem_task::TaskHandle;
pub use message::Message;
pub use outbox::{EventId, MAX_TOPIC_LEN, enqueue, enqueue_with_id};
pub use relay::{Pass, Relay, RelayError, RelayOptions, Waiting};
/// The token that stops the relay and the consumers: cancel it with the server's graceful
/// shutdown.
pub use tokio_util::sync::CancellationToken;
