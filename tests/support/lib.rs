//! Shared pieces of the behaviour tests: the app under test (the example's router plus a few
//! test-only handlers) on either database, a request builder, and database probes.
//!
//! Every behaviour test is written once and run on both backends through [`backend_tests!`].

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, body::Body, http::Request, routing::post};
use idem_examples::{payments, schema};
use idem_runtime::{
    Settings, Store,
    tasks::{PurgeOptions, PurgeReport, RecoveryHook, RecoveryReport},
};
use serde_json::Value;
use sqlx::{
    PgPool, SqlitePool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tower::ServiceExt;

mod handlers;
mod http;
mod proxy;
mod statements;
mod tenant;

pub use http::{Reply, Req, payment};
pub use proxy::CommitCutter;
pub use statements::StatementLog;
pub use tenant::Tenant;

/// Runs each test body on PostgreSQL (a fresh database from `#[sqlx::test]`) and on SQLite (a
/// fresh file), as `postgres::<name>` and `sqlite::<name>`.
#[macro_export]
macro_rules! backend_tests {
    ($(async fn $name:ident($db:ident) $body:block)*) => {
        mod postgres {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[sqlx::test(migrations = false)]
                async fn $name(
                    _: sqlx::postgres::PgPoolOptions,
                    connect: sqlx::postgres::PgConnectOptions,
                ) {
                    let $db = $crate::TestDb::Postgres(Box::new(connect));
                    $body
                }
            )*
        }
        mod sqlite {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let $db = $crate::TestDb::sqlite();
                    $body
                }
            )*
        }
    };
}

/// Where a test's data lives.
#[derive(Debug)]
pub enum TestDb {
    /// A database of its own on the PostgreSQL server.
    Postgres(Box<PgConnectOptions>),
    /// A SQLite file in a directory of its own, removed after the test.
    Sqlite(tempfile::TempDir),
}

impl TestDb {
    /// A fresh SQLite file.
    pub fn sqlite() -> Self {
        Self::Sqlite(tempfile::tempdir().expect("a temporary directory"))
    }
}

/// A pool on either database.
#[derive(Clone, Debug)]
pub enum Db {
    /// PostgreSQL.
    Postgres(PgPool),
    /// SQLite.
    Sqlite(SqlitePool),
}

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
    /// `POST /test/external-slow`.
    pub external: AtomicUsize,
    /// `POST /test/redirect`.
    pub redirect: AtomicUsize,
    /// `POST /test/aborted`.
    pub aborted: AtomicUsize,
    /// `POST /test/deferred`.
    pub deferred: AtomicUsize,
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

/// How to build the app under test.
#[derive(Debug, Default)]
pub struct Options {
    /// The store's settings.
    pub settings: Settings,
    /// Where refunds go (default: the processor's default address).
    pub processor: Option<String>,
    /// Pool size (default 10).
    pub connections: Option<u32>,
}

/// The service under test.
#[derive(Clone)]
pub struct App {
    /// The example's router with the test routes merged in.
    pub router: Router,
    /// The test's own database.
    pub db: Db,
    /// Handler call counters.
    pub calls: Arc<Calls>,
    /// Released to let `POST /test/slow` finish.
    pub gate: Arc<tokio::sync::Semaphore>,
    in_flight: Arc<dyn Fn() -> (usize, usize) + Send + Sync>,
    _dir: Option<Arc<tempfile::TempDir>>,
}

impl App {
    /// The app with default settings.
    pub async fn new(db: TestDb) -> Self {
        Self::build(db, Options::default()).await
    }

    /// The app, sending refunds to the processor at `url`.
    pub async fn with_processor(db: TestDb, url: String) -> Self {
        Self::build(
            db,
            Options {
                processor: Some(url),
                ..Options::default()
            },
        )
        .await
    }

