//! The routes of the payments service (as the README's "The two commands" describes), written
//! once for every database: every handler is generic over its database `DB` (routed as
//! `routes::<Postgres>()`, `routes::<Sqlite>()` or `routes::<MySql>()`), and its SQL goes through
//! [`crate::sql::Sql`].

use axum::{
    Json, Router,
    extract::{FromRef, Path, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use idem_events as events;
use idem_runtime::{Backend, IdempotencyContext, Store, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;
use tower_http::catch_panic::CatchPanicLayer;

use crate::{
    auth::Tenant,
    balance, bounded,
    card::{self, Decision},
    error::{ApiError, ApiJson},
    orders,
    processor::RefundRequest,
    refunds::{NewRefund, Refund},
    sql::Sql,
    webhook_secret::WebhookSecret,
    webhooks,
};

/// The router's state: the idempotency store, whose pool the read routes use too, and the
/// client of the card processor that refunds go to.
#[derive(Debug)]
pub struct AppState<DB: Backend> {
    /// Pool and idempotency settings.
    pub store: Store<DB>,
    /// Where refunds and charges are executed.
    pub processor: crate::refunds::ProcessorClient,
    /// `$CRASH_AFTER`: the step of `POST /v1/orders` after which the process aborts (`reserve`,
    /// `charge`, `ship`, or `charge-call`: once the processor answered), for crash tests.
    pub crash_after: Option<String>,
    /// `$WEBHOOK_SECRET`: what the processor's webhooks are verified with.
    pub webhooks: WebhookSecret,
}

impl<DB: Backend> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            processor: self.processor.clone(),
            crash_after: self.crash_after.clone(),
            webhooks: self.webhooks.clone(),
        }
    }
}

impl<DB: Backend> AppState<DB> {
    /// State over `store`, with the processor at its default address (`http://127.0.0.1:3001`)
    /// and its webhooks verified with the default secret
    /// ([`crate::webhook_secret::DEFAULT_SECRET`]).
    pub fn new(store: Store<DB>) -> Self {
        Self {
            store,
            processor: crate::refunds::ProcessorClient::new("http://127.0.0.1:3001"),
            crash_after: None,
            webhooks: WebhookSecret::default(),
        }
    }
}

impl<DB: Backend> AppState<DB> {
    /// Runs `query` on a connection of the store's pool within the store's database deadline
    /// ([`bounded::within_deadline`]): what the read routes and the external-mode handlers'
    /// own statements go through.
    pub(crate) async fn within_deadline<T>(
        &self,
        query: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, sqlx::Error>,
    ) -> Result<T, ApiError> {
        bounded::within_deadline(self.store.pool(), self.store.options(), query).await
    }
}

impl<DB: Backend> FromRef<AppState<DB>> for Store<DB> {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.store.clone()
    }
}

/// The body of `POST /v1/payments` and `POST /v1/payouts`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct NewTransfer {
    /// Positive, in minor units.
    pub amount: i64,
    /// Three letters.
    pub currency: String,
    /// The customer's id; some ids are magic (see [`crate::card::decide`]).
    pub customer: String,
}

impl NewTransfer {
    pub(crate) fn validate(&self) -> Result<(), ApiError> {
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
        // The answer repeats the customer: a longer one could make it too large to store.
        let length = self.customer.chars().count();
        if length > MAX_CUSTOMER {
            return Err(ApiError::Invalid(format!(
                "`customer` must be at most {MAX_CUSTOMER} characters, got {length}"
            )));
        }
        Ok(())
    }
}

/// The longest `customer` id accepted, in characters.
pub(crate) const MAX_CUSTOMER: usize = 255;

/// Refuses (400) a record id from the path that holds U+0000 (NUL), which `Path` decodes from
/// `%00`: PostgreSQL's `text` cannot hold it, so looking it up would fail as a database error.
pub(crate) fn check_id(noun: &str, id: &str) -> Result<(), ApiError> {
    if id.contains('\0') {
        return Err(ApiError::Invalid(format!(
            "the {noun} id {id:?} contains the character U+0000 (NUL), which no id contains"
        )));
    }
    Ok(())
}

