use axum::extract::Path;
use idem_runtime::{IdempotencyContext, idempotent};

#[idempotent(external, scope = "account", backend = sqlx::Postgres)]
async fn create(Path(account): Path<String>, ctx: &IdempotencyContext) -> String {
    let _ = ctx;
    account
}

fn main() {}
