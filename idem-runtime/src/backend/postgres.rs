//! PostgreSQL: the key is held by a transaction-scoped advisory lock while the handler runs, and
//! written once, completed, in the handler's commit.
//!
//! The claim costs one statement beyond `BEGIN` (two when an expired row of the key is in the
//! way, and is deleted). The lock is tried in the same round trip as `BEGIN` (its id is a number,
//! formatted into the simple query), and taking it marks the transaction: the setting
//! `idem.claim`, set `LOCAL` to the lock's id, which ends with the transaction. The claim
//! statement then reads the key's row in a snapshot taken after the lock was tried, so that a
//! completion committed by the lock's previous holder is seen, and reads the mark to know
//! whether the lock was taken. The completion writes only while the mark is there: a handler
//! that ended the transaction itself (`COMMIT`, `ROLLBACK`) ended the mark with it and cannot
//! have its outcome stored. Nothing of the claim assigns the transaction an id, so a replay or a
//! 409 writes nothing, not even an abort record.

use sqlx::{PgConnection, Postgres, Row, SqlSafeStr, Transaction, migrate::Migrator};

use std::time::Duration;

use super::{Begun, ClaimRequest, Purged, SharedStorage, Storage, Undone, dialect::Dialect};
use crate::record::{Abandoned, Completion, KeyRecord, KeyRef, Start, Started};

const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

// The key's row, live or expired, read after `begin_claim`'s lock attempt; `held` whether that
// attempt took the lock (the transaction's mark is the lock's id, `$3`).
// `read_only`: a standby, or a primary a failover demoted, runs the lock and this read but
// would refuse the handler's first write; the claim refuses first.
const CLAIM: &str = "SELECT current_setting('idem.claim', true) = $3 AS held, \
     current_setting('transaction_read_only') = 'on' AS read_only, \
     CASE WHEN k.status = 'started' AND k.parked_at IS NOT NULL THEN 'parked' ELSE k.status END \
       AS status, k.method, k.path, k.fingerprint, k.response_status, k.response_headers, \
     k.response_body, \
     (k.expires_at > now() OR (k.status = 'started' AND k.parked_at IS NOT NULL)) AS live \
     FROM (SELECT 1) AS claim LEFT JOIN idem_keys k ON k.scope = $1 AND k.key = $2";

// An expired row of a key this transaction holds, out of the completion's way (never a parked
// claim: an operator's, whatever its expiry).
const DELETE_EXPIRED: &str = "DELETE FROM idem_keys \
     WHERE scope = $1 AND key = $2 AND expires_at <= now() AND parked_at IS NULL";

// The transaction's mark before a rollback (see `undo_handler`).
const MARK: &str = "SELECT current_setting('idem.claim', true) AS mark";

const LOOKUP: &str = "SELECT status, method, path, fingerprint, response_status, \
     response_headers, response_body FROM idem_keys \
     WHERE scope = $1 AND key = $2 AND expires_at > now()";

const START: &str = "SELECT outcome, taken_over, status, method, path, fingerprint, \
     response_status, response_headers, response_body, lease_left \
     FROM idem_start($1, $2, $3, $4, $5, $6, $7, $8, $9)";

// ctid batches: the inner SELECT finds the oldest expired rows through the expires_at index and
// locks them, skipping any row a live request holds; the DELETE removes exactly those. Each
// batch starts at the expiry where the previous one ended ($2, microseconds since the epoch):
// the index keeps a deleted row's entry until a vacuum, and a scan from the oldest expiry would
// walk past every row the pass had already deleted. `>=`: rows of the same expiry as the last
// one deleted may be left.
const PURGE: &str = "WITH purged AS ( \
       DELETE FROM idem_keys WHERE ctid = ANY(ARRAY( \
         SELECT ctid FROM idem_keys \
         WHERE expires_at <= now() AND parked_at IS NULL \
           AND expires_at >= COALESCE('epoch'::timestamptz + $2::int8 * interval '1 microsecond', \
                                      '-infinity') \
         ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)) \
       RETURNING expires_at) \
     SELECT count(*) AS purged, \
       (extract(epoch FROM max(expires_at)) * 1000000)::int8 AS last \
     FROM purged";

