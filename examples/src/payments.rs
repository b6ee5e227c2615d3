//! The routes of the payments service (`CONTRACT.md` §3).

use axum::{
    Json, Router,
    extract::{FromRef, Path, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use idem_runtime::{Store, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, Transaction};
use tower_http::catch_panic::CatchPanicLayer;

use crate::{
    auth::Tenant,
    card::{self, Decision},
    error::{ApiError, ApiJson},
};

/// The router's state: the idempotency store, whose pool the read routes use too, and the
/// client of the card processor that refunds go to.
#[derive(Clone, Debug)]
pub struct AppState {
    /// Pool and idempotency settings.
    pub store: Store<Postgres>,
    /// Where refunds are executed.
    pub processor: crate::refunds::ProcessorClient,
}

impl AppState {
    /// State over `store`, with the processor at its default address (`http://127.0.0.1:3001`).
    pub fn new(store: Store<Postgres>) -> Self {
        Self {
            store,
            processor: crate::refunds::ProcessorClient::new("http://127.0.0.1:3001"),
        }
    }
}

impl FromRef<AppState> for Store<Postgres> {
    fn from_ref(state: &AppState) -> Self {
        state.store.clone()
    }
}

/// The payments API over `store`, with the processor at its default address; its tables must
/// exist ([`crate::schema::create`]).
pub fn router(store: Store<Postgres>) -> Router {
    routes().with_state(AppState::new(store))
}

/// The routes of [`router`], before the state is given, for embedding in a larger router.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/payments", post(create_payment).get(list_payments))
        .route("/v1/payments/{id}", get(get_payment))
        .route("/v1/payouts", post(create_payout).get(list_payouts))
        .route("/v1/payouts/{id}", get(get_payout))
        .route(
            "/v1/refunds",
            post(crate::refunds::create_refund).get(crate::refunds::list_refunds),
        )
        .route("/v1/refunds/{id}", get(crate::refunds::get_refund))
        .layer(CatchPanicLayer::custom(panic_problem))
}

/// The body of `POST /v1/payments` and `POST /v1/payouts`.
#[derive(Debug, Clone, Deserialize)]
pub struct NewTransfer {
    /// Positive, in minor units.
    pub amount: i64,
    /// Three letters.
    pub currency: String,
    /// The customer's id; some ids are magic (see [`card::decide`]).
    pub customer: String,
}

impl NewTransfer {
    fn validate(&self) -> Result<(), ApiError> {
        if self.amount <= 0 {
            return Err(ApiError::Invalid(format!(
                "`amount` must be a positive integer in minor units, got {}",
                self.amount
            )));
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(ApiError::Invalid(format!(
                "`currency` must be a three-letter code such as \"usd\", got {:?}",
                self.currency
            )));
        }
        if self.customer.is_empty() {
            return Err(ApiError::Invalid("`customer` must not be empty".into()));
        }
        Ok(())
    }
}

/// A payment or a payout, as answered.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, PartialEq, Eq)]
pub struct Transfer {
    /// `pay_...` or `po_...`.
    pub id: String,
    /// In minor units.
    pub amount: i64,
    /// Three letters.
    pub currency: String,
    /// The customer.
    pub customer: String,
    /// `succeeded` / `paid`, or `declined`.
    pub status: String,
}

/// What differs between payments and payouts.
struct Kind {
    noun: &'static str,
    id_prefix: &'static str,
    path: &'static str,
    approved: &'static str,
    insert: &'static str,
    settle: &'static str,
    list: &'static str,
    fetch: &'static str,
}

const PAYMENTS: Kind = Kind {
    noun: "payment",
    id_prefix: "pay",
    path: "/v1/payments",
    approved: "succeeded",
    insert: "INSERT INTO payments (id, tenant, amount, currency, customer, status) \
             VALUES ($1, $2, $3, $4, $5, 'processing')",
    settle: "UPDATE payments SET status = $2 WHERE id = $1",
    list: "SELECT id, amount, currency, customer, status FROM payments \
           WHERE tenant = $1 ORDER BY created_at DESC, id DESC",
    fetch: "SELECT id, amount, currency, customer, status FROM payments \
            WHERE tenant = $1 AND id = $2",
};

const PAYOUTS: Kind = Kind {
    noun: "payout",
    id_prefix: "po",
    path: "/v1/payouts",
    approved: "paid",
    insert: "INSERT INTO payouts (id, tenant, amount, currency, customer, status) \
             VALUES ($1, $2, $3, $4, $5, 'processing')",
    settle: "UPDATE payouts SET status = $2 WHERE id = $1",
    list: "SELECT id, amount, currency, customer, status FROM payouts \
           WHERE tenant = $1 ORDER BY created_at DESC, id DESC",
    fetch: "SELECT id, amount, currency, customer, status FROM payouts \
            WHERE tenant = $1 AND id = $2",
};

type Created = (
    StatusCode,
    [(header::HeaderName, String); 1],
    Json<Transfer>,
);

/// `POST /v1/payments`: a 5xx is rolled back and not stored, so a retry charges again.
#[idempotent(scope = "tenant", retention = "24h", replay_5xx = false)]
pub async fn create_payment(
    tenant: Tenant,
    tx: &mut Transaction<'_, Postgres>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Created, ApiError> {
    create(&PAYMENTS, &tenant, tx, body).await
}

/// `POST /v1/payouts`: a 5xx is stored and replayed (Stripe v1), its writes undone.
#[idempotent(scope = "tenant", retention = "7d", replay_5xx = true)]
pub async fn create_payout(
    tenant: Tenant,
    tx: &mut Transaction<'_, Postgres>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Created, ApiError> {
    create(&PAYOUTS, &tenant, tx, body).await
}

/// `POST /v1/payments` without idempotency: the same work in a transaction of its own. Not
/// routed by [`router`]; it is the baseline that tests and benchmarks compare against.
pub async fn create_payment_bare(
    tenant: Tenant,
    State(state): State<AppState>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Created, ApiError> {
    let mut tx = state.store.pool().begin().await?;
    let created = create(&PAYMENTS, &tenant, &mut tx, body).await?;
    tx.commit().await?;
    Ok(created)
}

/// Records the attempt, asks the processor, and settles the record with its decision.
async fn create(
    kind: &Kind,
    tenant: &Tenant,
    tx: &mut Transaction<'_, Postgres>,
    body: NewTransfer,
) -> Result<Created, ApiError> {
    body.validate()?;
    let id = format!("{}_{}", kind.id_prefix, uuid::Uuid::new_v4().simple());
    sqlx::query(kind.insert)
        .bind(&id)
        .bind(&tenant.0)
        .bind(body.amount)
        .bind(&body.currency)
        .bind(&body.customer)
        .execute(&mut **tx)
        .await?;
    let status = match card::decide(&body.customer).await {
        Decision::Approved => kind.approved,
        Decision::Declined => "declined",
        Decision::Unavailable => {
            return Err(ApiError::Unavailable(format!(
                "the processor did not answer; the {} was not made, retry with the same key",
                kind.noun
            )));
        }
    };
    sqlx::query(kind.settle)
        .bind(&id)
        .bind(status)
        .execute(&mut **tx)
        .await?;
    if status == "declined" {
        return Err(ApiError::Declined(format!(
            "the {} {id} was declined by the card issuer",
            kind.noun
        )));
    }
    let location = format!("{}/{id}", kind.path);
    let transfer = Transfer {
        id,
        amount: body.amount,
        currency: body.currency,
        customer: body.customer,
        status: status.to_owned(),
    };
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(transfer),
    ))
}

