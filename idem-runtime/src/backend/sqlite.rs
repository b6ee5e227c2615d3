//! SQLite: one writer at a time. The handler's transaction begins `IMMEDIATE` (it takes the
//! write lock at once, so it can never fail to upgrade later); within a process a duplicate is
//! refused before it waits for that lock; completed keys are read without it (WAL readers do
//! not wait for the writer). Times are Unix milliseconds, from the system clock (read by this
//! process, or by SQLite's `unixepoch('subsec')`, which needs SQLite 3.42; the bundled one is
//! newer).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{Connection, Row, SqlSafeStr, Sqlite, SqliteConnection, Transaction, migrate::Migrator};

use super::{Begun, ClaimRequest, Purged, SharedStorage, Storage, Undone, dialect::Dialect};
use crate::record::{Abandoned, Completion, KeyRecord, KeyRef, KeyStatus, Start, Started};

// A parked claim is live whatever its expiry: an operator's until resumed or abandoned.
const LIVE: &str = "SELECT \
       CASE WHEN status = 'started' AND parked_at IS NOT NULL THEN 'parked' ELSE status END \
       AS status, method, path, fingerprint, response_status, response_headers, \
     response_body, lease_until FROM idem_keys WHERE scope = $1 AND key = $2 \
       AND (expires_at > $3 OR (status = 'started' AND parked_at IS NOT NULL))";

const START: &str = "INSERT INTO idem_keys \
     (scope, key, method, path, fingerprint, status, created_at, expires_at, locked_at, \
      lease_until, claim_token) \
     VALUES ($1, $2, $3, $4, $5, 'started', $6, $7, $6, $8, $9) \
     ON CONFLICT (scope, key) DO UPDATE SET \
       method = excluded.method, path = excluded.path, fingerprint = excluded.fingerprint, \
       status = 'started', created_at = excluded.created_at, expires_at = excluded.expires_at, \
       locked_at = excluded.locked_at, lease_until = excluded.lease_until, \
       claim_token = excluded.claim_token, response_status = NULL, response_headers = NULL, \
       response_body = NULL, \
       steps = CASE WHEN idem_keys.expires_at <= $6 THEN NULL ELSE idem_keys.steps END, \
       recovery_attempts = CASE WHEN idem_keys.expires_at <= $6 THEN 0 \
         ELSE idem_keys.recovery_attempts END, \
       recovery_error = CASE WHEN idem_keys.expires_at <= $6 THEN NULL \
         ELSE idem_keys.recovery_error END";

const PURGE: &str = "DELETE FROM idem_keys WHERE rowid IN ( \
     SELECT rowid FROM idem_keys WHERE expires_at <= $1 AND parked_at IS NULL \
     ORDER BY expires_at LIMIT $2)";

const RECLAIM: &str = "UPDATE idem_keys SET lease_until = min($2, expires_at), claim_token = $3, \
       recovery_attempts = recovery_attempts + 1 \
     WHERE rowid IN (SELECT rowid FROM idem_keys \
       WHERE status = 'started' AND lease_until <= $1 AND expires_at > $1 \
         AND ($5 OR steps IS NULL) \
       ORDER BY lease_until LIMIT $4) \
     RETURNING scope, key, method, path, fingerprint, locked_at, steps, recovery_attempts";

const BEGIN_IMMEDIATE: &str = "BEGIN IMMEDIATE";

// The handler's transaction, with a savepoint that only this transaction has: a handler that
// ends the transaction itself (COMMIT, ROLLBACK) takes the savepoint with it, and the
// completion, which releases it first, then knows.
const BEGIN_CLAIM: &str = "BEGIN IMMEDIATE; SAVEPOINT idem_claim";

// Around the handler of a route whose 5xx outcomes are stored: undoing its writes keeps the
// transaction, its write lock and so the key. Taken with the claim, in the same call: the claim
// writes nothing, so the point is the same one taken before the handler would be.
const BEGIN_CLAIM_WITH_UNDO: &str = "BEGIN IMMEDIATE; SAVEPOINT idem_claim; SAVEPOINT idem_handler";
const UNDO_HANDLER: &str = "ROLLBACK TO SAVEPOINT idem_handler";

/// A duration in whole milliseconds, as statements bind it (saturating).
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Now, in milliseconds since the Unix epoch: the unit of SQLite's time columns.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

async fn live_row(
    conn: &mut SqliteConnection,
    key: &KeyRef,
    now: i64,
) -> Result<Option<(KeyRecord, Option<i64>)>, crate::error::Error> {
    let row = sqlx::query(LIVE)
        .bind(&key.scope)
        .bind(&key.key)
        .bind(now)
        .fetch_optional(conn)
        .await?;
    row.map(|row| {
        let record = Sqlite::decode_record(&row)?
            .ok_or_else(|| crate::error::Error::corrupt("a key's row without a status"))?;
        Ok((record, row.try_get("lease_until")?))
    })
    .transpose()
}

impl Dialect for Sqlite {
    /// `BEGIN IMMEDIATE` excludes every other writer: a row read in it stays as read.
    const LOCK_SKIPPING: &'static str = "";