    /// The app as `options` say.
    pub async fn build(db: TestDb, options: Options) -> Self {
        let connections = options.connections.unwrap_or(10);
        match db {
            TestDb::Postgres(connect) => {
                let pool = PgPoolOptions::new()
                    .max_connections(connections)
                    .connect_with(*connect)
                    .await
                    .expect("connect to the test database");
                Self::build_on(Db::Postgres(pool), options, None).await
            }
            TestDb::Sqlite(dir) => {
                let pool = sqlite_pool(&dir, connections).await;
                Self::build_on(Db::Sqlite(pool), options, Some(Arc::new(dir))).await
            }
        }
    }

    /// A second app on the same database, sending refunds to the processor at `url` (another
    /// process of the same service, as it were).
    pub async fn sibling_with_processor(&self, url: String) -> Self {
        let options = Options {
            processor: Some(url),
            ..Options::default()
        };
        self.sibling_with(options).await
    }

    /// Another instance of the service on the same database: its own pool, store, held keys,
    /// writer queue and handler counters; nothing shared with `self` but the database, as two
    /// processes behind a load balancer.
    pub async fn sibling(&self) -> Self {
        self.sibling_with(Options::default()).await
    }

    /// Another instance on the same database, built as `options` say.
    pub async fn sibling_with(&self, options: Options) -> Self {
        let connections = options.connections.unwrap_or(10);
        let db = match &self.db {
            Db::Postgres(pool) => Db::Postgres(
                PgPoolOptions::new()
                    .max_connections(connections)
                    .connect_with((*pool.connect_options()).clone())
                    .await
                    .expect("connect to the test database"),
            ),
            Db::Sqlite(_) => {
                let dir = self._dir.as_ref().expect("a SQLite app has its directory");
                Db::Sqlite(sqlite_pool(dir, connections).await)
            }
        };
        Self::build_on(db, options, self._dir.clone()).await
    }

    async fn build_on(db: Db, options: Options, dir: Option<Arc<tempfile::TempDir>>) -> Self {
        let calls = Arc::new(Calls::default());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let processor = options
            .processor
            .map(idem_examples::refunds::ProcessorClient::new);
        let (router, in_flight): (Router, Arc<dyn Fn() -> (usize, usize) + Send + Sync>) = match &db
        {
            Db::Postgres(pool) => {
                schema::create(pool).await.expect("create tables");
                let store = Store::with_settings(pool.clone(), options.settings);
                let mut state = payments::AppState::new(store.clone());
                if let Some(processor) = processor {
                    state.processor = processor;
                }
                let router = payments::routes::<sqlx::Postgres>()
                    .route(
                        "/test/bare-payments",
                        post(payments::create_payment_bare::<sqlx::Postgres>),
                    )
                    .with_state(state)
                    .merge(
                        handlers::routes::<sqlx::Postgres>(Arc::clone(&calls), Arc::clone(&gate))
                            .with_state(store.clone()),
                    );
                (
                    router,
                    Arc::new(move || (store.keys_in_flight(), store.queued_writers())),
                )
            }
            Db::Sqlite(pool) => {
                schema::create(pool).await.expect("create tables");
                let store = Store::with_settings(pool.clone(), options.settings);
                let mut state = payments::AppState::new(store.clone());
                if let Some(processor) = processor {
                    state.processor = processor;
                }
                let router = payments::routes::<sqlx::Sqlite>()
                    .route(
                        "/test/bare-payments",
                        post(payments::create_payment_bare::<sqlx::Sqlite>),
                    )
                    .with_state(state)
                    .merge(
                        handlers::routes::<sqlx::Sqlite>(Arc::clone(&calls), Arc::clone(&gate))
                            .with_state(store.clone()),
                    );
                (
                    router,
                    Arc::new(move || (store.keys_in_flight(), store.queued_writers())),
                )
            }
        };
        let app = Self {
            router,
            db,
            calls,
            gate,
            in_flight,
            _dir: dir,
        };
        app.create_effects_table().await;
        app
    }

