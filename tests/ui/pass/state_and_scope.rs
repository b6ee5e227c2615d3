//! `State` plus a custom scope extractor, the transaction in the middle, `Json` last.

use std::borrow::Cow;

use axum::{
    Json, Router,
    extract::{FromRef, FromRequestParts, State},
    http::{StatusCode, request::Parts},
    routing::post,
};
use idem_runtime::{IdempotencyScope, Store, idempotent};
use serde::Deserialize;
use sqlx::{Postgres, Transaction};

#[derive(Clone)]
struct AppState {
    store: Store<Postgres>,
    currency: &'static str,
}

impl FromRef<AppState> for Store<Postgres> {
    fn from_ref(state: &AppState) -> Self {
        state.store.clone()
    }
}

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

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
}

#[idempotent(scope = "tenant", retention = "1h30m", replay_5xx = true, state = AppState)]
async fn create_payment(
    State(state): State<AppState>,
    tenant: Tenant,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<NewPayment>,
) -> StatusCode {
    let _ = sqlx::query("INSERT INTO payments (tenant, amount, currency) VALUES ($1, $2, $3)")
        .bind(&tenant.0)
        .bind(body.amount)
        .bind(state.currency)
        .execute(&mut **tx)
        .await;
    StatusCode::CREATED
}

fn router() -> Router<AppState> {
    Router::new().route("/payments", post(create_payment))
}

pub fn main() {
    let _ = router;
}
