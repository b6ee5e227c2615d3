use axum::Json;
use idem_runtime::idempotent;

#[idempotent(scope = "tenant", retention = "1.5h", replay_5xx = 1)]
fn create(Json(body): Json<serde_json::Value>, tenant: String) {
    let _ = (body, tenant);
}

fn main() {}
