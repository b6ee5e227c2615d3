//! Orders (the guide's "Multi-step handlers", `docs/guide/steps.md`): reserve stock, charge the
//! customer at the card processor, ship. The three steps cannot share a transaction (the charge is
//! in another process), so `POST /v1/orders` runs them through [`Steps`]: each is recorded on the
//! key as it completes, and a retry after a crash resumes after the last recorded one. Its recovery
//! hook, [`SettleAbandoned`], settles orders whose client never came back.

use axum::{
    Json,
    extract::{Path, State},
    http::{StatusCode, header},
};
use idem_runtime::{
    StepError, Steps, idempotent,
    tasks::{AbandonedClaim, RecoveryHook, StoredResponse, Verdict},
};
use serde::{Deserialize, Serialize};

use crate::{
    auth::Tenant,
    error::{ApiError, ApiJson},
    payments::{AppState, MAX_CUSTOMER, check_id},
    processor::{ChargeRequest, ExecutedCharge},
    processor_client::ProcessorClient,
    sql::Sql,
};

/// The stock every SKU starts with, the first time it is seen.
pub const STOCK_PER_SKU: i64 = 100;

/// The price of one unit, in minor units.
pub const UNIT_PRICE: i64 = 1000;

/// The longest SKU accepted, in characters.
const MAX_SKU: usize = 64;

/// The body of `POST /v1/orders`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct NewOrder {
    /// The article.
    pub sku: String,
    /// Positive.
    pub quantity: i64,
    /// Who pays; magic ids as for payments (`cus_declined`, `cus_unavailable`).
    pub customer: String,
}

impl NewOrder {
    fn validate(&self) -> Result<(), ApiError> {
        if self.sku.is_empty() || self.sku.chars().count() > MAX_SKU {
            return Err(ApiError::Invalid(format!(
                "`sku` must be 1 to {MAX_SKU} characters, got {:?}",
                self.sku
            )));
        }
        // Bounded so that the amount cannot overflow.
        if !(1..=STOCK_PER_SKU).contains(&self.quantity) {
            return Err(ApiError::Invalid(format!(
                "`quantity` must be a positive integer of at most {STOCK_PER_SKU}, got {}",
                self.quantity
            )));
        }
        let length = self.customer.chars().count();
        if length == 0 || length > MAX_CUSTOMER {
            return Err(ApiError::Invalid(format!(
                "`customer` must be 1 to {MAX_CUSTOMER} characters, got {length}"
            )));
        }
        Ok(())
    }
}

/// What `reserve` records: the stock taken, and the order it is taken for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reservation {
    /// The order's id, chosen when its stock is reserved.
    pub order: String,
    /// The article.
    pub sku: String,
    /// Units taken.
    pub quantity: i64,
    /// Who pays.
    pub customer: String,
    /// `quantity` × [`UNIT_PRICE`].
    pub amount: i64,
}

/// An order, as answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Order {
    /// `ord_...`.
    pub id: String,
    /// The article.
    pub sku: String,
    /// Units.
    pub quantity: i64,
    /// Who paid.
    pub customer: String,
    /// In minor units.
    pub amount: i64,
    /// The processor's charge id.
    pub charge: String,
    /// `confirmed`.
    pub status: String,
}

type OrderCreated = (StatusCode, [(header::HeaderName, String); 1], Json<Order>);

/// `POST /v1/orders`: `reserve` (database), `charge` (the processor, under the key derived for
/// this step), `ship` (database), each recorded on the key; a declined charge gives the stock
/// back (a step too) and answers 402, stored; an unavailable processor answers 503, not stored,
/// and the retry resumes at `charge`.
#[utoipa::path(
    post,
    path = "/v1/orders",
    tag = "orders",
    summary = "Order an article: reserve stock, charge, ship",
    request_body = NewOrder,
    responses(
        (status = 201, description = "Reserved, charged and shipped.", body = Order,
            headers(("Location" = String, description = "`/v1/orders/{id}`"))),
        (status = 400, description = "`sku`, `quantity` or `customer` invalid, not enough stock, or the body not JSON.", body = crate::api_doc::Problem, content_type = "application/problem+json"),
        (status = 402, description = "The card was declined; the stock was given back.", body = crate::api_doc::Problem, content_type = "application/problem+json"),
        (status = 503, description = "The processor did not answer; a retry with the same key resumes at the charge.", body = crate::api_doc::Problem, content_type = "application/problem+json"),
    )
)]
#[idempotent(external, scope = "tenant", retention = "24h", lease = "5s", state = AppState<DB>)]
pub async fn create_order<DB: Sql>(
    tenant: Tenant,
    steps: Steps<DB>,
    State(state): State<AppState<DB>>,
    ApiJson(body): ApiJson<NewOrder>,
) -> Result<OrderCreated, ApiError> {
    body.validate()?;
    if let Some(point) = state.crash_after.clone() {
        // `$CRASH_AFTER=<step>`: the process dies right after that step is recorded.
        steps.on_recorded(move |step| crash_at(&point, step));
    }
    let reservation: Reservation = steps
        .step("reserve", async |conn| reserve::<DB>(conn, &body).await)
        .await?;
    if let Some(reason) = steps.output::<String>("release")? {
        // Declined, and given back, by an attempt that died before its 402 was stored: the
        // charge is not tried again on stock that is no longer reserved.
        return Err(ApiError::Declined(reason));
    }
    let charged = steps
        .call("charge", async |key| {
            let charged = charge(&state, &tenant.0, key, &reservation).await;
            // `$CRASH_AFTER=charge-call`: the processor answered; nothing is recorded yet.
            if let Some(point) = &state.crash_after {
                crash_at(point, "charge-call");
            }
            charged
        })
        .await;
    let charge = match charged {
        Err(ApiError::Declined(reason)) => {
            let reason = steps
                .step("release", async |conn| {
                    release::<DB>(conn, &reservation, reason).await
                })
                .await?;
            return Err(ApiError::Declined(reason));
        }
        other => other?,
    };
    let order = steps
        .step("ship", async |conn| {
            ship::<DB>(conn, &tenant.0, &reservation, &charge).await
        })
        .await?;
    let location = format!("/v1/orders/{}", order.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(order),
    ))
}

