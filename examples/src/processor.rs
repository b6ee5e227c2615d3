//! A simulated card processor, run as its own process (`cargo run --bin processor`). It honours
//! `Idempotency-Key`: a refund requested again with a key it has seen is not executed again; the
//! refund it already made is returned.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use idem_runtime::Problem;
use serde::{Deserialize, Serialize};

/// A refund request, as the payments service sends it.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct RefundRequest {
    /// The payment refunded.
    pub payment: String,
    /// In minor units.
    pub amount: i64,
    /// The payment's customer (`cus_slow` answers after about a second).
    pub customer: String,
}

/// A refund the processor executed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct ExecutedRefund {
    /// `re_...`.
    pub id: String,
    /// The payment refunded.
    pub payment: String,
    /// In minor units.
    pub amount: i64,
    /// Always `refunded`.
    pub status: String,
}

#[derive(Debug, Default)]
struct Ledger {
    executed: Vec<ExecutedRefund>,
    by_key: HashMap<String, usize>,
}

/// The processor's state: every refund it executed, in memory.
#[derive(Debug, Clone, Default)]
pub struct Processor {
    ledger: Arc<Mutex<Ledger>>,
}

/// The processor's API: `POST /v1/refunds`, `GET /v1/refunds`.
pub fn router() -> Router {
    Router::new()
        .route("/v1/refunds", post(refund).get(list))
        .with_state(Processor::default())
}

async fn refund(
    State(processor): State<Processor>,
    headers: HeaderMap,
    Json(request): Json<RefundRequest>,
) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
    else {
        return Problem::new(StatusCode::BAD_REQUEST, "Idempotency-Key header is missing")
            .with_detail("the processor requires an Idempotency-Key on every refund")
            .into_response();
    };
    let (refund, replayed) = {
        let mut ledger = processor.ledger.lock().expect("ledger lock");
        match ledger.by_key.get(key) {
            Some(&index) => (ledger.executed[index].clone(), true),
            None => {
                let refund = ExecutedRefund {
                    id: format!("re_{}", uuid::Uuid::new_v4().simple()),
                    payment: request.payment.clone(),
                    amount: request.amount,
                    status: "refunded".to_owned(),
                };
                // Recorded at once: the money moves before the answer leaves.
                ledger.executed.push(refund.clone());
                let index = ledger.executed.len() - 1;
                ledger.by_key.insert(key.to_owned(), index);
                (refund, false)
            }
        }
    };
    if request.customer == "cus_slow" {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if replayed {
        (
            StatusCode::OK,
            [("idempotent-replayed", "true")],
            Json(refund),
        )
            .into_response()
    } else {
        (StatusCode::CREATED, Json(refund)).into_response()
    }
}

async fn list(State(processor): State<Processor>) -> Json<Vec<ExecutedRefund>> {
    Json(
        processor
            .ledger
            .lock()
            .expect("ledger lock")
            .executed
            .clone(),
    )
}