const RECLAIM: &str = "WITH lapsed AS ( \
       SELECT scope, key FROM idem_keys \
       WHERE status = 'started' AND lease_until <= now() AND expires_at > now() \
         AND ($4 OR steps IS NULL) \
       ORDER BY lease_until LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE idem_keys k \
       SET lease_until = LEAST(now() + make_interval(secs => $2), k.expires_at), claim_token = $3, \
         recovery_attempts = k.recovery_attempts + 1 \
     FROM lapsed WHERE k.scope = lapsed.scope AND k.key = lapsed.key \
     RETURNING k.scope, k.key, k.method, k.path, k.fingerprint, k.steps, k.recovery_attempts, \
       extract(epoch FROM now() - k.locked_at)::float8 AS age";

// Client sessions on this database running a statement, but this one: autovacuum and the
// server's other workers are not counted (their backend_type differs), nor idle sessions in or
// out of a transaction.
const OTHERS_ACTIVE: &str = "SELECT count(*) FROM pg_stat_activity \
     WHERE state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid() \
       AND datname = current_database()";

// The session's `client_min_messages`, returned, and set to `warning` where it lets notices
// through (for the migrations' run: `relation "_idem_migrations" already exists, skipping`).
// `OFFSET 0` keeps the subquery from being merged into the outer one, where it would read the
// setting after `set_config` changed it.
const QUIET_NOTICES: &str = "SELECT previous FROM ( \
       SELECT CASE WHEN source = 'session' THEN setting ELSE '' END AS previous, \
         setting AS level \
       FROM pg_settings WHERE name = 'client_min_messages' OFFSET 0) AS session, \
     LATERAL set_config('client_min_messages', \
       CASE WHEN level IN ('debug5', 'debug4', 'debug3', 'debug2', 'debug1', 'log', 'notice') \
         THEN 'warning' ELSE level END, false) AS quieted";

impl Dialect for Postgres {
    /// A plain INSERT (the claim removed any expired row), written only in the claiming transaction.
    const COMPLETE: &'static str = "INSERT INTO idem_keys \
         (scope, key, method, path, fingerprint, status, response_status, response_headers, \
          response_body, created_at, expires_at) \
         SELECT $8, $9, $1, $2, $3, 'completed', $4, $5, $6, now(), \
                now() + make_interval(secs => $7) \
         WHERE current_setting('idem.claim', true) = $10";

    const COMPLETE_STARTED: &'static str = "UPDATE idem_keys SET status = 'completed', response_status = $1, \
         response_headers = $2, response_body = $3, locked_at = NULL, lease_until = NULL, \
         claim_token = NULL, parked_at = NULL, \
         expires_at = COALESCE(now() + make_interval(secs => $4::float8), expires_at) \
         WHERE scope = $5 AND key = $6 AND status = 'started' AND claim_token = $7";

    /// A claim given up with its recorded steps kept: its lease ends now.
    const LAPSE: &'static str = "UPDATE idem_keys SET lease_until = now() \
         WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3";

    const MIGRATOR: Migrator = sqlx::migrate!("migrations/postgres");
    const BEGIN_OWN: &'static str = BEGIN;
    const NOW: &'static str = "now()";
    const IN_AN_HOUR: &'static str = "(now() + interval '1 hour')";
    const NOW_MS: &'static str = "(EXTRACT(EPOCH FROM now()) * 1000)::bigint";

    fn ms(column: &str) -> String {
        format!("(EXTRACT(EPOCH FROM {column}) * 1000)::bigint")
    }

    /// HTTP statuses are held in a `smallint`.
    type Status = i16;