/// A payment or a payout, as answered.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, PartialEq, Eq, utoipa::ToSchema)]
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
    /// The topic of the event enqueued, with the approval, for the ledger and the like.
    event: Option<&'static str>,
    insert: &'static str,
    settle: &'static str,
    /// `SELECT` of the caller's records, without its order.
    list: &'static str,
    fetch: &'static str,
}

const PAYMENTS: Kind = Kind {
    noun: "payment",
    id_prefix: "pay",
    path: "/v1/payments",
    approved: "succeeded",
    event: Some("payment.succeeded"),
    insert: "INSERT INTO payments (id, tenant, amount, currency, customer, status) \
             VALUES ($1, $2, $3, $4, $5, 'processing')",
    settle: "UPDATE payments SET status = $1 WHERE id = $2",
    list: "SELECT id, amount, currency, customer, status FROM payments \
           WHERE tenant = $1",
    fetch: "SELECT id, amount, currency, customer, status FROM payments \
            WHERE tenant = $1 AND id = $2",
};

const PAYOUTS: Kind = Kind {
    noun: "payout",
    id_prefix: "po",
    path: "/v1/payouts",
    approved: "paid",
    event: None,
    insert: "INSERT INTO payouts (id, tenant, amount, currency, customer, status) \
             VALUES ($1, $2, $3, $4, $5, 'processing')",
    settle: "UPDATE payouts SET status = $1 WHERE id = $2",
    list: "SELECT id, amount, currency, customer, status FROM payouts \
           WHERE tenant = $1",
    fetch: "SELECT id, amount, currency, customer, status FROM payouts \
            WHERE tenant = $1 AND id = $2",
};

type Created = (
    StatusCode,
    [(header::HeaderName, String); 1],
    Json<Transfer>,
);

type RefundCreated = (StatusCode, [(header::HeaderName, String); 1], Json<Refund>);

/// The answer to a handler that panicked: nothing was committed.
pub(crate) fn panic_problem(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    idem_runtime::Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal error")
        .with_detail("the handler failed; nothing was stored, retry with the same key")
        .into_response()
}

/// The payments API over `store`, with the processor at its default address; its tables must
/// exist ([`crate::schema::create`]).
pub fn router<DB: Sql>(store: Store<DB>) -> Router {
    routes::<DB>().with_state(AppState::new(store))
}

/// The routes of [`router`], before the state is given, for embedding in a larger router.
pub fn routes<DB: Sql>() -> Router<AppState<DB>> {
    Router::new()
        .route(
            "/v1/payments",
            post(create_payment::<DB>).get(list_payments::<DB>),
        )
        .route("/v1/payments/{id}", get(get_payment::<DB>))
        .route(
            "/v1/payouts",
            post(create_payout::<DB>).get(list_payouts::<DB>),
        )
        .route("/v1/payouts/{id}", get(get_payout::<DB>))
        .route(
            "/v1/refunds",
            post(create_refund::<DB>).get(list_refunds::<DB>),
        )
        .route("/v1/refunds/{id}", get(get_refund::<DB>))
        .route(
            "/v1/orders",
            post(orders::create_order::<DB>).get(orders::list_orders::<DB>),
        )
        .route("/v1/orders/{id}", get(orders::get_order::<DB>))
        .route("/v1/inventory/{sku}", get(orders::get_stock::<DB>))
        .route(
            "/v1/webhooks/processor",
            post(webhooks::receive_processor_event::<DB>),
        )
        .route("/v1/balance", get(balance::get_balance::<DB>))
        .layer(CatchPanicLayer::custom(panic_problem))
}

