//! The outbox and the consumers' records on SQLite.
//!
//! SQLite admits one writer at a time, so event ids are given in commit order and a topic's
//! events are published in id order. It has no row locks: a relay holds a topic with a lease
//! (`relay`, `leased_until`) that it takes and gives back in short transactions of their own,
//! and that another relay may take over once it ran out. Times are the database's own
//! (`unixepoch('subsec')`, in milliseconds), as in the key table.

use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::{Pool, SqlSafeStr, Sqlite, Transaction, migrate::Migrator, pool::PoolConnection};

use super::{
    Batch, EventStorage, Wanted,
    dialect::{Dialect, NUMBERED_CLEAR_FAILURES, with_waiting_topics},
    millis,
};

/// Now, in milliseconds since the Unix epoch: the unit of SQLite's time columns.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

// The rows of the waiting events' topics that have none yet.
const KNOW_TOPICS: &str = concat!(
    with_waiting_topics!(),
    "INSERT OR IGNORE INTO idem_outbox_topics (topic) \
     SELECT topic FROM waiting WHERE topic IS NOT NULL"
);

const LEASE_TOPIC: &str = "UPDATE idem_outbox_topics SET relay = $1, leased_until = $2 \
     WHERE topic = ( \
         SELECT topic FROM idem_outbox_topics t \
         WHERE EXISTS (SELECT 1 FROM idem_outbox o \
                       WHERE o.topic = t.topic AND o.published_at IS NULL) \
           AND (t.relay IS NULL OR t.relay = $1 OR t.leased_until < $3) \
           AND t.topic NOT IN (SELECT value FROM json_each($5)) \
         ORDER BY t.topic <= $4, t.topic LIMIT 1) \
     RETURNING topic";

const READY: &str = "SELECT id, event_id, payload FROM idem_outbox \
     WHERE topic = $1 AND published_at IS NULL ORDER BY id LIMIT $2";

const MARK: &str = "UPDATE idem_outbox SET published_at = $1 \
     WHERE id IN (SELECT value FROM json_each($2))";

const LET_GO: &str = "UPDATE idem_outbox_topics SET relay = NULL, leased_until = NULL \
     WHERE topic = $1 AND relay = $2";

/// A relay's lease on a topic: nothing to hold on to but the row it wrote, let go of through
/// the pool, under the relay's name.
pub struct Lease {
    pool: Pool<Sqlite>,
    relay: String,
}

impl Dialect for Sqlite {
    const MIGRATOR: Migrator = sqlx::migrate!("migrations/sqlite");
    const ENQUEUE: &'static str = "INSERT INTO idem_outbox (event_id, topic, payload, created_at) \
         VALUES ($1, $2, $3, CAST(unixepoch('subsec') * 1000 AS INTEGER))";
    const WAITING: &'static str = "SELECT COUNT(*), \
         CAST(unixepoch('subsec') * 1000 AS INTEGER) - MIN(created_at) \
         FROM idem_outbox WHERE published_at IS NULL";
    const PURGE_PUBLISHED: &'static str = "DELETE FROM idem_outbox WHERE id IN ( \
         SELECT id FROM idem_outbox WHERE published_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - $1 LIMIT $2)";
    const RECORD_PROCESSED: &'static str = "INSERT INTO idem_consumed (consumer, message_id, processed_at) \
         VALUES ($1, $2, CAST(unixepoch('subsec') * 1000 AS INTEGER)) ON CONFLICT DO NOTHING";
    const ATTEMPTS: &'static str =
        "SELECT attempts FROM idem_consumer_failures WHERE consumer = $1 AND message_id = $2";
    const NOTE_FAILURE: &'static str = "UPDATE idem_consumer_failures \
         SET last_error = $3, failed_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) WHERE consumer = $1 AND message_id = $2 \
         RETURNING attempts";
    const COUNT_FAILURE: &'static str = "INSERT INTO idem_consumer_failures \
             (consumer, message_id, attempts, last_error, failed_at) \
             VALUES ($1, $2, 1, $3, CAST(unixepoch('subsec') * 1000 AS INTEGER)) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
             SET attempts = attempts + 1, last_error = excluded.last_error, \
                 failed_at = excluded.failed_at \
         RETURNING attempts";
    const FAILURE_RETURNS_COUNT: bool = true;
    const CLEAR_FAILURES: &'static str = NUMBERED_CLEAR_FAILURES;
    const PURGE_CONSUMED: &'static str = "DELETE FROM idem_consumed WHERE rowid IN ( \
         SELECT rowid FROM idem_consumed \
         WHERE consumer = $1 AND processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - $2 LIMIT $3)";
    const PURGE_FAILURES: &'static str = "DELETE FROM idem_consumer_failures WHERE rowid IN ( \
         SELECT rowid FROM idem_consumer_failures \
         WHERE consumer = $1 AND failed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - $2 LIMIT $3)";

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }
}

impl EventStorage for Sqlite {
    type Held = Lease;

    async fn begin_write(
        conn: PoolConnection<Sqlite>,
    ) -> Result<Transaction<'static, Sqlite>, crate::error::Error> {
        Ok(Transaction::begin(conn, Some("BEGIN IMMEDIATE".into_sql_str())).await?)
    }

    async fn hold_batch(
        pool: &Pool<Sqlite>,
        wanted: Wanted<'_>,
    ) -> Result<Option<Batch<Sqlite>>, crate::error::Error> {
        let conn = pool.acquire().await?;
        let mut tx = Self::begin_write(conn).await?;
        let now = now_ms();
        let mut topic = None;
        for known in [true, false] {
            topic = sqlx::query_scalar::<_, String>(LEASE_TOPIC)
                .bind(wanted.relay)
                .bind(now.saturating_add(millis(wanted.lease)))
                .bind(now)
                .bind(wanted.after.unwrap_or(""))
                .bind(sqlx::types::Json(wanted.skip))
                .fetch_optional(&mut *tx)
                .await?;
            if topic.is_some() || !known {
                break;
            }
            // A topic without its row yet: added when a lease finds none.
            sqlx::query(KNOW_TOPICS).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        let Some(topic) = topic else {
            return Ok(None);
        };
        let rows = sqlx::query_as(READY)
            .bind(&topic)
            .bind(wanted.limit)
            .fetch_all(pool)
            .await?;
        let lease = Lease {
            pool: pool.clone(),
            relay: wanted.relay.to_owned(),
        };
        Ok(Some(Batch::new(topic, rows, lease)))
    }

    async fn mark_published(batch: Batch<Sqlite>) -> Result<(), crate::error::Error> {
        let Lease { pool, relay } = batch.held;
        let conn = pool.acquire().await?;
        let mut tx = Self::begin_write(conn).await?;
        sqlx::query(MARK)
            .bind(now_ms())
            .bind(sqlx::types::Json(&batch.rows))
            .execute(&mut *tx)
            .await?;
        sqlx::query(LET_GO)
            .bind(&batch.topic)
            .bind(&relay)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn abandon(batch: Batch<Sqlite>) -> Result<(), crate::error::Error> {
        let Lease { pool, relay } = batch.held;
        sqlx::query(LET_GO)
            .bind(&batch.topic)
            .bind(&relay)
            .execute(&pool)
            .await?;
        Ok(())
    }
}
