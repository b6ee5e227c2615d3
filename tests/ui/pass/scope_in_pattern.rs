//! The scope bound inside a pattern: `Extension(tenant)`, before the body or as the last
//! extractor, and a scope of a built-in type (`u64`).

use axum::{Extension, Json, Router, extract::Path, http::StatusCode, routing::post};
use idem_runtime::{Store, idempotent};
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tenant")]
async fn create_payment(
    Extension(tenant): Extension<String>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<serde_json::Value>,
) -> StatusCode {
    let _ = (tenant, &mut **tx, body);
    StatusCode::CREATED
}

#[idempotent(scope = "tenant")]
async fn cancel_payment(
    tx: &mut Transaction<'_, Postgres>,
    Extension(tenant): Extension<String>,
) -> StatusCode {
    let _ = (tenant, &mut **tx);
    StatusCode::OK
}

#[idempotent(scope = "account")]
async fn refund(Path((account, payment)): Path<(u64, String)>, tx: &mut Transaction<'_, Postgres>) {
    let _ = (account, payment, &mut **tx);
}

fn router() -> Router<Store<Postgres>> {
    Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/cancel", post(cancel_payment))
        .route("/accounts/{account}/payments/{payment}/refund", post(refund))
}

pub fn main() {
    let _ = router;
}
