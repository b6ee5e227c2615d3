//! Keys from elsewhere than `Idempotency-Key`: a header, a field of the body, optional, on a
//! free function, on an associated function (the source is named in the signature's type, so
//! no item is needed beside the handler), and under `#[cfg]`.
use axum::{Json, Router, http::StatusCode, routing::post};
use idem_runtime::{Store, idempotent};
use serde_json::Value;
use sqlx::{Postgres, Transaction};

struct Webhooks;

impl Webhooks {
    #[idempotent(global, key_header = "webhook-id")]
    async fn receive(tx: &mut Transaction<'_, Postgres>, body: String) -> StatusCode {
        let _ = (tx, body);
        StatusCode::OK
    }

    #[idempotent(global, key_pointer = "/id", key_optional)]
    async fn receive_in_body(tx: &mut Transaction<'_, Postgres>, Json(body): Json<Value>) -> StatusCode {
        let _ = (tx, body);
        StatusCode::OK
    }
}

#[idempotent(scope = "tenant", key_optional)]
pub async fn optional(tenant: String, tx: &mut Transaction<'_, Postgres>) -> StatusCode {
    let _ = (tenant, tx);
    StatusCode::CREATED
}

#[idempotent(global, key_header = "X-GitHub-Delivery")]
#[cfg(any())]
async fn compiled_out(tx: &mut Transaction<'_, Postgres>) -> StatusCode {
    let _ = tx;
    StatusCode::OK
}

fn router() -> Router<Store<Postgres>> {
    Router::new()
        .route("/hooks", post(Webhooks::receive))
        .route("/hooks-in-body", post(Webhooks::receive_in_body))
        .route("/optional", post(optional))
}

pub fn main() {
    let _ = router;
}