    fn status(status: u16) -> Result<i16, crate::error::Error> {
        i16::try_from(status).map_err(|e| sqlx::Error::Encode(Box::new(e)).into())
    }

    /// A time to live in seconds, added to the server's `now()`.
    type Expiry = Option<f64>;

    fn expiry(retention: Option<Duration>) -> Option<f64> {
        retention.map(|r| r.as_secs_f64())
    }

    /// The claiming transaction's mark (the lock's id), which the completion checks.
    type Guard<'a> = &'a str;

    fn completion_guard<'a>(c: &Completion<'a>) -> &'a str {
        c.mark.unwrap_or_default()
    }

    /// PostgreSQL's completion checks its transaction in its own `WHERE` (its
    /// [`Guard`](Dialect::Guard)).
    async fn run_completion<'q>(
        conn: &'q mut PgConnection,
        completion: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<bool, crate::error::Error> {
        Ok(completion.execute(conn).await?.rows_affected() == 1)
    }

    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }

    /// `client_min_messages` at `warning` (where it was more talkative); returned, the
    /// session's own setting before, or `""` where the session had not set it (then it is
    /// reset after, not set: setting it back to the same level would leave it set in the
    /// session, which a pooled connection must not carry).
    async fn quiet_notices(conn: &mut PgConnection) -> Result<Option<String>, crate::error::Error> {
        Ok(Some(
            sqlx::query_scalar(QUIET_NOTICES).fetch_one(conn).await?,
        ))
    }

    async fn restore_notices(
        conn: &mut PgConnection,
        previous: Option<String>,
    ) -> Result<(), crate::error::Error> {
        match previous.as_deref() {
            None => {}
            Some("") => {
                sqlx::raw_sql("RESET client_min_messages")
                    .execute(conn)
                    .await?;
            }
            Some(previous) => {
                sqlx::query("SELECT set_config('client_min_messages', $1, false)")
                    .bind(previous)
                    .execute(conn)
                    .await?;
            }
        }
        Ok(())
    }

    async fn before_migrate(pool: &sqlx::PgPool) -> Result<(), crate::error::Error> {
        match crate::pooler::check_pooler(pool).await? {
            crate::pooler::Pooling::Own => Ok(()),
            crate::pooler::Pooling::Shared => Err(crate::error::Error::Pooler {
                reason: crate::pooler::migrations_need_a_session(),
            }),
        }
    }
}

/// A timeout as PostgreSQL's settings take it: whole milliseconds, from 1 to `i32::MAX`.
fn millis(limit: Duration) -> u128 {
    limit.as_millis().clamp(1, i32::MAX as u128)
}

/// Whether `error` is SQLSTATE 25P02 (in_failed_sql_transaction): an earlier statement failed.
fn in_failed_transaction(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("25P02"))
}

/// The simple query that begins a claim's transaction (`begin`: the `BEGIN`, or what rolls back
/// and begins again), sets its timeouts, and tries the key's lock, marking the transaction when
/// the lock is taken.
fn begin_claim_sql(begin: &str, request: &ClaimRequest<'_>) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!(
        "{}; SELECT CASE WHEN pg_try_advisory_xact_lock({lock}) \
         THEN set_config('idem.claim', '{lock}', true) END",
        begin_handler_sql(begin, request.statement_timeout, request.idle_timeout),
        lock = request.key.lock_id
    ))
}

/// `begin`, and the handler transaction's timeouts, in the same round trip: they end with the
/// transaction.
fn begin_handler_sql(
    begin: &str,
    statement_timeout: Option<Duration>,
    idle_timeout: Duration,
) -> String {
    let timeout = statement_timeout.map_or(String::new(), |limit| {
        format!("SET LOCAL statement_timeout = {};", millis(limit))
    });
    format!(
        "{begin}; {timeout} SET LOCAL idle_in_transaction_session_timeout = {}",
        millis(idle_timeout)
    )
}

