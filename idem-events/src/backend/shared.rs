//! The outbox's and the consumers' statements every backend shares, written once over
//! [`Dialect`]: what a backend's SQL differs in comes from its dialect, the rest is here.

use std::{future::Future, time::Duration};

use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Type, migrate::Migrate};

use super::{count, dialect::Dialect, millis};

/// Whether any event waits: the same statement on every database.
const ANY_WAITING: &str = "SELECT EXISTS (SELECT 1 FROM idem_outbox WHERE published_at IS NULL)";

/// The part of [`EventStorage`](super::EventStorage) that is the same on every database:
/// implemented once, below, for every database with a [`Dialect`].
pub(crate) trait SharedEventStorage: sqlx::Database + Sized {
    /// Adds an event to the outbox, in the transaction `conn` is in.
    fn enqueue<'c>(
        conn: &'c mut Self::Connection,
        id: &'c str,
        topic: &'c str,
        payload: &'c str,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + 'c;

    /// Whether any event waits to be published: one index probe, and no lock.
    fn any_waiting(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + '_;

    /// How many events wait to be published, and the age of the oldest in milliseconds.
    fn waiting(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<(i64, Option<i64>), crate::error::Error>> + Send + '_;

    /// Deletes up to `limit` events published more than `retention` ago.
    fn purge_published(
        pool: &Pool<Self>,
        retention: Duration,
        limit: i64,
    ) -> impl Future<Output = Result<u64, crate::error::Error>> + Send + '_;

    /// Records that `consumer` processed `message_id`, in the transaction `conn` is in; `false`
    /// when it was recorded before (waiting, on PostgreSQL and MySQL, for a transaction that is
    /// recording it right now to end).
    fn record_processed<'c>(
        conn: &'c mut Self::Connection,
        consumer: &'c str,
        message_id: &'c str,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'c;

    /// How many times `consumer` failed `message_id`.
    fn attempts<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
    ) -> impl Future<Output = Result<u32, crate::error::Error>> + Send + 'p;

    /// Records `error` as the last failure of `consumer` on `message_id`, counted before (see
    /// [`SharedEventStorage::count_failure`]); returns the count.
    fn note_failure<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
        error: &'p str,
    ) -> impl Future<Output = Result<u32, crate::error::Error>> + Send + 'p;

    /// Counts one more failure of `consumer` on `message_id` and returns the count.
    fn count_failure<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
        error: &'p str,
    ) -> impl Future<Output = Result<u32, crate::error::Error>> + Send + 'p;

    /// Forgets the failures of `consumer` on `message_id`, in the transaction `conn` is in.
    fn clear_failures<'c>(
        conn: &'c mut Self::Connection,
        consumer: &'c str,
        message_id: &'c str,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + 'c;

    /// Forgets the failures of `consumer` on `message_id`, in a statement of its own.
    fn clear_failures_apart<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        message_id: &'p str,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + 'p;

    /// Creates or upgrades the event tables.
    fn migrate(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + '_;

    /// Deletes up to `limit` records of `consumer` (processed ids and failure counts) older
    /// than `retention`.
    fn purge_consumed<'p>(
        pool: &'p Pool<Self>,
        consumer: &'p str,
        retention: Duration,
        limit: i64,
    ) -> impl Future<Output = Result<u64, crate::error::Error>> + Send + 'p;
}

