use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tenant")]
async fn create(tenant: String, tx: Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
