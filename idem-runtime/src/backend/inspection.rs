//! The operator's statements (the `admin` module), written once over [`Dialect`]: counts, one
//! key, the claims in flight, and releasing a claim by its key.

use std::{future::Future, time::Duration};

use sqlx::{
    ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Row, Type, pool::PoolConnection,
};

use super::dialect::Dialect;
use crate::report::{Forgotten, KeyInfo, ParkedClaim, Released, Stats, Unparked};

/// Claims in flight: `started` rows with a lease (external mode). A transactional claim is
/// never one: on PostgreSQL and SQLite it has no row, on MySQL its row is uncommitted (nobody
/// else sees it), and the committed `started` row a handler that ran `COMMIT` itself leaves
/// behind has no lease and is already expired, so it counts as expired, and the purge takes it.
const IN_FLIGHT: &str = "status = 'started' AND lease_until IS NOT NULL";

/// Claims the recovery gave up on: `started` rows without a lease, with `parked_at` (the
/// recovery's index of started claims by lease end finds them). A resumed claim keeps
/// `parked_at`, so that retries are still answered that a person looks at it, and gets a lease
/// again: the recovery's to take, no longer parked.
const PARKED: &str = "status = 'started' AND lease_until IS NULL AND parked_at IS NOT NULL";

/// What the `admin` module runs on a database: implemented once, below, for every database with
/// a [`Dialect`].
pub(crate) trait Inspection: sqlx::Database + Sized {
    /// See [`Store::stats`](crate::store::Store::stats).
    fn stats(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Stats, crate::error::Error>> + Send + '_;

    /// See [`Store::inspect`](crate::store::Store::inspect).
    fn inspect<'a>(
        pool: &'a Pool<Self>,
        scope: &'a str,
        key: &'a str,
        with_body: bool,
    ) -> impl Future<Output = Result<Option<KeyInfo>, crate::error::Error>> + Send + 'a;

    /// See [`Store::in_flight`](crate::store::Store::in_flight).
    fn in_flight(
        pool: &Pool<Self>,
        older_than: Duration,
    ) -> impl Future<Output = Result<Vec<KeyInfo>, crate::error::Error>> + Send + '_;

    /// See [`Store::release_claim`](crate::store::Store::release_claim).
    fn release_claim<'a>(
        pool: &'a Pool<Self>,
        scope: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<Released, crate::error::Error>> + Send + 'a;

    /// See [`Store::forget`](crate::store::Store::forget): deletes the completed keys of
    /// `scope` in statements of at most `batch` rows each, until none is left.
    fn forget<'a>(
        pool: &'a Pool<Self>,
        scope: &'a str,
        batch: u32,
    ) -> impl Future<Output = Result<Forgotten, crate::error::Error>> + Send + 'a;

    /// The claims the recovery's gauges report: parked ones, and ones in flight whose lease
    /// ran out (nobody is working on them: the recovery has not taken them, or does not take
    /// claims with steps). Both read the index of started claims by lease end.
    fn claim_counts(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<ClaimCounts, crate::error::Error>> + Send + '_;

    /// See [`Store::parked`](crate::store::Store::parked).
    fn parked(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<ParkedClaim>, crate::error::Error>> + Send + '_;

    /// See [`Store::resume_parked`](crate::store::Store::resume_parked) (`resume`) and
    /// [`Store::abandon_parked`](crate::store::Store::abandon_parked).
    fn unpark<'a>(
        pool: &'a Pool<Self>,
        scope: &'a str,
        key: &'a str,
        resume: bool,
    ) -> impl Future<Output = Result<Unparked, crate::error::Error>> + Send + 'a;
}

/// The columns of a [`KeyInfo`]; the stored body only `with_body`. The stored headers always:
/// a sealed answer's say which key sealed it.
fn key_columns<DB: Dialect>(with_body: bool) -> String {
    format!(
        "{scope_and_key}, status, method, path, \
         CAST(response_status AS {bigint}) AS response_status, \
         {now} - {created} AS age_ms, {expires} - {now} AS expires_in_ms, \
         {now} - {locked} AS claimed_ms, {lease} - {now} AS lease_left_ms, \
         CAST(steps AS {text}) AS steps, CAST(response_headers AS {text}) AS response_headers, \
         {body} AS response_body",
        scope_and_key = DB::SCOPE_AND_KEY,
        bigint = DB::BIGINT,
        text = DB::TEXT,
        now = DB::NOW_MS,
        created = DB::ms("created_at"),
        expires = DB::ms("expires_at"),
        locked = DB::ms("locked_at"),
        lease = DB::ms("lease_until"),
        body = if with_body { "response_body" } else { "NULL" },
    )
}

