//! PostgreSQL: the key is held by a transaction-scoped advisory lock while the handler runs, and
//! written once, completed, in the handler's commit.

use sqlx::{
    PgConnection, PgPool, Postgres, Row, Transaction, migrate::MigrateError, postgres::PgRow,
    types::Json,
};

use super::Backend;
use crate::{
    fingerprint::Fingerprint,
    record::{Completion, KeyRecord, KeyRef, KeyStatus, Lookup, StoredResponse},
};

const CLAIM: &str = "SELECT acquired, status, method, path, fingerprint, \
     response_status, response_headers, response_body FROM idem_claim($1, $2, $3)";

const COMPLETE: &str = "INSERT INTO idem_keys AS k \
     (scope, key, method, path, fingerprint, status, response_status, response_headers, \
      response_body, created_at, expires_at, locked_at) \
     VALUES ($1, $2, $3, $4, $5, 'completed', $6, $7, $8, now(), \
             now() + make_interval(secs => $9), NULL) \
     ON CONFLICT (scope, key) DO UPDATE SET \
       method = EXCLUDED.method, path = EXCLUDED.path, fingerprint = EXCLUDED.fingerprint, \
       status = 'completed', response_status = EXCLUDED.response_status, \
       response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body, \
       created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at, locked_at = NULL \
     WHERE k.expires_at <= now()";

impl Backend for Postgres {
    const NAME: &'static str = "postgres";

    async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        // The claim's correctness rests on READ COMMITTED snapshots (see the migration).
        pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
    }

    async fn claim(conn: &mut PgConnection, key: &KeyRef) -> Result<Lookup, sqlx::Error> {
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

    async fn complete(conn: &mut PgConnection, c: &Completion<'_>) -> Result<bool, sqlx::Error> {
        let status =
            i16::try_from(c.response.status).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        let done = sqlx::query(COMPLETE)
            .bind(&c.key.scope)
            .bind(&c.key.key)
            .bind(c.method)
            .bind(c.path)
            .bind(&c.fingerprint.as_bytes()[..])
            .bind(status)
            .bind(Json(&c.response.headers))
            .bind(&c.response.body)
            .bind(c.retention.as_secs_f64())
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn savepoint(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql("SAVEPOINT idem_handler")
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn rollback_to_savepoint(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql("ROLLBACK TO SAVEPOINT idem_handler")
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
        let mut migrator = sqlx::migrate!("../migrations/postgres");
        migrator.set_ignore_missing(true);
        migrator.dangerous_set_table_name("_idem_migrations");
        migrator.run(pool).await
    }
}

fn decode_record(row: &PgRow) -> Result<Option<KeyRecord>, sqlx::Error> {
    let Some(status) = row.try_get::<Option<String>, _>("status")? else {
        return Ok(None);
    };
    let status = match status.as_str() {
        "completed" => KeyStatus::Completed,
        "started" => KeyStatus::Started,
        other => {
            return Err(sqlx::Error::Decode(
                format!("unknown idem_keys.status {other:?}").into(),
            ));
        }
    };
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let fingerprint = Fingerprint::from_slice(&fingerprint)
        .ok_or_else(|| sqlx::Error::Decode("idem_keys.fingerprint is not 32 bytes".into()))?;
    let response = match row.try_get::<Option<i16>, _>("response_status")? {
        Some(code) => Some(StoredResponse {
            status: u16::try_from(code).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            headers: row
                .try_get::<Option<Json<Vec<(String, String)>>>, _>("response_headers")?
                .map(|Json(h)| h)
                .unwrap_or_default(),
            body: row
                .try_get::<Option<Vec<u8>>, _>("response_body")?
                .unwrap_or_default(),
        }),
        None => None,
    };
    Ok(Some(KeyRecord {
        status,
        method: row.try_get("method")?,
        path: row.try_get("path")?,
        fingerprint,
        response,
    }))
}
