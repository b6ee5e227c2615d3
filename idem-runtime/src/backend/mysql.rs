//! MySQL and MariaDB: the key is held by the handler's transaction through an uncommitted row,
//! and turned `completed` in the handler's commit.
//!
//! The claim is one `INSERT` after `BEGIN`: a `started` row of the key, already expired, that
//! nobody else sees until it commits. A duplicate's `INSERT` finds the key's index entry locked
//! and, with its lock wait set to zero for that one statement, is refused at once (ER 1205): a
//! 409 without waiting. A committed row of the key is a duplicate-key error (ER 1062): it is read
//! and answered when live, deleted and claimed again when expired. The completion is an
//! `UPDATE` of the claim's row. A rollback, a crash or a dropped connection takes the row with
//! it, so a key is never left stuck; a handler that commits its transaction itself leaves an
//! expired row, which the next claim takes over, and its outcome is refused (the savepoint
//! `idem_claim`, begun with the transaction, is gone at completion).
//!
//! Nothing of the claim depends on a lock that lives outside the rows: on a Galera cluster,
//! whose nodes each take writes, a duplicate at another node claims its own copy of the key and
//! runs; the first to commit wins, and the other's commit is refused by certification (a
//! deadlock error), its writes with it.
//!
//! `SET STATEMENT … FOR` (the per-statement lock wait) is MariaDB's. Times are `DATETIME(6)` in
//! UTC, from the server's `UTC_TIMESTAMP(6)`; durations are bound in microseconds.

use std::time::Duration;

use sqlx::{
    MySql, MySqlConnection, QueryBuilder, Row, SqlSafeStr, Transaction,
    migrate::Migrator,
    mysql::{MySqlDatabaseError, MySqlRow},
};

use super::{
    Begun, ClaimRequest, Purged, SharedStorage, Storage, Undone, dialect::Dialect,
    rekeying::KeyPart,
};
use crate::record::{
    Abandoned, Completion, KeyRecord, KeyRef, KeyStatus, Start, Started, fresh_token,
};

/// How a statement that writes one key's row begins: `update_by_key!()` or `delete_by_key!()`,
/// reaching the row by the primary key only (`FORCE INDEX (PRIMARY)`; MariaDB takes an index
/// hint on a `DELETE` in the multi-table form), for `concat!` to join to the rest.
///
/// Every statement that writes one key's row begins so. Left to itself, MariaDB's optimizer at
/// times reached the row through `idem_keys_started_lease_idx` (its `status = 'started'`),
/// walking past other keys' in-flight claims and locking them: two completions each waited for
/// the other's claim, a deadlock answered 409 (46 in 5 million requests of the purge
/// benchmark's live load); and a statement with its lock wait at zero was refused for a key not
/// its own.
macro_rules! update_by_key {
    () => {
        "UPDATE idem_keys FORCE INDEX (PRIMARY)"
    };
}

/// See [`update_by_key`].
macro_rules! delete_by_key {
    () => {
        "DELETE idem_keys FROM idem_keys FORCE INDEX (PRIMARY)"
    };
}

/// The handler's transaction, with a savepoint only this transaction has: a handler that ends
/// the transaction itself (`COMMIT`, `ROLLBACK`) takes the savepoint with it, and the
/// completion, which releases it first, then knows.
const BEGIN_CLAIM: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; \
     SAVEPOINT idem_claim";
const RELEASE_CLAIM: &str = "RELEASE SAVEPOINT idem_claim";

/// The errors the connection's diagnostics area holds: those of the last statement that used a
/// table or raised a condition (a plain `ROLLBACK` after it leaves them).
const SHOW_ERRORS: &str = "SHOW ERRORS";

/// A transaction of idem's own (external-mode starts, purges, recoveries).
const BEGIN: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

// Around the handler of a route whose 5xx outcomes are stored: undoing its writes keeps the
// claim's row, and so the key.
const BEFORE_HANDLER: &str = "SAVEPOINT idem_handler";
const UNDO_HANDLER: &str = "ROLLBACK TO SAVEPOINT idem_handler";

