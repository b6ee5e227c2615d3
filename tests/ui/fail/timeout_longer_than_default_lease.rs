use axum::extract::Path;
use idem_runtime::idempotent;

#[idempotent(external, scope = "account", timeout = "1m", backend = sqlx::Postgres)]
async fn create(Path(account): Path<String>) -> String {
    account
}

fn main() {}
