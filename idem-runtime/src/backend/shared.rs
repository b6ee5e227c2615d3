//! The statements every backend shares, written once over [`Dialect`]: what a backend's SQL
//! differs in comes from its dialect, the rest is here.

use std::{future::Future, time::Duration};

use sqlx::{
    ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Row, Type, migrate::Migrate,
    types::Json,
};

use super::dialect::Dialect;
use crate::record::{
    Abandoned, Completion, KeyRecord, KeyRef, RawRecord, RecordedStep, checked_fingerprint,
};

/// Runs `statement` on the row of `key` owned by `token`: whether it wrote that one row. Its
/// parameters are the values in brackets, then the scope, the key and the claim token. (A macro
/// rather than a function: the statement runs under the bounds of `SharedStorage`'s one
/// implementation.)
macro_rules! on_owned_row {
    ($statement:expr, $conn:expr, [$($first:expr),*], $key:expr, $token:expr) => {{
        let done = sqlx::query($statement)
            $(.bind($first))*
            .bind(&$key.scope)
            .bind(&$key.key)
            .bind($token)
            .execute($conn)
            .await?;
        DB::rows_affected(&done) == 1
    }};
}

/// The part of [`Storage`](super::Storage) that is the same on every database: implemented
/// once, below, for every database with a [`Dialect`].
pub(crate) trait SharedStorage: sqlx::Database + Sized {
    /// Stores a completed response for a key this transaction holds. Returns `false` when the
    /// claim is no longer this transaction's (the handler ended the transaction itself):
    /// nothing was written. A live row in the way is an error on PostgreSQL (a unique
    /// violation) and `false` on SQLite.
    fn complete<'c>(
        conn: &'c mut Self::Connection,
        completion: &'c Completion<'c>,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'c;

    /// Completes a `started` row owned by `token`, to expire `retention` from now, or with
    /// `None` when its claim said (a recovery hook completing an abandoned claim). Returns
    /// `false` if the claim is no longer owned by `token`.
    fn complete_started<'c>(
        conn: &'c mut Self::Connection,
        completion: &'c Completion<'c>,
        token: i64,
        retention: Option<Duration>,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'c;

    /// Deletes a `started` row owned by `token`, so that a retry runs the handler again.
    fn release<'c>(
        conn: &'c mut Self::Connection,
        key: &'c KeyRef,
        token: i64,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'c;

    /// Lets go of a `started` row owned by `token`: deletes it, or, when steps are recorded on
    /// it, ends its lease now and keeps them, so that a retry takes it over at once and resumes
    /// after the last step. The row decides, not what the
    /// caller knows: a step whose commit was sent but not answered may be recorded. Returns
    /// `false` if the claim is no longer owned by `token`.
    fn give_up<'c>(
        conn: &'c mut Self::Connection,
        key: &'c KeyRef,
        token: i64,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'c;

    /// Writes `steps` as the recorded steps of the `started` row owned by `token`; in the
    /// transaction `conn` is in, if any. Returns `false` (nothing written) if the claim is no
    /// longer owned by `token`.
    fn record_steps<'c>(
        conn: &'c mut Self::Connection,
        key: &'c KeyRef,
        token: i64,
        steps: &'c [RecordedStep],
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'c;

