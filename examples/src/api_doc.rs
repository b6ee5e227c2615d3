//! `GET /openapi.json` and `GET /idempotency-policy`: the service's OpenAPI 3.1 document,
//! generated from the handlers' `#[utoipa::path]` attributes, and its idempotency policy,
//! generated from their `#[idempotent]` attributes.
//!
//! The idempotency part (the `Idempotency-Key` header, the layer's problem responses, each
//! operation's retention) is not written here: the library's [`Idempotency`] modifier adds it
//! to every operation served by an `#[idempotent]` handler.

use std::sync::Arc;

use axum::{
    Router,
    extract::State,
    http::header,
    response::{IntoResponse, Response},
    routing::get,
};
use idem_openapi::{Idempotency, retention_policy};
use utoipa::{
    Modify, OpenApi, ToSchema,
    openapi::{
        ContentBuilder, Ref, RefOr, ResponseBuilder,
        header::HeaderBuilder,
        security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme},
    },
};

use crate::{balance, orders, payments, telemetry, webhooks};

/// The route that authenticates its callers by a webhook signature, not a bearer token.
const SIGNED_ROUTE: &str = "/v1/webhooks/processor";

/// The service's OpenAPI document: every route, the idempotency of the idempotent ones
/// ([`Idempotency`]), and the demo's bearer authentication ([`BearerAuth`]).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem example: payments",
        description = "Payments, payouts, refunds and orders, safe to retry with an \
                       `Idempotency-Key` header. Every `/v1` route but the processor's webhooks \
                       needs `Authorization: Bearer <tenant>` (the token is the tenant's id)."
    ),
    paths(
        payments::create_payment,
        payments::list_payments,
        payments::get_payment,
        payments::create_payout,
        payments::list_payouts,
        payments::get_payout,
        payments::create_refund,
        payments::list_refunds,
        payments::get_refund,
        orders::create_order,
        orders::list_orders,
        orders::get_order,
        orders::get_stock,
        webhooks::receive_processor_event,
        balance::get_balance,
        telemetry::metrics,
        openapi_json,
        idempotency_policy,
    ),
    components(schemas(Problem)),
    modifiers(&BearerAuth, &DatabaseDeadline, &Idempotency),
    tags(
        (name = "payments", description = "Card payments (transactional mode)."),
        (name = "payouts", description = "Payouts: a 5xx outcome is stored and replayed."),
        (name = "refunds", description = "Refunds at the processor (external mode)."),
        (name = "orders", description = "Orders in steps: stock, charge, shipping."),
        (name = "webhooks", description = "The processor's events, signed as Standard Webhooks \
                                           v1 specifies; the `webhook-id` is the key."),
        (name = "balance", description = "Balances, grown by the processor's webhooks."),
        (name = "operations", description = "For operators and tools."),
    )
)]
pub struct ApiDoc;

/// The ledger's OpenAPI document: its one route of its own, `/metrics` and `/openapi.json`.
/// It has no idempotent operation: its writes come from the queue, made idempotent by the
/// consumer (`idem_events::Consumer`), not from requests.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem example: ledger",
        description = "The ledger the payments service's events feed. `GET /v1/ledger` needs \
                       `Authorization: Bearer <tenant>`."
    ),
    paths(crate::ledger::balance, telemetry::metrics, openapi_json),
    components(schemas(Problem)),
    modifiers(&BearerAuth, &DatabaseDeadline, &Idempotency),
    tags(
        (name = "ledger", description = "Entries made from `payment.succeeded` events."),
        (name = "operations", description = "For operators and tools."),
    )
)]
pub struct LedgerDoc;

/// An RFC 9457 problem details document, as every error of this service is answered
/// (`application/problem+json`).
#[derive(Debug, ToSchema)]
#[allow(dead_code)] // Only its schema is used: `Problem` of idem-runtime is what is sent.
pub struct Problem {
    /// A URI naming the kind of problem.
    #[schema(rename = "type")]
    type_uri: String,
    /// A short summary of the kind of problem.
    title: String,
    /// The HTTP status.
    status: u16,
    /// What went wrong with this request.
    detail: Option<String>,
}

/// The problems `POST /v1/payments` and `POST /v1/payouts` answer themselves (the
/// idempotency layer's own are added by [`Idempotency`]).
#[derive(Debug, utoipa::IntoResponses)]
#[allow(dead_code)] // Only its responses are used.
pub enum TransferProblems {
    /// `amount` not positive, or `currency` not 3 letters, or the body not JSON.
    #[response(status = 400, content_type = "application/problem+json")]
    Invalid(Problem),
    /// The card was declined; the record is kept with `"status": "declined"`.
    #[response(status = 402, content_type = "application/problem+json")]
    Declined(Problem),
    /// The processor did not answer; nothing was recorded.
    #[response(status = 503, content_type = "application/problem+json")]
    Unavailable(Problem),
}

