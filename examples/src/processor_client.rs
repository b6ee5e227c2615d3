//! The payments service's client of the card processor ([`crate::processor`]): refunds and
//! charges, each sent with the idempotency key the caller derived for it, through idem's
//! client middleware, which retries network errors, 409, 429 and 5xx under that same key.

use std::time::Duration;

use idem_client::{IdempotencyKey, IdempotentRetry, RetryPolicy, reqwest_middleware};

use crate::{
    error::ApiError,
    processor::{ChargeRequest, ExecutedCharge, ExecutedRefund, RefundRequest},
};

/// The payments service's client of the card processor.
#[derive(Debug, Clone)]
pub struct ProcessorClient {
    url: String,
    http: reqwest_middleware::ClientWithMiddleware,
}

impl ProcessorClient {
    /// A client of the processor at `url` (e.g. `http://127.0.0.1:3001`).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into().trim_end_matches('/').to_owned(),
            // A few quick retries: the request that waits for them holds its key's lease (5 s).
            http: reqwest_middleware::ClientBuilder::new(
                // Each attempt bounded too: the last may start at the end of the budget.
                reqwest::Client::builder()
                    .timeout(Duration::from_secs(2))
                    .build()
                    .unwrap_or_default(),
            )
            .with(IdempotentRetry::new(
                RetryPolicy::default()
                    .with_max_attempts(3)
                    .with_budget(Duration::from_secs(2))
                    .with_backoff(Duration::from_millis(50), Duration::from_millis(500)),
            ))
            .build(),
        }
    }

    /// Executes a refund, at most once per `key`.
    ///
    /// # Errors
    ///
    /// [`ApiError::Unavailable`] when the processor cannot be reached or refuses.
    pub(crate) async fn refund(
        &self,
        key: &str,
        request: &RefundRequest,
    ) -> Result<ExecutedRefund, ApiError> {
        let response = self.post("refunds", key, request).await?;
        read(response).await
    }

    /// Executes a charge, at most once per `key`.
    ///
    /// # Errors
    ///
    /// [`ApiError::Declined`] when the processor declined it (402; nothing was charged),
    /// [`ApiError::Unavailable`] when it cannot be reached or answers otherwise.
    pub(crate) async fn charge(
        &self,
        key: &str,
        request: &ChargeRequest,
    ) -> Result<ExecutedCharge, ApiError> {
        let response = self.post("charges", key, request).await?;
        if response.status() == reqwest::StatusCode::PAYMENT_REQUIRED {
            return Err(ApiError::Declined(format!(
                "the card issuer declined the charge of {} to {}",
                request.amount, request.customer
            )));
        }
        read(response).await
    }

    /// The charge made under `key`, if the processor made one.
    ///
    /// # Errors
    ///
    /// [`ApiError::Unavailable`] when the processor cannot be reached or answers otherwise.
    pub(crate) async fn find_charge(&self, key: &str) -> Result<Option<ExecutedCharge>, ApiError> {
        let response = self
            .http
            .get(format!("{}/v1/charges/by-key/{key}", self.url))
            .send()
            .await
            .map_err(|e| unavailable(&e.to_string()))?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        read(response).await.map(Some)
    }

    /// Sends `body` to `/v1/<resource>` under `key`.
    async fn post(
        &self,
        resource: &str,
        key: &str,
        body: &impl serde::Serialize,
    ) -> Result<reqwest::Response, ApiError> {
        self.http
            .post(format!("{}/v1/{resource}", self.url))
            .with_extension(IdempotencyKey(key.to_owned()))
            .json(body)
            .send()
            .await
            .map_err(|e| unavailable(&e.to_string()))
    }
}

/// The processor's answer, if it is a success.
async fn read<T: serde::de::DeserializeOwned>(response: reqwest::Response) -> Result<T, ApiError> {
    if !response.status().is_success() {
        return Err(unavailable(&format!("it answered {}", response.status())));
    }
    response
        .json()
        .await
        .map_err(|e| unavailable(&e.to_string()))
}

fn unavailable(reason: &str) -> ApiError {
    ApiError::Unavailable(format!(
        "the processor could not be reached or did not answer ({reason}); nothing was recorded here, retry with the same key: the processor executes each key once"
    ))
}
