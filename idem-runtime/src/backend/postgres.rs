//! PostgreSQL: the key is held by a transaction-scoped advisory lock while the handler runs, and
//! written once, completed, in the handler's commit.

use sqlx::{
    PgConnection, PgPool, Postgres, Row, SqlSafeStr, Transaction, pool::PoolConnection,
    postgres::PgRow, types::Json,
};

use std::time::Duration;

use super::{
    Storage,
    shared::{abandoned, decode_record, replace_expired_row, shared_storage},
};
use crate::record::{
    Abandoned, Completion, KeyRecord, KeyRef, Lookup, RawRecord, Start, Started,
    checked_fingerprint,
};

const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

const CLAIM: &str = "SELECT acquired, status, method, path, fingerprint, \
     response_status, response_headers, response_body FROM idem_claim($1, $2, $3)";

// INSERT ... SELECT ... WHERE: the row is written only while the claim's marker (set by
// idem_claim, local to the transaction) is still there, i.e. the handler did not end the
// transaction itself.
const COMPLETE: &str = concat!(
    "INSERT INTO idem_keys AS k \
     (scope, key, method, path, fingerprint, status, response_status, response_headers, \
      response_body, created_at, expires_at, locked_at) \
     SELECT $1, $2, $3, $4, $5, 'completed', $6, $7, $8, now(), \
            now() + make_interval(secs => $9), NULL \
     WHERE current_setting('idem.claim', true) = $10 ",
    replace_expired_row!(),
    "WHERE k.expires_at <= now()"
);

const LOOKUP: &str = "SELECT status, method, path, fingerprint, response_status, \
     response_headers, response_body FROM idem_keys \
     WHERE scope = $1 AND key = $2 AND expires_at > now()";

const START: &str = "SELECT outcome, taken_over, status, method, path, fingerprint, \
     response_status, response_headers, response_body, lease_left \
     FROM idem_start($1, $2, $3, $4, $5, $6, $7, $8, $9)";

const FINISH: &str = "UPDATE idem_keys SET status = 'completed', response_status = $4, \
     response_headers = $5, response_body = $6, locked_at = NULL, lease_until = NULL, \
     claim_token = NULL, \
     expires_at = COALESCE(now() + make_interval(secs => $7::float8), expires_at) \
     WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3";

// ctid batches: the inner SELECT finds the oldest expired rows through the expires_at index and
// locks them, skipping any row a live request holds; the DELETE removes exactly those.
const PURGE: &str = "DELETE FROM idem_keys WHERE ctid = ANY(ARRAY( \
     SELECT ctid FROM idem_keys WHERE expires_at <= now() \
     ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))";

const RECLAIM: &str = "WITH lapsed AS ( \
       SELECT scope, key FROM idem_keys \
       WHERE status = 'started' AND lease_until <= now() AND expires_at > now() \
       ORDER BY lease_until LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE idem_keys k \
       SET lease_until = LEAST(now() + make_interval(secs => $2), k.expires_at), claim_token = $3 \
     FROM lapsed WHERE k.scope = lapsed.scope AND k.key = lapsed.key \
     RETURNING k.scope, k.key, k.method, k.path, k.fingerprint, \
       extract(epoch FROM now() - k.locked_at)::float8 AS age";

impl Storage for Postgres {
    shared_storage!(PgConnection, migrations = "migrations/postgres");

    async fn begin(
        conn: PoolConnection<Postgres>,
        statement_timeout: Option<Duration>,
    ) -> Result<Transaction<'static, Postgres>, crate::Error> {
        // The claim's correctness rests on READ COMMITTED snapshots (see the migration). The
        // statement timeout goes in the same round trip, and ends with the transaction.
        let begin = match statement_timeout {
            None => BEGIN.into_sql_str(),
            Some(limit) => sqlx::AssertSqlSafe(format!(
                "{BEGIN}; SET LOCAL statement_timeout = {}",
                limit.as_millis().max(1)
            ))
            .into_sql_str(),
        };
        Ok(Transaction::begin(conn, Some(begin)).await?)
    }

    async fn lookup(
        conn: &mut PgConnection,
        key: &KeyRef,
    ) -> Result<Option<KeyRecord>, crate::Error> {
        let row = sqlx::query(LOOKUP)
            .bind(&key.scope)
            .bind(&key.key)
            .fetch_optional(conn)
            .await?;
        match row {
            Some(row) => decode_record(&row),
            None => Ok(None),
        }
    }

    async fn claim(conn: &mut PgConnection, key: &KeyRef) -> Result<Lookup, crate::Error> {
        let row = sqlx::query(CLAIM)
            .bind(&key.scope)
            .bind(&key.key)
            .bind(key.lock_id)
            .fetch_one(conn)
            .await?;
        Ok(Lookup {
            acquired: row.try_get("acquired")?,
            record: decode_record(&row)?,
        })
    }

    async fn start(conn: &mut PgConnection, start: &Start<'_>) -> Result<Started, crate::Error> {
        let row = sqlx::query(START)
            .bind(&start.key.scope)
            .bind(&start.key.key)
            .bind(start.key.lock_id)
            .bind(start.method)
            .bind(start.path)
            .bind(&start.fingerprint.as_bytes()[..])
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
                let record = decode_record(&row)?.ok_or_else(|| {
                    crate::Error::corrupt("idem_start found a row without a status")
                })?;
                let lease_left = row
                    .try_get::<Option<f64>, _>("lease_left")?
                    .map(|secs| Duration::from_secs_f64(secs.max(0.0)));
                Ok(Started::Found { record, lease_left })
            }
            other => Err(crate::Error::corrupt(format!(
                "idem_start returned outcome {other:?}"
            ))),
        }
    }

    async fn purge_batch(pool: &PgPool, limit: i64) -> Result<u64, crate::Error> {
        Ok(sqlx::query(PURGE)
            .bind(limit)
            .execute(pool)
            .await?
            .rows_affected())
    }

    async fn reclaim_abandoned(
        pool: &PgPool,
        limit: i64,
        lease: Duration,
        token: i64,
    ) -> Result<Vec<Abandoned>, crate::Error> {
        let rows = sqlx::query(RECLAIM)
            .bind(limit)
            .bind(lease.as_secs_f64())
            .bind(token)
            .fetch_all(pool)
            .await?;
        rows.iter()
            .map(|row| {
                let age: f64 = row.try_get("age")?;
                abandoned!(row, Duration::from_secs_f64(age.max(0.0)))
            })
            .collect()
    }

    fn is_transaction_aborted(error: &crate::Error) -> bool {
        // SQLSTATE 25P02: in_failed_sql_transaction.
        matches!(error, crate::Error::Database(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02"))
    }
}

fn decode_record(row: &PgRow) -> Result<Option<KeyRecord>, crate::Error> {
    decode_record!(row, i16)
}

/// HTTP statuses are held in a `smallint`.
fn status(status: u16) -> Result<i16, crate::Error> {
    i16::try_from(status).map_err(|e| sqlx::Error::Encode(Box::new(e)).into())
}

/// A time to live in seconds, added to the server's `now()`.
fn expiry(retention: Option<Duration>) -> Option<f64> {
    retention.map(|r| r.as_secs_f64())
}

/// The claim's transaction-local mark, which the completion must still find.
fn completion_guard(c: &Completion<'_>) -> String {
    c.key.lock_id.to_string()
}
