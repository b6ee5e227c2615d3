//! The outbox and the consumers' records on SQLite.
//!
//! SQLite admits one writer at a time, so event ids are given in commit order and a topic's
//! events are published in id order. It has no row locks: a relay holds a topic with a lease
//! (`relay`, `leased_until`) that it takes and gives back in short transactions of their own,
//! and that another relay may take over once it ran out.

use std::time::Duration;

use sqlx::{Pool, Row, Sqlite, SqliteConnection};

use super::{Batch, EventStorage};
use crate::backend::millis;
use crate::{backend::sqlite::now_ms, events::Message};

const ENQUEUE: &str =
    "INSERT INTO idem_outbox (event_id, topic, payload, created_at) VALUES ($1, $2, $3, $4)";

const KNOW_TOPICS: &str = "INSERT OR IGNORE INTO idem_outbox_topics (topic) \
     SELECT DISTINCT topic FROM idem_outbox WHERE published_at IS NULL";

const LEASE_TOPIC: &str = "UPDATE idem_outbox_topics SET relay = $1, leased_until = $2 \
     WHERE topic = ( \
         SELECT topic FROM idem_outbox_topics t \
         WHERE EXISTS (SELECT 1 FROM idem_outbox o \
                       WHERE o.topic = t.topic AND o.published_at IS NULL) \
           AND (t.relay IS NULL OR t.relay = $1 OR t.leased_until < $3) \
         ORDER BY t.topic <= $4, t.topic LIMIT 1) \
     RETURNING topic";

const READY: &str = "SELECT id, event_id, payload FROM idem_outbox \
     WHERE topic = $1 AND published_at IS NULL ORDER BY id LIMIT $2";

const MARK: &str = "UPDATE idem_outbox SET published_at = $1 \
     WHERE id IN (SELECT value FROM json_each($2))";

const LET_GO: &str = "UPDATE idem_outbox_topics SET relay = NULL, leased_until = NULL \
     WHERE topic = $1 AND relay = $2";

const PURGE_PUBLISHED: &str = "DELETE FROM idem_outbox WHERE id IN ( \
     SELECT id FROM idem_outbox WHERE published_at < $1 LIMIT $2)";

const CLAIM: &str = "INSERT INTO idem_consumed (consumer, message_id, processed_at) \
     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";

const ATTEMPTS: &str =
    "SELECT attempts FROM idem_consumer_failures WHERE consumer = $1 AND message_id = $2";

const COUNT_FAILURE: &str = "INSERT INTO idem_consumer_failures \
         (consumer, message_id, attempts, last_error, failed_at) VALUES ($1, $2, 1, $3, $4) \
     ON CONFLICT (consumer, message_id) DO UPDATE \
         SET attempts = attempts + 1, last_error = excluded.last_error, \
             failed_at = excluded.failed_at \
     RETURNING attempts";

const CLEAR_FAILURES: &str =
    "DELETE FROM idem_consumer_failures WHERE consumer = $1 AND message_id = $2";

const PURGE_CONSUMED: &str = "DELETE FROM idem_consumed WHERE rowid IN ( \
     SELECT rowid FROM idem_consumed WHERE consumer = $1 AND processed_at < $2 LIMIT $3)";

const PURGE_FAILURES: &str = "DELETE FROM idem_consumer_failures WHERE rowid IN ( \
     SELECT rowid FROM idem_consumer_failures WHERE consumer = $1 AND failed_at < $2 LIMIT $3)";

/// A relay's lease on a topic: nothing to hold on to but the row it wrote.
pub struct Lease;

impl EventStorage for Sqlite {
    type Held = Lease;

