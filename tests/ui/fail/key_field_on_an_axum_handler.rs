use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

// `key_field` names a field of a tonic request message; an Axum handler has none.
#[idempotent(scope = "tenant", key_field = "request_id")]
async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
