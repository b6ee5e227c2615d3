use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tenant", fingerprint_only = [])]
async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

#[idempotent(scope = "tenant", fingerprint_only = ["/amount", "/amount"])]
async fn update(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

#[idempotent(scope = "tenant", fingerprint_only = "/amount")]
async fn delete(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
