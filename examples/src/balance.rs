//! Tenants' balances, which the processor's `balance.credited` webhooks grow
//! ([`crate::webhooks`]), and `GET /v1/balance`, which reads the caller's.

use axum::{Json, extract::State};
use serde::{Deserialize, Serialize};

use crate::{auth::Tenant, error::ApiError, payments::AppState, sql::Sql};

/// A tenant's balance, as `GET /v1/balance` answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Balance {
    /// The sum of the credits, in minor units.
    pub balance: i64,
    /// How many credits were made.
    pub credits: i64,
}

/// `GET /v1/balance`: the caller's balance; zeros for a tenant never credited.
///
/// # Errors
///
/// 401 without a bearer token; 503 when the database does not answer in time.
#[utoipa::path(get, path = "/v1/balance", tag = "balance",
    summary = "The caller's balance, grown by the processor's webhooks",
    responses((status = 200, description = "The caller's balance.", body = Balance)))]
pub async fn get_balance<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
) -> Result<Json<Balance>, ApiError> {
    let balance = state
        .within_deadline(async |conn| DB::balance(conn, &tenant.0).await)
        .await?;
    Ok(Json(balance))
}
