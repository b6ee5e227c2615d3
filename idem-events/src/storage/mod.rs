//! The SQL of the outbox and of the consumers' records, behind narrow traits: a backend supplies
//! its [`Dialect`](dialect::Dialect), which gives it the statements every database shares
//! ([`SharedEventStorage`]), and implements [`EventStorage`] for the rest.

use std::{future::Future, time::Duration};

use sqlx::{Pool, Transaction, pool::PoolConnection};

use crate::Message;

mod dialect;
mod shared;

pub(crate) use shared::SharedEventStorage;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// Events of one topic that a relay holds (no other relay publishes that topic meanwhile),
/// oldest first.
pub(crate) struct Batch<DB: EventStorage> {
    /// The topic.
    pub topic: String,
    /// The events, in the order to publish them.
    pub messages: Vec<Message>,
    /// Their rows.
    pub(crate) rows: Vec<i64>,
    /// What holds the topic: a transaction with its row locked, or a lease.
    pub(crate) held: DB::Held,
}

impl<DB: EventStorage> Batch<DB> {
    /// The batch of `topic` from its rows `(id, event id, payload)`, in order.
    pub(crate) fn new(topic: String, rows: Vec<(i64, String, String)>, held: DB::Held) -> Self {
        let mut ids = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        for (id, event_id, payload) in rows {
            ids.push(id);
            messages.push(Message::new(event_id, topic.clone(), payload));
        }
        Self {
            topic,
            messages,
            rows: ids,
            held,
        }
    }
}

/// The outbox's and the consumers' statements of one database. Private: applications reach
/// them only through the relay, the consumers and [`enqueue`](crate::enqueue).
///
/// What every database does alike is its supertrait [`SharedEventStorage`], which a database
/// gets from its [`Dialect`](dialect::Dialect); what each does its own way (how a relay holds a
/// topic) is here, implemented in the backend's module.
pub(crate) trait EventStorage: SharedEventStorage {
    /// What holds a topic while its batch is published.
    type Held: Send;

    /// Begins a transaction on `conn` that is going to write: as any other on PostgreSQL and
    /// MySQL; on SQLite with its write lock taken at once (`BEGIN IMMEDIATE`), so that a
    /// transaction that reads first cannot fail to upgrade its lock later.
    fn begin_write(
        conn: PoolConnection<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, crate::Error>> + Send;

    /// Takes a topic with waiting events that no other relay holds and is not in `skip`, and
    /// up to `limit` of its events, in order. The topics after `after` come first, so that
    /// every topic gets its turn. `None` when there is no such topic; nothing is written then.
    fn take_batch<'p>(
        pool: &'p Pool<Self>,
        relay: &'p str,
        after: Option<&'p str>,
        skip: &'p [String],
        limit: i64,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<Batch<Self>>, crate::Error>> + Send + 'p;

    /// Marks a batch's events published and lets go of its topic.
    fn mark_published(
        pool: &Pool<Self>,
        relay: &str,
        batch: Batch<Self>,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send;

    /// Lets go of a batch's topic, its events still waiting.
    fn abandon(
        pool: &Pool<Self>,
        relay: &str,
        batch: Batch<Self>,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send;
}

/// A duration in whole milliseconds, as statements bind it (saturating).
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// An attempt count as the database holds it (absent: none).
fn count(attempts: Option<i64>) -> u32 {
    attempts.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
}