// The claim's row: uncommitted, and expired, so that a handler that commits by itself leaves
// a row the next claim takes over. Refused at once when another transaction holds the key.
const CLAIM: &str = "SET STATEMENT innodb_lock_wait_timeout = 0 FOR \
     INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, created_at, \
       expires_at, claim_token) \
     VALUES (?, ?, '', '', '', 'started', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), ?)";

// A committed row that was in the claim's way.
const EXISTING: &str = "SELECT IF(status = 'started' AND parked_at IS NOT NULL, 'parked', status) \
       AS status, method, path, fingerprint, response_status, response_headers, response_body, \
     (expires_at > UTC_TIMESTAMP(6) OR (status = 'started' AND parked_at IS NOT NULL)) AS live \
     FROM idem_keys WHERE scope = ? AND `key` = ?";

// An expired row out of the claim's way; refused at once when another transaction holds it.
const DELETE_EXPIRED: &str = concat!(
    "SET STATEMENT innodb_lock_wait_timeout = 0 FOR ",
    delete_by_key!(),
    " WHERE scope = ? AND `key` = ? AND expires_at <= UTC_TIMESTAMP(6) AND parked_at IS NULL"
);

const LOOKUP: &str = "SELECT status, method, path, fingerprint, response_status, \
     response_headers, response_body FROM idem_keys \
     WHERE scope = ? AND `key` = ? AND expires_at > UTC_TIMESTAMP(6)";

// The key's row for an external-mode start, locked; refused at once when another transaction
// holds it (MariaDB answers NOWAIT with ER 1205, MySQL with ER 3572).
const START_ROW: &str = "SELECT IF(status = 'started' AND parked_at IS NOT NULL, 'parked', status) \
       AS status, method, path, fingerprint, response_status, \
     response_headers, response_body, expires_at > UTC_TIMESTAMP(6) AS live, \
     COALESCE(lease_until > UTC_TIMESTAMP(6), FALSE) AS leased, \
     TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until) AS lease_left \
     FROM idem_keys WHERE scope = ? AND `key` = ? FOR UPDATE NOWAIT";

const START_INSERT: &str = "SET STATEMENT innodb_lock_wait_timeout = 0 FOR \
     INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, created_at, \
       expires_at, locked_at, lease_until, claim_token) \
     VALUES (?, ?, ?, ?, ?, 'started', UTC_TIMESTAMP(6), \
       UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6), \
       UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)";

// An expired row, or a lapsed claim of the same request, taken over. `steps` and the recovery's
// count are assigned first: MySQL assigns left to right, and they read the old `expires_at`.
const START_TAKEOVER: &str = "UPDATE idem_keys SET \
       steps = IF(expires_at <= UTC_TIMESTAMP(6), NULL, steps), \
       recovery_attempts = IF(expires_at <= UTC_TIMESTAMP(6), 0, recovery_attempts), \
       recovery_error = IF(expires_at <= UTC_TIMESTAMP(6), NULL, recovery_error), \
       method = ?, path = ?, fingerprint = ?, status = 'started', \
       created_at = UTC_TIMESTAMP(6), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
       locked_at = UTC_TIMESTAMP(6), lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
       claim_token = ?, response_status = NULL, response_headers = NULL, response_body = NULL \
     WHERE scope = ? AND `key` = ?";

// The oldest expired rows, in one statement; refused at once when a live request holds one of
// the rows it reaches (an in-flight claim's row, expired until its completion, among them).
// Each batch starts at the expiry where the previous one ended (microseconds since the epoch):
// the index keeps a deleted row's entry until InnoDB's purge thread gets to it, and at read
// committed a scan from the oldest expiry slows with every entry it walks past (measured: a
// batch of 1,000 took 6.8 ms at first and 20.6 ms at the tenth). `>=`: rows of the same expiry
// as the last one deleted may be left.
const PURGE: &str = "SET STATEMENT innodb_lock_wait_timeout = 0 FOR \
     DELETE FROM idem_keys \
     WHERE expires_at >= TIMESTAMP'1970-01-01 00:00:00' + INTERVAL ? MICROSECOND \
       AND expires_at <= UTC_TIMESTAMP(6) AND parked_at IS NULL \
     ORDER BY expires_at LIMIT ? \
     RETURNING TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', expires_at) AS expiry";

