use idem_runtime::{Steps, idempotent};
use sqlx::Postgres;

#[idempotent(global)]
async fn create(steps: Steps<Postgres>) {
    let _ = steps;
}

fn main() {}
