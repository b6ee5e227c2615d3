//! `impl IntoResponse` returns, bare and inside a `Result`.

use axum::{
    Json, Router,
    extract::Path,
    http::StatusCode,
    response::IntoResponse,
    routing::post,
};
use idem_runtime::{Store, idempotent};
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "account")]
async fn create_payment(
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<serde_json::Value>,
) -> impl IntoResponse {
    let _ = &mut **tx;
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "account": account, "request": body })),
    )
}

#[idempotent(scope = "account")]
async fn create_payout(
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<impl IntoResponse, StatusCode> {
    sqlx::query("INSERT INTO payouts (account) VALUES ($1)")
        .bind(&account)
        .execute(&mut **tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, account))
}

fn router() -> Router<Store<Postgres>> {
    Router::new()
        .route("/accounts/{account}/payments", post(create_payment))
        .route("/accounts/{account}/payouts", post(create_payout))
}

pub fn main() {
    let _ = router;
}