    async fn create_effects_table(&self) {
        // `test_child` has a foreign key checked at COMMIT only (SQLite enforces it because
        // sqlx turns `foreign_keys` on).
        self.execute(
            "CREATE TABLE IF NOT EXISTS test_effects (route text NOT NULL, tenant text NOT NULL);
             CREATE TABLE IF NOT EXISTS test_unique (id integer PRIMARY KEY);
             CREATE TABLE IF NOT EXISTS test_parent (id integer PRIMARY KEY);
             CREATE TABLE IF NOT EXISTS test_child (
                 parent integer REFERENCES test_parent (id) DEFERRABLE INITIALLY DEFERRED
             );",
        )
        .await;
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

    /// Serves the app on a loopback port, as a client would reach it; returns its address.
    pub async fn serve(&self) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let router = self.router.clone();
        tokio::spawn(async move {
            axum::serve(listener, router).await.expect("serve");
        });
        addr
    }

    /// Keys the app's transactional handlers hold right now.
    pub fn keys_in_flight(&self) -> usize {
        (self.in_flight)().0
    }

    /// The app's writers waiting for their turn (SQLite's single writer); 0 on PostgreSQL.
    pub fn queued_writers(&self) -> usize {
        (self.in_flight)().1
    }

    /// Whether the app stores in PostgreSQL (else SQLite).
    pub fn is_postgres(&self) -> bool {
        matches!(self.db, Db::Postgres(_))
    }

