//! What both backends do alike, written once: the statements whose SQL differs only in dialect
//! are bound and run by [`shared_storage!`], records are decoded by [`decode_record!`].
//!
//! A backend module that invokes them provides, under these names: the SQL constants `COMPLETE`,
//! `FINISH` and `LAPSE`; `status(u16)`, the integer its `response_status` column holds;
//! `expiry(Option<Duration>)`, how it binds a time to live (`None` keeps the row's expiry);
//! `completion_guard(&Completion)`, the completion's last parameter (what makes the write
//! conditional, or the time it happens); and `still_claimed(conn)`, run before the completion:
//! whether the claim's transaction is still open, where the completion's `WHERE` cannot tell
//! (on SQLite it releases the claim's savepoint, and reopens a transaction when it is gone).

/// Deletes a `started` row owned by `$3`: the same statement on every database.
pub(super) const RELEASE: &str = "DELETE FROM idem_keys \
     WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3";

/// Deletes a `started` row owned by `$3` that has no recorded steps.
pub(super) const RELEASE_WITHOUT_STEPS: &str = "DELETE FROM idem_keys \
     WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3 \
       AND steps IS NULL";

/// Records a claim's steps, only while `$3` owns it: the same statement on every database.
pub(super) const RECORD_STEPS: &str = "UPDATE idem_keys SET steps = $4 \
     WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3";

/// The steps of the row `$3` owns: the same statement on every database.
pub(super) const RECORDED_STEPS: &str =
    "SELECT steps FROM idem_keys WHERE scope = $1 AND key = $2 AND claim_token = $3";

/// The `Storage` methods that differ between backends only in their SQL's dialect.
macro_rules! shared_storage {
    ($conn:ty, migrations = $migrations:literal) => {
        async fn complete(
            conn: &mut $conn,
            c: &Completion<'_>,
            retention: Duration,
        ) -> Result<bool, crate::Error> {
            if !still_claimed(&mut *conn).await? {
                return Ok(false);
            }
            let done = sqlx::query(COMPLETE)
                .bind(&c.key.scope)
                .bind(&c.key.key)
                .bind(c.method)
                .bind(c.path)
                .bind(&c.fingerprint.as_bytes()[..])
                .bind(status(c.response.status)?)
                .bind(Json(&c.response.headers))
                .bind(&c.response.body)
                .bind(expiry(Some(retention)))
                .bind(completion_guard(c))
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn finish(
            conn: &mut $conn,
            c: &Completion<'_>,
            token: i64,
            retention: Option<Duration>,
        ) -> Result<bool, crate::Error> {
            let done = sqlx::query(FINISH)
                .bind(&c.key.scope)
                .bind(&c.key.key)
                .bind(token)
                .bind(status(c.response.status)?)
                .bind(Json(&c.response.headers))
                .bind(&c.response.body)
                .bind(expiry(retention))
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn release(conn: &mut $conn, key: &KeyRef, token: i64) -> Result<bool, crate::Error> {
            let done = sqlx::query(super::shared::RELEASE)
                .bind(&key.scope)
                .bind(&key.key)
                .bind(token)
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn give_up(conn: &mut $conn, key: &KeyRef, token: i64) -> Result<bool, crate::Error> {
            let deleted = sqlx::query(super::shared::RELEASE_WITHOUT_STEPS)
                .bind(&key.scope)
                .bind(&key.key)
                .bind(token)
                .execute(&mut *conn)
                .await?;
            if deleted.rows_affected() == 1 {
                return Ok(true);
            }
            // Steps are recorded (or the claim is no longer `token`'s: then nothing matches).
            let lapsed = sqlx::query(LAPSE)
                .bind(&key.scope)
                .bind(&key.key)
                .bind(token)
                .execute(conn)
                .await?;
            Ok(lapsed.rows_affected() == 1)
        }

        async fn record_steps(
            conn: &mut $conn,
            key: &KeyRef,
            token: i64,
            steps: &[RecordedStep],
        ) -> Result<bool, crate::Error> {
            let done = sqlx::query(super::shared::RECORD_STEPS)
                .bind(&key.scope)
                .bind(&key.key)
                .bind(token)
                .bind(Json(steps))
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn recorded_steps(
            conn: &mut $conn,
            key: &KeyRef,
            token: i64,
        ) -> Result<Vec<RecordedStep>, crate::Error> {
            let steps: Option<Option<Json<Vec<RecordedStep>>>> =
                sqlx::query_scalar(super::shared::RECORDED_STEPS)
                    .bind(&key.scope)
                    .bind(&key.key)
                    .bind(token)
                    .fetch_optional(conn)
                    .await?;
            Ok(steps.flatten().map(|Json(steps)| steps).unwrap_or_default())
        }

        async fn savepoint(conn: &mut $conn) -> Result<(), crate::Error> {
            sqlx::raw_sql("SAVEPOINT idem_handler")
                .execute(conn)
                .await?;
            Ok(())
        }

        async fn rollback_to_savepoint(conn: &mut $conn) -> Result<(), crate::Error> {
            sqlx::raw_sql("ROLLBACK TO SAVEPOINT idem_handler")
                .execute(conn)
                .await?;
            Ok(())
        }

        async fn migrate(pool: &sqlx::Pool<Self>) -> Result<(), crate::Error> {
            // Recorded apart from the application's own `_sqlx_migrations`.
            let mut migrator = sqlx::migrate!($migrations);
            migrator.set_ignore_missing(true);
            migrator.dangerous_set_table_name("_idem_migrations");
            Ok(migrator.run(pool).await?)
        }
    };
}

/// Decodes the columns of a key's row (`status` may be `NULL` where the statement found none),
/// its `response_status` held as `$status`.
macro_rules! decode_record {
    ($row:expr, $status:ty) => {{
        let row = $row;
        match row.try_get::<Option<String>, _>("status")? {
            None => Ok(None),
            Some(status) => RawRecord {
                status,
                method: row.try_get("method")?,
                path: row.try_get("path")?,
                fingerprint: row.try_get("fingerprint")?,
                response_status: row
                    .try_get::<Option<$status>, _>("response_status")?
                    .map(i64::from),
                response_headers: row
                    .try_get::<Option<Json<Vec<(String, String)>>>, _>("response_headers")?
                    .map(|Json(headers)| headers),
                response_body: row.try_get("response_body")?,
            }
            .check()
            .map(Some),
        }
    }};
}

/// An abandoned claim from a row of the recovery's `RETURNING`, `$age` after its claim.
macro_rules! abandoned {
    ($row:expr, $age:expr) => {{
        let row = $row;
        let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
        Ok(Abandoned {
            key: KeyRef::new(row.try_get("scope")?, row.try_get("key")?),
            method: row.try_get("method")?,
            path: row.try_get("path")?,
            fingerprint: checked_fingerprint(&fingerprint)?,
            age: $age,
            steps: row
                .try_get::<Option<Json<Vec<RecordedStep>>>, _>("steps")?
                .map(|Json(steps)| steps)
                .unwrap_or_default(),
        })
    }};
}

pub(super) use {abandoned, decode_record, shared_storage};
