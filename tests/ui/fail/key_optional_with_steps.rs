use idem_runtime::{Steps, idempotent};
use sqlx::Postgres;

// A request without a key has no claim to record its steps on.
#[idempotent(scope = "tenant", key_optional, external)]
async fn create(tenant: String, steps: Steps<Postgres>) {
    let _ = (tenant, steps);
}

fn main() {}
