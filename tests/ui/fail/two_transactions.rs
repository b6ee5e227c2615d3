use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(global)]
async fn create(tx: &mut Transaction<'_, Postgres>, audit: &mut Transaction<'_, Postgres>) {
    let _ = (tx, audit);
}

fn main() {}