    /// Runs a statement that has no parameters.
    pub async fn execute(&self, sql: &'static str) {
        match &self.db {
            Db::Postgres(pool) => sqlx::raw_sql(sql).execute(pool).await.map(|_| ()),
            Db::Sqlite(pool) => sqlx::raw_sql(sql).execute(pool).await.map(|_| ()),
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn scalar(&self, sql: String, bind: Option<&str>) -> i64 {
        let sql = sqlx::AssertSqlSafe(sql);
        match &self.db {
            Db::Postgres(pool) => {
                let query = sqlx::query_scalar::<_, i64>(sql);
                match bind {
                    Some(value) => query.bind(value).fetch_one(pool).await,
                    None => query.fetch_one(pool).await,
                }
            }
            Db::Sqlite(pool) => {
                let query = sqlx::query_scalar::<_, i64>(sql);
                match bind {
                    Some(value) => query.bind(value).fetch_one(pool).await,
                    None => query.fetch_one(pool).await,
                }
            }
        }
        .expect("a number")
    }

    /// Locks the database holds for keys right now: PostgreSQL's advisory locks in this test's
    /// database (other databases on the server are not counted); on SQLite, 1 while some
    /// connection holds the write lock (found by trying to take it without waiting), else 0.
    pub async fn db_locks(&self) -> i64 {
        match self.db {
            Db::Postgres(_) => {
                self.scalar(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                        .into(),
                    None,
                )
                .await
            }
            Db::Sqlite(_) => {
                use sqlx::Connection;
                let dir = self._dir.as_ref().expect("a SQLite app has its directory");
                let options = sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(dir.path().join("test.db"))
                    .busy_timeout(std::time::Duration::ZERO);
                let mut conn = sqlx::SqliteConnection::connect_with(&options)
                    .await
                    .expect("open the SQLite file");
                let taken = sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK")
                    .execute(&mut conn)
                    .await;
                match taken {
                    Ok(_) => 0,
                    Err(sqlx::Error::Database(e)) if e.message().contains("locked") => 1,
                    Err(error) => panic!("probing SQLite's write lock: {error}"),
                }
            }
        }
    }

    /// Rows in `table` (a fixed name from the tests).
    pub async fn count(&self, table: &str) -> i64 {
        self.scalar(format!("SELECT count(*) FROM {table}"), None)
            .await
    }

    /// Rows of the key table for `key`, in any scope.
    pub async fn keys_named(&self, key: &str) -> i64 {
        self.scalar(
            "SELECT count(*) FROM idem_keys WHERE key = $1".into(),
            Some(key),
        )
        .await
    }

    /// Rows of the key table with `status`.
    pub async fn keys_with_status(&self, status: &str) -> i64 {
        self.scalar(
            "SELECT count(*) FROM idem_keys WHERE status = $1".into(),
            Some(status),
        )
        .await
    }

    /// The status of `key`'s row, if there is one.
    pub async fn key_status(&self, key: &str) -> Option<String> {
        let sql = "SELECT status FROM idem_keys WHERE key = $1";
        match &self.db {
            Db::Postgres(pool) => sqlx::query_scalar(sql).bind(key).fetch_optional(pool).await,
            Db::Sqlite(pool) => sqlx::query_scalar(sql).bind(key).fetch_optional(pool).await,
        }
        .expect("read key")
    }

    /// Seconds between `key`'s creation and its expiry.
    pub async fn retention_secs(&self, key: &str) -> i64 {
        let sql = match self.db {
            Db::Postgres(_) => {
                "SELECT extract(epoch FROM expires_at - created_at)::int8 FROM idem_keys WHERE key = $1"
            }
            Db::Sqlite(_) => {
                "SELECT (expires_at - created_at) / 1000 FROM idem_keys WHERE key = $1"
            }
        };
        self.scalar(sql.into(), Some(key)).await
    }

    /// The stored response status of `key`.
    pub async fn response_status(&self, key: &str) -> i64 {
        self.scalar(
            "SELECT CAST(response_status AS BIGINT) FROM idem_keys WHERE key = $1".into(),
            Some(key),
        )
        .await
    }

    /// The statuses of all payments.
    pub async fn payment_statuses(&self) -> Vec<String> {
        let sql = "SELECT status FROM payments";
        match &self.db {
            Db::Postgres(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
            Db::Sqlite(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
        }
        .expect("read payments")
    }

    /// Moves every key past its expiry, as time would.
    pub async fn expire_all_keys(&self) {
        match self.db {
            Db::Postgres(_) => {
                self.execute("UPDATE idem_keys SET expires_at = now() - interval '1 second'")
                    .await;
            }
            Db::Sqlite(_) => {
                self.execute(
                    "UPDATE idem_keys SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000",
                )
                .await;
            }
        }
    }

    /// Ends the lease of `key`'s claim, as if its process had stalled.
    pub async fn lapse_lease(&self, key: &str) {
        let sql = match self.db {
            Db::Postgres(_) => {
                "UPDATE idem_keys SET lease_until = now() - interval '1 second' WHERE key = $1"
            }
            Db::Sqlite(_) => {
                "UPDATE idem_keys SET lease_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000 WHERE key = $1"
            }
        };
        match &self.db {
            Db::Postgres(pool) => sqlx::query(sql).bind(key).execute(pool).await.map(|_| ()),
            Db::Sqlite(pool) => sqlx::query(sql).bind(key).execute(pool).await.map(|_| ()),
        }
        .expect("lapse lease");
    }

    /// Inserts `n` completed keys in `scope`, expiring `expires_in_secs` from now (negative:
    /// already expired).
    pub async fn seed_keys(&self, scope: &str, n: i64, expires_in_secs: i64) {
        match &self.db {
            Db::Postgres(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
                   response_status, response_headers, response_body, expires_at) \
                 SELECT $1, 'seed-' || $1 || '-' || g, 'POST', '/v1/payments', \
                   sha256(g::text::bytea), 'completed', 201, '[]'::jsonb, ''::bytea, \
                   now() + make_interval(secs => $3) \
                 FROM generate_series(1, $2) g",
            )
            .bind(scope)
            .bind(n)
            .bind(expires_in_secs as f64)
            .execute(pool)
            .await
            .map(|_| ()),
            Db::Sqlite(pool) => sqlx::query(
                "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < $2) \
                 INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
                   response_status, response_headers, response_body, created_at, expires_at) \
                 SELECT $1, 'seed-' || $1 || '-' || n, 'POST', '/v1/payments', randomblob(32), \
                   'completed', 201, '[]', x'', CAST(unixepoch('subsec') * 1000 AS INTEGER), \
                   CAST(unixepoch('subsec') * 1000 AS INTEGER) + $3 * 1000 \
                 FROM g",
            )
            .bind(scope)
            .bind(n)
            .bind(expires_in_secs)
            .execute(pool)
            .await
            .map(|_| ()),
        }
        .expect("seed keys");
    }

    /// Writes a `started` claim taken a minute ago whose lease ran out 55 s ago, as a crash
    /// between the external call and the completion leaves it.
    pub async fn abandoned_claim(&self, scope: &str, key: &str, fingerprint: &[u8]) {
        match &self.db {
            Db::Postgres(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, expires_at, \
                   locked_at, lease_until, claim_token) \
                 VALUES ($1, $2, 'POST', '/v1/refunds', $3, 'started', now() + interval '1 day', \
                   now() - interval '1 minute', now() - interval '55 seconds', 42)",
            )
            .bind(scope)
            .bind(key)
            .bind(fingerprint)
            .execute(pool)
            .await
            .map(|_| ()),
            Db::Sqlite(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, \
                   expires_at, locked_at, lease_until, claim_token) \
                 VALUES ($1, $2, 'POST', '/v1/refunds', $3, 'started', $4 - 60000, \
                   $4 + 86400000, $4 - 60000, $4 - 55000, 42)",
            )
            .bind(scope)
            .bind(key)
            .bind(fingerprint)
            .bind(now_ms())
            .execute(pool)
            .await
            .map(|_| ()),
        }
        .expect("insert claim");
    }