/// `POST /v1/payments`: a 5xx is rolled back and not stored, so a retry charges again.
#[utoipa::path(
    post,
    path = "/v1/payments",
    tag = "payments",
    summary = "Charge a customer",
    request_body = NewTransfer,
    responses(
        (status = 201, description = "The payment succeeded.", body = Transfer,
            headers(("Location" = String, description = "`/v1/payments/{id}`"))),
        crate::api_doc::TransferProblems,
    )
)]
#[idempotent(
    scope = "tenant",
    retention = "24h",
    replay_5xx = false,
    wait = "10s",
    state = AppState<DB>
)]
pub async fn create_payment<DB: Sql>(
    tenant: Tenant,
    tx: &mut Transaction<'_, DB>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Created, ApiError> {
    create(&PAYMENTS, &tenant, tx, body).await
}

/// `POST /v1/payouts`: a 5xx is stored and replayed (Stripe v1), its writes undone.
#[utoipa::path(
    post,
    path = "/v1/payouts",
    tag = "payouts",
    summary = "Pay a customer out",
    request_body = NewTransfer,
    responses(
        (status = 201, description = "The payout was paid.", body = Transfer,
            headers(("Location" = String, description = "`/v1/payouts/{id}`"))),
        crate::api_doc::TransferProblems,
    )
)]
#[idempotent(scope = "tenant", retention = "7d", replay_5xx = true, state = AppState<DB>)]
pub async fn create_payout<DB: Sql>(
    tenant: Tenant,
    tx: &mut Transaction<'_, DB>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Created, ApiError> {
    create(&PAYOUTS, &tenant, tx, body).await
}

/// `POST /v1/payments` without idempotency: the same work in a transaction of its own. Not
/// routed by [`router`]; it is the baseline that tests and benchmarks compare against.
pub async fn create_payment_bare<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Created, ApiError> {
    let mut tx = state.store.pool().begin().await?;
    let created = create(&PAYMENTS, &tenant, &mut tx, body).await?;
    tx.commit().await?;
    Ok(created)
}

/// The work of `POST /v1/payments` in the caller's transaction, answered as a response: for
/// benchmarks that wrap the same work in another idempotency design.
///
/// # Errors
///
/// When a statement fails; a refused request is an `Ok` response (400, 402, 503).
pub async fn record_payment<DB: Sql>(
    tenant: &Tenant,
    tx: &mut Transaction<'_, DB>,
    body: NewTransfer,
) -> Result<Response, sqlx::Error> {
    match create(&PAYMENTS, tenant, tx, body).await {
        Ok(created) => Ok(created.into_response()),
        Err(ApiError::Database(error)) => Err(error),
        Err(refused) => Ok(refused.into_response()),
    }
}

/// The work of `POST /v1/payments` in the caller's transaction, the payment as recorded: what
/// the gRPC service's `CreatePayment` runs.
///
/// # Errors
///
/// As `POST /v1/payments` answers them: invalid values, a declined payment (recorded), the
/// processor away (nothing recorded), a statement that failed.
pub async fn record_payment_in<DB: Sql>(
    tenant: &Tenant,
    tx: &mut Transaction<'_, DB>,
    body: NewTransfer,
) -> Result<Transfer, ApiError> {
    let (_, _, Json(transfer)) = create(&PAYMENTS, tenant, tx, body).await?;
    Ok(transfer)
}

/// One of `tenant`'s payments, as `GET /v1/payments/{id}` reads it.
///
/// # Errors
///
/// [`ApiError::NotFound`] when the tenant has no payment `id`; the database's failures.
pub async fn fetch_payment<DB: Sql>(
    state: &AppState<DB>,
    tenant: &Tenant,
    id: &str,
) -> Result<Transfer, ApiError> {
    let Json(transfer) = fetch(&PAYMENTS, state, tenant, id).await?;
    Ok(transfer)
}