/// Dies without unwinding or cleaning up, as a `SIGKILL` would, when `step` is `point`.
fn crash_at(point: &str, step: &str) {
    if point == step {
        eprintln!("payments: CRASH_AFTER={point}: aborting");
        std::process::abort();
    }
}

async fn reserve<DB: Sql>(
    conn: &mut DB::Connection,
    body: &NewOrder,
) -> Result<Reservation, ApiError> {
    if !DB::reserve(conn, &body.sku, body.quantity).await? {
        return Err(ApiError::Invalid(format!(
            "not enough stock of {} for {} units; nothing was reserved",
            body.sku, body.quantity
        )));
    }
    Ok(Reservation {
        order: format!("ord_{}", uuid::Uuid::new_v4().simple()),
        sku: body.sku.clone(),
        quantity: body.quantity,
        customer: body.customer.clone(),
        amount: body.quantity * UNIT_PRICE,
    })
}

/// Charges the reservation at the processor, for `tenant`, whose balance the processor's
/// webhook then credits.
async fn charge<DB: Sql>(
    state: &AppState<DB>,
    tenant: &str,
    key: &str,
    reservation: &Reservation,
) -> Result<ExecutedCharge, ApiError> {
    let request = ChargeRequest {
        customer: reservation.customer.clone(),
        amount: reservation.amount,
        tenant: Some(tenant.to_owned()),
    };
    state.processor.charge(key, &request).await
}

/// Gives the reservation back, for `reason` (recorded as the step's output): the compensation
/// of a declined charge, or of an order abandoned before it was charged.
async fn release<DB: Sql>(
    conn: &mut DB::Connection,
    reservation: &Reservation,
    reason: String,
) -> Result<String, ApiError> {
    DB::give_back(conn, &reservation.sku, reservation.quantity).await?;
    Ok(reason)
}

async fn ship<DB: Sql>(
    conn: &mut DB::Connection,
    tenant: &str,
    reservation: &Reservation,
    charge: &ExecutedCharge,
) -> Result<Order, ApiError> {
    let order = Order {
        id: reservation.order.clone(),
        sku: reservation.sku.clone(),
        quantity: reservation.quantity,
        customer: reservation.customer.clone(),
        amount: reservation.amount,
        charge: charge.id.clone(),
        status: "confirmed".to_owned(),
    };
    DB::insert_order(conn, &order, tenant).await?;
    Ok(order)
}

/// The recovery hook of the payments service: an abandoned order is finished when it was
/// charged (retries then replay its 201), and otherwise has its stock given back and its key
/// released; any other abandoned claim (a refund) is released, for a retry to run again (the
/// processor deduplicates through the derived key).
///
/// "Charged" is the `charge` step recorded, or, when the attempt died between the processor's
/// answer and the record, a charge the processor has under the step's derived key (recorded
/// then). A request still waiting for the processor when its lease ran out (the lease is
/// shorter than the processor's slowest answer) can still be charged after the hook gave its
/// stock back; it then fails with a 409, and its retry, under the same charge key, orders
/// again without a second charge.
#[derive(Debug, Clone)]
pub struct SettleAbandoned {
    processor: ProcessorClient,
}

impl SettleAbandoned {
    /// The hook, asking `processor` about charges whose answer was lost.
    pub fn new(processor: ProcessorClient) -> Self {
        Self { processor }
    }
}

impl<DB: Sql> RecoveryHook<DB> for SettleAbandoned {
    async fn recover(&self, claim: AbandonedClaim<DB>) -> Verdict {
        if claim.path != "/v1/orders" {
            return Verdict::Release;
        }
        match settle(&claim, &self.processor).await {
            Ok(recovery) => recovery,
            Err(error) => {
                tracing::warn!(%error, "settling an abandoned order failed; trying again later");
                Verdict::Keep
            }
        }
    }
}