    const BEGIN_OWN: &'static str = BEGIN_IMMEDIATE;

    /// The claim's savepoint released (it fails when the handler ended the claim's transaction),
    /// then a fresh row, or every column written over an expired row of the key (and only such a
    /// row); one row back when it was written. One statement list, so one call to the connection's
    /// thread while the write lock is held.
    const COMPLETE: &'static str = "RELEASE SAVEPOINT idem_claim; INSERT INTO idem_keys \
         (scope, key, method, path, fingerprint, status, response_status, response_headers, \
          response_body, created_at, expires_at) \
         VALUES ($8, $9, $1, $2, $3, 'completed', $4, $5, $6, $10, $10 + $7) \
         ON CONFLICT (scope, key) DO UPDATE SET \
           method = excluded.method, path = excluded.path, fingerprint = excluded.fingerprint, \
           status = 'completed', response_status = excluded.response_status, \
           response_headers = excluded.response_headers, response_body = excluded.response_body, \
           created_at = excluded.created_at, expires_at = excluded.expires_at, locked_at = NULL, \
           lease_until = NULL, claim_token = NULL \
         WHERE idem_keys.expires_at <= $10 \
         RETURNING 1";

    const COMPLETE_STARTED: &'static str = "UPDATE idem_keys SET status = 'completed', response_status = $1, \
         response_headers = $2, response_body = $3, locked_at = NULL, lease_until = NULL, \
         claim_token = NULL, parked_at = NULL, \
         expires_at = COALESCE(CAST(unixepoch('subsec') * 1000 AS INTEGER) + $4, expires_at) \
         WHERE scope = $5 AND key = $6 AND status = 'started' AND claim_token = $7";

    /// A claim given up with its recorded steps kept: its lease ends now.
    const LAPSE: &'static str = "UPDATE idem_keys SET lease_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) \
         WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3";

    const MIGRATOR: Migrator = sqlx::migrate!("migrations/sqlite");
    const NOW: &'static str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";
    const IN_AN_HOUR: &'static str = "(CAST(unixepoch('subsec') * 1000 AS INTEGER) + 3600000)";
    const NOW_MS: &'static str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

    /// SQLite stores Unix milliseconds already.
    fn ms(column: &str) -> String {
        column.to_owned()
    }

    /// HTTP statuses are held in an `INTEGER`.
    type Status = i64;

    fn status(status: u16) -> Result<i64, crate::error::Error> {
        Ok(i64::from(status))
    }

    /// A time to live in milliseconds, added to the process's clock.
    type Expiry = Option<i64>;

    fn expiry(retention: Option<Duration>) -> Option<i64> {
        retention.map(millis)
    }

    /// The time of the completion: its `created_at`, and what an expired row is measured
    /// against.
    type Guard<'a> = i64;

    fn completion_guard(_: &Completion<'_>) -> i64 {
        now_ms()
    }

    /// The completion releases the claim's savepoint first, in the same call: when the
    /// savepoint is gone, so is the claim's transaction, and the `INSERT` does not run.
    ///
    /// A transaction is then opened again (unless the handler opened one), so that the
    /// `ROLLBACK` that sqlx sends when the claim is dropped has one to end: sqlx counts
    /// transactions on its side, and a failed `ROLLBACK` would leave the pooled connection
    /// counted as inside one, refusing every later `BEGIN` on it.
    async fn run_completion<'q>(
        conn: &'q mut SqliteConnection,
        completion: sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> Result<bool, crate::error::Error> {
        match completion.fetch_optional(&mut *conn).await {
            Ok(written) => Ok(written.is_some()),
            Err(sqlx::Error::Database(e)) if e.message().contains("no such savepoint") => {
                open_unless_open(conn).await?;
                Ok(false)
            }
            Err(error) => Err(error.into()),
        }
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }
}

impl Storage for Sqlite {
    const SINGLE_WRITER: bool = true;

