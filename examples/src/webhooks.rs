//! `POST /v1/webhooks/processor`: the payments service's receiver of the simulated processor's
//! webhooks, signed as Standard Webhooks v1 specifies.
//!
//! The delivery's `webhook-id` is its idempotency key, under one scope for the whole endpoint
//! ([`ProcessorWebhooks`]): a redelivery of a delivered id is answered as the first delivery
//! was, with `Idempotent-Replayed: true`, and credits nothing again. The signature is checked
//! by the handler's last extractor ([`Verified`]), which idem runs before it claims the key: a
//! delivery whose signature does not verify is refused (401) and leaves nothing behind, so the
//! genuine delivery of the same id still runs.

use std::{borrow::Cow, convert::Infallible};

use axum::{
    Json,
    body::Bytes,
    extract::{FromRef, FromRequest, FromRequestParts, Request},
    http::{StatusCode, request::Parts},
};
use idem_runtime::{Backend, IdempotencyScope, idempotent};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;
use sqlx::Transaction;

use crate::{
    auth::MAX_TENANT_LEN, error::ApiError, payments::AppState, sql::Sql,
    webhook_secret::WebhookSecret,
};

/// The idempotency scope of every delivery to `POST /v1/webhooks/processor`. Scopes of every
/// handler share one space, and a tenant's scope is its bearer token, any ASCII text: the `§`
/// keeps this one out of every tenant's reach, so no API caller can take a delivery's id first
/// (its request would be a different request under the key: the delivery would get 422).
pub const SCOPE: &str = "§webhooks/processor";

/// The largest credit one event may carry, in minor units: a balance is a 64-bit sum, and nine
/// million credits of this size still fit in one, so that reading it back never overflows.
pub const MAX_CREDIT: i64 = 1_000_000_000_000;

/// The event that grows a tenant's balance.
pub const BALANCE_CREDITED: &str = "balance.credited";

/// The scope of the processor's deliveries: one for the endpoint, since the processor is its
/// only sender and its `webhook-id`s are unique across tenants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessorWebhooks;

impl<S: Send + Sync> FromRequestParts<S> for ProcessorWebhooks {
    type Rejection = Infallible;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, Infallible> {
        Ok(Self)
    }
}

impl IdempotencyScope for ProcessorWebhooks {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(SCOPE)
    }
}

/// A webhook whose signature verified, its body read as JSON into `T`.
#[derive(Debug, Clone)]
pub struct Verified<T> {
    /// Its `webhook-id`.
    pub id: String,
    /// Its body.
    pub value: T,
}

impl<S, T> FromRequest<S> for Verified<T>
where
    S: Send + Sync,
    WebhookSecret: FromRef<S>,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    /// Verifies the raw body against the Standard Webhooks headers with the state's
    /// [`WebhookSecret`], then reads it as JSON.
    ///
    /// # Errors
    ///
    /// 401 ([`ApiError::BadSignature`]) when the signature does not verify or a header is
    /// missing; 400 when the body is not JSON of the expected shape.
    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let secret = WebhookSecret::from_ref(state);
        let headers = request.headers().clone();
        let body = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| ApiError::BadJson(rejection.status(), rejection.body_text()))?;
        secret.verify(&body, &headers).map_err(|error| {
            ApiError::BadSignature(format!(
                "the webhook's Standard Webhooks signature does not verify ({error}); nothing was \
                 stored"
            ))
        })?;
        // Verified: the header is there and is text.
        let id = headers
            .get(standardwebhooks::HEADER_WEBHOOK_ID)
            .and_then(|id| id.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let value = serde_json::from_slice(&body).map_err(|error| {
            ApiError::BadJson(
                StatusCode::BAD_REQUEST,
                format!("the webhook's body is not a processor event: {error}"),
            )
        })?;
        Ok(Self { id, value })
    }
}

impl<DB: Backend> FromRef<AppState<DB>> for WebhookSecret {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.webhooks.clone()
    }
}

/// A processor event, as delivered: `{"type": "...", "data": {...}}`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProcessorEvent {
    /// `balance.credited` grows a tenant's balance; any other type is acknowledged and
    /// ignored.
    #[serde(rename = "type")]
    pub kind: String,
    /// For `balance.credited`: `{"tenant": "<tenant>", "amount": <positive integer>}`.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub data: Value,
}

/// What a `balance.credited` event credits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credit {
    /// The tenant credited.
    pub tenant: String,
    /// In minor units, positive.
    pub amount: i64,
}

