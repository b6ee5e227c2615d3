//! The statements of [`Store::rekey`](crate::store::Store::rekey), written once over
//! [`Dialect`]: the stored answers and recorded steps read in the primary key's order, a page
//! at a time, and each row that needs sealing again locked, read whole and written back in a
//! short transaction of its own, so that a retry meeting the row waits (or, on MySQL, is
//! refused) for one row's write at most.
//!
//! Only rows nobody is working on are read: completed keys, and claims the recovery parked.
//! A claim in flight (a handler or the recovery at work on it) is never read nor written: its
//! steps are its owner's to write. A row locked by another transaction at the moment (a retry
//! taking an expired key over, the purge deleting it) is skipped, not waited for, and reported
//! [`Locked::Busy`]; on SQLite, whose transactions exclude each other whole, the row's
//! transaction waits for the database's writer instead (its busy timeout).

use std::future::Future;

use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Row, Type, types::Json};

use super::dialect::Dialect;
use crate::record::{KeyRef, RecordedStep, StoredResponse};

/// Rows the rekey reads: completed keys, and parked claims (`started`, no lease, `parked_at`).
const SETTLED: &str = "(status = 'completed' \
     OR (status = 'started' AND lease_until IS NULL AND parked_at IS NOT NULL))";

/// A row as [`Rekeying::settled_after`] reads it: what tells whether it is sealed with the
/// sealing key, without its body.
#[derive(Debug, Clone)]
pub(crate) struct SettledRow {
    /// The row's scope and key.
    pub(crate) key: KeyRef,
    /// The stored answer's headers, as JSON text; `None` for a parked claim.
    pub(crate) headers: Option<String>,
    /// The recorded steps, as JSON text; `None` where none were recorded.
    pub(crate) steps: Option<String>,
}

/// What a row locked by [`Rekeying::rewrite`] holds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LockedRow {
    /// The stored answer; `None` for a parked claim.
    pub(crate) answer: Option<StoredResponse>,
    /// The recorded steps; `None` where none were recorded.
    pub(crate) steps: Option<Vec<RecordedStep>>,
}

/// What to write back to a locked row: each part `None` is left as it is.
#[derive(Debug, Default)]
pub(crate) struct Rewrite {
    /// The answer, sealed again.
    pub(crate) answer: Option<StoredResponse>,
    /// The steps, sealed again.
    pub(crate) steps: Option<Vec<RecordedStep>>,
}

/// What [`Rekeying::rewrite`] found of one key.
#[derive(Debug)]
pub(crate) enum Locked<T> {
    /// The row was locked and read; `T` is what the caller made of it.
    Read(T),
    /// Another transaction holds the row (or the row's transaction lost a conflict with one):
    /// left as it is.
    Busy,
    /// The row is no longer a completed key nor a parked claim (purged, forgotten, taken over
    /// by a retry): nothing to seal.
    Gone,
    /// The row's headers, steps or status do not read as idem writes them: left as it is.
    Corrupt(String),
}

/// What [`Store::rekey`](crate::store::Store::rekey) runs on a database: implemented once,
/// below, for every database with a [`Dialect`].
pub(crate) trait Rekeying: sqlx::Database + Sized {
    /// At most `limit` completed keys and parked claims after `after` (scope, then key; from
    /// the first when `None`) in the primary key's order, without their bodies. A plain read:
    /// it locks nothing.
    fn settled_after<'a>(
        pool: &'a Pool<Self>,
        after: Option<&'a KeyRef>,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<SettledRow>, crate::error::Error>> + Send + 'a;

    /// In one transaction, locks each of `keys` that is still a completed key or a parked
    /// claim, skipping any another transaction holds; reads it whole and hands it, with its key,
    /// to `decide`,
    /// which says what to write back and what to report; writes it, and commits. With `write`
    /// false, reads without locking and writes nothing (a dry run).
    fn rewrite<'a, T, F>(
        pool: &'a Pool<Self>,
        keys: &'a [KeyRef],
        write: bool,
        decide: F,
    ) -> impl Future<Output = Result<Vec<Locked<T>>, crate::error::Error>> + Send + 'a
    where
        T: Send + 'a,
        F: FnMut(&KeyRef, LockedRow) -> (Rewrite, T) + Send + 'a;

    /// The claims in flight (a lease, not parked), which the rekey leaves.
    fn in_flight_count(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<u64, crate::error::Error>> + Send + '_;
}

/// Headers or steps stored as JSON text, parsed.
fn parsed<T: serde::de::DeserializeOwned>(
    text: Option<String>,
    column: &str,
) -> Result<Option<T>, crate::error::Error> {
    text.map(|text| serde_json::from_str(&text))
        .transpose()
        .map_err(|error| crate::error::Error::corrupt(format!("{column} do not parse: {error}")))
}

