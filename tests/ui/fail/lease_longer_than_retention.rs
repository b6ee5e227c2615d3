use axum::extract::Path;
use idem_runtime::idempotent;

#[idempotent(external, scope = "account", retention = "1h", lease = "2h", backend = sqlx::Postgres)]
async fn create(Path(account): Path<String>) -> String {
    account
}

fn main() {}