async fn settle<DB: Sql>(
    claim: &AbandonedClaim<DB>,
    processor: &ProcessorClient,
) -> Result<Verdict, ApiError> {
    let steps = claim.steps();
    let Some(reservation) = steps.output::<Reservation>("reserve")? else {
        // Nothing was taken.
        return Ok(Verdict::Release);
    };
    if steps.output::<String>("release")?.is_some() {
        // Declined and given back already.
        return Ok(Verdict::Release);
    }
    // A charge the processor made but the attempt did not record is recorded now; none is made.
    let charge = steps
        .call("charge", async |key| {
            match processor.find_charge(key).await {
                Ok(Some(charge)) => Ok(charge),
                Ok(None) => Err(Lookup::NotCharged),
                Err(error) => Err(Lookup::Failed(error)),
            }
        })
        .await;
    let charge: Option<ExecutedCharge> = match charge {
        Ok(charge) => Some(charge),
        Err(Lookup::NotCharged) => None,
        Err(Lookup::Failed(error)) => return Err(error),
    };
    if let Some(charge) = charge {
        let order = steps
            .step("ship", async |conn| {
                ship::<DB>(conn, &claim.scope, &reservation, &charge).await
            })
            .await?;
        let body = serde_json::to_vec(&order).map_err(|e| ApiError::Internal(e.to_string()))?;
        return Ok(Verdict::Complete(StoredResponse {
            status: StatusCode::CREATED.as_u16(),
            headers: vec![
                ("content-type".to_owned(), "application/json".to_owned()),
                ("location".to_owned(), format!("/v1/orders/{}", order.id)),
            ],
            body,
        }));
    }
    let reason = "abandoned before it was charged".to_owned();
    steps
        .step("release", async |conn| {
            release::<DB>(conn, &reservation, reason).await
        })
        .await?;
    Ok(Verdict::Release)
}

/// What the recovery's look-up of an unrecorded charge found, when it found no charge.
enum Lookup {
    /// The processor has no charge under the step's key.
    NotCharged,
    /// The processor or the store could not tell.
    Failed(ApiError),
}

impl From<StepError> for Lookup {
    fn from(error: StepError) -> Self {
        Self::Failed(error.into())
    }
}

/// `GET /v1/orders`: the caller's orders, newest first.
#[utoipa::path(get, path = "/v1/orders", tag = "orders", summary = "The caller's orders, newest first",
    responses((status = 200, description = "The caller's orders.", body = Vec<Order>)))]
pub async fn list_orders<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
) -> Result<Json<Vec<Order>>, ApiError> {
    let sql = format!("{ORDER_COLUMNS} WHERE tenant = $1 {}", DB::NEWEST_FIRST);
    let rows = state
        .within_deadline(async |conn| DB::orders(conn, sql, &tenant.0, &[]).await)
        .await?;
    Ok(Json(rows))
}

/// `GET /v1/orders/{id}`: one of the caller's orders.
#[utoipa::path(get, path = "/v1/orders/{id}", tag = "orders", summary = "One of the caller's orders",
    params(("id" = String, Path, description = "The order's id, `ord_…`.")),
    responses((status = 200, description = "The order.", body = Order),
        (status = 404, description = "No such order for this caller.", body = crate::api_doc::Problem, content_type = "application/problem+json")))]
pub async fn get_order<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
    Path(id): Path<String>,
) -> Result<Json<Order>, ApiError> {
    check_id("order", &id)?;
    let sql = format!("{ORDER_COLUMNS} WHERE tenant = $1 AND id = $2");
    let rows = state
        .within_deadline(async |conn| DB::orders(conn, sql, &tenant.0, &[&id]).await)
        .await?;
    rows.into_iter()
        .next()
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no order {id} for this tenant")))
}

const ORDER_COLUMNS: &str =
    "SELECT id, sku, quantity, customer, amount, charge, status FROM orders";

/// A SKU's stock, as answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Stock {
    /// The article.
    pub sku: String,
    /// Units left.
    pub stock: i64,
}

/// `GET /v1/inventory/{sku}`: any tenant may read it; an unseen SKU has its initial stock.
#[utoipa::path(get, path = "/v1/inventory/{sku}", tag = "orders", summary = "An article's stock",
    params(("sku" = String, Path, description = "The article.")),
    responses((status = 200, description = "Units left (an article never ordered has its initial stock).", body = Stock)))]
pub async fn get_stock<DB: Sql>(
    _tenant: Tenant,
    State(state): State<AppState<DB>>,
    Path(sku): Path<String>,
) -> Result<Json<Stock>, ApiError> {
    check_id("sku", &sku)?;
    let stock = state
        .within_deadline(async |conn| DB::stock(conn, &sku).await)
        .await?
        .unwrap_or(STOCK_PER_SKU);
    Ok(Json(Stock { sku, stock }))
}