/// What the claim statement found.
enum Claimed {
    /// The key has a live row.
    Live(KeyRecord),
    /// Another transaction holds the key.
    Busy,
    /// This transaction holds the key, under this mark.
    Held(String),
}

/// Reads the key's row after the lock attempt of [`begin_claim_sql`], in the transaction open
/// on `conn`; deletes an expired row of a key the transaction holds.
async fn claim(conn: &mut PgConnection, key: &KeyRef) -> Result<Claimed, crate::error::Error> {
    let mark = key.lock_id.to_string();
    let row = sqlx::query(CLAIM)
        .bind(&key.scope)
        .bind(&key.key)
        .bind(&mark)
        .fetch_one(&mut *conn)
        .await?;
    if row.try_get::<bool, _>("read_only")? {
        return Err(crate::error::Error::ReadOnly);
    }
    let held: Option<bool> = row.try_get("held")?;
    let live: Option<bool> = row.try_get("live")?;
    let record = Postgres::decode_record(&row)?;
    Ok(match (record, live, held == Some(true)) {
        (Some(record), Some(true), _) => Claimed::Live(record),
        (_, _, false) => Claimed::Busy,
        (Some(_), _, true) => {
            sqlx::query(DELETE_EXPIRED)
                .bind(&key.scope)
                .bind(&key.key)
                .execute(&mut *conn)
                .await?;
            Claimed::Held(mark)
        }
        (None, _, true) => Claimed::Held(mark),
    })
}

