//! A `Result` return whose body uses `?` and an early `return`.

use axum::{Json, Router, extract::Path, http::StatusCode, routing::post};
use idem_runtime::{Store, idempotent};
use serde::Deserialize;
use sqlx::{Postgres, Transaction};

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
}

#[idempotent(scope = "account")]
async fn create_payment(
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<NewPayment>,
) -> Result<(StatusCode, String), StatusCode> {
    if body.amount <= 0 {
        return Err(StatusCode::BAD_REQUEST);
    }
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO payments (account, amount) VALUES ($1, $2) RETURNING id",
    )
    .bind(&account)
    .bind(body.amount)
    .fetch_one(&mut **tx)
    .await
    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, id.to_string()))
}

fn router() -> Router<Store<Postgres>> {
    Router::new().route("/accounts/{account}/payments", post(create_payment))
}

pub fn main() {
    let _ = router;
}
