use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tenant")]
async fn create<'a>(tenant: String, tx: &mut Transaction<'a, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
