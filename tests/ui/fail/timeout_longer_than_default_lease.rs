use axum::extract::Path;
use idem_runtime::idempotent;

#[idempotent(scope = "account", timeout = "1m")]
async fn create(Path(account): Path<String>) -> String {
    account
}

fn main() {}
