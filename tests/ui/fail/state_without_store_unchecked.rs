use axum::{Json, Router, extract::Path, routing::post};
use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

/// A state that does not provide `idem_runtime::Store<Postgres>` through `FromRef`, and no
/// `state = AppState` in the attribute: the error can only come at `.route(...)`.
#[derive(Clone)]
struct AppState {
    name: String,
}

#[idempotent(scope = "account")]
async fn create(
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<serde_json::Value>,
) {
    let _ = (account, tx, body);
}

fn router() -> Router<AppState> {
    Router::new().route("/accounts/{account}/payments", post(create))
}

fn main() {
    let _ = router;
}
