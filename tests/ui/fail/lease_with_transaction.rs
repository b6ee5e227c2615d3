use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tenant", lease = "5s")]
async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
