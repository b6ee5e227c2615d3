//! `state = AppState` names a state that does not provide the store, and the router is built
//! with that state: the first error is the missing `FromRef`, at the attribute, and the router
//! keeps `AppState` as its state (the handler is a handler of that state only), so the second
//! says the handler does not fit it, not "expected `Store<Sqlite>`, found `AppState`" at
//! `.with_state`.
use axum::{Router, extract::Path, routing::post};
use idem_runtime::idempotent;
use sqlx::{Sqlite, Transaction};

#[derive(Clone)]
struct AppState {
    name: String,
}

#[idempotent(scope = "account", state = AppState)]
async fn create(Path(account): Path<String>, tx: &mut Transaction<'_, Sqlite>) {
    let _ = (account, tx);
}

fn app() -> Router {
    Router::new()
        .route("/accounts/{account}/payments", post(create))
        .with_state(AppState { name: "app".into() })
}

fn main() {
    let _ = app;
}
