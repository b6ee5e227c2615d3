use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(global)]
async fn create(tx: &mut Transaction<'_, Postgres>) -> &str {
    let _ = tx;
    "ok"
}

fn main() {}
