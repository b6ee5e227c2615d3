//! The payments service's client of the card processor ([`crate::processor`]): refunds and
//! charges, each sent with the idempotency key the caller derived for it.

use crate::{
    error::ApiError,
    processor::{ChargeRequest, ExecutedCharge, ExecutedRefund, RefundRequest},
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
    ///
    /// # Errors
    ///
    /// [`ApiError::Unavailable`] when the processor cannot be reached or refuses.
    pub(crate) async fn refund(
        &self,
        key: &str,
        request: &RefundRequest,
    ) -> Result<ExecutedRefund, ApiError> {
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
    /// Executes a charge, at most once per `key`.
    ///
    /// # Errors
    ///
    /// [`ApiError::Declined`] when the processor declined it (402), [`ApiError::Unavailable`]
    /// when it cannot be reached or answers otherwise; nothing was charged in either case.
    pub(crate) async fn charge(
        &self,
        key: &str,
        request: &ChargeRequest,
    ) -> Result<ExecutedCharge, ApiError> {
        let unavailable = |reason: String| {
            ApiError::Unavailable(format!(
                "the processor could not be reached ({reason}); nothing was charged, retry with the same key"
            ))
        };
        let response = self
            .http
            .post(format!("{}/v1/charges", self.url))
            .header("idempotency-key", key)
            .json(request)
            .send()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        if response.status() == reqwest::StatusCode::PAYMENT_REQUIRED {
            return Err(ApiError::Declined(format!(
                "the card issuer declined the charge of {} to {}",
                request.amount, request.customer
            )));
        }
        if !response.status().is_success() {
            return Err(unavailable(format!("it answered {}", response.status())));
        }
        response
            .json()
            .await
            .map_err(|e| unavailable(e.to_string()))
    }
}
