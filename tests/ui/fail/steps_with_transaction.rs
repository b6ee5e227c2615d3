use idem_runtime::{Steps, idempotent};
use sqlx::{Postgres, Transaction};

#[idempotent(global)]
async fn create(tx: &mut Transaction<'_, Postgres>, steps: Steps<Postgres>) {
    let _ = (tx, steps);
}

fn main() {}
