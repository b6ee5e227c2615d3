use axum::{Router, routing::post};
use idem_runtime::{Backend, Store, idempotent};
use sqlx::{Postgres, Transaction};

// Refused (no scope); routed with its type argument, it adds no error of its own.
#[idempotent(retention = "1h")]
async fn create<DB: Backend>(tenant: String, tx: &mut Transaction<'_, DB>) {
    let _ = (tenant, tx);
}

fn main() {
    let _router: Router<Store<Postgres>> = Router::new().route("/", post(create::<Postgres>));
}
