use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tenant", rpc = "Create")]
async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
