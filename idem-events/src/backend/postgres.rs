//! The outbox and the consumers' records on PostgreSQL.
//!
//! A relay holds a topic by locking its row in `idem_outbox_topics` (`FOR UPDATE SKIP LOCKED`)
//! in a transaction that stays open while the batch is published: a relay that dies lets go
//! with its connection. Events go out in id order: one whose transaction committed before
//! another's began has the smaller id.

use sqlx::{Pool, Postgres, Transaction, migrate::Migrator};

use super::{
    Batch, EventStorage, Wanted,
    dialect::{Dialect, NUMBERED_CLEAR_FAILURES, with_waiting_topics},
};

// The rows of the waiting events' topics that have none yet.
const KNOW_TOPICS: &str = concat!(
    with_waiting_topics!(),
    "INSERT INTO idem_outbox_topics (topic) \
     SELECT topic FROM waiting WHERE topic IS NOT NULL ON CONFLICT DO NOTHING"
);

const LOCK_TOPIC: &str = "SELECT topic FROM idem_outbox_topics t \
     WHERE EXISTS (SELECT 1 FROM idem_outbox o WHERE o.topic = t.topic AND o.published_at IS NULL) \
       AND NOT (t.topic = ANY($2)) \
     ORDER BY t.topic <= $1, t.topic \
     LIMIT 1 FOR UPDATE SKIP LOCKED";

const READY: &str = "SELECT id, event_id, payload FROM idem_outbox \
     WHERE topic = $1 AND published_at IS NULL ORDER BY id LIMIT $2";

const MARK: &str = "UPDATE idem_outbox SET published_at = now() WHERE id = ANY($1)";

impl Dialect for Postgres {
    const MIGRATOR: Migrator = sqlx::migrate!("migrations/postgres");
    const ENQUEUE: &'static str =
        "INSERT INTO idem_outbox (event_id, topic, payload) VALUES ($1, $2, $3)";
    const WAITING: &'static str = "SELECT COUNT(*), \
         CAST(EXTRACT(EPOCH FROM now() - MIN(created_at)) * 1000 AS BIGINT) \
         FROM idem_outbox WHERE published_at IS NULL";
    const PURGE_PUBLISHED: &'static str = "DELETE FROM idem_outbox WHERE id IN ( \
         SELECT id FROM idem_outbox \
         WHERE published_at < now() - $1 * interval '1 millisecond' LIMIT $2)";
    const RECORD_PROCESSED: &'static str = "INSERT INTO idem_consumed (consumer, message_id) VALUES ($1, $2) \
         ON CONFLICT DO NOTHING";
    const ATTEMPTS: &'static str = "SELECT attempts::bigint FROM idem_consumer_failures \
         WHERE consumer = $1 AND message_id = $2";
    const NOTE_FAILURE: &'static str = "UPDATE idem_consumer_failures \
         SET last_error = $3, failed_at = now() WHERE consumer = $1 AND message_id = $2 \
         RETURNING attempts::bigint";
    const COUNT_FAILURE: &'static str = "INSERT INTO idem_consumer_failures \
             (consumer, message_id, attempts, last_error) VALUES ($1, $2, 1, $3) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
             SET attempts = idem_consumer_failures.attempts + 1, \
                 last_error = excluded.last_error, failed_at = now() \
         RETURNING attempts::bigint";
    const FAILURE_RETURNS_COUNT: bool = true;
    const CLEAR_FAILURES: &'static str = NUMBERED_CLEAR_FAILURES;
    const PURGE_CONSUMED: &'static str = "DELETE FROM idem_consumed WHERE ctid IN ( \
         SELECT ctid FROM idem_consumed \
         WHERE consumer = $1 AND processed_at < now() - $2 * interval '1 millisecond' LIMIT $3)";
    const PURGE_FAILURES: &'static str = "DELETE FROM idem_consumer_failures WHERE ctid IN ( \
         SELECT ctid FROM idem_consumer_failures \
         WHERE consumer = $1 AND failed_at < now() - $2 * interval '1 millisecond' LIMIT $3)";

    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }
}

impl EventStorage for Postgres {
    type Held = Transaction<'static, Postgres>;

    async fn hold_batch(
        pool: &Pool<Postgres>,
        wanted: Wanted<'_>,
    ) -> Result<Option<Batch<Postgres>>, crate::error::Error> {
        // The topics' rows are added when a lock finds none: the scan of every waiting event
        // that it takes runs when a new topic appears, not on every pass.
        for known in [true, false] {
            let mut tx = pool.begin().await?;
            let topic = sqlx::query_scalar::<_, String>(LOCK_TOPIC)
                .bind(wanted.after.unwrap_or(""))
                .bind(wanted.skip)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(topic) = topic {
                let rows = sqlx::query_as(READY)
                    .bind(&topic)
                    .bind(wanted.limit)
                    .fetch_all(&mut *tx)
                    .await?;
                return Ok(Some(Batch::new(topic, rows, tx)));
            }
            tx.rollback().await?;
            if known {
                sqlx::query(KNOW_TOPICS).execute(pool).await?;
            }
        }
        Ok(None)
    }

    async fn mark_published(batch: Batch<Postgres>) -> Result<(), crate::error::Error> {
        let mut tx = batch.held;
        sqlx::query(MARK)
            .bind(&batch.rows)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn abandon(batch: Batch<Postgres>) -> Result<(), crate::error::Error> {
        batch.held.rollback().await?;
        Ok(())
    }
}
