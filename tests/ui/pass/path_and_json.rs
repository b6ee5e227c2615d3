//! `Path` as the scope (bound inside its pattern) and `Json` as the body; the state is the
//! `Store` itself.

use axum::{Json, Router, extract::Path, http::StatusCode, routing::post};
use idem_runtime::{Store, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Postgres, Transaction};

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
}

#[derive(Serialize)]
struct Payment {
    account: String,
    amount: i64,
}

#[idempotent(scope = "account", retention = "7d")]
async fn create_payment(
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<NewPayment>,
) -> (StatusCode, Json<Payment>) {
    let _ = &mut **tx;
    (
        StatusCode::CREATED,
        Json(Payment {
            account,
            amount: body.amount,
        }),
    )
}

fn router() -> Router<Store<Postgres>> {
    Router::new().route("/accounts/{account}/payments", post(create_payment))
}

pub fn main() {
    let _ = router;
}