    async fn enqueue(
        conn: &mut SqliteConnection,
        id: &str,
        topic: &str,
        payload: &str,
    ) -> Result<(), crate::Error> {
        sqlx::query(ENQUEUE)
            .bind(id)
            .bind(topic)
            .bind(payload)
            .bind(now_ms())
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn take_batch(
        pool: &Pool<Sqlite>,
        relay: &str,
        after: Option<&str>,
        limit: i64,
        lease: Duration,
    ) -> Result<Option<Batch<Sqlite>>, crate::Error> {
        let conn = pool.acquire().await?;
        let mut tx = <Sqlite as crate::backend::Storage>::begin_write(conn).await?;
        sqlx::query(KNOW_TOPICS).execute(&mut *tx).await?;
        let now = now_ms();
        let topic: Option<String> = sqlx::query_scalar(LEASE_TOPIC)
            .bind(relay)
            .bind(now.saturating_add(millis(lease)))
            .bind(now)
            .bind(after.unwrap_or(""))
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        let Some(topic) = topic else {
            return Ok(None);
        };
        let rows = sqlx::query(READY)
            .bind(&topic)
            .bind(limit)
            .fetch_all(pool)
            .await?;
        let mut ids = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        for row in rows {
            ids.push(row.try_get::<i64, _>("id")?);
            messages.push(Message::new(
                row.try_get::<String, _>("event_id")?,
                topic.clone(),
                row.try_get::<String, _>("payload")?,
            ));
        }
        Ok(Some(Batch {
            topic,
            messages,
            rows: ids,
            held: Lease,
        }))
    }

    async fn mark_published(
        pool: &Pool<Sqlite>,
        relay: &str,
        batch: Batch<Sqlite>,
    ) -> Result<(), crate::Error> {
        let Lease = batch.held;
        let conn = pool.acquire().await?;
        let mut tx = <Sqlite as crate::backend::Storage>::begin_write(conn).await?;
        sqlx::query(MARK)
            .bind(now_ms())
            .bind(sqlx::types::Json(&batch.rows))
            .execute(&mut *tx)
            .await?;
        sqlx::query(LET_GO)
            .bind(&batch.topic)
            .bind(relay)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn abandon(
        pool: &Pool<Sqlite>,
        relay: &str,
        batch: Batch<Sqlite>,
    ) -> Result<(), crate::Error> {
        let Lease = batch.held;
        sqlx::query(LET_GO)
            .bind(&batch.topic)
            .bind(relay)
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn purge_published(
        pool: &Pool<Sqlite>,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, crate::Error> {
        let done = sqlx::query(PURGE_PUBLISHED)
            .bind(now_ms().saturating_sub(millis(retention)))
            .bind(limit)
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn claim_message(
        conn: &mut SqliteConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<bool, crate::Error> {
        let done = sqlx::query(CLAIM)
            .bind(consumer)
            .bind(message_id)
            .bind(now_ms())
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn attempts(
        pool: &Pool<Sqlite>,
        consumer: &str,
        message_id: &str,
    ) -> Result<u32, crate::Error> {
        let attempts: Option<i64> = sqlx::query_scalar(ATTEMPTS)
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(pool)
            .await?;
        Ok(attempts.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)))
    }

    async fn count_failure(
        pool: &Pool<Sqlite>,
        consumer: &str,
        message_id: &str,
        error: &str,
    ) -> Result<u32, crate::Error> {
        let attempts: i64 = sqlx::query_scalar(COUNT_FAILURE)
            .bind(consumer)
            .bind(message_id)
            .bind(error)
            .bind(now_ms())
            .fetch_one(pool)
            .await?;
        Ok(u32::try_from(attempts).unwrap_or(u32::MAX))
    }

    async fn clear_failures(
        conn: &mut SqliteConnection,
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

    async fn purge_consumed(
        pool: &Pool<Sqlite>,
        consumer: &str,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, crate::Error> {
        let before = now_ms().saturating_sub(millis(retention));
        let mut deleted = 0;
        for statement in [PURGE_CONSUMED, PURGE_FAILURES] {
            deleted += sqlx::query(statement)
                .bind(consumer)
                .bind(before)
                .bind(limit)
                .execute(pool)
                .await?
                .rows_affected();
        }
        Ok(deleted)
    }
}
