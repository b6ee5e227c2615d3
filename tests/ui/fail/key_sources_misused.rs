use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

// A pointer that is not one, a header name with a space, two sources, a value after
// `key_optional`.
#[idempotent(scope = "tenant", key_pointer = "request_id")]
async fn not_a_pointer(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

#[idempotent(scope = "tenant", key_header = "webhook id")]
async fn not_a_header_name(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

#[idempotent(scope = "tenant", key_header = "webhook-id", key_pointer = "/id")]
async fn two_sources(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

#[idempotent(scope = "tenant", key_optional = true)]
async fn optional_with_a_value(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

#[idempotent(scope = "tenant", key_header = "Idempotency-Key")]
async fn the_default_header_named(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {}
