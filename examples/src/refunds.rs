//! Refunds (external mode, as the guide's chapter `docs/guide/external.md` describes): the side
//! effect is outside the database, at the card processor,
//! so the route runs in external mode and hands the processor a key derived from its own. The
//! handlers are in [`crate::payments`], one set per database.

use serde::{Deserialize, Serialize};

pub use crate::processor_client::ProcessorClient;

/// The body of `POST /v1/refunds`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct NewRefund {
    /// The payment to refund, one of the caller's.
    pub payment: String,
    /// Positive, in minor units.
    pub amount: i64,
}

/// A refund, as answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
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
