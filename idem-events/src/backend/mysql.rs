//! The outbox and the consumers' records on MySQL 8 and MariaDB 10.11 (InnoDB).
//!
//! A relay holds a topic as on PostgreSQL: it locks the topic's row in `idem_outbox_topics`
//! (`FOR UPDATE SKIP LOCKED`) in a transaction that stays open while the batch is published, and
//! a relay that dies lets go with its connection. That transaction is `READ COMMITTED`: InnoDB
//! then lets go at once of the rows a locking read looked at and passed over (topics with no
//! waiting event), takes no gap locks that would hold up the producers, and reads the events
//! as they are once the lock is taken (not as a snapshot taken before another relay's marks).
//! The topics are locked in index order, one statement after `after` and one up to it, so that
//! no sort makes InnoDB lock every candidate before the first is chosen. (InnoDB refuses writes
//! in a `READ COMMITTED` transaction when the binlog is `STATEMENT`: the server must log `ROW`
//! or `MIXED`, the defaults of MySQL 8 and MariaDB.)
//!
//! Identifiers are `VARBINARY` (exact, case and trailing spaces kept; see the migration for
//! their lengths) and read back as text with `CONVERT(… USING utf8mb4)`; times are
//! `DATETIME(6)` in UTC (`UTC_TIMESTAMP(6)`); durations are bound in milliseconds. MySQL takes
//! `?` placeholders in order: where a statement needs its parameters in another order than the
//! shared ones bind them, it reads them from a derived table (`JOIN (SELECT ? AS …) AS p`).
//! MySQL has no `RETURNING`: the failure statements are followed by [`ATTEMPTS`], in their
//! transaction ([`Dialect::FAILURE_RETURNS_COUNT`]).

use std::fmt::Write as _;

use sqlx::{
    AssertSqlSafe, MySql, MySqlConnection, Pool, SqlSafeStr, Transaction, migrate::Migrator,
};

use super::{Batch, EventStorage, Wanted, dialect::Dialect};

/// Begins the relay's transaction (see the module's documentation): `SET TRANSACTION` sets the
/// level of the next transaction only, sent with it in one round trip.
const BEGIN_READ_COMMITTED: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

// The topics of the waiting events that have no row yet (a loose scan of idem_outbox_published).
// Topics that have one are left out by a consistent read rather than by `INSERT IGNORE`, which
// would wait for the lock of a topic another relay holds. Run `READ COMMITTED`, where InnoDB
// reads idem_outbox without locking it.
const KNOW_TOPICS: &str = "INSERT IGNORE INTO idem_outbox_topics (topic) \
     SELECT DISTINCT o.topic FROM idem_outbox o \
     WHERE o.published_at IS NULL \
       AND NOT EXISTS (SELECT 1 FROM idem_outbox_topics t WHERE t.topic = o.topic)";

// The first free topic with waiting events, in index order from a bound (`?`); the skipped
// topics' `NOT IN` list and `LIMIT 1 FOR UPDATE SKIP LOCKED` are added by `lock_topic`. The
// scalar subquery (rather than `EXISTS`, which the optimiser may turn into a semi-join that
// reads every waiting event) probes one index entry per topic.
const LOCK_TOPIC_AFTER: &str = "SELECT CONVERT(t.topic USING utf8mb4) AS topic \
     FROM idem_outbox_topics t \
     WHERE t.topic > ? \
       AND (SELECT 1 FROM idem_outbox o \
            WHERE o.topic = t.topic AND o.published_at IS NULL LIMIT 1) IS NOT NULL";

const LOCK_TOPIC_UP_TO: &str = "SELECT CONVERT(t.topic USING utf8mb4) AS topic \
     FROM idem_outbox_topics t \
     WHERE t.topic <= ? \
       AND (SELECT 1 FROM idem_outbox o \
            WHERE o.topic = t.topic AND o.published_at IS NULL LIMIT 1) IS NOT NULL";

const READY: &str = "SELECT id, CONVERT(event_id USING utf8mb4) AS event_id, payload \
     FROM idem_outbox WHERE topic = ? AND published_at IS NULL ORDER BY id LIMIT ?";

/// Marks events published; `mark_published` adds the ids' `IN (…)` list.
const MARK: &str = "UPDATE idem_outbox SET published_at = UTC_TIMESTAMP(6) WHERE id IN ";

