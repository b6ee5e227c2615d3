//! Shared pieces of the behaviour tests: the app under test (the example's router plus a few
//! test-only handlers), a request builder, and database probes.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Extension, Router,
    body::Body,
    http::{HeaderMap, Method, Request, StatusCode},
    response::IntoResponse,
    routing::post,
};
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_examples::{auth::Tenant, payments, schema};
use idem_runtime::{Store, idempotent};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use tower::ServiceExt;

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
}

/// The service under test.
#[derive(Clone)]
pub struct App {
    /// The example's router with the test routes merged in.
    pub router: Router,
    /// The test's own database.
    pub pool: PgPool,
    /// Handler call counters.
    pub calls: Arc<Calls>,
    /// Released to let `POST /test/slow` finish.
    pub gate: Arc<tokio::sync::Semaphore>,
}

impl App {
    /// Creates the tables in `pool` and builds the router with default settings.
    pub async fn new(pool: PgPool) -> Self {
        Self::build(pool.clone(), Store::new(pool), None).await
    }

    /// As [`App::new`], with a store of the caller's settings.
    pub async fn with_store(pool: PgPool, store: Store<Postgres>) -> Self {
        Self::build(pool, store, None).await
    }

    /// As [`App::new`], sending refunds to the processor at `url`.
    pub async fn with_processor(pool: PgPool, url: String) -> Self {
        Self::build(pool.clone(), Store::new(pool), Some(url)).await
    }

    async fn build(pool: PgPool, store: Store<Postgres>, processor_url: Option<String>) -> Self {
        schema::create(&pool).await.expect("create tables");
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS test_effects (route text NOT NULL, tenant text NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("create test_effects");
        let calls = Arc::new(Calls::default());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let test_routes = Router::new()
            .route("/test/flaky", post(flaky))
            .route("/test/panic", post(panicky))
            .route("/test/global", post(global))
            .route("/test/slow", post(slow))
            .layer(Extension(Arc::clone(&calls)))
            .layer(Extension(Arc::clone(&gate)))
            .layer(tower_http::catch_panic::CatchPanicLayer::new())
            .with_state(store.clone());
        let mut state = payments::AppState::new(store);
        if let Some(url) = processor_url {
            state.processor = idem_examples::refunds::ProcessorClient::new(url);
        }
        let router = payments::routes()
            .route("/test/bare-payments", post(payments::create_payment_bare))
            .with_state(state)
            .merge(test_routes);
        Self {
            router,
            pool,
            calls,
            gate,
        }
    }

    /// Sends one request through the router.
    pub async fn send(&self, request: Request<Body>) -> Reply {
        let response = self
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("the router is infallible");
        Reply::read(response).await
    }

    /// Rows in `table` (a fixed name from the tests).
    pub async fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table}");
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .expect("count rows")
    }

    /// Makes a payment for `tenant` and returns its id.
    pub async fn paid(&self, tenant: &str, customer: &str) -> String {
        let key = format!("pay-{}", uuid_like());
        let reply = self
            .send(
                Req::post("/v1/payments")
                    .tenant(tenant)
                    .key(&key)
                    .json(&payment(100, customer))
                    .build(),
            )
            .await;
        assert_eq!(reply.status, StatusCode::CREATED);
        reply.json()["id"].as_str().expect("payment id").to_owned()
    }

    /// The status of `key`'s row, if there is one.
    pub async fn key_status(&self, key: &str) -> Option<String> {
        sqlx::query_scalar("SELECT status FROM idem_keys WHERE key = $1")
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .expect("read key")
    }

    /// Rows of the key table for `key`, in any scope.
    pub async fn keys_named(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE key = $1")
            .bind(key)
            .fetch_one(&self.pool)
            .await
            .expect("count keys")
    }

    /// Advisory locks held right now in this test's database (a handler holding its key).
    /// Other databases on the server (other tests, other users) are not counted.
    pub async fn advisory_locks(&self) -> i64 {
        sqlx::query_scalar(ADVISORY_LOCKS_HERE)
            .fetch_one(&self.pool)
            .await
            .expect("read pg_locks")
    }
}

/// Serves the simulated card processor on a loopback port; returns its base URL.
pub async fn spawn_processor() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        axum::serve(listener, idem_examples::processor::router())
            .await
            .expect("serve processor");
    });
    format!("http://{addr}")
}

/// The refunds the processor at `url` has executed.
pub async fn executed_refunds(url: &str) -> Vec<Value> {
    reqwest::get(format!("{url}/v1/refunds"))
        .await
        .expect("processor answers")
        .json()
        .await
        .expect("a JSON list")
}

/// Counts the granted advisory locks of the current database.
pub const ADVISORY_LOCKS_HERE: &str = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
     AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// Waits until `counter` reaches `n` (a handler body has started).