impl Storage for Postgres {
    async fn begin_handler(
        conn: &mut PgConnection,
        statement_timeout: Option<Duration>,
        idle_timeout: Duration,
    ) -> Result<Transaction<'_, Postgres>, crate::error::Error> {
        let begin = sqlx::AssertSqlSafe(begin_handler_sql(BEGIN, statement_timeout, idle_timeout));
        Ok(Transaction::begin(conn, Some(begin.into_sql_str())).await?)
    }

    /// The request's `undo_point` asks nothing here: a 5xx's writes are undone by rolling back
    /// and claiming again (`undo_handler`).
    async fn begin_claim<'c>(
        conn: &'c mut PgConnection,
        request: ClaimRequest<'_>,
    ) -> Result<Begun<'c, Postgres>, crate::error::Error> {
        // The claim's correctness rests on READ COMMITTED snapshots: the claim statement sees
        // what committed before it began.
        let begin = begin_claim_sql(BEGIN, &request);
        let mut tx = Transaction::<'c, Postgres>::begin(conn, Some(begin.into_sql_str())).await?;
        Ok(match claim(&mut tx, request.key).await? {
            Claimed::Live(record) => Begun::Live(record),
            Claimed::Busy => Begun::Busy,
            Claimed::Held(mark) => Begun::Acquired(tx, Some(mark)),
        })
    }

    async fn undo_handler<'c>(
        conn: &'c mut PgConnection,
        request: ClaimRequest<'c>,
        mark: Option<&'c str>,
    ) -> Result<Undone, crate::error::Error> {
        // The transaction is rolled back and begun again in one round trip, so that sqlx's
        // count of open transactions on the connection stays right, and the claim is taken
        // again. A subtransaction around the handler would keep the key through the undo, but
        // cost a round trip and a subtransaction on every request for the rare 5xx.
        let restart = begin_claim_sql("ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED", &request);
        match sqlx::query_scalar::<_, Option<String>>(MARK)
            .fetch_one(&mut *conn)
            .await
        {
            Ok(before) if before.as_deref() == mark => {}
            Ok(_) => return Ok(Undone::Ended),
            // A statement of the handler failed, which aborted the claim's transaction: its
            // mark cannot be read; the transaction is the claim's all the same (a handler that
            // ended it would have had to begin another).
            Err(error) if in_failed_transaction(&error) => {}
            Err(error) => return Err(error.into()),
        }
        sqlx::raw_sql(restart).execute(&mut *conn).await?;
        Ok(match claim(conn, request.key).await? {
            Claimed::Held(mark) => Undone::Kept(Some(mark)),
            Claimed::Live(_) | Claimed::Busy => Undone::Taken,
        })
    }

    async fn lookup(
        conn: &mut PgConnection,
        key: &KeyRef,
    ) -> Result<Option<KeyRecord>, crate::error::Error> {
        let row = sqlx::query(LOOKUP)
            .bind(&key.scope)
            .bind(&key.key)
            .fetch_optional(conn)
            .await?;
        match row {
            Some(row) => Self::decode_record(&row),
            None => Ok(None),
        }
    }

    async fn start(
        conn: &mut PgConnection,
        start: &Start<'_>,
    ) -> Result<Started, crate::error::Error> {
        let row = sqlx::query(START)
            .bind(&start.row.key.scope)
            .bind(&start.row.key.key)
            .bind(start.row.key.lock_id)
            .bind(start.row.method)
            .bind(start.row.path)
            .bind(&start.row.fingerprint.as_bytes()[..])
            .bind(start.lease.as_secs_f64())
            .bind(start.retention.as_secs_f64())
            .bind(start.token)
            .fetch_one(conn)
            .await?;
        let outcome: String = row.try_get("outcome")?;
        match outcome.as_str() {
            "acquired" => Ok(Started::Acquired {
                taken_over: row.try_get("taken_over")?,
            }),
            "busy" => Ok(Started::Busy),
            "found" => {
                let record = Self::decode_record(&row)?.ok_or_else(|| {
                    crate::error::Error::corrupt("idem_start found a row without a status")
                })?;
                let lease_left = row
                    .try_get::<Option<f64>, _>("lease_left")?
                    .map(|secs| Duration::from_secs_f64(secs.max(0.0)));
                Ok(Started::Found { record, lease_left })
            }
            other => Err(crate::error::Error::corrupt(format!(
                "idem_start returned outcome {other:?}"
            ))),
        }
    }

    async fn purge_batch(
        conn: &mut PgConnection,
        limit: i64,
        from: Option<i64>,
    ) -> Result<Purged, crate::error::Error> {
        let row = sqlx::query(PURGE)
            .bind(limit)
            .bind(from)
            .fetch_one(conn)
            .await?;
        let rows: i64 = row.try_get("purged")?;
        Ok(Purged {
            rows: u64::try_from(rows).unwrap_or_default(),
            last: row.try_get("last")?,
        })
    }

    async fn reclaim_abandoned(
        conn: &mut PgConnection,
        limit: i64,
        lease: Duration,
        token: i64,
        with_steps: bool,
    ) -> Result<Vec<Abandoned>, crate::error::Error> {
        let rows = sqlx::query(RECLAIM)
            .bind(limit)
            .bind(lease.as_secs_f64())
            .bind(token)
            .bind(with_steps)
            .fetch_all(conn)
            .await?;
        rows.iter()
            .map(|row| {
                let age: f64 = row.try_get("age")?;
                Self::abandoned(row, Duration::from_secs_f64(age.max(0.0)))
            })
            .collect()
    }

    async fn others_active(conn: &mut PgConnection) -> Result<Option<u64>, crate::error::Error> {
        let active: i64 = sqlx::query_scalar(OTHERS_ACTIVE).fetch_one(conn).await?;
        Ok(Some(active.max(0) as u64))
    }

    async fn ensure_open(_: &mut PgConnection) -> Result<(), crate::error::Error> {
        // A ROLLBACK outside a transaction is a warning there, and sqlx counts it done.
        Ok(())
    }

    fn is_transaction_aborted(error: &crate::error::Error) -> bool {
        matches!(error, crate::error::Error::Database(error) if in_failed_transaction(error))
    }
}
