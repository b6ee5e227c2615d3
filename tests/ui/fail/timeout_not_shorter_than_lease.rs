use axum::extract::Path;
use idem_runtime::idempotent;

// The lease starts at the claim, before the body: a body allowed the whole lease could still
// be running when a retry takes the key over.
#[idempotent(external, scope = "account", lease = "5s", timeout = "5s", backend = sqlx::Postgres)]
async fn create(Path(account): Path<String>) -> String {
    account
}

fn main() {}