/// Records the attempt, asks the processor, and settles the record with its decision.
async fn create<DB: Sql>(
    kind: &Kind,
    tenant: &Tenant,
    tx: &mut Transaction<'_, DB>,
    body: NewTransfer,
) -> Result<Created, ApiError> {
    body.validate()?;
    let mut transfer = Transfer {
        id: format!("{}_{}", kind.id_prefix, uuid::Uuid::new_v4().simple()),
        amount: body.amount,
        currency: body.currency,
        customer: body.customer,
        status: "processing".to_owned(),
    };
    DB::insert_transfer(tx, kind.insert, &transfer, &tenant.0).await?;
    let status = match card::decide(&transfer.customer).await {
        Decision::Approved => kind.approved,
        Decision::Declined => "declined",
        Decision::Unavailable => {
            return Err(ApiError::Unavailable(format!(
                "the processor did not answer; the {} was not made, retry with the same key",
                kind.noun
            )));
        }
    };
    DB::settle(tx, kind.settle, &transfer.id, status).await?;
    if status == "declined" {
        return Err(ApiError::Declined(format!(
            "the {} {} was declined by the card issuer",
            kind.noun, transfer.id
        )));
    }
    status.clone_into(&mut transfer.status);
    if let Some(topic) = kind.event {
        // In the same transaction as the payment: the event exists exactly when it does.
        let event = events::EventId::new();
        let payload = serde_json::json!({
            "event_id": event,
            "payment": transfer.id,
            "tenant": tenant.0,
            "amount": transfer.amount,
            "currency": transfer.currency,
        });
        events::enqueue_with_id(tx, event, topic, &payload).await?;
    }
    let location = format!("{}/{}", kind.path, transfer.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(transfer),
    ))
}

/// `GET /v1/payments`.
#[utoipa::path(get, path = "/v1/payments", tag = "payments", summary = "The caller's payments, newest first",
    responses((status = 200, description = "The caller's payments.", body = Vec<Transfer>)))]
pub async fn list_payments<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
) -> Result<Json<Vec<Transfer>>, ApiError> {
    list(&PAYMENTS, &state, &tenant).await
}

/// `GET /v1/payouts`.
#[utoipa::path(get, path = "/v1/payouts", tag = "payouts", summary = "The caller's payouts, newest first",
    responses((status = 200, description = "The caller's payouts.", body = Vec<Transfer>)))]
pub async fn list_payouts<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
) -> Result<Json<Vec<Transfer>>, ApiError> {
    list(&PAYOUTS, &state, &tenant).await
}

/// `GET /v1/payments/{id}`.
#[utoipa::path(get, path = "/v1/payments/{id}", tag = "payments", summary = "One of the caller's payments",
    params(("id" = String, Path, description = "The payment's id, `pay_…`.")),
    responses((status = 200, description = "The payment.", body = Transfer),
        (status = 404, description = "No such payment for this caller.", body = crate::api_doc::Problem, content_type = "application/problem+json")))]
pub async fn get_payment<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
    Path(id): Path<String>,
) -> Result<Json<Transfer>, ApiError> {
    fetch(&PAYMENTS, &state, &tenant, &id).await
}

/// `GET /v1/payouts/{id}`.
#[utoipa::path(get, path = "/v1/payouts/{id}", tag = "payouts", summary = "One of the caller's payouts",
    params(("id" = String, Path, description = "The payout's id, `po_…`.")),
    responses((status = 200, description = "The payout.", body = Transfer),
        (status = 404, description = "No such payout for this caller.", body = crate::api_doc::Problem, content_type = "application/problem+json")))]
pub async fn get_payout<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
    Path(id): Path<String>,
) -> Result<Json<Transfer>, ApiError> {
    fetch(&PAYOUTS, &state, &tenant, &id).await
}

async fn list<DB: Sql>(
    kind: &Kind,
    state: &AppState<DB>,
    tenant: &Tenant,
) -> Result<Json<Vec<Transfer>>, ApiError> {
    let sql = format!("{} {}", kind.list, DB::NEWEST_FIRST);
    let rows = state
        .within_deadline(async |conn| DB::transfers(conn, sql, &tenant.0, &[]).await)
        .await?;
    Ok(Json(rows))
}