    /// The steps recorded on the row owned by `token` (none if it is not owned by `token`).
    fn recorded_steps<'c>(
        conn: &'c mut Self::Connection,
        key: &'c KeyRef,
        token: i64,
    ) -> impl Future<Output = Result<Vec<RecordedStep>, crate::error::Error>> + Send + 'c;

    /// Records a recovery round that the hook did not settle on the `started` row owned by
    /// `token`: `reason`, when given, kept as the hook's last error; and, with `park`, the claim
    /// parked: its lease and owner cleared and `parked_at` set, so that neither a retry nor the
    /// recovery takes it again until an operator does. Returns `false` if the claim is no
    /// longer owned by `token`.
    fn unsettled_round<'c>(
        conn: &'c mut Self::Connection,
        key: &'c KeyRef,
        token: i64,
        reason: Option<&'c str>,
        park: bool,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'c;

    /// Creates or upgrades the key table, and checks the settings the backend relies on.
    fn migrate(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + '_;

    /// Decodes the columns of a key's row: `None` where `status` is `NULL` (the statement
    /// found no row).
    ///
    /// # Errors
    ///
    /// When a column is missing or does not decode, or the row does not make a record.
    fn decode_record(row: &Self::Row) -> Result<Option<KeyRecord>, crate::error::Error>;

    /// An abandoned claim from a row of the recovery's `RETURNING`, `age` after its claim.
    ///
    /// # Errors
    ///
    /// When a column is missing or does not decode, or the fingerprint is not one.
    fn abandoned(row: &Self::Row, age: Duration) -> Result<Abandoned, crate::error::Error>;
}