impl<DB> Rekeying for DB
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    &'static str: ColumnIndex<DB::Row>,
    usize: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    for<'q> Json<&'q Vec<(String, String)>>: Encode<'q, DB> + Type<DB>,
    for<'q> Json<&'q Vec<RecordedStep>>: Encode<'q, DB> + Type<DB>,
{
    async fn settled_after(
        pool: &Pool<DB>,
        after: Option<&KeyRef>,
        limit: u32,
    ) -> Result<Vec<SettledRow>, crate::error::Error> {
        // From the first: every key is after `("", "")`, as a key is never empty.
        let (scope, key) = after.map_or(("", ""), |k| (k.scope.as_str(), k.key.as_str()));
        let sql = format!(
            // The order by the table's columns, not the names selected: MySQL's are converted
            // to text, whose collation would order them otherwise than the range compares.
            "SELECT {scope_and_key}, CAST(response_headers AS {text}) AS response_headers, \
               CAST(steps AS {text}) AS steps \
             FROM idem_keys WHERE {after} AND {SETTLED} \
             ORDER BY idem_keys.scope, idem_keys.{key_column} LIMIT {limit}",
            scope_and_key = DB::SCOPE_AND_KEY,
            text = DB::TEXT,
            after = DB::AFTER_KEY,
            key_column = DB::KEY_COLUMN,
            limit = DB::param(DB::AFTER_KEY_BINDS.len() + 1),
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for bind in DB::AFTER_KEY_BINDS {
            query = query.bind(match bind {
                KeyPart::Scope => scope,
                KeyPart::Key => key,
            });
        }
        let mut conn = pool.acquire().await?;
        let rows = query.bind(i64::from(limit)).fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|row| {
                Ok(SettledRow {
                    key: KeyRef::new(row.try_get("scope")?, row.try_get("key")?),
                    headers: row.try_get("response_headers")?,
                    steps: row.try_get("steps")?,
                })
            })
            .collect()
    }

    async fn rewrite<'a, T, F>(
        pool: &'a Pool<DB>,
        keys: &'a [KeyRef],
        write: bool,
        mut decide: F,
    ) -> Result<Vec<Locked<T>>, crate::error::Error>
    where
        T: Send + 'a,
        F: FnMut(&KeyRef, LockedRow) -> (Rewrite, T) + Send + 'a,
    {
        let statements = RowStatements::of::<DB>();
        let mut conn = pool.acquire().await?;
        let mut found = Vec::with_capacity(keys.len());
        for key in keys {
            let done = if write {
                rewrite_row::<DB, T>(&mut conn, &statements, key, &mut decide).await
            } else {
                read_row::<DB>(&mut conn, &statements.read, key)
                    .await
                    .map(|row| match row {
                        None => Locked::Gone,
                        Some(Err(reason)) => Locked::Corrupt(reason),
                        Some(Ok(row)) => Locked::Read(decide(key, row).1),
                    })
            };
            found.push(match done {
                // Lost a conflict (a deadlock, a Galera certification): left for the retry.
                Err(error) if error.is_conflict() => Locked::Busy,
                other => other?,
            });
        }
        Ok(found)
    }

    async fn in_flight_count(pool: &Pool<DB>) -> Result<u64, crate::error::Error> {
        let mut conn = pool.acquire().await?;
        let row = sqlx::query(
            "SELECT COUNT(*) FROM idem_keys WHERE status = 'started' AND lease_until IS NOT NULL",
        )
        .fetch_one(&mut *conn)
        .await?;
        Ok(u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0))
    }
}

/// A part of a row's primary key, as [`Dialect::AFTER_KEY_BINDS`] binds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyPart {
    /// The scope.
    Scope,
    /// The key.
    Key,
}

/// `scope = <n> AND key = <n + 1>`, as the database spells it.
fn key_at<DB: Dialect>(first: usize) -> String {
    format!(
        "scope = {} AND {} = {}",
        DB::param(first),
        DB::KEY_COLUMN,
        DB::param(first + 1)
    )
}

/// The statements of one row's rewrite, as the database spells them.
struct RowStatements {
    /// The row, if it is a completed key or a parked claim, without a lock.
    read: String,
    /// The same, locking it, skipping it if another transaction holds it.
    lock: String,
    /// Writes the answer (`$1` headers, `$2` body), if the row is still settled.
    answer: String,
    /// Writes the steps (`$1`), if the row is still settled.
    steps: String,
}

