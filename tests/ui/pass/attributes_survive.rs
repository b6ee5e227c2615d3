//! Doc comments, lint attributes and `pub(crate)` visibility survive the rewrite: the crate
//! denies unused variables and the route is registered from another module.

#![deny(unused_variables)]

mod handlers {
    use axum::{Json, extract::Path, http::StatusCode};
    use idem_runtime::idempotent;
    use sqlx::{Postgres, Transaction};

    /// Creates a payment.
    ///
    /// Retried requests with the same `Idempotency-Key` get the same answer.
    #[idempotent(scope = "account")]
    #[allow(unused_variables)]
    pub(crate) async fn create_payment(
        Path(account): Path<String>,
        tx: &mut Transaction<'_, Postgres>,
        Json(body): Json<serde_json::Value>,
    ) -> StatusCode {
        let unused = 1;
        StatusCode::CREATED
    }
}

use axum::{Router, routing::post};
use idem_runtime::Store;
use sqlx::Postgres;

fn router() -> Router<Store<Postgres>> {
    Router::new().route(
        "/accounts/{account}/payments",
        post(handlers::create_payment),
    )
}

pub fn main() {
    let _ = router;
}
