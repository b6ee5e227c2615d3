//! Refunds (`CONTRACT.md` §4): the side effect is outside the database, at the card processor,
//! so the route runs in external mode and hands the processor a key derived from its own.

use axum::{
    Json,
    extract::{Path, State},
    http::{StatusCode, header},
};
use idem_runtime::{IdempotencyContext, idempotent};
use serde::{Deserialize, Serialize};

use crate::{
    auth::Tenant,
    error::{ApiError, ApiJson},
    payments::AppState,
    processor::{ExecutedRefund, RefundRequest},
};

/// The payments service's client of the card processor.
#[derive(Debug, Clone)]
pub struct ProcessorClient {
    url: String,
    http: reqwest::Client,
}

impl ProcessorClient {
    /// A client of the processor at `url` (e.g. `http://127.0.0.1:3001`).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into().trim_end_matches('/').to_owned(),
            http: reqwest::Client::new(),
        }
    }

    /// Executes a refund, at most once per `key`.
    async fn refund(&self, key: &str, request: &RefundRequest) -> Result<ExecutedRefund, ApiError> {
        let unavailable = |reason: String| {
            ApiError::Unavailable(format!(
                "the processor could not be reached ({reason}); no refund was recorded, retry with the same key"
            ))
        };
        let response = self
            .http
            .post(format!("{}/v1/refunds", self.url))
            .header("idempotency-key", key)
            .json(request)
            .send()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        if !response.status().is_success() {
            return Err(unavailable(format!("it answered {}", response.status())));
        }
        response
            .json()
            .await
            .map_err(|e| unavailable(e.to_string()))
    }
}

/// The body of `POST /v1/refunds`.
#[derive(Debug, Clone, Deserialize)]
pub struct NewRefund {
    /// The payment to refund, one of the caller's.
    pub payment: String,
    /// Positive, in minor units.
    pub amount: i64,
}

/// A refund, as answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Refund {
    /// The processor's refund id.
    pub id: String,
    /// The payment refunded.
    pub payment: String,
    /// In minor units.
    pub amount: i64,
    /// `refunded`.
    pub status: String,
}

type Created = (StatusCode, [(header::HeaderName, String); 1], Json<Refund>);

/// `POST /v1/refunds`, in external mode: no transaction; the processor call happens between a
/// committed claim and the stored outcome, protected by a key derived from the client's.
#[idempotent(scope = "tenant", retention = "24h", lock_timeout = "5s")]
pub async fn create_refund(
    tenant: Tenant,
    ctx: IdempotencyContext,
    State(state): State<AppState>,
    ApiJson(body): ApiJson<NewRefund>,
) -> Result<Created, ApiError> {
    if body.amount <= 0 {
        return Err(ApiError::Invalid(format!(
            "`amount` must be a positive integer in minor units, got {}",
            body.amount
        )));
    }
    let pool = state.store.pool();
    let customer: Option<String> =
        sqlx::query_scalar("SELECT customer FROM payments WHERE tenant = $1 AND id = $2")
            .bind(&tenant.0)
            .bind(&body.payment)
            .fetch_optional(pool)
            .await?;
    let Some(customer) = customer else {
        return Err(ApiError::NotFound(format!(
            "no payment {} for this tenant",
            body.payment
        )));
    };
    let request = RefundRequest {
        payment: body.payment,
        amount: body.amount,
        customer,
    };
    // The same derived key on every retry and takeover: the processor refunds once.
    let executed = state
        .processor
        .refund(&ctx.derive("refund"), &request)
        .await?;
    let refund = Refund {
        id: executed.id,
        payment: executed.payment,
        amount: executed.amount,
        status: executed.status,
    };
    // A takeover after a crash may find the row written already: the insert is idempotent too.
    sqlx::query(
        "INSERT INTO refunds (id, tenant, payment, amount, status) VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(&refund.id)
    .bind(&tenant.0)
    .bind(&refund.payment)
    .bind(refund.amount)
    .bind(&refund.status)
    .execute(pool)
    .await?;
    let location = format!("/v1/refunds/{}", refund.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(refund),
    ))
}

/// `GET /v1/refunds`: the caller's refunds, newest first.
pub async fn list_refunds(
    tenant: Tenant,
    State(state): State<AppState>,
) -> Result<Json<Vec<Refund>>, ApiError> {
    let rows = sqlx::query_as(
        "SELECT id, payment, amount, status FROM refunds WHERE tenant = $1 \
         ORDER BY created_at DESC, id DESC",
    )
    .bind(&tenant.0)
    .fetch_all(state.store.pool())
    .await?;
    Ok(Json(rows))
}

/// `GET /v1/refunds/{id}`: one of the caller's refunds.
pub async fn get_refund(
    tenant: Tenant,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Refund>, ApiError> {
    sqlx::query_as("SELECT id, payment, amount, status FROM refunds WHERE tenant = $1 AND id = $2")
        .bind(&tenant.0)
        .bind(&id)
        .fetch_optional(state.store.pool())
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no refund {id} for this tenant")))
}
