//! The outbox and the consumers' records on PostgreSQL.
//!
//! A relay holds a topic by locking its row in `idem_outbox_topics` (`FOR UPDATE SKIP LOCKED`)
//! in a transaction that stays open while the batch is published: a relay that dies lets go
//! with its connection. Events go out in id order: one whose transaction committed before
//! another's began has the smaller id.

use std::time::Duration;

use sqlx::{PgConnection, Pool, Postgres, Row, Transaction};

use super::{Batch, EventStorage};
use crate::backend::millis;
use crate::events::Message;

const ENQUEUE: &str = "INSERT INTO idem_outbox (event_id, topic, payload) VALUES ($1, $2, $3)";

const KNOW_TOPICS: &str = "INSERT INTO idem_outbox_topics (topic) \
     SELECT DISTINCT topic FROM idem_outbox WHERE published_at IS NULL \
     ON CONFLICT DO NOTHING";

const LOCK_TOPIC: &str = "SELECT topic FROM idem_outbox_topics t \
     WHERE EXISTS (SELECT 1 FROM idem_outbox o WHERE o.topic = t.topic AND o.published_at IS NULL) \
     ORDER BY t.topic <= $1, t.topic \
     LIMIT 1 FOR UPDATE SKIP LOCKED";

const READY: &str = "SELECT id, event_id, payload FROM idem_outbox \
     WHERE topic = $1 AND published_at IS NULL ORDER BY id LIMIT $2";

const MARK: &str = "UPDATE idem_outbox SET published_at = now() WHERE id = ANY($1)";

const PURGE_PUBLISHED: &str = "DELETE FROM idem_outbox WHERE id IN ( \
     SELECT id FROM idem_outbox \
     WHERE published_at < now() - $1 * interval '1 millisecond' LIMIT $2)";

const CLAIM: &str = "INSERT INTO idem_consumed (consumer, message_id) VALUES ($1, $2) \
     ON CONFLICT DO NOTHING";

const ATTEMPTS: &str =
    "SELECT attempts FROM idem_consumer_failures WHERE consumer = $1 AND message_id = $2";

const COUNT_FAILURE: &str = "INSERT INTO idem_consumer_failures \
         (consumer, message_id, attempts, last_error) VALUES ($1, $2, 1, $3) \
     ON CONFLICT (consumer, message_id) DO UPDATE \
         SET attempts = idem_consumer_failures.attempts + 1, \
             last_error = excluded.last_error, failed_at = now() \
     RETURNING attempts";

const CLEAR_FAILURES: &str =
    "DELETE FROM idem_consumer_failures WHERE consumer = $1 AND message_id = $2";

const PURGE_CONSUMED: &str = "DELETE FROM idem_consumed WHERE ctid IN ( \
     SELECT ctid FROM idem_consumed \
     WHERE consumer = $1 AND processed_at < now() - $2 * interval '1 millisecond' LIMIT $3)";

const PURGE_FAILURES: &str = "DELETE FROM idem_consumer_failures WHERE ctid IN ( \
     SELECT ctid FROM idem_consumer_failures \
     WHERE consumer = $1 AND failed_at < now() - $2 * interval '1 millisecond' LIMIT $3)";

impl EventStorage for Postgres {
    type Held = Transaction<'static, Postgres>;

    async fn enqueue(
        conn: &mut PgConnection,
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

    async fn take_batch(
        pool: &Pool<Postgres>,
        _relay: &str,
        after: Option<&str>,
        limit: i64,
        _lease: Duration,
    ) -> Result<Option<Batch<Postgres>>, crate::Error> {
        sqlx::query(KNOW_TOPICS).execute(pool).await?;
        let mut tx = pool.begin().await?;
        let Some(topic) = sqlx::query_scalar::<_, String>(LOCK_TOPIC)
            .bind(after.unwrap_or(""))
            .fetch_optional(&mut *tx)
            .await?
        else {
            tx.rollback().await?;
            return Ok(None);
        };
        let rows = sqlx::query(READY)
            .bind(&topic)
            .bind(limit)
            .fetch_all(&mut *tx)
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
            held: tx,
        }))
    }

    async fn mark_published(
        _pool: &Pool<Postgres>,
        _relay: &str,
        batch: Batch<Postgres>,
    ) -> Result<(), crate::Error> {
        let mut tx = batch.held;
        sqlx::query(MARK)
            .bind(&batch.rows)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn abandon(
        _pool: &Pool<Postgres>,
        _relay: &str,
        batch: Batch<Postgres>,
    ) -> Result<(), crate::Error> {
        batch.held.rollback().await?;
        Ok(())
    }

    async fn purge_published(
        pool: &Pool<Postgres>,
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
        conn: &mut PgConnection,
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
        pool: &Pool<Postgres>,
        consumer: &str,
        message_id: &str,
    ) -> Result<u32, crate::Error> {
        let attempts: Option<i32> = sqlx::query_scalar(ATTEMPTS)
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(pool)
            .await?;
        Ok(attempts.map_or(0, |n| n.unsigned_abs()))
    }

    async fn count_failure(
        pool: &Pool<Postgres>,
        consumer: &str,
        message_id: &str,
        error: &str,
    ) -> Result<u32, crate::Error> {
        let attempts: i32 = sqlx::query_scalar(COUNT_FAILURE)
            .bind(consumer)
            .bind(message_id)
            .bind(error)
            .fetch_one(pool)
            .await?;
        Ok(attempts.unsigned_abs())
    }

    async fn clear_failures(
        conn: &mut PgConnection,
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
        pool: &Pool<Postgres>,
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
}
