//! The first example of the README, as written there.
use axum::{
    Json, Router,
    extract::{FromRef, Path},
    http::StatusCode,
    routing::post,
};
use idem_runtime::{Store, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, Transaction};

#[derive(Clone)]
struct AppState {
    store: Store<Postgres>,
}

impl FromRef<AppState> for Store<Postgres> {
    fn from_ref(state: &AppState) -> Self {
        state.store.clone()
    }
}

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
}

#[derive(Serialize)]
struct Payment {
    id: i64,
    amount: i64,
}

#[idempotent(scope = "tenant", retention = "24h", state = AppState)]
async fn create_payment(
    Path(tenant): Path<String>,         // any extractor; `scope` names it
    tx: &mut Transaction<'_, Postgres>, // begun, claimed and committed by the macro
    Json(body): Json<NewPayment>,
) -> Result<(StatusCode, Json<Payment>), StatusCode> {
    let id: i64 =
        sqlx::query_scalar("INSERT INTO payments (tenant, amount) VALUES ($1, $2) RETURNING id")
            .bind(&tenant)
            .bind(body.amount)
            .fetch_one(&mut **tx)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(Payment { id, amount: body.amount })))
}

fn app(pool: PgPool) -> Router {
    Router::new()
        .route("/v1/tenants/{tenant}/payments", post(create_payment)) // an ordinary handler
        .with_state(AppState {
            store: Store::new(pool),
        })
}

pub fn main() {
    let _ = app;
}