/// `scope = $1 AND key = $2`, as the database spells it.
fn this_key<DB: Dialect>() -> String {
    format!(
        "scope = {} AND {} = {}",
        DB::param(1),
        DB::KEY_COLUMN,
        DB::param(2)
    )
}

/// `sql` as a query with the key bound: its first two parameters the scope and the key, as
/// `this_key` writes them.
fn for_this_key<'q, DB>(
    sql: impl sqlx::SqlSafeStr,
    scope: &'q str,
    key: &'q str,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Dialect,
    &'q str: Encode<'q, DB> + Type<DB>,
{
    sqlx::query(sql).bind(scope).bind(key)
}

impl<DB> Inspection for DB
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    &'static str: ColumnIndex<DB::Row>,
    usize: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'r> Decode<'r, DB> + Type<DB>,
{
    async fn stats(pool: &Pool<DB>) -> Result<Stats, crate::error::Error> {
        let mut conn = pool.acquire().await?;
        let count = |condition: &str| format!("SELECT COUNT(*) FROM idem_keys WHERE {condition}");
        let now = DB::NOW_MS;
        Ok(Stats {
            completed: scalar(&mut conn, count("status = 'completed'"))
                .await?
                .unwrap_or(0),
            started: scalar(&mut conn, count(IN_FLIGHT)).await?.unwrap_or(0),
            oldest_started_ms: scalar(
                &mut conn,
                format!(
                    "SELECT MAX({now} - {}) FROM idem_keys WHERE {IN_FLIGHT}",
                    DB::ms("locked_at")
                ),
            )
            .await?,
            expired: scalar(
                &mut conn,
                count(&format!(
                    "{} <= {now} AND parked_at IS NULL",
                    DB::ms("expires_at")
                )),
            )
            .await?
            .unwrap_or(0),
            parked: scalar(&mut conn, count(PARKED)).await?.unwrap_or(0),
        })
    }

    async fn inspect(
        pool: &Pool<DB>,
        scope: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<KeyInfo>, crate::error::Error> {
        let sql = format!(
            "SELECT {} FROM idem_keys WHERE {}",
            key_columns::<DB>(with_body),
            this_key::<DB>(),
        );
        let mut conn = pool.acquire().await?;
        let row = for_this_key::<DB>(sqlx::AssertSqlSafe(sql), scope, key)
            .fetch_optional(&mut *conn)
            .await?;
        row.as_ref()
            .map(|row| key_info::<DB>(row, with_body))
            .transpose()
    }

    async fn in_flight(
        pool: &Pool<DB>,
        older_than: Duration,
    ) -> Result<Vec<KeyInfo>, crate::error::Error> {
        let sql = format!(
            "SELECT {} FROM idem_keys WHERE {IN_FLIGHT} AND {} - {} >= {} ORDER BY locked_at",
            key_columns::<DB>(false),
            DB::NOW_MS,
            DB::ms("locked_at"),
            DB::param(1),
        );
        let older = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let mut conn = pool.acquire().await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(older)
            .fetch_all(&mut *conn)
            .await?;
        rows.iter().map(|row| key_info::<DB>(row, false)).collect()
    }

    async fn release_claim(
        pool: &Pool<DB>,
        scope: &str,
        key: &str,
    ) -> Result<Released, crate::error::Error> {
        // Never a parked claim: `abandon` is the operator's verb for it.
        let delete = format!(
            "{} WHERE {} AND status = 'started' AND NOT ({PARKED})",
            Self::DELETE_BY_KEY,
            this_key::<DB>()
        );
        let mut conn = pool.acquire().await?;
        if let Some(lock) = DB::LOCK_UNHELD_ROW {
            return release_unheld::<DB>(&mut conn, lock, &delete, scope, key).await;
        }
        let deleted = for_this_key::<DB>(sqlx::AssertSqlSafe(delete), scope, key)
            .execute(&mut *conn)
            .await?;
        if DB::rows_affected(&deleted) == 1 {
            return Ok(Released::Done);
        }
        let parked = format!(
            "SELECT 1 FROM idem_keys WHERE {} AND {PARKED}",
            this_key::<DB>()
        );
        let parked = for_this_key::<DB>(sqlx::AssertSqlSafe(parked), scope, key)
            .fetch_optional(&mut *conn)
            .await?;
        if parked.is_some() {
            return Ok(Released::Parked);
        }
        Ok(match exists::<DB>(&mut conn, scope, key).await? {
            true => Released::Completed,
            false => Released::Missing,
        })
    }

    async fn forget(
        pool: &Pool<DB>,
        scope: &str,
        batch: u32,
    ) -> Result<Forgotten, crate::error::Error> {
        let mut conn = pool.acquire().await?;
        let mut deleted = 0;
        loop {
            // Each batch a statement (a transaction) of its own: locks held briefly.
            let done = sqlx::query(DB::FORGET_BATCH)
                .bind(scope)
                .bind(i64::from(batch))
                .execute(&mut *conn)
                .await?;
            let rows = DB::rows_affected(&done);
            deleted += rows;
            // Until a batch deletes nothing: a short batch may be one whose rows the purge or a
            // retry took meanwhile, with more left behind it.
            if rows == 0 {
                break;
            }
        }
        let left = format!(
            "SELECT COUNT(CASE WHEN parked_at IS NULL THEN 1 END) AS in_flight, \
               COUNT(parked_at) AS parked \
             FROM idem_keys WHERE scope = {} AND status = 'started'",
            DB::param(1)
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(left))
            .bind(scope)
            .fetch_one(&mut *conn)
            .await?;
        let count = |column: &'static str| -> Result<u64, crate::error::Error> {
            Ok(u64::try_from(row.try_get::<i64, _>(column)?).unwrap_or(0))
        };
        Ok(Forgotten {
            deleted,
            in_flight_left: count("in_flight")?,
            parked_left: count("parked")?,
        })
    }

    async fn claim_counts(pool: &Pool<DB>) -> Result<ClaimCounts, crate::error::Error> {
        let mut conn = pool.acquire().await?;
        let count = |condition: &str| format!("SELECT COUNT(*) FROM idem_keys WHERE {condition}");
        Ok(ClaimCounts {
            parked: scalar(&mut conn, count(PARKED)).await?.unwrap_or(0),
            past_lease: scalar(
                &mut conn,
                count(&format!(
                    "status = 'started' AND lease_until <= {now} AND expires_at > {now}",
                    now = DB::NOW
                )),
            )
            .await?
            .unwrap_or(0),
        })
    }

    async fn parked(pool: &Pool<DB>) -> Result<Vec<ParkedClaim>, crate::error::Error> {
        let mut conn = pool.acquire().await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(DB::list_sql()))
            .fetch_all(&mut *conn)
            .await?;
        rows.iter().map(parked_claim::<DB>).collect()
    }

    async fn unpark(
        pool: &Pool<DB>,
        scope: &str,
        key: &str,
        resume: bool,
    ) -> Result<Unparked, crate::error::Error> {
        let sql = if resume {
            DB::resume_sql()
        } else {
            DB::abandon_sql()
        };
        let mut conn = pool.acquire().await?;
        let done = for_this_key::<DB>(sqlx::AssertSqlSafe(sql), scope, key)
            .execute(&mut *conn)
            .await?;
        if DB::rows_affected(&done) == 1 {
            return Ok(Unparked::Done);
        }
        Ok(match exists::<DB>(&mut conn, scope, key).await? {
            true => Unparked::NotParked,
            false => Unparked::Missing,
        })
    }
}

