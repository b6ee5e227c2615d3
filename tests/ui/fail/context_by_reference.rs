use axum::extract::Path;
use idem_runtime::{IdempotencyContext, idempotent};

#[idempotent(scope = "account")]
async fn create(Path(account): Path<String>, ctx: &IdempotencyContext) -> String {
    let _ = ctx;
    account
}

fn main() {}