// The oldest expired rows from the same expiry on, skipping rows a live request holds (an
// in-flight claim's row too).
const PURGE_SELECT: &str = "SELECT scope, `key`, \
       TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', expires_at) AS expiry \
     FROM idem_keys \
     WHERE expires_at >= TIMESTAMP'1970-01-01 00:00:00' + INTERVAL ? MICROSECOND \
       AND expires_at <= UTC_TIMESTAMP(6) AND parked_at IS NULL \
     ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED";

const RECLAIM_SELECT: &str = "SELECT scope, `key` FROM idem_keys \
     WHERE status = 'started' AND lease_until <= UTC_TIMESTAMP(6) \
       AND expires_at > UTC_TIMESTAMP(6) AND (? OR steps IS NULL) \
     ORDER BY lease_until LIMIT ? FOR UPDATE SKIP LOCKED";

/// MariaDB's answer to a statement whose lock wait ran out (at once, with the wait at zero or
/// `NOWAIT`).
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// MySQL's answer to a `NOWAIT` locking read of a locked row.
const ER_LOCK_NOWAIT: u16 = 3572;
const ER_DUP_ENTRY: u16 = 1062;
/// A deadlock, or (on a Galera cluster) a conflict with a transaction another node committed:
/// either way the server has rolled the whole transaction back.
const ER_LOCK_DEADLOCK: u16 = 1213;
const ER_SP_DOES_NOT_EXIST: u16 = 1305;

/// The MySQL error number of `error`, if the server answered it.
fn error_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(e) => e
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

/// Whether `error` says another transaction holds the row the statement needed.
fn is_locked(error: &sqlx::Error) -> bool {
    matches!(
        error_number(error),
        Some(ER_LOCK_WAIT_TIMEOUT | ER_LOCK_NOWAIT)
    )
}

/// A duration in whole microseconds, as statements bind it (saturating).
fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

// Connections to this database running a statement, but this one: sleeping connections, the
// server's own threads (Galera's `system user`, the event scheduler) and replication dumps are
// not counted.
const OTHERS_ACTIVE: &str = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
     WHERE COMMAND NOT IN ('Sleep', 'Daemon', 'Binlog Dump', 'Binlog Dump GTID') \
       AND USER NOT IN ('system user', 'event_scheduler') AND ID <> CONNECTION_ID() \
       AND DB = DATABASE()";