    async fn begin_write(
        conn: &mut SqliteConnection,
    ) -> Result<Transaction<'_, Sqlite>, crate::error::Error> {
        Ok(Transaction::begin(conn, Some(BEGIN_IMMEDIATE.into_sql_str())).await?)
    }

    async fn ensure_open(conn: &mut SqliteConnection) -> Result<(), crate::error::Error> {
        open_unless_open(conn).await
    }

    /// The request's timeouts ask nothing here. SQLite has no statement timeout; its
    /// statements are short (no lock waits beyond the busy timeout, no network). Nor a server
    /// to end an abandoned transaction: the process ends it by closing the connection.
    async fn begin_claim<'c>(
        conn: &'c mut SqliteConnection,
        request: ClaimRequest<'_>,
    ) -> Result<Begun<'c, Sqlite>, crate::error::Error> {
        // IMMEDIATE takes the write lock now: a deferred transaction that read first could fail
        // with "database is locked" when it later writes. Holding it, nobody else can complete
        // the key: the transaction holds the key unless it has a live row.
        let begin = if request.undo_point {
            BEGIN_CLAIM_WITH_UNDO
        } else {
            BEGIN_CLAIM
        };
        let mut tx = Transaction::<'c, Sqlite>::begin(conn, Some(begin.into_sql_str())).await?;
        Ok(match live_row(&mut tx, request.key, now_ms()).await? {
            // Ended here: `BEGIN IMMEDIATE` took the database's write lock, which a dropped
            // transaction keeps until its connection is next used.
            Some((record, _)) => {
                tx.rollback().await?;
                Begun::Live(record)
            }
            None => Begun::Acquired(tx, None),
        })
    }

    /// The point the writes are undone to was taken with the claim (`begin_claim`'s
    /// `undo_point`; `before_handler` does nothing).
    async fn undo_handler<'c>(
        conn: &'c mut SqliteConnection,
        _request: ClaimRequest<'c>,
        _mark: Option<&'c str>,
    ) -> Result<Undone, crate::error::Error> {
        match sqlx::raw_sql(UNDO_HANDLER).execute(&mut *conn).await {
            Ok(_) => Ok(Undone::Kept(None)),
            // The handler ended the transaction, and the savepoint with it.
            Err(sqlx::Error::Database(e)) if e.message().contains("no such savepoint") => {
                open_unless_open(conn).await?;
                Ok(Undone::Ended)
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn lookup(
        conn: &mut SqliteConnection,
        key: &KeyRef,
    ) -> Result<Option<KeyRecord>, crate::error::Error> {
        Ok(live_row(conn, key, now_ms())
            .await?
            .map(|(record, _)| record))
    }

    async fn start(
        conn: &mut SqliteConnection,
        start: &Start<'_>,
    ) -> Result<Started, crate::error::Error> {
        // The takeover rule, as PostgreSQL's `idem_start` has it (there it must run inside the
        // function that holds the advisory lock, with a fresh snapshot, in one round trip): a
        // live row stays when it is completed, leased, or another request's; an expired row or
        // a lapsed claim of the same request is replaced. `tests/external.rs` pins each case on
        // both databases.
        let mut tx = conn.begin_with(BEGIN_IMMEDIATE).await?;
        let now = now_ms();
        let existing = live_row(&mut tx, start.row.key, now).await?;
        let taken_over = match existing {
            Some((record, lease_until)) => {
                let leased = lease_until.is_some_and(|until| until > now);
                if record.status != KeyStatus::Started
                    || leased
                    || record.fingerprint != *start.row.fingerprint
                {
                    let lease_left = lease_until.map(|until| {
                        Duration::from_millis(until.saturating_sub(now).max(0) as u64)
                    });
                    // Ended now: `BEGIN IMMEDIATE` holds the database's write lock.
                    tx.rollback().await?;
                    return Ok(Started::Found { record, lease_left });
                }
                true
            }
            None => {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM idem_keys WHERE scope = $1 AND key = $2",
                )
                .bind(&start.row.key.scope)
                .bind(&start.row.key.key)
                .fetch_one(&mut *tx)
                .await?
                    > 0
            }
        };
        sqlx::query(START)
            .bind(&start.row.key.scope)
            .bind(&start.row.key.key)
            .bind(start.row.method)
            .bind(start.row.path)
            .bind(&start.row.fingerprint.as_bytes()[..])
            .bind(now)
            .bind(now.saturating_add(millis(start.retention)))
            .bind(now.saturating_add(millis(start.lease)))
            .bind(start.token)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Started::Acquired { taken_over })
    }

    async fn purge_batch(
        conn: &mut SqliteConnection,
        limit: i64,
        _from: Option<i64>,
    ) -> Result<Purged, crate::error::Error> {
        // SQLite removes a deleted row's index entries with it: each batch's scan starts at the
        // oldest row left, with nothing to walk past.
        let rows = sqlx::query(PURGE)
            .bind(now_ms())
            .bind(limit)
            .execute(conn)
            .await?
            .rows_affected();
        Ok(Purged { rows, last: None })
    }

    async fn reclaim_abandoned(
        conn: &mut SqliteConnection,
        limit: i64,
        lease: Duration,
        token: i64,
        with_steps: bool,
    ) -> Result<Vec<Abandoned>, crate::error::Error> {
        let now = now_ms();
        let rows = sqlx::query(RECLAIM)
            .bind(now)
            .bind(now.saturating_add(millis(lease)))
            .bind(token)
            .bind(limit)
            .bind(with_steps)
            .fetch_all(conn)
            .await?;
        rows.iter()
            .map(|row| {
                let locked_at: Option<i64> = row.try_get("locked_at")?;
                let age = now.saturating_sub(locked_at.unwrap_or(now)).max(0);
                Self::abandoned(row, Duration::from_millis(age as u64))
            })
            .collect()
    }

    fn is_transaction_aborted(_error: &crate::error::Error) -> bool {
        // SQLite does not abort a transaction when one of its statements fails.
        false
    }
}

/// Opens a transaction on `conn` unless one is open (SQLite refuses a `BEGIN` inside one, and
/// the refusal changes nothing).
async fn open_unless_open(conn: &mut SqliteConnection) -> Result<(), crate::error::Error> {
    match sqlx::raw_sql("BEGIN").execute(conn).await {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) if e.message().contains("within a transaction") => Ok(()),
        Err(error) => Err(error.into()),
    }
}
