use axum::extract::State;
use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

#[derive(Clone)]
struct AppState {
    name: String,
}

#[idempotent(scope = "tenant", state = AppState)]
async fn create(
    State(state): State<AppState>,
    tenant: String,
    tx: &mut Transaction<'_, Postgres>,
) {
    let _ = (state, tenant, tx);
}

fn main() {
    let state = AppState { name: "app".into() };
    let _ = &state.name;
}