impl<DB> Unparking for DB where DB: Dialect {}

/// The statements of [`Inspection::parked`] and [`Inspection::unpark`].
trait Unparking: Dialect {
    /// The parked claims, oldest parking first.
    fn list_sql() -> String {
        format!(
            "SELECT {scope_and_key}, method, path, \
               CAST(recovery_attempts AS {bigint}) AS attempts, recovery_error, \
               {now} - {parked} AS parked_ms, {now} - {locked} AS claimed_ms \
             FROM idem_keys WHERE {PARKED} ORDER BY parked_at",
            scope_and_key = Self::SCOPE_AND_KEY,
            bigint = Self::BIGINT,
            now = Self::NOW_MS,
            parked = Self::ms("parked_at"),
            locked = Self::ms("locked_at"),
        )
    }

    /// Hands the parked claim back to the recovery: its count of rounds reset, its lease ended
    /// now (the next pass takes it), and an expiry at least an hour away, so that a claim
    /// parked past its key's retention is not purged before the pass. `parked_at` stays: a
    /// retry meanwhile is still refused, not let take the claim over as a lapsed one.
    fn resume_sql() -> String {
        format!(
            "{update} SET recovery_attempts = 0, lease_until = {now}, \
               expires_at = CASE WHEN expires_at < {hour} THEN {hour} ELSE expires_at END \
             WHERE {this_key} AND {PARKED}",
            update = Self::UPDATE_BY_KEY,
            now = Self::NOW,
            hour = Self::IN_AN_HOUR,
            this_key = this_key::<Self>(),
        )
    }

    /// Deletes the parked claim: the next retry runs the handler.
    fn abandon_sql() -> String {
        format!(
            "{} WHERE {} AND {PARKED}",
            Self::DELETE_BY_KEY,
            this_key::<Self>()
        )
    }
}

