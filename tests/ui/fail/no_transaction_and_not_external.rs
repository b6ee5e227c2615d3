//! A handler that lost its transaction parameter is not silently an external one: the error
//! offers both fixes.
use axum::extract::Path;
use idem_runtime::idempotent;

#[idempotent(scope = "account")]
async fn create(Path(account): Path<String>) -> String {
    account
}

fn main() {}
