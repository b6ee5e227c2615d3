//! The statements of [`Store::rekey`](crate::store::Store::rekey), written once over
//! [`Dialect`]: the stored answers and recorded steps read in the primary key's order, a few at
//! a time, and each row that needs sealing again locked, read whole and written back in one
//! short transaction per batch.
//!
//! Only rows nobody is working on are read: completed keys, and claims the recovery parked.
//! A claim in flight (a handler or the recovery at work on it) is never read nor written: its
//! steps are its owner's to write. A row locked by another transaction at the moment (a retry
//! taking an expired key over, the purge deleting it) is skipped, not waited for, and reported
//! [`Locked::Busy`].

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
    /// The stored answer's headers; `None` for a parked claim.
    pub(crate) headers: Option<Vec<(String, String)>>,
    /// The recorded steps; `None` where none were recorded.
    pub(crate) steps: Option<Vec<RecordedStep>>,
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
    /// The row is locked by another transaction, or is no longer a completed key nor a parked
    /// claim (purged, forgotten, taken over): left as it is.
    Busy,
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
            "SELECT {scope_and_key}, CAST(response_headers AS {text}) AS response_headers, \
               CAST(steps AS {text}) AS steps \
             FROM idem_keys WHERE {after} AND {SETTLED} \
             ORDER BY scope, {key_column} LIMIT {limit}",
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
                    headers: parsed(row.try_get("response_headers")?, "response_headers")?,
                    steps: parsed(row.try_get("steps")?, "steps")?,
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
        let read = format!(
            "SELECT CAST(response_status AS {bigint}) AS response_status, \
               CAST(response_headers AS {text}) AS response_headers, response_body, \
               CAST(steps AS {text}) AS steps \
             FROM idem_keys WHERE {this_key} AND {SETTLED}{lock}",
            bigint = DB::BIGINT,
            text = DB::TEXT,
            this_key = key_at::<DB>(1),
            lock = if write { DB::LOCK_SKIPPING } else { "" },
        );
        let write_answer = format!(
            "{} SET response_headers = {}, response_body = {} WHERE {}",
            DB::UPDATE_BY_KEY,
            DB::param(1),
            DB::param(2),
            key_at::<DB>(3),
        );
        let write_steps = format!(
            "{} SET steps = {} WHERE {}",
            DB::UPDATE_BY_KEY,
            DB::param(1),
            key_at::<DB>(2),
        );
        let mut conn = pool.acquire().await?;
        let mut tx = sqlx::Connection::begin_with(&mut *conn, DB::BEGIN_OWN).await?;
        let mut found = Vec::with_capacity(keys.len());
        for key in keys {
            let row = sqlx::query(sqlx::AssertSqlSafe(read.clone()))
                .bind(key.scope.as_str())
                .bind(key.key.as_str())
                .fetch_optional(&mut *tx)
                .await?;
            let Some(row) = row else {
                found.push(Locked::Busy);
                continue;
            };
            let headers = parsed(row.try_get("response_headers")?, "response_headers")?;
            let answer = match (row.try_get::<Option<i64>, _>("response_status")?, headers) {
                (Some(status), Some(headers)) => Some(StoredResponse {
                    status: u16::try_from(status).map_err(|_| {
                        crate::error::Error::corrupt(format!("response_status {status}"))
                    })?,
                    headers,
                    body: row
                        .try_get::<Option<Vec<u8>>, _>("response_body")?
                        .unwrap_or_default(),
                }),
                _ => None,
            };
            let steps = parsed(row.try_get("steps")?, "steps")?;
            let (rewrite, made) = decide(key, LockedRow { answer, steps });
            if write {
                if let Some(answer) = &rewrite.answer {
                    sqlx::query(sqlx::AssertSqlSafe(write_answer.clone()))
                        .bind(Json(&answer.headers))
                        .bind(&answer.body)
                        .bind(key.scope.as_str())
                        .bind(key.key.as_str())
                        .execute(&mut *tx)
                        .await?;
                }
                if let Some(steps) = &rewrite.steps {
                    sqlx::query(sqlx::AssertSqlSafe(write_steps.clone()))
                        .bind(Json(steps))
                        .bind(key.scope.as_str())
                        .bind(key.key.as_str())
                        .execute(&mut *tx)
                        .await?;
                }
            }
            found.push(Locked::Read(made));
        }
        if write {
            tx.commit().await?;
        } else {
            tx.rollback().await?;
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
