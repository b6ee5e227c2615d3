//! A simulated card processor, run as its own process (`cargo run --bin processor`). It honours
//! `Idempotency-Key`: a refund or a charge requested again with a key it has seen is not executed
//! again; the one it already made is returned. Charges react to magic customer ids:
//! `cus_declined` is declined (402), `cus_unavailable` finds it down (503); neither is recorded.
//!
//! Given a URL ([`router_with`], `$WEBHOOK_URL` for the binary), it sends webhooks of what it
//! settles, signed as Standard Webhooks v1 specifies and redelivered until answered
//! ([`crate::processor_webhooks`]): `balance.credited` for each charge it executes for a tenant
//! (the charging tenant's balance grows by the amount), `refund.succeeded` for each refund.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use idem_runtime::Problem;

use crate::processor_webhooks::{Delivery, WebhookSender};
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

/// A charge request, as the payments service sends it.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ChargeRequest {
    /// The customer charged.
    pub customer: String,
    /// In minor units.
    pub amount: i64,
    /// The tenant charging, whose balance the charge credits (`balance.credited`); none, no
    /// webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// A charge the processor executed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct ExecutedCharge {
    /// `ch_...`.
    pub id: String,
    /// The customer charged.
    pub customer: String,
    /// In minor units.
    pub amount: i64,
    /// Always `succeeded`.
    pub status: String,
}

#[derive(Debug, Default)]
struct Ledger {
    executed: Vec<ExecutedRefund>,
    by_key: HashMap<String, usize>,
    charges: Vec<ExecutedCharge>,
    charge_keys: HashMap<String, usize>,
}

/// The processor's state: every refund and charge it executed, in memory, and where its
/// webhooks go.
#[derive(Debug, Clone, Default)]
pub struct Processor {
    ledger: Arc<Mutex<Ledger>>,
    webhooks: WebhookSender,
}

/// The processor's API, sending no webhooks: `POST /v1/refunds`, `GET /v1/refunds`,
/// `POST /v1/charges`, `GET /v1/charges`, `GET /v1/charges/by-key/{key}` (the charge made
/// under an idempotency key, if any: how a caller that lost the answer finds out whether the
/// charge happened), and `GET /v1/webhooks/deliveries` (none here).
pub fn router() -> Router {
    router_with(WebhookSender::default())
}

/// The processor's API ([`router`]), sending its webhooks with `webhooks`;
/// `GET /v1/webhooks/deliveries` lists them and their attempts.
pub fn router_with(webhooks: WebhookSender) -> Router {
    Router::new()
        .route("/v1/refunds", post(refund).get(list))
        .route("/v1/charges", post(charge).get(list_charges))
        .route("/v1/charges/by-key/{key}", get(charge_by_key))
        .route("/v1/webhooks/deliveries", get(deliveries))
        .with_state(Processor {
            ledger: Arc::default(),
            webhooks,
        })
}

/// `GET /v1/webhooks/deliveries`: every webhook sent, in order, with its attempts.
async fn deliveries(State(processor): State<Processor>) -> Json<Vec<Delivery>> {
    Json(processor.webhooks.deliveries())
}

fn idempotency_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
}

fn missing_key(what: &str) -> Response {
    Problem::new(StatusCode::BAD_REQUEST, "Idempotency-Key header is missing")
        .with_detail(format!(
            "the processor requires an Idempotency-Key on every {what}"
        ))
        .into_response()
}

/// `POST /v1/charges`: executes the charge once per key (a key it has seen answers the charge
/// it made, 200 with `Idempotent-Replayed: true`); 402 for `cus_declined`, 503 for
/// `cus_unavailable`, nothing recorded for either.
async fn charge(
    State(processor): State<Processor>,
    headers: HeaderMap,
    Json(request): Json<ChargeRequest>,
) -> Response {
    let Some(key) = idempotency_key(&headers) else {
        return missing_key("charge");
    };
    match request.customer.as_str() {
        "cus_declined" => {
            return Problem::new(StatusCode::PAYMENT_REQUIRED, "The card was declined")
                .with_detail(format!(
                    "the card issuer declined a charge of {}",
                    request.amount
                ))
                .into_response();
        }
        "cus_unavailable" => {
            return Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "The processor is unavailable",
            )
            .with_detail("nothing was charged; retry with the same key")
            .into_response();
        }
        _ => {}
    }
    let (charge, replayed) = {
        let mut ledger = processor.ledger.lock().expect("ledger lock");
        match ledger.charge_keys.get(key) {
            Some(&index) => (ledger.charges[index].clone(), true),
            None => {
                let charge = ExecutedCharge {
                    id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
                    customer: request.customer.clone(),
                    amount: request.amount,
                    status: "succeeded".to_owned(),
                };
                ledger.charges.push(charge.clone());
                let index = ledger.charges.len() - 1;
                ledger.charge_keys.insert(key.to_owned(), index);
                // Once per charge executed, never for a replay.
                if let Some(tenant) = &request.tenant {
                    processor.webhooks.send(
                        crate::webhooks::BALANCE_CREDITED,
                        serde_json::json!({"tenant": tenant, "amount": charge.amount}),
                    );
                }
                (charge, false)
            }
        }
    };
    if replayed {
        (
            StatusCode::OK,
            [("idempotent-replayed", "true")],
            Json(charge),
        )
            .into_response()
    } else {
        (StatusCode::CREATED, Json(charge)).into_response()
    }
}

/// `GET /v1/charges/by-key/{key}`: the charge made under `key`, or 404.
async fn charge_by_key(State(processor): State<Processor>, Path(key): Path<String>) -> Response {
    let ledger = processor.ledger.lock().expect("ledger lock");
    match ledger.charge_keys.get(&key) {
        Some(&index) => Json(ledger.charges[index].clone()).into_response(),
        None => Problem::new(StatusCode::NOT_FOUND, "No charge under this key")
            .with_detail("nothing was charged with this idempotency key")
            .into_response(),
    }
}

/// `GET /v1/charges`: every charge executed, in order.
async fn list_charges(State(processor): State<Processor>) -> Json<Vec<ExecutedCharge>> {
    Json(
        processor
            .ledger
            .lock()
            .expect("ledger lock")
            .charges
            .clone(),
    )
}

async fn refund(
    State(processor): State<Processor>,
    headers: HeaderMap,
    Json(request): Json<RefundRequest>,
) -> Response {
    let Some(key) = idempotency_key(&headers) else {
        return missing_key("refund");
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
                processor.webhooks.send(
                    "refund.succeeded",
                    serde_json::json!({"refund": refund.id, "payment": refund.payment,
                        "amount": refund.amount}),
                );
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
