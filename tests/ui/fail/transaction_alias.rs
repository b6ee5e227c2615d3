use idem_runtime::idempotent;
use sqlx::PgTransaction;

#[idempotent(scope = "tenant")]
async fn create(tenant: String, tx: &mut PgTransaction<'_>) {
    let _ = (tenant, tx);
}

fn main() {}
