//! Test-only handlers whose key is elsewhere than `Idempotency-Key`: a webhook receiver keyed
//! by its `webhook-id` header that checks the sender's signature in its last extractor, a
//! handler keyed by a field of its JSON body, and handlers whose key is optional, in both
//! modes. Written once for every database, as the test app's other handlers are.

use std::sync::{Arc, atomic::Ordering};

use axum::{
    Extension, Json, Router,
    extract::{FromRequest, Request},
    http::StatusCode,
    routing::post,
};
use idem_runtime::{Store, idempotent};
use sqlx::Transaction;

use crate::{
    Tenant,
    handlers::Calls,
    test_app::{Param, TestBackend, run},
};

/// The secret the test sender signs its deliveries with.
pub const WEBHOOK_SECRET: &str = "test-webhook-secret";

/// The header that carries a delivery's signature.
pub const SIGNATURE: &str = "x-test-signature";

/// The signature of a delivery with id `id` and `body`: a keyed SHA-256 over both, as a
/// webhook sender computes one (the test stands for the sender).
pub fn sign(id: &str, body: &str) -> String {
    idem_key::derive_key(WEBHOOK_SECRET, id, body)
}

/// A delivery's body, once its signature over the `webhook-id` and the body verified; a
/// delivery whose signature is missing or wrong is refused with 401.
#[derive(Debug)]
pub struct Signed(pub String);

impl<S: Send + Sync> FromRequest<S> for Signed {
    type Rejection = (StatusCode, &'static str);

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let id = request
            .headers()
            .get("webhook-id")
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let signature = request
            .headers()
            .get(SIGNATURE)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let body = String::from_request(request, state)
            .await
            .map_err(|_| (StatusCode::BAD_REQUEST, "the body is not UTF-8"))?;
        if signature.as_deref() != Some(sign(&id, &body).as_str()) {
            return Err((StatusCode::UNAUTHORIZED, "the signature does not verify"));
        }
        Ok(Self(body))
    }
}

/// The scope of `POST /test/hooks`: this endpoint, whoever sends.
#[derive(Debug)]
pub struct HookEndpoint;

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for HookEndpoint {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        _: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Self)
    }
}

impl idem_runtime::IdempotencyScope for HookEndpoint {
    fn idempotency_scope(&self) -> std::borrow::Cow<'_, str> {
        "test/hooks".into()
    }
}

/// The routes of this module, their counters and gate as `Extension`s.
pub fn routes<DB: TestBackend>() -> Router<Store<DB>> {
    Router::new()
        .route("/test/hooks", post(hook::<DB>))
        .route("/test/body-key", post(body_key::<DB>))
        .route("/test/optional-key", post(optional::<DB>))
        .route("/test/optional-key-external", post(optional_external::<DB>))
}

/// A webhook receiver: keyed by `webhook-id`, its sender's signature checked by its last
/// extractor; it records the delivery, then waits for the test's gate when the body asks
/// (`"hold"`).
#[idempotent(scope = "endpoint", key_header = "webhook-id", retention = "1h")]
async fn hook<DB: TestBackend>(
    endpoint: HookEndpoint,
    Extension(calls): Extension<Arc<Calls>>,
    Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
    tx: &mut Transaction<'_, DB>,
    Signed(body): Signed,
) -> (StatusCode, String) {
    let _ = endpoint;
    let sql = "INSERT INTO test_effects (route, tenant) VALUES ('hook', $1)";
    run(tx, sql, &[Param::Text(&body)])
        .await
        .expect("insert effect");
    let call = calls.hook.fetch_add(1, Ordering::SeqCst) + 1;
    if body.contains("hold") {
        gate.acquire().await.expect("gate open").forget();
    }
    (StatusCode::OK, format!("delivery {call}: {body}"))
}

/// Keyed by the `request_id` field of its JSON body.
#[idempotent(scope = "tenant", key_pointer = "/request_id", retention = "1h")]
async fn body_key<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
    Json(body): Json<serde_json::Value>,
) -> (StatusCode, String) {
    let sql = "INSERT INTO test_effects (route, tenant) VALUES ('body-key', $1)";
    run(tx, sql, &[Param::Text(&tenant.0)])
        .await
        .expect("insert effect");
    let call = calls.body_key.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!("call {call}: {}", body["amount"]),
    )
}

/// Its key is optional: a request without one runs, unprotected.
#[idempotent(scope = "tenant", key_optional, retention = "1h")]
async fn optional<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
    body: String,
) -> (StatusCode, String) {
    let sql = "INSERT INTO test_effects (route, tenant) VALUES ('optional', $1)";
    run(tx, sql, &[Param::Text(&tenant.0)])
        .await
        .expect("insert effect");
    let call = calls.optional.fetch_add(1, Ordering::SeqCst) + 1;
    let status = if body == "fail" {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::CREATED
    };
    (status, format!("call {call}"))
}

/// External mode, its key optional.
#[idempotent(scope = "tenant", key_optional, external, backend = DB, retention = "1h")]
async fn optional_external<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
) -> (StatusCode, String) {
    let _ = tenant;
    let call = calls.optional_external.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("call {call}"))
}