impl Dialect for MySql {
    const MIGRATOR: Migrator = sqlx::migrate!("migrations/mysql");
    const ENQUEUE: &'static str = "INSERT INTO idem_outbox (event_id, topic, payload, created_at) \
         VALUES (?, ?, ?, UTC_TIMESTAMP(6))";
    const WAITING: &'static str = "SELECT COUNT(*), \
         CAST(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED) \
         FROM idem_outbox WHERE published_at IS NULL";
    const PURGE_PUBLISHED: &'static str = "DELETE FROM idem_outbox \
         WHERE published_at < UTC_TIMESTAMP(6) - INTERVAL ? * 1000 MICROSECOND \
         ORDER BY published_at LIMIT ?";
    /// `INSERT IGNORE` writes nothing (0 rows) for an id recorded before, and waits, as PostgreSQL's
    /// `ON CONFLICT DO NOTHING`, for a transaction that is inserting it right now. (`ON DUPLICATE KEY
    /// UPDATE` with a no-op cannot tell: sqlx connects with `CLIENT_FOUND_ROWS`, which counts the
    /// untouched row as affected.) `IGNORE` also cuts an id longer than its column instead of
    /// failing: the limits are documented with the table.
    const RECORD_PROCESSED: &'static str = "INSERT IGNORE INTO idem_consumed (consumer, message_id, processed_at) \
         VALUES (?, ?, UTC_TIMESTAMP(6))";
    const ATTEMPTS: &'static str = "SELECT CAST(attempts AS SIGNED) FROM idem_consumer_failures \
         WHERE consumer = ? AND message_id = ?";
    const NOTE_FAILURE: &'static str = "UPDATE idem_consumer_failures f \
         JOIN (SELECT CAST(? AS BINARY) AS consumer, CAST(? AS BINARY) AS message_id, \
                      ? AS last_error) AS p \
           ON f.consumer = p.consumer AND f.message_id = p.message_id \
         SET f.last_error = p.last_error, f.failed_at = UTC_TIMESTAMP(6)";
    /// The parameters come as the shared statements bind them (consumer, message id, error), from a
    /// derived table; `CAST(… AS BINARY)` keeps the comparisons with the columns exact.
    const COUNT_FAILURE: &'static str = "INSERT INTO idem_consumer_failures \
             (consumer, message_id, attempts, last_error, failed_at) \
         SELECT p.consumer, p.message_id, 1, p.last_error, UTC_TIMESTAMP(6) \
         FROM (SELECT CAST(? AS BINARY) AS consumer, CAST(? AS BINARY) AS message_id, \
                      ? AS last_error) AS p \
         ON DUPLICATE KEY UPDATE attempts = idem_consumer_failures.attempts + 1, \
             last_error = p.last_error, failed_at = UTC_TIMESTAMP(6)";
    const FAILURE_RETURNS_COUNT: bool = false;
    const CLEAR_FAILURES: &'static str =
        "DELETE FROM idem_consumer_failures WHERE consumer = ? AND message_id = ?";
    const PURGE_CONSUMED: &'static str = "DELETE FROM idem_consumed \
         WHERE consumer = ? AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? * 1000 MICROSECOND \
         ORDER BY processed_at LIMIT ?";
    const PURGE_FAILURES: &'static str = "DELETE FROM idem_consumer_failures \
         WHERE consumer = ? AND failed_at < UTC_TIMESTAMP(6) - INTERVAL ? * 1000 MICROSECOND \
         ORDER BY failed_at LIMIT ?";

    fn rows_affected(done: &sqlx::mysql::MySqlQueryResult) -> u64 {
        done.rows_affected()
    }
}

/// The most placeholders a MySQL statement takes.
const MAX_PLACEHOLDERS: usize = 65_535;

/// `(?, ?, …)` for `count` values, and how many to bind: the count rounded up to a power of two
/// (within [`MAX_PLACEHOLDERS`]) so that the statements built with it come in few shapes (each
/// shape is a prepared statement in every connection's cache). The values are padded by
/// repeating the last ([`padded`]), which an `IN` list ignores.
fn placeholders(count: usize) -> (String, usize) {
    let count = count.max(1);
    let bound = match count.next_power_of_two() {
        rounded if rounded <= MAX_PLACEHOLDERS => rounded,
        _ => count,
    };
    let mut list = String::with_capacity(bound * 3 + 2);
    list.push('(');
    for i in 0..bound {
        list.push_str(if i == 0 { "?" } else { ", ?" });
    }
    list.push(')');
    (list, bound)
}