/// The demo's authentication: `Authorization: Bearer <tenant>` on every `/v1` route but the
/// webhook receiver's (which checks a signature instead), answered with 401 when missing.
#[derive(Debug, Clone, Copy)]
pub struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The token is the tenant's id (demo authentication)."))
                    .build(),
            ),
        );
        for (path, item) in &mut openapi.paths.paths {
            if !path.starts_with("/v1/") || path == SIGNED_ROUTE {
                continue;
            }
            for operation in [&mut item.get, &mut item.post].into_iter().flatten() {
                operation
                    .security
                    .get_or_insert_with(Vec::new)
                    .push(SecurityRequirement::new("bearer", Vec::<String>::new()));
                operation.responses.responses.insert(
                    "401".to_owned(),
                    RefOr::T(
                        ResponseBuilder::new()
                            .description("No `Authorization: Bearer <tenant>` header.")
                            .content(
                                "application/problem+json",
                                ContentBuilder::new()
                                    .schema(Some(Ref::from_schema_name("Problem")))
                                    .build(),
                            )
                            .build(),
                    ),
                );
            }
        }
    }
}

/// The deadline of the read routes' database work ([`crate::bounded`]): every `GET` under
/// `/v1` may answer 503 with `Retry-After` when the database does not answer in time.
#[derive(Debug, Clone, Copy)]
pub struct DatabaseDeadline;

impl Modify for DatabaseDeadline {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in &mut openapi.paths.paths {
            let Some(operation) = item.get.as_mut().filter(|_| path.starts_with("/v1/")) else {
                continue;
            };
            operation.responses.responses.insert(
                "503".to_owned(),
                RefOr::T(
                    ResponseBuilder::new()
                        .description(
                            "The database did not answer in time or cannot be reached \
                             (`database-unavailable`); retry after `Retry-After` seconds.",
                        )
                        .header(
                            "Retry-After",
                            HeaderBuilder::new()
                                .description(Some("Seconds to wait before retrying."))
                                .build(),
                        )
                        .content(
                            "application/problem+json",
                            ContentBuilder::new()
                                .schema(Some(Ref::from_schema_name("Problem")))
                                .build(),
                        )
                        .build(),
                ),
            );
        }
    }
}

/// The document and the policy, rendered once.
#[derive(Debug)]
struct Rendered {
    json: String,
    policy: String,
}

/// The policy text of this service: what `GET /idempotency-policy` answers and the guide's
/// Operations chapter quotes.
///
/// # Panics
///
/// As [`Idempotency`] does: when an operation id names two differing `#[idempotent]`
/// handlers, which this crate's tests rule out.
pub fn policy() -> String {
    retention_policy(&ApiDoc::openapi()).to_string()
}

/// `GET /openapi.json` and `GET /idempotency-policy`.
///
/// # Errors
///
/// When the document does not serialize, which a correct build never sees.
///
/// # Panics
///
/// As [`policy`] does.
pub fn router() -> Result<Router, serde_json::Error> {
    let document = ApiDoc::openapi();
    let rendered = Rendered {
        json: document.to_json()?,
        policy: retention_policy(&document).to_string(),
    };
    Ok(Router::new()
        .route("/openapi.json", get(openapi_json))
        .route("/idempotency-policy", get(idempotency_policy))
        .with_state(Arc::new(rendered)))
}

/// The ledger's `GET /openapi.json`.
///
/// # Errors
///
/// When the document does not serialize, which a correct build never sees.
pub fn ledger_router() -> Result<Router, serde_json::Error> {
    let rendered = Rendered {
        json: LedgerDoc::openapi().to_json()?,
        policy: String::new(),
    };
    Ok(Router::new()
        .route("/openapi.json", get(openapi_json))
        .with_state(Arc::new(rendered)))
}

/// `GET /openapi.json`.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    summary = "This document (OpenAPI 3.1)",
    responses((status = 200, description = "The OpenAPI document.", content_type = "application/json")))]
async fn openapi_json(State(rendered): State<Arc<Rendered>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        rendered.json.clone(),
    )
        .into_response()
}

/// `GET /idempotency-policy`: how long keys live, per operation, from the handlers'
/// attributes (the IETF draft asks servers to publish it).
#[utoipa::path(get, path = "/idempotency-policy", tag = "operations",
    summary = "The idempotency policy: how long keys live, per operation",
    responses((status = 200, description = "The policy, in Markdown.", body = String, content_type = "text/markdown")))]
async fn idempotency_policy(State(rendered): State<Arc<Rendered>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/markdown; charset=utf-8")],
        rendered.policy.clone(),
    )
        .into_response()
}