/// The shared statements for every [`Dialect`], given what they need of sqlx for the database:
/// statements run on its connection (and so on its pool), its migrations, and text and `i64`
/// bound and read.
impl<DB> SharedEventStorage for DB
where
    DB: Dialect,
    // Statements run on a connection or a pool, migrations on a pool.
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    DB::Connection: Migrate,
    // Columns read by position, and the values bound and read.
    usize: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    bool: for<'r> Decode<'r, DB> + Type<DB>,
{
    async fn migrate(pool: &Pool<DB>) -> Result<(), crate::error::Error> {
        // Recorded apart from the application's `_sqlx_migrations` and the key table's.
        let mut migrator = DB::MIGRATOR;
        migrator.set_ignore_missing(true);
        migrator.dangerous_set_table_name("_idem_events_migrations");
        Ok(migrator.run(pool).await?)
    }

    async fn enqueue(
        conn: &mut DB::Connection,
        id: &str,
        topic: &str,
        payload: &str,
    ) -> Result<(), crate::error::Error> {
        sqlx::query(DB::ENQUEUE)
            .bind(id)
            .bind(topic)
            .bind(payload)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn any_waiting(pool: &Pool<DB>) -> Result<bool, crate::error::Error> {
        Ok(sqlx::query_scalar(ANY_WAITING).fetch_one(pool).await?)
    }

    async fn waiting(pool: &Pool<DB>) -> Result<(i64, Option<i64>), crate::error::Error> {
        Ok(sqlx::query_as(DB::WAITING).fetch_one(pool).await?)
    }

    async fn purge_published(
        pool: &Pool<DB>,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, crate::error::Error> {
        let done = sqlx::query(DB::PURGE_PUBLISHED)
            .bind(millis(retention))
            .bind(limit)
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done))
    }

    async fn record_processed(
        conn: &mut DB::Connection,
        consumer: &str,
        message_id: &str,
    ) -> Result<bool, crate::error::Error> {
        let done = sqlx::query(DB::RECORD_PROCESSED)
            .bind(consumer)
            .bind(message_id)
            .execute(conn)
            .await?;
        Ok(DB::rows_affected(&done) == 1)
    }

    async fn attempts(
        pool: &Pool<DB>,
        consumer: &str,
        message_id: &str,
    ) -> Result<u32, crate::error::Error> {
        let attempts: Option<i64> = sqlx::query_scalar(DB::ATTEMPTS)
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(pool)
            .await?;
        Ok(count(attempts))
    }

    async fn note_failure(
        pool: &Pool<DB>,
        consumer: &str,
        message_id: &str,
        error: &str,
    ) -> Result<u32, crate::error::Error> {
        let attempts = failure_counted(pool, DB::NOTE_FAILURE, consumer, message_id, error).await?;
        Ok(count(attempts))
    }

    async fn count_failure(
        pool: &Pool<DB>,
        consumer: &str,
        message_id: &str,
        error: &str,
    ) -> Result<u32, crate::error::Error> {
        let attempts =
            failure_counted(pool, DB::COUNT_FAILURE, consumer, message_id, error).await?;
        // An upsert that returns the count always answers with one: none is an error, as a row
        // not found. Counted apart (MySQL), no row read back counts as none.
        if DB::FAILURE_RETURNS_COUNT && attempts.is_none() {
            return Err(sqlx::Error::RowNotFound.into());
        }
        Ok(count(attempts))
    }

    async fn clear_failures(
        conn: &mut DB::Connection,
        consumer: &str,
        message_id: &str,
    ) -> Result<(), crate::error::Error> {
        sqlx::query(DB::CLEAR_FAILURES)
            .bind(consumer)
            .bind(message_id)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn clear_failures_apart(
        pool: &Pool<DB>,
        consumer: &str,
        message_id: &str,
    ) -> Result<(), crate::error::Error> {
        let mut conn = pool.acquire().await?;
        Self::clear_failures(&mut conn, consumer, message_id).await
    }

    async fn purge_consumed(
        pool: &Pool<DB>,
        consumer: &str,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, crate::error::Error> {
        let mut deleted = 0;
        for statement in [DB::PURGE_CONSUMED, DB::PURGE_FAILURES] {
            let done = sqlx::query(statement)
                .bind(consumer)
                .bind(millis(retention))
                .bind(limit)
                .execute(pool)
                .await?;
            deleted += DB::rows_affected(&done);
        }
        Ok(deleted)
    }
}

/// Runs `statement`, which notes a failure of `message_id` (its parameters the consumer, the
/// message id and the error), and reads how many times the message failed: from the
/// statement's own answer where the database returns it ([`Dialect::FAILURE_RETURNS_COUNT`]);
/// otherwise with [`Dialect::ATTEMPTS`] in the same transaction, so that the row the statement
/// wrote stays locked until the count is read. `None` when the statement wrote nothing.
async fn failure_counted<DB>(
    pool: &Pool<DB>,
    statement: &'static str,
    consumer: &str,
    message_id: &str,
    error: &str,
) -> Result<Option<i64>, crate::error::Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
{
    if DB::FAILURE_RETURNS_COUNT {
        return Ok(sqlx::query_scalar(statement)
            .bind(consumer)
            .bind(message_id)
            .bind(error)
            .fetch_optional(pool)
            .await?);
    }
    let mut tx = pool.begin().await?;
    sqlx::query(statement)
        .bind(consumer)
        .bind(message_id)
        .bind(error)
        .execute(&mut *tx)
        .await?;
    let attempts = sqlx::query_scalar(DB::ATTEMPTS)
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(attempts)
}
