use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(global)]
async fn create(tx: &mut Transaction<'_, Postgres>) -> &'static str {
    let _ = tx;
    "ok"
}

#[idempotent(global)]
async fn create_borrowed<'a>(tx: &'a mut Transaction<'_, Postgres>) -> &'a str {
    let _ = tx;
    "ok"
}

fn main() {}