impl Dialect for MySql {
    /// The completion turns the claim's row `completed`.
    const COMPLETE: &'static str = concat!(
        update_by_key!(),
        " SET method = ?, path = ?, fingerprint = ?, \
           status = 'completed', response_status = ?, response_headers = ?, response_body = ?, \
           created_at = UTC_TIMESTAMP(6), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
           claim_token = NULL \
         WHERE scope = ? AND `key` = ? AND status = 'started' AND claim_token = ?"
    );

    const COMPLETE_STARTED: &'static str = concat!(
        update_by_key!(),
        " SET status = 'completed', response_status = ?, \
           response_headers = ?, response_body = ?, \
           expires_at = COALESCE(UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at), \
           locked_at = NULL, lease_until = NULL, claim_token = NULL, parked_at = NULL \
         WHERE scope = ? AND `key` = ? AND status = 'started' AND claim_token = ?"
    );

    /// A claim given up with its recorded steps kept: its lease ends now.
    const LAPSE: &'static str = concat!(
        update_by_key!(),
        " SET lease_until = UTC_TIMESTAMP(6) \
         WHERE scope = ? AND `key` = ? AND status = 'started' AND claim_token = ?"
    );

    const RELEASE: &'static str = concat!(
        delete_by_key!(),
        " WHERE scope = ? AND `key` = ? AND status = 'started' AND claim_token = ?"
    );

    const RELEASE_WITHOUT_STEPS: &'static str = concat!(
        delete_by_key!(),
        " WHERE scope = ? AND `key` = ? AND status = 'started' AND claim_token = ? \
           AND steps IS NULL"
    );

    const RECORD_STEPS: &'static str = concat!(
        update_by_key!(),
        " SET steps = ? \
         WHERE scope = ? AND `key` = ? AND status = 'started' AND claim_token = ?"
    );

    const RECORDED_STEPS: &'static str =
        "SELECT steps FROM idem_keys WHERE scope = ? AND `key` = ? AND claim_token = ?";

    const MIGRATOR: Migrator = sqlx::migrate!("migrations/mysql");
    const NOW: &'static str = "UTC_TIMESTAMP(6)";
    const IN_AN_HOUR: &'static str = "(UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)";
    const NOW_MS: &'static str =
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

    /// `DATETIME(6)` in UTC, counted from the epoch as a naive time: no session time zone is
    /// involved (`UNIX_TIMESTAMP` would read the column in the session's zone).
    fn ms(column: &str) -> String {
        format!("(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {column}) DIV 1000)")
    }

    const KEY_COLUMN: &'static str = "`key`";

    /// By the primary key only: see [`update_by_key`].
    const UPDATE_BY_KEY: &'static str = update_by_key!();

    /// By the primary key only: see [`update_by_key`].
    const DELETE_BY_KEY: &'static str = delete_by_key!();

    /// `scope` and `key` are `VARBINARY`, which sqlx decodes only as bytes.
    const SCOPE_AND_KEY: &'static str =
        "CONVERT(scope USING utf8mb4) AS scope, CONVERT(`key` USING utf8mb4) AS `key`";

    const BIGINT: &'static str = "SIGNED";

    const TEXT: &'static str = "CHAR";

    fn param(_: usize) -> String {
        "?".to_owned()
    }

    /// A key a transaction holds (a transactional claim's uncommitted row, or a row being
    /// completed or renewed) is skipped rather than waited for, so that a release neither
    /// blocks on it nor deletes what a handler is writing.
    const LOCK_UNHELD_ROW: Option<&'static str> = Some(
        "SELECT IF(status = 'started' AND lease_until IS NULL AND parked_at IS NOT NULL, \
           'parked', status) AS status \
         FROM idem_keys WHERE scope = ? AND `key` = ? FOR UPDATE SKIP LOCKED",
    );

    /// The range spelled out: MariaDB reads a row value's comparison by scanning the index
    /// from its start.
    const AFTER_KEY: &'static str = "(scope > ? OR (scope = ? AND `key` > ?))";

    const AFTER_KEY_BINDS: &'static [KeyPart] = &[KeyPart::Scope, KeyPart::Scope, KeyPart::Key];

    const BEGIN_OWN: &'static str = BEGIN;

    /// MySQL deletes with a `LIMIT` of its own, by the primary key's prefix `scope`.
    const FORGET_BATCH: &'static str =
        "DELETE FROM idem_keys WHERE scope = ? AND status = 'completed' LIMIT ?";

    /// HTTP statuses are held in a `SMALLINT`.
    type Status = i16;

    fn status(status: u16) -> Result<i16, crate::error::Error> {
        i16::try_from(status).map_err(|e| sqlx::Error::Encode(Box::new(e)).into())
    }

    /// A time to live in microseconds, added to the server's `UTC_TIMESTAMP(6)`.
    type Expiry = Option<i64>;

    fn expiry(retention: Option<Duration>) -> Option<i64> {
        retention.map(micros)
    }

    /// The claim's token, written on its row: the completion updates only that row.
    type Guard<'a> = i64;

    fn completion_guard(c: &Completion<'_>) -> i64 {
        c.mark
            .and_then(|mark| mark.parse().ok())
            .unwrap_or_default()
    }

    /// Releases the claim's savepoint first: when it is gone, so is the claim's transaction
    /// (MySQL's prepared statements are one statement each, so this takes its own round trip).
    async fn run_completion<'q>(
        conn: &'q mut MySqlConnection,
        completion: sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<bool, crate::error::Error> {
        match sqlx::raw_sql(RELEASE_CLAIM).execute(&mut *conn).await {
            Ok(_) => {}
            Err(error) if error_number(&error) == Some(ER_SP_DOES_NOT_EXIST) => return Ok(false),
            Err(error) => return Err(error.into()),
        }
        Ok(completion.execute(conn).await?.rows_affected() == 1)
    }

    fn rows_affected(done: &sqlx::mysql::MySqlQueryResult) -> u64 {
        done.rows_affected()
    }
}

/// What the claim's `INSERT` came to.
enum Claimed {
    /// The key has a live row.
    Live(KeyRecord),
    /// Another transaction holds the key.
    Busy,
    /// This transaction holds the key, under this token.
    Held(i64),
}