/// A [`ParkedClaim`] from a row of [`Unparking::list_sql`].
fn parked_claim<DB>(row: &DB::Row) -> Result<ParkedClaim, crate::error::Error>
where
    DB: sqlx::Database,
    &'static str: ColumnIndex<DB::Row>,
    i64: for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
{
    Ok(ParkedClaim {
        scope: row.try_get("scope")?,
        key: row.try_get("key")?,
        method: row.try_get("method")?,
        path: row.try_get("path")?,
        attempts: row.try_get("attempts")?,
        last_error: row.try_get("recovery_error")?,
        parked_ms: row.try_get("parked_ms")?,
        claimed_ms: row.try_get("claimed_ms")?,
    })
}

/// What [`Inspection::claim_counts`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClaimCounts {
    /// Parked claims.
    pub(crate) parked: i64,
    /// Claims in flight past their lease, of keys not expired.
    pub(crate) past_lease: i64,
}

/// Runs a statement that reads one integer, or none.
async fn scalar<DB>(
    conn: &mut PoolConnection<DB>,
    sql: String,
) -> Result<Option<i64>, crate::error::Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    i64: for<'r> Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .fetch_one(&mut **conn)
        .await?;
    Ok(row.try_get::<Option<i64>, _>(0)?)
}

/// Whether `key` of `scope` has a row another transaction can see.
async fn exists<DB>(
    conn: &mut PoolConnection<DB>,
    scope: &str,
    key: &str,
) -> Result<bool, crate::error::Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
{
    let sql = format!("SELECT 1 FROM idem_keys WHERE {}", this_key::<DB>());
    let row = for_this_key::<DB>(sqlx::AssertSqlSafe(sql), scope, key)
        .fetch_optional(&mut **conn)
        .await?;
    Ok(row.is_some())
}

/// The release where a row may be held by a transaction for as long as a handler runs
/// ([`Dialect::LOCK_UNHELD_ROW`]): the row is locked without waiting, and deleted only if it is
/// a claim in flight; a row that cannot be locked is reported [`Released::Busy`].
async fn release_unheld<DB>(
    conn: &mut PoolConnection<DB>,
    lock: &'static str,
    delete: &str,
    scope: &str,
    key: &str,
) -> Result<Released, crate::error::Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    &'static str: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
{
    let mut tx = sqlx::Connection::begin(&mut **conn).await?;
    let row = for_this_key::<DB>(lock, scope, key)
        .fetch_optional(&mut *tx)
        .await?;
    let status = row
        .map(|row| row.try_get::<String, _>("status"))
        .transpose()?;
    let released = match status.as_deref() {
        Some("started") => {
            for_this_key::<DB>(sqlx::AssertSqlSafe(delete.to_owned()), scope, key)
                .execute(&mut *tx)
                .await?;
            Released::Done
        }
        Some("parked") => Released::Parked,
        Some(_) => Released::Completed,
        // Not there, or held by a transaction: a plain read tells which (an uncommitted claim
        // is invisible to it, as on the other databases).
        None => Released::Missing,
    };
    tx.commit().await?;
    if released == Released::Missing && exists::<DB>(conn, scope, key).await? {
        return Ok(Released::Busy);
    }
    Ok(released)
}

/// A [`KeyInfo`] from a row of [`key_columns`]: its headers kept only `with_body`, the key id
/// of a sealed answer either way. A sealed answer is left as stored (`Store::inspect` opens it).
fn key_info<DB>(row: &DB::Row, with_body: bool) -> Result<KeyInfo, crate::error::Error>
where
    DB: sqlx::Database,
    &'static str: ColumnIndex<DB::Row>,
    i64: for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'r> Decode<'r, DB> + Type<DB>,
{
    let headers = row
        .try_get::<Option<String>, _>("response_headers")?
        .map(|text| serde_json::from_str::<Vec<(String, String)>>(&text))
        .transpose()
        .map_err(|error| {
            crate::error::Error::corrupt(format!(
                "response_headers are not a list of pairs: {error}"
            ))
        })?;
    let sealed_with = match headers.as_deref() {
        Some([(name, id)]) if name == crate::seal::SEALED_WITH => Some(id.clone()),
        _ => None,
    };
    Ok(KeyInfo {
        scope: row.try_get("scope")?,
        key: row.try_get("key")?,
        status: row.try_get("status")?,
        method: row.try_get("method")?,
        path: row.try_get("path")?,
        response_status: row.try_get("response_status")?,
        age_ms: row.try_get("age_ms")?,
        expires_in_ms: row.try_get("expires_in_ms")?,
        claimed_ms: row.try_get("claimed_ms")?,
        lease_left_ms: row.try_get("lease_left_ms")?,
        steps: row.try_get("steps")?,
        sealed_with,
        response_headers: headers.filter(|_| with_body),
        response_body: row.try_get("response_body")?,
        unopened: None,
    })
}
