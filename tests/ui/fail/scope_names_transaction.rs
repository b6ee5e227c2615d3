use axum::extract::Path;
use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[idempotent(scope = "tx")]
async fn create(Path(tenant): Path<String>, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
