use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(external, global)]
async fn create(tx: &mut Transaction<'_, Postgres>) {
    let _ = tx;
}

fn main() {}
