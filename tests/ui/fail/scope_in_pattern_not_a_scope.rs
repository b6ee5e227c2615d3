use axum::{Extension, Json};
use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[derive(Clone)]
struct Caller(String);

#[idempotent(scope = "caller")]
async fn create(
    Extension(caller): Extension<Caller>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<serde_json::Value>,
) {
    let _ = (caller.0, tx, body);
}

fn main() {}
