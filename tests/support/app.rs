//! The app under test: a [`Service`]'s router over a store on the test's own database, and
//! further instances of it on the same database.

use std::{future::Future, pin::Pin, sync::Arc};

use axum::{Router, body::Body, http::Request};
use idem_runtime::{Store, StoreOptions};
use sqlx::{
    MySqlPool, PgPool, SqlitePool,
    mysql::{MySqlConnectOptions, MySqlPoolOptions},
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tower::ServiceExt;

use crate::{Calls, MySqlDb, Reply, TestApp};

/// Where a test's data lives.
#[derive(Debug)]
pub enum TestDb {
    /// A database of its own on the PostgreSQL server.
    Postgres(Box<PgConnectOptions>),
    /// A SQLite file in a directory of its own, removed after the test.
    Sqlite(tempfile::TempDir),
    /// A database of its own on the MySQL (MariaDB) server, dropped after the test
    /// ([`backend_tests!`](crate::backend_tests) drops it).
    MySql(Box<MySqlDb>),
}

impl TestDb {
    /// A fresh SQLite file.
    pub fn sqlite() -> Self {
        Self::Sqlite(tempfile::tempdir().expect("a temporary directory"))
    }
}

/// A pool on one of the databases.
#[derive(Clone, Debug)]
pub enum Db {
    /// PostgreSQL.
    Postgres(PgPool),
    /// SQLite.
    Sqlite(SqlitePool),
    /// MySQL (MariaDB).
    MySql(MySqlPool),
}

/// A store on one of the databases: the runtime's own, which the `idem` command uses too.
pub use idem_runtime::admin::AnyStore;

/// What an instance is built from: its store, and the counters and gate the test shares with
/// its handlers.
#[derive(Debug)]
pub struct Parts {
    /// The instance's store, with the test's settings.
    pub store: AnyStore,
    /// The instance's handler counters.
    pub calls: Arc<Calls>,
    /// Closed until the test adds permits.
    pub gate: Arc<tokio::sync::Semaphore>,
}

/// A future a [`Service`] builds its router in.
pub type Building<'a> = Pin<Box<dyn Future<Output = Router> + Send + 'a>>;

/// A service under test: creates its tables and builds its router on the store it is given.
pub trait Service: Send + Sync + 'static {
    /// The router of one instance.
    fn build(&self, parts: Parts) -> Building<'_>;
}

/// How to build the app under test.
#[derive(Debug, Default)]
pub struct Options {
    /// The store's options.
    pub store_options: StoreOptions,
    /// Pool size (default 10).
    pub connections: Option<u32>,
}

/// One instance of a service under test.
#[derive(Clone)]
pub struct App {
    /// The service's router.
    pub router: Router,
    /// The test's own database.
    pub db: Db,
    /// Handler call counters.
    pub calls: Arc<Calls>,
    /// Released to let the gated handlers finish.
    pub gate: Arc<tokio::sync::Semaphore>,
    store: AnyStore,
    service: Arc<dyn Service>,
    pub(crate) dir: Option<Arc<tempfile::TempDir>>,
    /// The servers [`App::serve`] started, stopped with the app: a server left running would
    /// keep the test database's connections open while `#[sqlx::test]` drops the database,
    /// which then waits 5 s for them and fails.
    served: Arc<Served>,
}

/// The servers of an app and its clones, stopped when the last of them is dropped.
#[derive(Default)]
struct Served(std::sync::Mutex<Vec<tokio::task::AbortHandle>>);

impl Drop for Served {
    fn drop(&mut self) {
        let servers = self.0.get_mut().unwrap_or_else(|e| e.into_inner());
        for server in servers.drain(..) {
            server.abort();
        }
    }
}

impl App {
    /// The suite's test app with default settings.
    pub async fn new(db: TestDb) -> Self {
        Self::build(db, Options::default()).await
    }

    /// The suite's test app, its transfers sent to the downstream service at `url`.
    pub async fn with_downstream(db: TestDb, url: &str) -> Self {
        Self::serving(db, Options::default(), TestApp::downstream(url)).await
    }

    /// The suite's test app as `options` say.
    pub async fn build(db: TestDb, options: Options) -> Self {
        Self::serving(db, options, TestApp::default()).await
    }

    /// `service` as `options` say.
    pub async fn serving(db: TestDb, options: Options, service: impl Service) -> Self {
        let connections = options.connections.unwrap_or(10);
        let service: Arc<dyn Service> = Arc::new(service);
        match db {
            TestDb::Postgres(connect) => {
                let pool = PgPoolOptions::new()
                    .max_connections(connections)
                    .connect_with(*connect)
                    .await
                    .expect("connect to the test database");
                Self::build_on(Db::Postgres(pool), options.store_options, service, None).await
            }
            TestDb::Sqlite(dir) => {
                let pool = sqlite_pool(&dir, connections).await;
                let dir = Some(Arc::new(dir));
                Self::build_on(Db::Sqlite(pool), options.store_options, service, dir).await
            }
            TestDb::MySql(database) => {
                let pool = MySqlPoolOptions::new()
                    .max_connections(connections)
                    .connect_with(database.options().clone())
                    .await
                    .expect("connect to the test database");
                Self::build_on(Db::MySql(pool), options.store_options, service, None).await
            }
        }
    }