/// `values` followed by copies of the last, `count` in all (none when `values` is empty).
fn padded<T>(values: &[T], count: usize) -> impl Iterator<Item = &T> {
    values
        .iter()
        .chain(std::iter::repeat_n(values.last(), count.saturating_sub(values.len())).flatten())
        .take(count)
}

/// Which side of the last topic a lock looks on.
#[derive(Clone, Copy)]
enum Side {
    /// The topics after it, which come first.
    After,
    /// The topics up to it, itself included.
    UpTo,
}

/// Locks the first free topic with waiting events on `side` of `after`, not in `skip`, in the
/// transaction `tx` is in.
async fn lock_topic(
    tx: &mut MySqlConnection,
    side: Side,
    after: &str,
    skip: &[String],
) -> Result<Option<String>, crate::error::Error> {
    let mut sql = String::from(match side {
        Side::After => LOCK_TOPIC_AFTER,
        Side::UpTo => LOCK_TOPIC_UP_TO,
    });
    let count = if skip.is_empty() {
        0
    } else {
        let (list, count) = placeholders(skip.len());
        let _ = write!(sql, " AND t.topic NOT IN {list}");
        count
    };
    sql.push_str(" ORDER BY t.topic LIMIT 1 FOR UPDATE SKIP LOCKED");
    let mut query = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql)).bind(after);
    for topic in padded(skip, count) {
        query = query.bind(topic);
    }
    Ok(query.fetch_optional(tx).await?)
}

/// Begins a `READ COMMITTED` transaction on a connection of `pool`.
async fn begin_read_committed(
    pool: &Pool<MySql>,
) -> Result<Transaction<'static, MySql>, crate::error::Error> {
    let conn = pool.acquire().await?;
    Ok(Transaction::begin(conn, Some(BEGIN_READ_COMMITTED.into_sql_str())).await?)
}

impl EventStorage for MySql {
    type Held = Transaction<'static, MySql>;

    async fn hold_batch(
        pool: &Pool<MySql>,
        wanted: Wanted<'_>,
    ) -> Result<Option<Batch<MySql>>, crate::error::Error> {
        let (after, skip) = (wanted.after.unwrap_or(""), wanted.skip);
        // The topics' rows are added when a lock finds none: the scan of the waiting events'
        // topics runs when a new topic appears, not on every pass.
        for known in [true, false] {
            let mut tx = begin_read_committed(pool).await?;
            let mut topic = lock_topic(&mut tx, Side::After, after, skip).await?;
            if topic.is_none() && !after.is_empty() {
                topic = lock_topic(&mut tx, Side::UpTo, after, skip).await?;
            }
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
                let mut tx = begin_read_committed(pool).await?;
                sqlx::query(KNOW_TOPICS).execute(&mut *tx).await?;
                tx.commit().await?;
            }
        }
        Ok(None)
    }

    async fn mark_published(batch: Batch<MySql>) -> Result<(), crate::error::Error> {
        let mut tx = batch.held;
        if !batch.rows.is_empty() {
            let (list, count) = placeholders(batch.rows.len());
            let mut query = sqlx::query(AssertSqlSafe(format!("{MARK}{list}")));
            for &id in padded(&batch.rows, count) {
                query = query.bind(id);
            }
            query.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn abandon(batch: Batch<MySql>) -> Result<(), crate::error::Error> {
        batch.held.rollback().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{padded, placeholders};

    #[test]
    fn placeholder_lists_come_in_powers_of_two() {
        assert_eq!(placeholders(0), ("(?)".to_owned(), 1));
        assert_eq!(placeholders(1), ("(?)".to_owned(), 1));
        assert_eq!(placeholders(3), ("(?, ?, ?, ?)".to_owned(), 4));
        assert_eq!(placeholders(4).1, 4);
        assert_eq!(placeholders(100).1, 128);
        assert_eq!(
            placeholders(40_000).1,
            40_000,
            "at most 65 535 placeholders"
        );
    }

    #[test]
    fn values_are_padded_with_the_last() {
        let values: Vec<_> = padded(&[1, 2, 3], 4).copied().collect();
        assert_eq!(values, [1, 2, 3, 3]);
        assert_eq!(padded(&[1, 2], 2).count(), 2);
        assert_eq!(padded::<i64>(&[], 4).count(), 0);
    }
}
