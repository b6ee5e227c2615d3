use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tenant", fingerprint_except = ["/sent_at", "trace_id", "/a~2"])]
async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
