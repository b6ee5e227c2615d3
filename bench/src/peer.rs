//! The peer: the idempotency design of the book "Zero To Production in Rust" (chapter 11), on
//! the same stack and the same business work, so that idem is compared with the simplest design
//! a Rust team would write by hand.
//!
//! In the handler's transaction: `INSERT` the key `ON CONFLICT DO NOTHING` (a duplicate waits
//! for the first transaction's lock, then finds the row); the business work; `UPDATE` the row
//! with the response; commit. A key that is already there is answered from its row. It has no
//! fingerprint, no 409 and no 422, and it cannot tell a handler's own commit from its own.

/// The peer's key table, as the book has it (headers as JSON instead of a composite type).
pub const TABLE: &str = "CREATE TABLE IF NOT EXISTS peer_idempotency (
    user_id              text        NOT NULL,
    idempotency_key      text        NOT NULL,
    response_status_code smallint,
    response_headers     jsonb,
    response_body        bytea,
    created_at           timestamptz NOT NULL,
    PRIMARY KEY (user_id, idempotency_key)
)";

/// The same table on MySQL (MariaDB): exact keys (`utf8mb4_bin`), InnoDB.
pub const MYSQL_TABLE: &str = "CREATE TABLE IF NOT EXISTS peer_idempotency (
    user_id              VARCHAR(255) COLLATE utf8mb4_bin NOT NULL,
    idempotency_key      VARCHAR(255) COLLATE utf8mb4_bin NOT NULL,
    response_status_code SMALLINT,
    response_headers     JSON,
    response_body        LONGBLOB,
    created_at           DATETIME(6) NOT NULL,
    PRIMARY KEY (user_id, idempotency_key)
) ENGINE = InnoDB";

/// The peer's handler on one database, from its three statements (parameters in the order
/// they are bound: the key's `user_id` and `idempotency_key`; for the `UPDATE`, the response's
/// status, headers and body first).
macro_rules! peer {
    ($db:ty, $insert:literal, $update:literal, $select:literal) => {
        use axum::{
            body::Body,
            extract::State,
            http::{HeaderMap, StatusCode},
            response::{IntoResponse, Response},
        };
        use idem_examples::{
            auth::Tenant,
            error::ApiJson,
            payments::{self, AppState, NewTransfer},
        };
        use sqlx::{Pool, Row};

        /// `POST /peer/payments`.
        pub async fn create_payment(
            tenant: Tenant,
            headers: HeaderMap,
            State(state): State<AppState<$db>>,
            ApiJson(body): ApiJson<NewTransfer>,
        ) -> Response {
            let Some(key) = headers
                .get("idempotency-key")
                .and_then(|key| key.to_str().ok())
            else {
                return (StatusCode::BAD_REQUEST, "an Idempotency-Key is required").into_response();
            };
            match run(&tenant, key, state.store.pool(), body).await {
                Ok(response) => response,
                Err(error) => {
                    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
                }
            }
        }

        async fn run(
            tenant: &Tenant,
            key: &str,
            pool: &Pool<$db>,
            body: NewTransfer,
        ) -> Result<Response, sqlx::Error> {
            let mut tx = pool.begin().await?;
            let inserted = sqlx::query($insert)
                .bind(&tenant.0)
                .bind(key)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if inserted == 0 {
                tx.rollback().await?;
                return saved_response(tenant, key, pool).await;
            }
            let response = payments::record_payment(tenant, &mut tx, body).await?;
            let (parts, body) = response.into_parts();
            let bytes = axum::body::to_bytes(body, usize::MAX)
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            let stored_headers: Vec<(&str, &str)> = parts
                .headers
                .iter()
                .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?)))
                .collect();
            sqlx::query($update)
                .bind(parts.status.as_u16() as i16)
                .bind(sqlx::types::Json(&stored_headers))
                .bind(&bytes[..])
                .bind(&tenant.0)
                .bind(key)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(Response::from_parts(parts, Body::from(bytes)))
        }

        /// The stored response of a key that is there.
        async fn saved_response(
            tenant: &Tenant,
            key: &str,
            pool: &Pool<$db>,
        ) -> Result<Response, sqlx::Error> {
            let row = sqlx::query($select)
                .bind(&tenant.0)
                .bind(key)
                .fetch_one(pool)
                .await?;
            let status: Option<i16> = row.try_get(0)?;
            let Some(status) = status else {
                return Ok((
                    StatusCode::CONFLICT,
                    "the first request has not saved its response",
                )
                    .into_response());
            };
            let headers: sqlx::types::Json<Vec<(String, String)>> = row.try_get(1)?;
            let body: Vec<u8> = row.try_get(2)?;
            let mut response = Response::new(Body::from(body));
            *response.status_mut() = StatusCode::from_u16(status as u16).unwrap_or(StatusCode::OK);
            for (name, value) in headers.0 {
                if let (Ok(name), Ok(value)) = (
                    axum::http::HeaderName::try_from(name),
                    axum::http::HeaderValue::try_from(value),
                ) {
                    response.headers_mut().append(name, value);
                }
            }
            response.headers_mut().insert(
                "idempotent-replayed",
                axum::http::HeaderValue::from_static("true"),
            );
            Ok(response)
        }
    };
}

/// The peer on PostgreSQL.
pub mod postgres {
    peer!(
        sqlx::Postgres,
        "INSERT INTO peer_idempotency (user_id, idempotency_key, created_at) \
         VALUES ($1, $2, now()) ON CONFLICT DO NOTHING",
        "UPDATE peer_idempotency SET response_status_code = $1, response_headers = $2, \
         response_body = $3 WHERE user_id = $4 AND idempotency_key = $5",
        "SELECT response_status_code, response_headers, response_body FROM peer_idempotency \
         WHERE user_id = $1 AND idempotency_key = $2"
    );
}

/// The peer on MySQL: `INSERT IGNORE` waits for the first transaction's lock as PostgreSQL's
/// `ON CONFLICT DO NOTHING` does.
pub mod mysql {
    peer!(
        sqlx::MySql,
        "INSERT IGNORE INTO peer_idempotency (user_id, idempotency_key, created_at) \
         VALUES (?, ?, UTC_TIMESTAMP(6))",
        "UPDATE peer_idempotency SET response_status_code = ?, response_headers = ?, \
         response_body = ? WHERE user_id = ? AND idempotency_key = ?",
        "SELECT response_status_code, response_headers, response_body FROM peer_idempotency \
         WHERE user_id = ? AND idempotency_key = ?"
    );
}