/// The shared statements for every [`Dialect`], given what they need of sqlx for the database:
/// statements run on its connection, its migrations, and the plain types they bind and read.
impl<DB> SharedStorage for DB
where
    DB: Dialect,
    // Statements run on a connection; migrations on a pool.
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    DB::Connection: Migrate,
    // Columns read by name, and the values bound and read.
    &'static str: ColumnIndex<DB::Row>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    String: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    for<'q> Json<&'q Vec<(String, String)>>: Encode<'q, DB> + Type<DB>,
    for<'q> Json<&'q [RecordedStep]>: Encode<'q, DB> + Type<DB>,
    Json<Vec<(String, String)>>: for<'r> Decode<'r, DB> + Type<DB>,
    Json<Vec<RecordedStep>>: for<'r> Decode<'r, DB> + Type<DB>,
{
    async fn complete(
        conn: &mut DB::Connection,
        c: &Completion<'_>,
        retention: Duration,
    ) -> Result<bool, crate::error::Error> {
        let completion = sqlx::query(DB::COMPLETE)
            .bind(c.row.method)
            .bind(c.row.path)
            .bind(&c.row.fingerprint.as_bytes()[..])
            .bind(DB::status(c.response.status)?)
            .bind(Json(&c.response.headers))
            .bind(&c.response.body)
            .bind(DB::expiry(Some(retention)))
            .bind(&c.row.key.scope)
            .bind(&c.row.key.key)
            .bind(DB::completion_guard(c));
        DB::run_completion(conn, completion).await
    }

    async fn complete_started(
        conn: &mut DB::Connection,
        c: &Completion<'_>,
        token: i64,
        retention: Option<Duration>,
    ) -> Result<bool, crate::error::Error> {
        let response = c.response;
        Ok(on_owned_row!(
            DB::COMPLETE_STARTED,
            conn,
            [
                DB::status(response.status)?,
                Json(&response.headers),
                &response.body,
                DB::expiry(retention)
            ],
            c.row.key,
            token
        ))
    }

    async fn release(
        conn: &mut DB::Connection,
        key: &KeyRef,
        token: i64,
    ) -> Result<bool, crate::error::Error> {
        Ok(on_owned_row!(DB::RELEASE, conn, [], key, token))
    }

    async fn give_up(
        conn: &mut DB::Connection,
        key: &KeyRef,
        token: i64,
    ) -> Result<bool, crate::error::Error> {
        if on_owned_row!(DB::RELEASE_WITHOUT_STEPS, &mut *conn, [], key, token) {
            return Ok(true);
        }
        // Steps are recorded (or the claim is no longer `token`'s: then nothing matches).
        Ok(on_owned_row!(DB::LAPSE, conn, [], key, token))
    }

    async fn record_steps(
        conn: &mut DB::Connection,
        key: &KeyRef,
        token: i64,
        steps: &[RecordedStep],
    ) -> Result<bool, crate::error::Error> {
        Ok(on_owned_row!(
            DB::RECORD_STEPS,
            conn,
            [Json(steps)],
            key,
            token
        ))
    }

    async fn recorded_steps(
        conn: &mut DB::Connection,
        key: &KeyRef,
        token: i64,
    ) -> Result<Vec<RecordedStep>, crate::error::Error> {
        let row = sqlx::query(DB::RECORDED_STEPS)
            .bind(&key.scope)
            .bind(&key.key)
            .bind(token)
            .fetch_optional(conn)
            .await?;
        let steps = match row {
            Some(row) => row.try_get::<Option<Json<Vec<RecordedStep>>>, _>("steps")?,
            None => None,
        };
        Ok(steps.map(|Json(steps)| steps).unwrap_or_default())
    }

    async fn unsettled_round(
        conn: &mut DB::Connection,
        key: &KeyRef,
        token: i64,
        reason: Option<&str>,
        park: bool,
    ) -> Result<bool, crate::error::Error> {
        let parked = if park {
            format!(
                "parked_at = {}, lease_until = NULL, claim_token = NULL, ",
                DB::NOW
            )
        } else {
            String::new()
        };
        let sql = format!(
            "{update} SET {parked}recovery_error = COALESCE({reason}, recovery_error) \
             WHERE scope = {scope} AND {key} = {key_param} AND status = 'started' \
               AND claim_token = {token}",
            update = DB::UPDATE_BY_KEY,
            reason = DB::param(1),
            scope = DB::param(2),
            key = DB::KEY_COLUMN,
            key_param = DB::param(3),
            token = DB::param(4),
        );
        Ok(on_owned_row!(
            sqlx::AssertSqlSafe(sql),
            conn,
            [reason],
            key,
            token
        ))
    }

    async fn migrate(pool: &Pool<DB>) -> Result<(), crate::error::Error> {
        DB::before_migrate(pool).await?;
        // Recorded apart from the application's own `_sqlx_migrations`.
        let mut migrator = DB::MIGRATOR;
        migrator.set_ignore_missing(true);
        migrator.dangerous_set_table_name("_idem_migrations");
        // On one connection (as `Migrator::run` on a pool does), its notices silenced for the
        // run: a start on migrated tables logs nothing of the tables already there.
        let mut conn = pool.acquire().await?;
        let previous = DB::quiet_notices(&mut conn).await?;
        let ran = migrator.run_direct(None, &mut *conn, false).await;
        if DB::restore_notices(&mut conn, previous).await.is_err() {
            // Not back into the pool with its notices silenced.
            drop(conn.detach());
        }
        Ok(ran?)
    }

    fn decode_record(row: &DB::Row) -> Result<Option<KeyRecord>, crate::error::Error> {
        match row.try_get::<Option<String>, _>("status")? {
            None => Ok(None),
            Some(status) => RawRecord {
                status,
                method: row.try_get("method")?,
                path: row.try_get("path")?,
                fingerprint: row.try_get("fingerprint")?,
                response_status: row
                    .try_get::<Option<DB::Status>, _>("response_status")?
                    .map(Into::into),
                response_headers: row
                    .try_get::<Option<Json<Vec<(String, String)>>>, _>("response_headers")?
                    .map(|Json(headers)| headers),
                response_body: row.try_get("response_body")?,
            }
            .check()
            .map(Some),
        }
    }

    fn abandoned(row: &DB::Row, age: Duration) -> Result<Abandoned, crate::error::Error> {
        let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
        Ok(Abandoned {
            key: KeyRef::new(row.try_get("scope")?, row.try_get("key")?),
            method: row.try_get("method")?,
            path: row.try_get("path")?,
            fingerprint: checked_fingerprint(&fingerprint)?,
            age,
            steps: row
                .try_get::<Option<Json<Vec<RecordedStep>>>, _>("steps")?
                .map(|Json(steps)| steps)
                .unwrap_or_default(),
            attempts: row.try_get::<i64, _>("recovery_attempts")?.max(0) as u64,
        })
    }
}