    /// Keeps `key`'s claim within its lease for another minute.
    pub async fn renew_lease(&self, key: &str) {
        let sql = match self.db {
            Db::Postgres(_) => {
                "UPDATE idem_keys SET lease_until = now() + interval '1 minute' WHERE key = $1"
            }
            Db::Sqlite(_) => {
                "UPDATE idem_keys SET lease_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) + 60000 WHERE key = $1"
            }
        };
        match &self.db {
            Db::Postgres(pool) => sqlx::query(sql).bind(key).execute(pool).await.map(|_| ()),
            Db::Sqlite(pool) => sqlx::query(sql).bind(key).execute(pool).await.map(|_| ()),
        }
        .expect("renew lease");
    }

    /// One purge pass.
    pub async fn purge(&self, options: PurgeOptions) -> PurgeReport {
        match &self.db {
            Db::Postgres(pool) => Store::new(pool.clone()).purge_expired(options).await,
            Db::Sqlite(pool) => Store::new(pool.clone()).purge_expired(options).await,
        }
        .expect("purge")
    }

    /// One recovery pass.
    pub async fn recover<H: RecoveryHook>(&self, hook: &H) -> RecoveryReport {
        match &self.db {
            Db::Postgres(pool) => Store::new(pool.clone()).recover_abandoned(hook, 100).await,
            Db::Sqlite(pool) => Store::new(pool.clone()).recover_abandoned(hook, 100).await,
        }
        .expect("recover")
    }

    /// The background purge task.
    pub fn spawn_purge(
        &self,
        every: std::time::Duration,
        stop: idem_runtime::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        use idem_runtime::tasks::spawn_purge;
        match &self.db {
            Db::Postgres(pool) => spawn_purge(
                Store::new(pool.clone()),
                every,
                PurgeOptions::default(),
                stop,
            ),
            Db::Sqlite(pool) => spawn_purge(
                Store::new(pool.clone()),
                every,
                PurgeOptions::default(),
                stop,
            ),
        }
    }

    /// The background recovery task with `hook`.
    pub fn spawn_recovery<H: RecoveryHook>(
        &self,
        hook: H,
        every: std::time::Duration,
        stop: idem_runtime::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        use idem_runtime::tasks::spawn_recovery;
        match &self.db {
            Db::Postgres(pool) => spawn_recovery(Store::new(pool.clone()), hook, every, stop),
            Db::Sqlite(pool) => spawn_recovery(Store::new(pool.clone()), hook, every, stop),
        }
    }

