//! The SQL of the outbox and of the consumers' records, behind one narrow trait per database.

use std::{future::Future, time::Duration};

use sqlx::Pool;

use crate::events::Message;

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// Events of one topic that a relay holds (no other relay publishes that topic meanwhile),
/// oldest first.
pub struct Batch<DB: EventStorage> {
    /// The topic.
    pub topic: String,
    /// The events, in the order to publish them.
    pub messages: Vec<Message>,
    /// Their rows.
    pub(crate) rows: Vec<i64>,
    /// What holds the topic: a transaction with its row locked, or a lease.
    pub(crate) held: DB::Held,
}

/// The outbox's and the consumers' statements of one database. Not public API (hidden, like
/// [`Storage`](super::Storage)).
#[doc(hidden)]
pub trait EventStorage: sqlx::Database + Sized {
    /// What holds a topic while its batch is published.
    type Held: Send;

    /// Adds an event to the outbox, in the transaction `conn` is in.
    fn enqueue<'c>(
        conn: &'c mut Self::Connection,
        id: &'c str,
        topic: &'c str,
        payload: &'c str,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send + 'c;

    /// Takes a topic no other relay holds and up to `limit` of its events that are ready, in
    /// order. The topics after `after` come first, so that every topic gets its turn. `None`
    /// when no topic with waiting events is free.
    fn take_batch<'p>(
        pool: &'p Pool<Self>,
        relay: &'p str,
        after: Option<&'p str>,
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

    /// Deletes up to `limit` events published more than `retention` ago.
    fn purge_published(
        pool: &Pool<Self>,
        retention: Duration,
        limit: i64,
    ) -> impl Future<Output = Result<u64, crate::Error>> + Send + '_;

    /// Records that `consumer` processed `message_id`, in the transaction `conn` is in; `false`
    /// when it was recorded before (waiting, on PostgreSQL, for a transaction that is recording
    /// it right now to end).
    fn claim_message<'c>(
        conn: &'c mut Self::Connection,
        consumer: &'c str,
        message_id: &'c str,
    ) -> impl Future<Output = Result<bool, crate::Error>> + Send + 'c;

    /// How many times `consumer` failed `message_id`.
    fn attempts<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
    ) -> impl Future<Output = Result<u32, crate::Error>> + Send + 'p;

    /// Counts one more failure of `consumer` on `message_id` and returns the count.
    fn count_failure<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
        error: &'p str,
    ) -> impl Future<Output = Result<u32, crate::Error>> + Send + 'p;

    /// Forgets the failures of `consumer` on `message_id`, in the transaction `conn` is in.
    fn clear_failures<'c>(
        conn: &'c mut Self::Connection,
        consumer: &'c str,
        message_id: &'c str,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send + 'c;

    /// Deletes up to `limit` records of `consumer` (processed ids and failure counts) older
    /// than `retention`.
    fn purge_consumed<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        retention: Duration,
        limit: i64,
    ) -> impl Future<Output = Result<u64, crate::Error>> + Send + 'p;
}
