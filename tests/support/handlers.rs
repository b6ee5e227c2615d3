//! Test-only handlers, written once for both databases (generic over the backend, routed as
//! `post(flaky::<DB>)`): they count their calls, write a row, and fail on purpose (a 5xx, a
//! panic) or wait for the test.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Extension, Router,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::post,
};
use idem_runtime::{Store, idempotent};
use sqlx::Transaction;

use crate::{
    Tenant,
    test_app::{Param, TestBackend, run},
};

/// How many times each test-only handler body ran.
#[derive(Debug, Default)]
pub struct Calls {
    /// `POST /test/flaky`.
    pub flaky: AtomicUsize,
    /// `POST /test/panic`.
    pub panic: AtomicUsize,
    /// `POST /test/global`.
    pub global: AtomicUsize,
    /// `POST /test/slow`.
    pub slow: AtomicUsize,
    /// `POST /test/slow-then-write`.
    pub slow_then_write: AtomicUsize,
    /// `POST /test/external-slow`.
    pub external: AtomicUsize,
    /// `POST /test/redirect`.
    pub redirect: AtomicUsize,
    /// `POST /test/aborted`.
    pub aborted: AtomicUsize,
    /// `POST /test/deferred`.
    pub deferred: AtomicUsize,
    /// `POST /test/entries` and `/test/stored-5xx`.
    pub entries: AtomicUsize,
    /// `POST /test/transfers`.
    pub transfers: AtomicUsize,
    /// The `take` step of `POST /test/orders`.
    pub take: AtomicUsize,
    /// The `transfer` step of `POST /test/orders`.
    pub transfer: AtomicUsize,
    /// The `book` step of `POST /test/orders`.
    pub book: AtomicUsize,
    /// `POST /test/hooks` (`key_sources`).
    pub hook: AtomicUsize,
    /// `POST /test/body-key` (`key_sources`).
    pub body_key: AtomicUsize,
    /// `POST /test/optional-key` (`key_sources`).
    pub optional: AtomicUsize,
    /// `POST /test/optional-key-external` (`key_sources`).
    pub optional_external: AtomicUsize,
}

/// The scope of `POST /test/account`: the `X-Account` header, as sent (possibly empty).
#[derive(Debug, Clone)]
pub struct Account(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Account {
    type Rejection = axum::http::StatusCode;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        let value = parts
            .headers
            .get("x-account")
            .ok_or(axum::http::StatusCode::UNAUTHORIZED)?;
        let value = value
            .to_str()
            .map_err(|_| axum::http::StatusCode::BAD_REQUEST)?;
        Ok(Self(value.to_owned()))
    }
}

impl idem_runtime::IdempotencyScope for Account {
    fn idempotency_scope(&self) -> std::borrow::Cow<'_, str> {
        std::borrow::Cow::Borrowed(&self.0)
    }
}

/// `/test/flaky`, `/test/panic`, `/test/global`, `/test/slow`, `/test/slow-then-write`,
/// `/test/external-slow`,
/// `/test/redirect`, `/test/aborted`, `/test/deferred`, `/test/account`,
/// `/test/ends-its-transaction`, and
/// `/test/nest-a/x`, `/test/nest-b/x` (one handler nested under two prefixes).
/// Their counters and gate come as `Extension`s.
pub fn routes<DB: TestBackend>() -> Router<Store<DB>> {
    let nested = || Router::new().route("/x", post(slow::<DB>));
    Router::new()
        .route("/test/flaky", post(flaky::<DB>))
        .route("/test/panic", post(panicky::<DB>))
        .route("/test/global", post(global::<DB>))
        .route("/test/slow", post(slow::<DB>))
        .route("/test/slow-then-write", post(slow_then_write::<DB>))
        .route("/test/external-slow", post(external_slow::<DB>))
        .route("/test/external-but-fields", post(external_but_fields::<DB>))
        .route("/test/redirect", post(redirect::<DB>))
        .route("/test/aborted", post(aborted::<DB>))
        .route("/test/deferred", post(deferred::<DB>))
        .route("/test/account", post(account::<DB>))
        .route(
            "/test/ends-its-transaction",
            post(ends_its_transaction::<DB>),
        )
        .nest("/test/nest-a", nested())
        .nest("/test/nest-b", nested())
}

async fn record_effect<DB: TestBackend>(
    tx: &mut Transaction<'_, DB>,
    route: &str,
    tenant: &Tenant,
) {
    let sql = "INSERT INTO test_effects (route, tenant) VALUES ($1, $2)";
    run(tx, sql, &[Param::Text(route), Param::Text(&tenant.0)])
        .await
        .expect("insert effect");
}

/// Writes, then answers 503 on its first call and 201 afterwards.
#[idempotent(scope = "tenant", retention = "1h")]
async fn flaky<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
) -> impl IntoResponse {
    record_effect(tx, "flaky", &tenant).await;
    let call = calls.flaky.fetch_add(1, Ordering::SeqCst) + 1;
    if call == 1 {
        (StatusCode::SERVICE_UNAVAILABLE, format!("call {call}"))
    } else {
        (StatusCode::CREATED, format!("call {call}"))
    }
}

/// Writes, then panics on its first call; answers 201 afterwards.
#[idempotent(scope = "tenant", retention = "1h")]
async fn panicky<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
) -> (StatusCode, String) {
    record_effect(tx, "panic", &tenant).await;
    let call = calls.panic.fetch_add(1, Ordering::SeqCst) + 1;
    assert!(call > 1, "the handler panics on its first call");
    (StatusCode::CREATED, format!("call {call}"))
}

