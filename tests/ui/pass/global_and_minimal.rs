//! `global` keys (with and without other extractors), and a handler whose only parameters are
//! the scope extractor and the transaction.

use std::borrow::Cow;

use axum::{
    Json, Router,
    extract::FromRequestParts,
    http::{StatusCode, request::Parts},
    routing::post,
};
use idem_runtime::{IdempotencyScope, Store, idempotent};
use sqlx::{Postgres, Transaction};

struct Tenant(String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("x-tenant")
            .and_then(|value| value.to_str().ok())
            .map(|value| Self(value.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl IdempotencyScope for Tenant {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[idempotent(global, retention = "90m")]
async fn import(tx: &mut Transaction<'_, Postgres>, Json(rows): Json<Vec<i64>>) -> StatusCode {
    let _ = (&mut **tx, rows);
    StatusCode::ACCEPTED
}

#[idempotent(global)]
async fn rotate(tx: &mut Transaction<'_, Postgres>) {
    let _ = &mut **tx;
}

#[idempotent(scope = "tenant")]
async fn close_account(tenant: Tenant, tx: &mut Transaction<'_, Postgres>) -> StatusCode {
    let _ = sqlx::query("UPDATE accounts SET closed = true WHERE tenant = $1")
        .bind(&tenant.0)
        .execute(&mut **tx)
        .await;
    StatusCode::NO_CONTENT
}

fn router() -> Router<Store<Postgres>> {
    Router::new()
        .route("/imports", post(import))
        .route("/keys/rotate", post(rotate))
        .route("/account/close", post(close_account))
}

pub fn main() {
    let _ = router;
}
