//! Refunds (the README's "Refunds" and external mode): the side effect is outside the database, at the card processor,
//! so the route runs in external mode and hands the processor a key derived from its own. The
//! handlers are in [`crate::payments`], one set per database.

use serde::{Deserialize, Serialize};

use crate::{
    error::ApiError,
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
