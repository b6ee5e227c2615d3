use axum::extract::Path;
use idem_runtime::idempotent;

#[idempotent(scope = "account", retention = "1h", lease = "2h")]
async fn create(Path(account): Path<String>) -> String {
    account
}

fn main() {}