    /// Another instance of the same service on the same database: its own pool, store, held
    /// keys, writer queue and handler counters; nothing shared with `self` but the database, as
    /// two processes behind a load balancer.
    pub async fn sibling(&self) -> Self {
        self.sibling_with(Options::default()).await
    }

    /// Another instance on the same database, built as `options` say.
    pub async fn sibling_with(&self, options: Options) -> Self {
        self.sibling_serving(options, Arc::clone(&self.service))
            .await
    }

    /// An instance of `service` on the same database (the same service configured otherwise,
    /// as a redeployed process).
    pub async fn sibling_serving(&self, options: Options, service: Arc<dyn Service>) -> Self {
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
                let dir = self.dir.as_ref().expect("a SQLite app has its directory");
                Db::Sqlite(sqlite_pool(dir, connections).await)
            }
            Db::MySql(pool) => Db::MySql(
                MySqlPoolOptions::new()
                    .max_connections(connections)
                    .connect_with((*pool.connect_options()).clone())
                    .await
                    .expect("connect to the test database"),
            ),
        };
        Self::build_on(db, options.store_options, service, self.dir.clone()).await
    }

    /// Another instance of the same service on the same MySQL database, at the server
    /// `options` name: a node of a Galera cluster other than `self`'s, as a process that
    /// connects to its own node.
    pub async fn sibling_at(&self, options: MySqlConnectOptions) -> Self {
        let pool = MySqlPoolOptions::new()
            .max_connections(10)
            .connect_with(options)
            .await
            .expect("connect to the test database at another server");
        Self::build_on(
            Db::MySql(pool),
            StoreOptions::default(),
            Arc::clone(&self.service),
            None,
        )
        .await
    }

    async fn build_on(
        db: Db,
        settings: StoreOptions,
        service: Arc<dyn Service>,
        dir: Option<Arc<tempfile::TempDir>>,
    ) -> Self {
        let store = match &db {
            Db::Postgres(pool) => {
                AnyStore::Postgres(Store::new(pool.clone()).with_options(settings))
            }
            Db::Sqlite(pool) => AnyStore::Sqlite(Store::new(pool.clone()).with_options(settings)),
            Db::MySql(pool) => AnyStore::MySql(Store::new(pool.clone()).with_options(settings)),
        };
        let calls = Arc::new(Calls::default());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let parts = Parts {
            store: store.clone(),
            calls: Arc::clone(&calls),
            gate: Arc::clone(&gate),
        };
        let router = service.build(parts).await;
        Self {
            router,
            db,
            calls,
            gate,
            store,
            service,
            dir,
            served: Arc::default(),
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

    /// Serves the app on a loopback port, as a client would reach it; returns its address.
    pub async fn serve(&self) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let router = self.router.clone();
        let server = tokio::spawn(async move {
            axum::serve(listener, router).await.expect("serve");
        });
        self.served
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(server.abort_handle());
        addr
    }

    /// The instance's store.
    pub fn store(&self) -> &AnyStore {
        &self.store
    }

    /// Keys the app's transactional handlers hold right now.
    pub fn keys_in_flight(&self) -> usize {
        match &self.store {
            AnyStore::Postgres(store) => store.keys_in_flight(),
            AnyStore::Sqlite(store) => store.keys_in_flight(),
            AnyStore::MySql(store) => store.keys_in_flight(),
        }
    }

    /// The app's writers waiting for their turn (SQLite's single writer); 0 on PostgreSQL.
    pub fn queued_writers(&self) -> usize {
        match &self.store {
            AnyStore::Postgres(store) => store.queued_writers(),
            AnyStore::Sqlite(store) => store.queued_writers(),
            AnyStore::MySql(store) => store.queued_writers(),
        }
    }

    /// Whether the app stores in PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        matches!(self.db, Db::Postgres(_))
    }

    /// Whether the app stores in MySQL (MariaDB).
    pub fn is_mysql(&self) -> bool {
        matches!(self.db, Db::MySql(_))
    }

    /// Whether the app's database takes one writer at a time (SQLite), so that a duplicate
    /// waits for the first's write lock instead of being refused at once (PostgreSQL, MySQL).
    pub fn is_single_writer(&self) -> bool {
        matches!(self.db, Db::Sqlite(_))
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