pub async fn until_called(counter: &AtomicUsize, n: usize) {
    while counter.load(Ordering::SeqCst) < n {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
}

impl Reply {
    /// Reads a response.
    pub async fn read(response: axum::response::Response) -> Self {
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("read body").to_bytes();
        Self {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header as text, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("text header"))
    }

    /// Whether the response is a replay.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a problem+json of `status` and returns its `type`.
    pub fn problem(&self, status: StatusCode) -> String {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let json = self.json();
        assert_eq!(json["status"], status.as_u16());
        assert!(
            json["title"].is_string() && json["detail"].is_string(),
            "{json}"
        );
        json["type"].as_str().expect("problem type").to_owned()
    }
}

/// Builds a request.
#[derive(Debug, Clone)]
pub struct Req {
    method: Method,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Req {
    /// `POST path`.
    pub fn post(path: &str) -> Self {
        Self {
            method: Method::POST,
            path: path.to_owned(),
            headers: Vec::new(),
            body: String::new(),
        }
    }

    /// `GET path`.
    pub fn get(path: &str) -> Self {
        Self {
            method: Method::GET,
            ..Self::post(path)
        }
    }

    /// `Authorization: Bearer <tenant>`.
    pub fn tenant(self, tenant: &str) -> Self {
        self.header("authorization", &format!("Bearer {tenant}"))
    }

    /// `Idempotency-Key: <key>` (bare form).
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    /// Any header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// A JSON body, sent as written.
    pub fn json(mut self, body: &str) -> Self {
        self.body = body.to_owned();
        self.header("content-type", "application/json")
    }

    /// The request.
    pub fn build(&self) -> Request<Body> {
        let mut builder = Request::builder()
            .method(self.method.clone())
            .uri(&self.path);
        for (name, value) in &self.headers {
            builder = builder.header(name, value);
        }
        builder
            .body(Body::from(self.body.clone()))
            .expect("valid request")
    }
}

fn uuid_like() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// A valid payment body.
pub fn payment(amount: i64, customer: &str) -> String {
    format!(r#"{{"amount": {amount}, "currency": "usd", "customer": "{customer}"}}"#)
}

async fn record_effect(tx: &mut Transaction<'_, Postgres>, route: &str, tenant: &Tenant) {
    sqlx::query("INSERT INTO test_effects (route, tenant) VALUES ($1, $2)")
        .bind(route)
        .bind(&tenant.0)
        .execute(&mut **tx)
        .await
        .expect("insert effect");
}

/// Writes, then answers 503 on its first call and 201 afterwards.
#[idempotent(scope = "tenant", retention = "1h")]
async fn flaky(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, Postgres>,
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
async fn panicky(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, Postgres>,
) -> (StatusCode, String) {
    record_effect(tx, "panic", &tenant).await;
    let call = calls.panic.fetch_add(1, Ordering::SeqCst) + 1;
    assert!(call > 1, "the handler panics on its first call");
    (StatusCode::CREATED, format!("call {call}"))
}

/// Keys shared by every caller.
#[idempotent(global, retention = "1h")]
async fn global(
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, Postgres>,
    body: String,
) -> (StatusCode, String) {
    sqlx::query("SELECT 1")
        .execute(&mut **tx)
        .await
        .expect("select");
    let call = calls.global.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("call {call}: {body}"))
}

/// Writes, then waits for the test to open the gate.
#[idempotent(scope = "tenant", retention = "1h")]
async fn slow(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
    tx: &mut Transaction<'_, Postgres>,
) -> (StatusCode, String) {
    record_effect(tx, "slow", &tenant).await;
    calls.slow.fetch_add(1, Ordering::SeqCst);
    gate.acquire().await.expect("gate open").forget();
    (StatusCode::CREATED, "done".to_owned())
}

/// Collects the SQL statements sqlx runs on the current thread while installed.
#[derive(Debug, Clone, Default)]
pub struct StatementLog(Arc<Mutex<Vec<String>>>);

impl StatementLog {
    /// Installs the log as the thread's default subscriber until the guard drops.
    pub fn install(&self) -> tracing::subscriber::DefaultGuard {
        use tracing_subscriber::{filter::Targets, layer::SubscriberExt};
        let filter = Targets::new().with_target("sqlx::query", tracing::Level::TRACE);
        let subscriber = tracing_subscriber::registry()
            .with(self.clone())
            .with(filter);
        tracing::subscriber::set_default(subscriber)
    }

    /// Takes the statements logged so far.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().expect("log lock"))
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StatementLog {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "sqlx::query" {
            return;
        }
        struct Statement(Option<String>);
        impl tracing::field::Visit for Statement {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                // The full statement when sqlx gives it, else its summary.
                let full = field.name() == "db.statement" && !value.is_empty();
                let summary = field.name() == "summary" && self.0.is_none();
                if full || summary {
                    self.0 = Some(value.trim().to_owned());
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.record_str(field, &format!("{value:?}"));
            }
        }
        let mut statement = Statement(None);
        event.record(&mut statement);
        if let Some(sql) = statement.0 {
            self.0.lock().expect("log lock").push(sql);
        }
    }
}