/// Keys shared by every caller.
#[idempotent(global, retention = "1h")]
async fn global<DB: TestBackend>(
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
    body: String,
) -> (StatusCode, String) {
    run(tx, "SELECT 1", &[]).await.expect("select");
    let call = calls.global.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("call {call}: {body}"))
}

/// Writes, then waits for the test to open the gate.
#[idempotent(scope = "tenant", retention = "1h")]
async fn slow<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
    tx: &mut Transaction<'_, DB>,
) -> (StatusCode, String) {
    record_effect(tx, "slow", &tenant).await;
    calls.slow.fetch_add(1, Ordering::SeqCst);
    gate.acquire().await.expect("gate open").forget();
    (StatusCode::CREATED, "done".to_owned())
}

/// Writes, waits for the test to open the gate, then writes again: a statement that fails
/// (its transaction lost a conflict meanwhile, say) is answered 500 with the database's message,
/// as a handler that passes its errors on with `?` answers.
#[idempotent(scope = "tenant", retention = "1h")]
async fn slow_then_write<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
    tx: &mut Transaction<'_, DB>,
) -> (StatusCode, String) {
    record_effect(tx, "before", &tenant).await;
    calls.slow_then_write.fetch_add(1, Ordering::SeqCst);
    gate.acquire().await.expect("gate open").forget();
    let sql = "INSERT INTO test_effects (route, tenant) VALUES ('after', $1)";
    match run(tx, sql, &[Param::Text(&tenant.0)]).await {
        Ok(_) => (StatusCode::CREATED, "done".to_owned()),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// Writes, then answers 303 See Other with a `Location`.
#[idempotent(scope = "tenant", retention = "1h")]
async fn redirect<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
) -> (StatusCode, [(header::HeaderName, String); 1], String) {
    record_effect(tx, "redirect", &tenant).await;
    let call = calls.redirect.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::SEE_OTHER,
        [(header::LOCATION, format!("/test/elsewhere/{call}"))],
        format!("see call {call}"),
    )
}

/// Writes, then runs a statement that fails (a duplicate primary key), ignores the
/// error and answers 201 anyway.
#[idempotent(scope = "tenant", retention = "1h")]
async fn aborted<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
) -> (StatusCode, String) {
    record_effect(tx, "aborted", &tenant).await;
    let call = calls.aborted.fetch_add(1, Ordering::SeqCst) + 1;
    for _ in 0..2 {
        let _ignored = run(tx, "INSERT INTO test_unique (id) VALUES (1)", &[]).await;
    }
    (StatusCode::CREATED, format!("call {call}"))
}

/// Writes a row whose deferred foreign key has no parent: the database refuses the
/// transaction at COMMIT, not before.
#[idempotent(scope = "tenant", retention = "1h")]
async fn deferred<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
) -> (StatusCode, String) {
    record_effect(tx, "deferred", &tenant).await;
    calls.deferred.fetch_add(1, Ordering::SeqCst);
    run(tx, "INSERT INTO test_child (parent) VALUES (999)", &[])
        .await
        .expect("a deferred constraint is checked at COMMIT only");
    (StatusCode::CREATED, "written".to_owned())
}

/// Scoped by the `X-Account` header, which may be empty.
#[idempotent(scope = "account", retention = "1h")]
async fn account<DB: TestBackend>(
    account: Account,
    tx: &mut Transaction<'_, DB>,
) -> (StatusCode, String) {
    run(tx, "SELECT 1", &[]).await.expect("select");
    (StatusCode::CREATED, format!("account {:?}", account.0))
}

/// External mode: counts its calls; the first waits for the test to open the gate.
#[idempotent(external, scope = "tenant", retention = "1h", lease = "5s", backend = DB)]
async fn external_slow<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
) -> (StatusCode, String) {
    let call = calls.external.fetch_add(1, Ordering::SeqCst) + 1;
    if call == 1 {
        gate.acquire().await.expect("gate open").forget();
    }
    (StatusCode::CREATED, format!("call {call} for {}", tenant.0))
}

/// External mode, the same request being the same JSON body but its `sent_at`: counts its
/// calls.
#[idempotent(external, scope = "tenant", retention = "1h", backend = DB, fingerprint_except = ["/sent_at"])]
async fn external_but_fields<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> (StatusCode, String) {
    let call = calls.external.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!("call {call} for {}: {}", tenant.0, body["amount"]),
    )
}

/// Writes, then ends its transaction itself with the statements in the body (`COMMIT`,
/// `ROLLBACK`, or `COMMIT` and a new `BEGIN` with a write in it), as a handler must not; with
/// `+503` after the statement, it then answers 503 (the path that rolls back, not completes).
#[idempotent(scope = "tenant", retention = "1h")]
async fn ends_its_transaction<DB: TestBackend>(
    tenant: Tenant,
    tx: &mut Transaction<'_, DB>,
    how: String,
) -> (StatusCode, String) {
    record_effect(tx, "before", &tenant).await;
    let (how, status) = match how.strip_suffix("+503") {
        Some(how) => (how.to_owned(), StatusCode::SERVICE_UNAVAILABLE),
        None => (how, StatusCode::CREATED),
    };
    match how.as_str() {
        "commit" => run(tx, "COMMIT", &[]).await,
        "rollback" => run(tx, "ROLLBACK", &[]).await,
        "commit-begin" => {
            run(tx, "COMMIT", &[]).await.expect("commit");
            run(tx, "BEGIN", &[]).await.expect("begin");
            let sql = "INSERT INTO test_effects (route, tenant) VALUES ('after', $1)";
            run(tx, sql, &[Param::Text(&tenant.0)]).await
        }
        other => panic!("unknown way to end a transaction: {other}"),
    }
    .expect("the statement runs");
    (status, format!("ended with {how}"))
}