    /// Makes a payment for `tenant` and returns its id.
    pub async fn paid(&self, tenant: &str, customer: &str) -> String {
        let key = format!("pay-{}", unique());
        let reply = self
            .send(
                Req::post("/v1/payments")
                    .tenant(tenant)
                    .key(&key)
                    .json(&payment(100, customer))
                    .build(),
            )
            .await;
        assert_eq!(reply.status, axum::http::StatusCode::CREATED);
        reply.json()["id"].as_str().expect("payment id").to_owned()
    }
}

async fn sqlite_pool(dir: &tempfile::TempDir, connections: u32) -> SqlitePool {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("test.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(30));
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
        .expect("open the SQLite file")
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn unique() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// How long any wait of the tests may last before it fails: far longer than any condition
/// takes on a loaded machine, so that only a real hang ends there.
pub const DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// Polls `condition` until it holds; panics, saying what it waited for, after [`DEADLINE`].
pub async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {DEADLINE:?} for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Waits until the app's handlers hold `n` keys.
pub async fn until_in_flight(app: &App, n: usize) {
    wait_until(&format!("{n} keys in flight"), || async {
        app.keys_in_flight() >= n
    })
    .await;
}

/// Waits until `n` of the app's writers queue for their turn.
pub async fn until_queued_writers(app: &App, n: usize) {
    wait_until(&format!("{n} queued writers"), || async {
        app.queued_writers() >= n
    })
    .await;
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

/// The simulated card processor on a loopback port, with two test hooks in front of it: it
/// notes the `Idempotency-Key` of every request, and it holds its first answer (after the
/// refund is recorded) until the test opens [`TestProcessor::gate`]; later answers go at once.
#[derive(Debug, Clone)]
pub struct TestProcessor {
    /// Its base URL.
    pub url: String,
    /// A permit lets the first answer go.
    pub gate: Arc<tokio::sync::Semaphore>,
    posts: Arc<AtomicUsize>,
    /// The `Idempotency-Key` of every refund request, in order of arrival.
    pub keys: Arc<std::sync::Mutex<Vec<String>>>,
}

impl TestProcessor {
    /// Starts one whose first answer waits for the gate.
    pub async fn gated() -> Self {
        let processor = Self {
            url: String::new(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
            keys: Arc::default(),
            posts: Arc::default(),
        };
        let hooks = processor.clone();
        let router = idem_examples::processor::router().layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let hooks = hooks.clone();
                async move {
                    if let Some(key) = request.headers().get("idempotency-key") {
                        let key = key.to_str().expect("a text key").to_owned();
                        hooks.keys.lock().expect("keys").push(key);
                    }
                    let gated = request.method() == axum::http::Method::POST
                        && hooks.posts.fetch_add(1, Ordering::SeqCst) == 0;
                    let response = next.run(request).await;
                    if gated {
                        hooks.gate.acquire().await.expect("gate open").forget();
                    }
                    response
                }
            },
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("serve processor");
        });
        Self {
            url: format!("http://{addr}"),
            ..processor
        }
    }

    /// The refunds it has executed.
    pub async fn refunds(&self) -> Vec<Value> {
        executed_refunds(&self.url).await
    }

    /// Waits until it has executed `n` refunds.
    pub async fn until_refunded(&self, n: usize) {
        wait_until(&format!("{n} refunds at the processor"), || async {
            self.refunds().await.len() >= n
        })
        .await;
    }

    /// The keys it was sent.
    pub fn keys(&self) -> Vec<String> {
        self.keys.lock().expect("keys").clone()
    }
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

/// Waits until `counter` reaches `n` (a handler body has started).
pub async fn until_called(counter: &AtomicUsize, n: usize) {
    wait_until(&format!("{n} calls of the handler"), || async {
        counter.load(Ordering::SeqCst) >= n
    })
    .await;
}