/// `GET /v1/payments`.
pub async fn list_payments(
    tenant: Tenant,
    State(state): State<AppState>,
) -> Result<Json<Vec<Transfer>>, ApiError> {
    list(&PAYMENTS, state.store.pool(), &tenant).await
}

/// `GET /v1/payouts`.
pub async fn list_payouts(
    tenant: Tenant,
    State(state): State<AppState>,
) -> Result<Json<Vec<Transfer>>, ApiError> {
    list(&PAYOUTS, state.store.pool(), &tenant).await
}

/// `GET /v1/payments/{id}`.
pub async fn get_payment(
    tenant: Tenant,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Transfer>, ApiError> {
    fetch(&PAYMENTS, state.store.pool(), &tenant, &id).await
}

/// `GET /v1/payouts/{id}`.
pub async fn get_payout(
    tenant: Tenant,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Transfer>, ApiError> {
    fetch(&PAYOUTS, state.store.pool(), &tenant, &id).await
}

async fn list(
    kind: &Kind,
    pool: &PgPool,
    tenant: &Tenant,
) -> Result<Json<Vec<Transfer>>, ApiError> {
    let rows = sqlx::query_as(kind.list)
        .bind(&tenant.0)
        .fetch_all(pool)
        .await?;
    Ok(Json(rows))
}

async fn fetch(
    kind: &Kind,
    pool: &PgPool,
    tenant: &Tenant,
    id: &str,
) -> Result<Json<Transfer>, ApiError> {
    sqlx::query_as(kind.fetch)
        .bind(&tenant.0)
        .bind(id)
        .fetch_optional(pool)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no {} {id} for this tenant", kind.noun)))
}

fn panic_problem(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    idem_runtime::Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal error")
        .with_detail("the handler failed; nothing was stored, retry with the same key")
        .into_response()
}