/// Claims `key` in the transaction open on `conn`: inserts its row, or answers from the live
/// row in the way, or deletes an expired one and tries again.
async fn claim(conn: &mut MySqlConnection, key: &KeyRef) -> Result<Claimed, crate::error::Error> {
    let token = fresh_token();
    // An expired row deleted, then the key claimed: two rounds at most, unless another
    // transaction keeps replacing the row meanwhile (then it holds the key: a 409).
    for _ in 0..3 {
        let inserted = sqlx::query(CLAIM)
            .bind(key.scope.as_bytes())
            .bind(key.key.as_bytes())
            .bind(token)
            .execute(&mut *conn)
            .await;
        match inserted {
            Ok(_) => return Ok(Claimed::Held(token)),
            Err(error) if is_locked(&error) => return Ok(Claimed::Busy),
            Err(error) if error_number(&error) == Some(ER_DUP_ENTRY) => {}
            Err(error) => return Err(error.into()),
        }
        let row = sqlx::query(EXISTING)
            .bind(key.scope.as_bytes())
            .bind(key.key.as_bytes())
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(row) = row {
            if row.try_get::<bool, _>("live")? {
                let record = MySql::decode_record(&row)?
                    .ok_or_else(|| crate::error::Error::corrupt("a key's row without a status"))?;
                return Ok(Claimed::Live(record));
            }
            let deleted = sqlx::query(DELETE_EXPIRED)
                .bind(key.scope.as_bytes())
                .bind(key.key.as_bytes())
                .execute(&mut *conn)
                .await;
            match deleted {
                Ok(_) => {}
                Err(error) if is_locked(&error) => return Ok(Claimed::Busy),
                Err(error) => return Err(error.into()),
            }
        }
    }
    Ok(Claimed::Busy)
}

/// A key as its row holds it: `scope` and `key`, as bytes.
type RowKey = (Vec<u8>, Vec<u8>);

/// Begins a transaction on `conn` (read committed) and reads, locking them, the rows that
/// `select` chooses (its parameters `first`, then `limit`): the transaction, the rows and their
/// keys. MySQL's `DELETE` and `UPDATE` cannot skip locked rows, so a batch is chosen first.
async fn choose<'c, T>(
    conn: &'c mut MySqlConnection,
    select: &'static str,
    first: T,
    limit: i64,
) -> Result<(Transaction<'c, MySql>, Vec<MySqlRow>, Vec<RowKey>), crate::error::Error>
where
    T: for<'q> sqlx::Encode<'q, MySql> + sqlx::Type<MySql> + Send + 'c,
{
    let mut tx = Transaction::<'_, MySql>::begin(conn, Some(BEGIN.into_sql_str())).await?;
    let rows = sqlx::query(select)
        .bind(first)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
    let keys = keys_of(&rows)?;
    Ok((tx, rows, keys))
}

/// The keys of `rows`.
fn keys_of(rows: &[sqlx::mysql::MySqlRow]) -> Result<Vec<RowKey>, crate::error::Error> {
    rows.iter()
        .map(|row| Ok((row.try_get("scope")?, row.try_get("key")?)))
        .collect()
}

/// A purge batch of `deleted` rows, from `rows` (in expiry order) with their `expiry`: the
/// next batch starts at the last one's.
fn purged(rows: &[MySqlRow], deleted: u64) -> Result<Purged, crate::error::Error> {
    let last = match rows.last() {
        Some(row) => Some(row.try_get("expiry")?),
        None => None,
    };
    Ok(Purged {
        rows: deleted,
        last,
    })
}

/// At most this many keys per statement of [`push_chosen`]: two placeholders each, well under
/// MySQL's 65,535 per statement whatever the purge's batch size.
const KEYS_PER_STATEMENT: usize = 1000;

/// Appends `(SELECT ? AS scope, ? AS `key` UNION ALL …) AS chosen STRAIGHT_JOIN idem_keys ON …`
/// for `keys` to `query`, a multi-table `DELETE` or `UPDATE` of `idem_keys`: the rows are then
/// reached by their primary key, one by one, the derived table read first. With `(scope, key)
/// IN (…)` instead, the optimizer scans the whole table when the keys are a large part of it,
/// and the scan waits for every row a live transaction holds (a claim's uncommitted row, for as
/// long as its handler runs).
fn push_chosen(query: &mut QueryBuilder<MySql>, keys: &[RowKey]) {
    debug_assert!(!keys.is_empty(), "a join with no keys");
    query.push("(");
    for (i, (scope, key)) in keys.iter().enumerate() {
        if i > 0 {
            query.push(" UNION ALL ");
        }
        query.push("SELECT ");
        query.push_bind(scope.as_slice());
        query.push(if i == 0 { " AS scope, " } else { ", " });
        query.push_bind(key.as_slice());
        if i == 0 {
            query.push(" AS `key`");
        }
    }
    query.push(
        ") AS chosen STRAIGHT_JOIN idem_keys \
         ON idem_keys.scope = chosen.scope AND idem_keys.`key` = chosen.`key`",
    );
}

/// Appends `(scope, key) IN ((?, ?), …)` for `keys` to `query`.
fn push_keys_in(query: &mut QueryBuilder<MySql>, keys: &[RowKey]) {
    query.push("(scope, `key`) IN (");
    let mut list = query.separated(", ");
    for (scope, key) in keys {
        list.push("(")
            .push_bind_unseparated(scope.as_slice())
            .push_unseparated(", ")
            .push_bind_unseparated(key.as_slice())
            .push_unseparated(")");
    }
    query.push(")");
}

/// `query` with the columns an external-mode start writes bound next, in the order both
/// [`START_INSERT`] (after the key) and [`START_TAKEOVER`] (before it) take them: method, path,
/// fingerprint, retention and lease (in microseconds), and the claim's token.
fn with_start_columns<'q>(
    query: sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    start: &Start<'q>,
) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
    query
        .bind(start.row.method)
        .bind(start.row.path)
        .bind(&start.row.fingerprint.as_bytes()[..])
        .bind(micros(start.retention))
        .bind(micros(start.lease))
        .bind(start.token)
}

