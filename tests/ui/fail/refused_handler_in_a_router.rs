use axum::{Router, routing::post};
use idem_runtime::{Store, idempotent};
use sqlx::{Postgres, Transaction};

// The attribute refuses the handler (no scope); the router that uses it adds no error.
#[idempotent(retention = "1h")]
async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}

fn main() {
    let _router: Router<Store<Postgres>> = Router::new().route("/", post(create));
}
