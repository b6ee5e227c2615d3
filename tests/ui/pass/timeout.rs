//! `timeout`: in transactional mode (where it is not bounded by any lease, and the body returns
//! early with `?`), and in external mode, shorter than the lease, on both backends.

use axum::{
    Json, Router,
    extract::Path,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use idem_runtime::{IdempotencyContext, Store, idempotent};
use sqlx::{Postgres, Sqlite, Transaction};

#[idempotent(scope = "account", retention = "24h", timeout = "2m")]
async fn create_payment(
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<serde_json::Value>,
) -> Result<impl IntoResponse, StatusCode> {
    sqlx::query("SELECT 1")
        .execute(&mut **tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, format!("{account} {body}")))
}

/// An hour-long timeout (longer than the default lease) is fine with a transaction.
#[idempotent(global, timeout = "1h")]
async fn create_sqlite(tx: &mut Transaction<'_, Sqlite>) -> Response {
    let _ = &mut **tx;
    StatusCode::CREATED.into_response()
}

#[idempotent(external, scope = "account", lease = "1m", timeout = "59s", backend = sqlx::Postgres)]
async fn send_email(Path(account): Path<String>, ctx: IdempotencyContext) -> String {
    format!("{account} {}", ctx.derive("email"))
}

/// Shorter than the default lease (30 s).
#[idempotent(external, scope = "account", timeout = "10s", backend = sqlx::Sqlite)]
async fn ping_sqlite(Path(account): Path<String>) -> String {
    account
}

fn router() -> Router<Store<Postgres>> {
    Router::new()
        .route("/accounts/{account}/payments", post(create_payment))
        .route("/accounts/{account}/emails", post(send_email))
}

fn sqlite_router() -> Router<Store<Sqlite>> {
    Router::new()
        .route("/payments", post(create_sqlite))
        .route("/accounts/{account}/ping", post(ping_sqlite))
}

pub fn main() {
    let _ = (router, sqlite_router);
}