/// An external-mode start, as [`Storage::start`] describes it: completed keys answered without
/// a lock, then the key's row read `FOR UPDATE NOWAIT` and inserted or taken over, committed.
async fn start_claim(
    conn: &mut MySqlConnection,
    start: &Start<'_>,
) -> Result<Started, crate::error::Error> {
    // Completed keys answer without a lock: concurrent replays do not refuse each other.
    if let Some(record) = MySql::lookup(&mut *conn, start.row.key).await?
        && record.status == KeyStatus::Completed
    {
        return Ok(Started::Found {
            record,
            lease_left: None,
        });
    }
    let mut tx = Transaction::<'_, MySql>::begin(conn, Some(BEGIN.into_sql_str())).await?;
    let scope = start.row.key.scope.as_bytes();
    let key = start.row.key.key.as_bytes();
    let row = match sqlx::query(START_ROW)
        .bind(scope)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await
    {
        Ok(row) => row,
        Err(error) if is_locked(&error) => {
            tx.rollback().await?;
            return Ok(Started::Busy);
        }
        Err(error) => return Err(error.into()),
    };
    // The takeover rule, as PostgreSQL's `idem_start` has it: a live row stays when it is
    // completed, leased, or another request's; an expired row or a lapsed claim of the
    // same request is replaced.
    let taken_over = match row {
        Some(row) => {
            let record = MySql::decode_record(&row)?
                .ok_or_else(|| crate::error::Error::corrupt("a key's row without a status"))?;
            let live: bool = row.try_get("live")?;
            let leased: bool = row.try_get("leased")?;
            // A parked claim stays an operator's, whatever its expiry.
            if record.status == KeyStatus::Parked
                || live
                    && (record.status == KeyStatus::Completed
                        || leased
                        || record.fingerprint != *start.row.fingerprint)
            {
                let lease_left = row
                    .try_get::<Option<i64>, _>("lease_left")?
                    .map(|us| Duration::from_micros(us.max(0) as u64));
                // Ended here, not when the connection is next used: until then the row stays
                // locked, and a retry's start would find it busy.
                tx.rollback().await?;
                return Ok(Started::Found { record, lease_left });
            }
            with_start_columns(sqlx::query(START_TAKEOVER), start)
                .bind(scope)
                .bind(key)
                .execute(&mut *tx)
                .await?;
            true
        }
        None => {
            let inserted =
                with_start_columns(sqlx::query(START_INSERT).bind(scope).bind(key), start)
                    .execute(&mut *tx)
                    .await;
            match inserted {
                Ok(_) => false,
                // Another start took the key since the read: it holds it.
                Err(error) if is_locked(&error) || error_number(&error) == Some(ER_DUP_ENTRY) => {
                    tx.rollback().await?;
                    return Ok(Started::Busy);
                }
                Err(error) => return Err(error.into()),
            }
        }
    };
    tx.commit().await?;
    Ok(Started::Acquired { taken_over })
}