async fn fetch<DB: Sql>(
    kind: &Kind,
    state: &AppState<DB>,
    tenant: &Tenant,
    id: &str,
) -> Result<Json<Transfer>, ApiError> {
    check_id(kind.noun, id)?;
    let sql = kind.fetch.to_owned();
    let rows = state
        .within_deadline(async |conn| DB::transfers(conn, sql, &tenant.0, &[id]).await)
        .await?;
    rows.into_iter()
        .next()
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no {} {id} for this tenant", kind.noun)))
}

/// `POST /v1/refunds`, in external mode: no transaction; the processor call happens between a
/// committed claim and the stored outcome, protected by a key derived from the client's.
#[utoipa::path(
    post,
    path = "/v1/refunds",
    tag = "refunds",
    summary = "Refund a payment",
    request_body = NewRefund,
    responses(
        (status = 201, description = "The processor refunded the payment.", body = Refund,
            headers(("Location" = String, description = "`/v1/refunds/{id}`"))),
        (status = 400, description = "`amount` not positive, or the body not JSON.", body = crate::api_doc::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such payment for this caller.", body = crate::api_doc::Problem, content_type = "application/problem+json"),
        (status = 503, description = "The processor could not be reached or refused; nothing was refunded.", body = crate::api_doc::Problem, content_type = "application/problem+json"),
    )
)]
#[idempotent(
    external,
    scope = "tenant",
    retention = "24h",
    lease = "5s",
    backend = DB,
    state = AppState<DB>
)]
pub async fn create_refund<DB: Sql>(
    tenant: Tenant,
    ctx: IdempotencyContext,
    State(state): State<AppState<DB>>,
    ApiJson(body): ApiJson<NewRefund>,
) -> Result<RefundCreated, ApiError> {
    if body.amount <= 0 {
        return Err(ApiError::Invalid(format!(
            "`amount` must be a positive integer in minor units, got {}",
            body.amount
        )));
    }
    let customer = state
        .within_deadline(async |conn| DB::payment_customer(conn, &tenant.0, &body.payment).await)
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
    state
        .within_deadline(async |conn| DB::insert_refund(conn, &refund, &tenant.0).await)
        .await?;
    let location = format!("/v1/refunds/{}", refund.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(refund),
    ))
}

/// `GET /v1/refunds`: the caller's refunds, newest first.
#[utoipa::path(get, path = "/v1/refunds", tag = "refunds", summary = "The caller's refunds, newest first",
    responses((status = 200, description = "The caller's refunds.", body = Vec<Refund>)))]
pub async fn list_refunds<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
) -> Result<Json<Vec<Refund>>, ApiError> {
    let sql = format!(
        "SELECT id, payment, amount, status FROM refunds WHERE tenant = $1 {}",
        DB::NEWEST_FIRST
    );
    let rows = state
        .within_deadline(async |conn| DB::refunds(conn, sql, &tenant.0, &[]).await)
        .await?;
    Ok(Json(rows))
}

/// `GET /v1/refunds/{id}`: one of the caller's refunds.
#[utoipa::path(get, path = "/v1/refunds/{id}", tag = "refunds", summary = "One of the caller's refunds",
    params(("id" = String, Path, description = "The refund's id.")),
    responses((status = 200, description = "The refund.", body = Refund),
        (status = 404, description = "No such refund for this caller.", body = crate::api_doc::Problem, content_type = "application/problem+json")))]
pub async fn get_refund<DB: Sql>(
    tenant: Tenant,
    State(state): State<AppState<DB>>,
    Path(id): Path<String>,
) -> Result<Json<Refund>, ApiError> {
    check_id("refund", &id)?;
    let sql = "SELECT id, payment, amount, status FROM refunds WHERE tenant = $1 AND id = $2";
    let rows = state
        .within_deadline(async |conn| DB::refunds(conn, sql.to_owned(), &tenant.0, &[&id]).await)
        .await?;
    rows.into_iter()
        .next()
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no refund {id} for this tenant")))
}