impl Credit {
    /// The credit `data` describes.
    ///
    /// # Errors
    ///
    /// [`ApiError::Invalid`] when `tenant` is missing or not a tenant id (1 to
    /// [`MAX_TENANT_LEN`] visible ASCII characters), or `amount` is not a positive integer.
    pub fn of(data: &Value) -> Result<Self, ApiError> {
        let tenant = data
            .get("tenant")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::Invalid("`data.tenant` must be the tenant's id".into()))?;
        if tenant.is_empty()
            || tenant.len() > MAX_TENANT_LEN
            || !tenant.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(ApiError::Invalid(format!(
                "`data.tenant` must be 1 to {MAX_TENANT_LEN} visible ASCII characters, got \
                 {tenant:?}"
            )));
        }
        let amount = data.get("amount");
        let Some(amount) = amount
            .and_then(Value::as_i64)
            .filter(|amount| (1..=MAX_CREDIT).contains(amount))
        else {
            return Err(ApiError::Invalid(format!(
                "`data.amount` must be a positive integer in minor units, at most {MAX_CREDIT}, \
                 got {}",
                amount.map_or_else(|| "nothing".to_owned(), Value::to_string)
            )));
        };
        Ok(Self {
            tenant: tenant.to_owned(),
            amount,
        })
    }
}

/// `POST /v1/webhooks/processor`: a `balance.credited` event credits its tenant once per
/// `webhook-id` (200 `{"credited": <amount>}`); any other event is acknowledged (200
/// `{"ignored": true}`).
///
/// # Errors
///
/// 400 when a `balance.credited` event has no tenant or an amount that is not a positive
/// integer (stored and replayed, as the example's other 400s); a statement that failed.
#[utoipa::path(
    post,
    path = "/v1/webhooks/processor",
    tag = "webhooks",
    summary = "Receive the processor's events (Standard Webhooks)",
    request_body = ProcessorEvent,
    params(
        ("webhook-timestamp" = i64, Header, description = "When the delivery was signed, Unix seconds."),
        ("webhook-signature" = String, Header, description = "`v1,<base64 HMAC-SHA256>`, space-separated."),
    ),
    responses(
        (status = 200, description = "The event was applied (`{\"credited\": <amount>}`) or ignored (`{\"ignored\": true}`)."),
        (status = 401, description = "The signature does not verify; nothing was stored.", body = crate::api_doc::Problem, content_type = "application/problem+json"),
    )
)]
#[idempotent(
    scope = "endpoint",
    key_header = "webhook-id",
    retention = "7d",
    state = AppState<DB>
)]
pub async fn receive_processor_event<DB: Sql>(
    endpoint: ProcessorWebhooks,
    tx: &mut Transaction<'_, DB>,
    delivery: Verified<ProcessorEvent>,
) -> Result<Json<Value>, ApiError> {
    if delivery.value.kind != BALANCE_CREDITED {
        return Ok(Json(serde_json::json!({"ignored": true})));
    }
    let credit = Credit::of(&delivery.value.data)?;
    DB::credit(tx, &delivery.id, &credit.tenant, credit.amount).await?;
    Ok(Json(serde_json::json!({"credited": credit.amount})))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Credit, MAX_CREDIT};

    #[test]
    fn a_credit_needs_a_tenant_and_a_positive_integer_amount() {
        assert_eq!(
            Credit::of(&json!({"tenant": "t1", "amount": 5})).unwrap(),
            Credit {
                tenant: "t1".into(),
                amount: 5
            }
        );
        assert!(Credit::of(&json!({"tenant": "t1", "amount": MAX_CREDIT})).is_ok());
        for data in [
            json!({"amount": 5}),
            json!({"tenant": "", "amount": 5}),
            json!({"tenant": "t 1", "amount": 5}),
            json!({"tenant": "t1"}),
            json!({"tenant": "t1", "amount": 0}),
            json!({"tenant": "t1", "amount": -3}),
            json!({"tenant": "t1", "amount": 2.5}),
            json!({"tenant": "t1", "amount": "5"}),
            json!({"tenant": "t1", "amount": 18_446_744_073_709_551_615_u64}),
            json!({"tenant": "t1", "amount": MAX_CREDIT + 1}),
            json!({"tenant": "t1", "amount": i64::MAX}),
        ] {
            assert!(Credit::of(&data).is_err(), "{data}");
        }
    }
}
