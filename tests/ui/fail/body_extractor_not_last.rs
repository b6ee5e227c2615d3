use axum::{Json, extract::Path};
use idem_runtime::idempotent;
use serde::Deserialize;
use sqlx::{Postgres, Transaction};

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
}

#[idempotent(scope = "account")]
async fn create(
    Json(body): Json<NewPayment>,
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
) {
    let _ = (body.amount, account, tx);
}

fn main() {}
