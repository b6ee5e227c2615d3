//! The SQL of the outbox and of the consumers' records, behind one narrow trait per database.

use std::{future::Future, time::Duration};

use sqlx::{Pool, Transaction, pool::PoolConnection};

use crate::Message;

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
pub(crate) trait EventStorage: sqlx::Database + Sized {
    /// What holds a topic while its batch is published.
    type Held: Send;

    /// Begins a transaction on `conn` that is going to write: as any other on PostgreSQL; on
    /// SQLite with its write lock taken at once (`BEGIN IMMEDIATE`), so that a transaction
    /// that reads first cannot fail to upgrade its lock later.
    fn begin_write(
        conn: PoolConnection<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, crate::Error>> + Send;

    /// Adds an event to the outbox, in the transaction `conn` is in.
    fn enqueue<'c>(
        conn: &'c mut Self::Connection,
        id: &'c str,
        topic: &'c str,
        payload: &'c str,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send + 'c;

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

    /// How many events wait to be published, and the age of the oldest in milliseconds.
    fn waiting(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<(i64, Option<i64>), crate::Error>> + Send + '_;

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

    /// Records `error` as the last failure of `consumer` on `message_id`, counted before (see
    /// [`EventStorage::count_failure`]); returns the count.
    fn note_failure<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
        error: &'p str,
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

    /// Forgets the failures of `consumer` on `message_id`, in a statement of its own.
    fn clear_failures_apart<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send + 'p;

    /// Creates or upgrades the event tables.
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), crate::Error>> + Send + '_;

    /// Deletes up to `limit` records of `consumer` (processed ids and failure counts) older
    /// than `retention`.
    fn purge_consumed<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        retention: Duration,
        limit: i64,
    ) -> impl Future<Output = Result<u64, crate::Error>> + Send + 'p;
}

/// The [`EventStorage`] methods whose statements bind alike on every database: each backend
/// module provides the SQL constants `ENQUEUE`, `WAITING`, `PURGE_PUBLISHED`, `CLAIM`, `ATTEMPTS`,
/// `NOTE_FAILURE`, `COUNT_FAILURE`, `CLEAR_FAILURES`, `PURGE_CONSUMED` and `PURGE_FAILURES`
/// (attempts read as a 64-bit integer, times computed by the database, retentions bound in
/// milliseconds).
macro_rules! shared_event_storage {
    ($db:ty, $conn:ty, migrations = $migrations:literal) => {
        async fn migrate(pool: &Pool<$db>) -> Result<(), crate::Error> {
            // Recorded apart from the application's `_sqlx_migrations` and the key table's.
            let mut migrator = sqlx::migrate!($migrations);
            migrator.set_ignore_missing(true);
            migrator.dangerous_set_table_name("_idem_events_migrations");
            Ok(migrator.run(pool).await?)
        }

        async fn enqueue(
            conn: &mut $conn,
            id: &str,
            topic: &str,
            payload: &str,
        ) -> Result<(), crate::Error> {
            sqlx::query(ENQUEUE)
                .bind(id)
                .bind(topic)
                .bind(payload)
                .execute(conn)
                .await?;
            Ok(())
        }

        async fn waiting(pool: &Pool<$db>) -> Result<(i64, Option<i64>), crate::Error> {
            Ok(sqlx::query_as(WAITING).fetch_one(pool).await?)
        }

        async fn purge_published(
            pool: &Pool<$db>,
            retention: Duration,
            limit: i64,
        ) -> Result<u64, crate::Error> {
            let done = sqlx::query(PURGE_PUBLISHED)
                .bind(millis(retention))
                .bind(limit)
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn claim_message(
            conn: &mut $conn,
            consumer: &str,
            message_id: &str,
        ) -> Result<bool, crate::Error> {
            let done = sqlx::query(CLAIM)
                .bind(consumer)
                .bind(message_id)
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn attempts(
            pool: &Pool<$db>,
            consumer: &str,
            message_id: &str,
        ) -> Result<u32, crate::Error> {
            let attempts: Option<i64> = sqlx::query_scalar(ATTEMPTS)
                .bind(consumer)
                .bind(message_id)
                .fetch_optional(pool)
                .await?;
            Ok(super::count(attempts))
        }

        async fn note_failure(
            pool: &Pool<$db>,
            consumer: &str,
            message_id: &str,
            error: &str,
        ) -> Result<u32, crate::Error> {
            let attempts: Option<i64> = sqlx::query_scalar(NOTE_FAILURE)
                .bind(consumer)
                .bind(message_id)
                .bind(error)
                .fetch_optional(pool)
                .await?;
            Ok(super::count(attempts))
        }

        async fn count_failure(
            pool: &Pool<$db>,
            consumer: &str,
            message_id: &str,
            error: &str,
        ) -> Result<u32, crate::Error> {
            let attempts: i64 = sqlx::query_scalar(COUNT_FAILURE)
                .bind(consumer)
                .bind(message_id)
                .bind(error)
                .fetch_one(pool)
                .await?;
            Ok(super::count(Some(attempts)))
        }

        async fn clear_failures(
            conn: &mut $conn,
            consumer: &str,
            message_id: &str,
        ) -> Result<(), crate::Error> {
            sqlx::query(CLEAR_FAILURES)
                .bind(consumer)
                .bind(message_id)
                .execute(conn)
                .await?;
            Ok(())
        }

        async fn clear_failures_apart(
            pool: &Pool<$db>,
            consumer: &str,
            message_id: &str,
        ) -> Result<(), crate::Error> {
            let mut conn = pool.acquire().await?;
            Self::clear_failures(&mut conn, consumer, message_id).await
        }

        async fn purge_consumed(
            pool: &Pool<$db>,
            consumer: &str,
            retention: Duration,
            limit: i64,
        ) -> Result<u64, crate::Error> {
            let mut deleted = 0;
            for statement in [PURGE_CONSUMED, PURGE_FAILURES] {
                deleted += sqlx::query(statement)
                    .bind(consumer)
                    .bind(millis(retention))
                    .bind(limit)
                    .execute(pool)
                    .await?
                    .rows_affected();
            }
            Ok(deleted)
        }
    };
}

pub(super) use shared_event_storage;

/// A duration in whole milliseconds, as statements bind it (saturating).
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// An attempt count as the database holds it (absent: none).
fn count(attempts: Option<i64>) -> u32 {
    attempts.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
}
