//! External mode: no transaction parameter, `external` in the attribute; a `lease`; the
//! idempotency context for a downstream key; with and without a body; on each backend, named
//! with `backend` (this crate enables both, so none is the default).

use axum::{Json, Router, extract::Path, http::StatusCode, routing::post};
use idem_runtime::{IdempotencyContext, Store, idempotent};
use sqlx::Postgres;

#[idempotent(external, scope = "account", retention = "24h", lease = "5s", backend = Postgres)]
async fn send_email(
    Path(account): Path<String>,
    ctx: IdempotencyContext,
    Json(body): Json<serde_json::Value>,
) -> (StatusCode, String) {
    let downstream_key = ctx.derive("email");
    (StatusCode::ACCEPTED, format!("{account} {downstream_key} {body}"))
}

/// Default lease, no context, no body.
#[idempotent(external, scope = "account", backend = Postgres)]
async fn ping(Path(account): Path<String>) -> String {
    account
}

/// The context in transactional mode too.
#[idempotent(global)]
async fn charge(ctx: IdempotencyContext, tx: &mut sqlx::Transaction<'_, Postgres>) -> String {
    let _ = &mut **tx;
    ctx.derive("charge")
}

/// External mode on SQLite: no transaction names the database, `backend` does.
#[idempotent(external, scope = "account", backend = sqlx::Sqlite)]
async fn ping_sqlite(Path(account): Path<String>) -> String {
    account
}

fn sqlite_router() -> Router<Store<sqlx::Sqlite>> {
    Router::new().route("/accounts/{account}/ping", post(ping_sqlite))
}

fn router() -> Router<Store<Postgres>> {
    Router::new()
        .route("/accounts/{account}/emails", post(send_email))
        .route("/accounts/{account}/ping", post(ping))
        .route("/charges", post(charge))
}

pub fn main() {
    let _ = (router, sqlite_router);
}