impl Storage for MySql {
    async fn begin_handler(
        conn: &mut MySqlConnection,
        _statement_timeout: Option<Duration>,
        _idle_timeout: Duration,
    ) -> Result<Transaction<'_, MySql>, crate::error::Error> {
        // At the claim's isolation level, READ COMMITTED, not the server's default.
        Ok(Transaction::begin(conn, Some(BEGIN.into_sql_str())).await?)
    }

    /// Only the request's key counts. MySQL has no timeout that ends with a transaction: a
    /// session setting would outlive it on the pooled connection; the store's deadline closes
    /// the connection instead. The point a 5xx's writes are undone to comes after the claim's
    /// row (`before_handler`), and MySQL's prepared claim is one statement.
    async fn begin_claim<'c>(
        conn: &'c mut MySqlConnection,
        request: ClaimRequest<'_>,
    ) -> Result<Begun<'c, MySql>, crate::error::Error> {
        let mut tx =
            Transaction::<'c, MySql>::begin(conn, Some(BEGIN_CLAIM.into_sql_str())).await?;
        Ok(match claim(&mut tx, request.key).await? {
            Claimed::Live(record) => Begun::Live(record),
            Claimed::Busy => Begun::Busy,
            Claimed::Held(token) => Begun::Acquired(tx, Some(token.to_string())),
        })
    }

    async fn before_handler(conn: &mut MySqlConnection) -> Result<(), crate::error::Error> {
        sqlx::raw_sql(BEFORE_HANDLER).execute(conn).await?;
        Ok(())
    }

    async fn undo_handler<'c>(
        conn: &'c mut MySqlConnection,
        _request: ClaimRequest<'c>,
        mark: Option<&'c str>,
    ) -> Result<Undone, crate::error::Error> {
        match sqlx::raw_sql(UNDO_HANDLER).execute(&mut *conn).await {
            Ok(_) => Ok(Undone::Kept(mark.map(str::to_owned))),
            // The handler ended the transaction, and the savepoint with it (or a deadlock
            // rolled it back).
            Err(error) if error_number(&error) == Some(ER_SP_DOES_NOT_EXIST) => Ok(Undone::Ended),
            Err(error) => Err(error.into()),
        }
    }

    async fn lookup(
        conn: &mut MySqlConnection,
        key: &KeyRef,
    ) -> Result<Option<KeyRecord>, crate::error::Error> {
        let row = sqlx::query(LOOKUP)
            .bind(key.scope.as_bytes())
            .bind(key.key.as_bytes())
            .fetch_optional(conn)
            .await?;
        match row {
            Some(row) => Self::decode_record(&row),
            None => Ok(None),
        }
    }

    async fn ensure_open(_: &mut MySqlConnection) -> Result<(), crate::error::Error> {
        // A ROLLBACK outside a transaction does nothing there, and sqlx counts it done.
        Ok(())
    }

    async fn start(
        conn: &mut MySqlConnection,
        start: &Start<'_>,
    ) -> Result<Started, crate::error::Error> {
        match start_claim(conn, start).await {
            // On a Galera cluster, a start of the key at another node committed first: at this
            // start's COMMIT (certification), or at one of its statements (the node applied the
            // other and aborted this one). Nothing of it was committed.
            Err(error) if error.is_conflict() => Ok(Started::Busy),
            started => started,
        }
    }

    async fn purge_batch(
        conn: &mut MySqlConnection,
        limit: i64,
        from: Option<i64>,
    ) -> Result<Purged, crate::error::Error> {
        let from = from.unwrap_or(0);
        // Read committed: the delete locks the rows it deletes and no gap, so a claim's insert
        // beside it is never refused for a lock of the purge's.
        let mut tx =
            Transaction::<'_, MySql>::begin(&mut *conn, Some(BEGIN.into_sql_str())).await?;
        match sqlx::query(PURGE)
            .bind(from)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await
        {
            Ok(rows) => {
                tx.commit().await?;
                return purged(&rows, rows.len() as u64);
            }
            // A live request holds a row in the way. The statement was undone; the locks it had
            // taken are let go with the transaction.
            Err(error) if is_locked(&error) => tx.rollback().await?,
            Err(error) => return Err(error.into()),
        }
        // MySQL's DELETE cannot skip locked rows: the rows are chosen and locked first, then
        // deleted by key, in one short transaction.
        let (mut tx, rows, keys) = choose(conn, PURGE_SELECT, from, limit).await?;
        let mut deleted = 0;
        for chunk in keys.chunks(KEYS_PER_STATEMENT) {
            let mut delete = QueryBuilder::<MySql>::new("DELETE idem_keys FROM ");
            push_chosen(&mut delete, chunk);
            deleted += delete.build().execute(&mut *tx).await?.rows_affected();
        }
        tx.commit().await?;
        purged(&rows, deleted)
    }

    async fn reclaim_abandoned(
        conn: &mut MySqlConnection,
        limit: i64,
        lease: Duration,
        token: i64,
        with_steps: bool,
    ) -> Result<Vec<Abandoned>, crate::error::Error> {
        let (mut tx, _, keys) = choose(conn, RECLAIM_SELECT, with_steps, limit).await?;
        if keys.is_empty() {
            // Ended now rather than when the connection is next used (sqlx's rollback of a
            // dropped transaction), so that it holds nothing past the pass.
            tx.commit().await?;
            return Ok(Vec::new());
        }
        for chunk in keys.chunks(KEYS_PER_STATEMENT) {
            let mut renew = QueryBuilder::<MySql>::new("UPDATE ");
            push_chosen(&mut renew, chunk);
            renew
                .push(" SET idem_keys.lease_until = LEAST(UTC_TIMESTAMP(6) + INTERVAL ")
                .push_bind(micros(lease))
                .push(" MICROSECOND, idem_keys.expires_at), idem_keys.claim_token = ")
                .push_bind(token)
                .push(", idem_keys.recovery_attempts = idem_keys.recovery_attempts + 1");
            renew.build().execute(&mut *tx).await?;
        }
        let mut read = QueryBuilder::<MySql>::new(
            "SELECT CONVERT(scope USING utf8mb4) AS scope, CONVERT(`key` USING utf8mb4) AS `key`, \
             method, path, fingerprint, steps, recovery_attempts, \
             TIMESTAMPDIFF(MICROSECOND, locked_at, UTC_TIMESTAMP(6)) AS age \
             FROM idem_keys WHERE ",
        );
        push_keys_in(&mut read, &keys);
        let rows = read.build().fetch_all(&mut *tx).await?;
        tx.commit().await?;
        rows.iter()
            .map(|row| {
                let age: Option<i64> = row.try_get("age")?;
                Self::abandoned(row, Duration::from_micros(age.unwrap_or(0).max(0) as u64))
            })
            .collect()
    }

    async fn others_active(conn: &mut MySqlConnection) -> Result<Option<u64>, crate::error::Error> {
        let active: i64 = sqlx::query_scalar(OTHERS_ACTIVE).fetch_one(conn).await?;
        Ok(Some(active.max(0) as u64))
    }

    async fn lost_a_conflict(conn: &mut MySqlConnection) -> Result<bool, crate::error::Error> {
        // The diagnostics of the handler's last statement: nothing has run since.
        let errors = sqlx::raw_sql(SHOW_ERRORS).fetch_all(conn).await?;
        for row in &errors {
            let code: u32 = row.try_get("Code")?;
            if code == u32::from(ER_LOCK_DEADLOCK) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn is_transaction_aborted(_error: &crate::error::Error) -> bool {
        // MySQL does not abort a transaction when one of its statements fails; a deadlock rolls
        // it back whole, which the completion finds (the claim's savepoint is gone).
        false
    }
}