impl RowStatements {
    fn of<DB: Dialect>() -> Self {
        let read = format!(
            "SELECT CAST(response_status AS {bigint}) AS response_status, \
               CAST(response_headers AS {text}) AS response_headers, response_body, \
               CAST(steps AS {text}) AS steps \
             FROM idem_keys WHERE {this_key} AND {SETTLED}",
            bigint = DB::BIGINT,
            text = DB::TEXT,
            this_key = key_at::<DB>(1),
        );
        Self {
            lock: format!("{read}{}", DB::LOCK_SKIPPING),
            read,
            answer: format!(
                "{} SET response_headers = {}, response_body = {} WHERE {} AND {SETTLED}",
                DB::UPDATE_BY_KEY,
                DB::param(1),
                DB::param(2),
                key_at::<DB>(3),
            ),
            steps: format!(
                "{} SET steps = {} WHERE {} AND {SETTLED}",
                DB::UPDATE_BY_KEY,
                DB::param(1),
                key_at::<DB>(2),
            ),
        }
    }
}

/// The row of `key` read with `sql` ([`RowStatements`]' `read` or `lock`): `None` when there is
/// none to read, `Some(Err)` when it does not parse.
async fn read_row<DB>(
    conn: &mut DB::Connection,
    sql: &str,
    key: &KeyRef,
) -> Result<Option<Result<LockedRow, String>>, crate::error::Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    &'static str: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    i64: for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'r> Decode<'r, DB> + Type<DB>,
{
    let row = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else { return Ok(None) };
    let status = row.try_get::<Option<i64>, _>("response_status")?;
    let headers = row.try_get::<Option<String>, _>("response_headers")?;
    let body = row.try_get::<Option<Vec<u8>>, _>("response_body")?;
    let steps = row.try_get::<Option<String>, _>("steps")?;
    Ok(Some(locked_row(status, headers, body, steps)))
}

/// A [`LockedRow`] from its columns, or what does not parse.
fn locked_row(
    status: Option<i64>,
    headers: Option<String>,
    body: Option<Vec<u8>>,
    steps: Option<String>,
) -> Result<LockedRow, String> {
    let headers = parsed::<Vec<(String, String)>>(headers, "response_headers")
        .map_err(|error| error.to_string())?;
    let answer = match (status, headers) {
        (Some(status), Some(headers)) => Some(StoredResponse {
            status: u16::try_from(status).map_err(|_| format!("response_status {status}"))?,
            headers,
            body: body.unwrap_or_default(),
        }),
        _ => None,
    };
    let steps = parsed(steps, "steps").map_err(|error| error.to_string())?;
    Ok(LockedRow { answer, steps })
}

/// One row's rewrite, in a transaction of its own: locked (or found held, or gone), decided,
/// written back, committed.
async fn rewrite_row<DB, T>(
    conn: &mut DB::Connection,
    statements: &RowStatements,
    key: &KeyRef,
    decide: &mut (impl FnMut(&KeyRef, LockedRow) -> (Rewrite, T) + Send),
) -> Result<Locked<T>, crate::error::Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    &'static str: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    i64: for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    for<'q> Json<&'q Vec<(String, String)>>: Encode<'q, DB> + Type<DB>,
    for<'q> Json<&'q Vec<RecordedStep>>: Encode<'q, DB> + Type<DB>,
{
    let mut tx = sqlx::Connection::begin_with(&mut *conn, DB::BEGIN_OWN).await?;
    let row = match read_row::<DB>(&mut tx, &statements.lock, key).await? {
        Some(Ok(row)) => row,
        unread => {
            tx.rollback().await?;
            return Ok(match unread {
                Some(Err(reason)) => Locked::Corrupt(reason),
                // Skipped: held by another transaction if a plain read still finds it.
                _ => match read_row::<DB>(conn, &statements.read, key).await? {
                    Some(_) => Locked::Busy,
                    None => Locked::Gone,
                },
            });
        }
    };
    let (rewrite, made) = decide(key, row);
    let mut written = true;
    if let Some(answer) = &rewrite.answer {
        let done = sqlx::query(sqlx::AssertSqlSafe(statements.answer.clone()))
            .bind(Json(&answer.headers))
            .bind(&answer.body)
            .bind(key.scope.as_str())
            .bind(key.key.as_str())
            .execute(&mut *tx)
            .await?;
        written &= DB::rows_affected(&done) == 1;
    }
    if let Some(steps) = &rewrite.steps {
        let done = sqlx::query(sqlx::AssertSqlSafe(statements.steps.clone()))
            .bind(Json(steps))
            .bind(key.scope.as_str())
            .bind(key.key.as_str())
            .execute(&mut *tx)
            .await?;
        written &= DB::rows_affected(&done) == 1;
    }
    if !written {
        // Not the row it read: never seen under the lock, but never written half either.
        tx.rollback().await?;
        return Ok(Locked::Busy);
    }
    tx.commit().await?;
    Ok(Locked::Read(made))
}
