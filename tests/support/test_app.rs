//! The suite's own small service: idem's tables, a few tables of its own, and the handlers of
//! [`crate::handlers`], [`crate::entries`] and [`crate::orders`], each written once for both
//! databases.

use axum::{Extension, Router};
use idem_runtime::{Backend, Store};
use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};

use crate::{
    AnyStore, Building, Parts, Service, downstream::unreachable_url, entries, handlers,
    key_sources, orders,
};

/// The service the library's behaviour tests drive.
#[derive(Debug, Clone)]
pub struct TestApp {
    /// Where `POST /test/transfers` sends its transfers.
    downstream: String,
}

impl Default for TestApp {
    /// Transfers go nowhere: every one is a 503.
    fn default() -> Self {
        Self::downstream(&unreachable_url())
    }
}

impl TestApp {
    /// The test app, sending its transfers to the downstream service at `url`.
    pub fn downstream(url: &str) -> Self {
        Self {
            downstream: url.to_owned(),
        }
    }

    async fn router<DB: TestBackend>(&self, store: Store<DB>, parts: Parts) -> Router {
        migrate_and_create_tables(store.pool()).await;
        self.routes(store, parts)
    }

    /// The router over `store`, creating no table: for a database that cannot be reached.
    pub fn routes<DB: TestBackend>(&self, store: Store<DB>, parts: Parts) -> Router {
        handlers::routes::<DB>()
            .merge(entries::routes::<DB>())
            .merge(orders::routes::<DB>())
            .merge(key_sources::routes::<DB>())
            .layer(Extension(parts.calls))
            .layer(Extension(parts.gate))
            .layer(Extension(entries::DownstreamClient::new(&self.downstream)))
            .layer(tower_http::catch_panic::CatchPanicLayer::new())
            .with_state(store)
    }
}

impl Service for TestApp {
    fn build(&self, parts: Parts) -> Building<'_> {
        Box::pin(async move {
            match parts.store.clone() {
                AnyStore::Postgres(store) => self.router(store, parts).await,
                AnyStore::Sqlite(store) => self.router(store, parts).await,
                AnyStore::MySql(store) => self.router(store, parts).await,
            }
        })
    }
}

/// A text or integer parameter of a test statement.
#[derive(Debug, Clone, Copy)]
pub enum Param<'a> {
    /// Bound as text.
    Text(&'a str),
    /// Bound as a 64-bit integer.
    Int(i64),
}

/// A database the tests run on, the per-database trait of the harness: an `idem-runtime`
/// backend, with the little SQL the test handlers and the probes send. The test handlers write
/// their statements once, with PostgreSQL's numbered parameters (`$1`); a database with
/// positional ones (MySQL) rewrites them ([`positional`](crate::positional)).
pub trait TestBackend: Backend {
    /// Creates the test app's tables.
    fn create_tables(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Runs `sql` with `params` on `conn`; returns the rows it touched.
    fn execute<'a>(
        conn: &'a mut Self::Connection,
        sql: &'static str,
        params: &'a [Param<'a>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Runs `sql` with `params` on `conn`; returns the first column of its first row.
    fn fetch_int<'a>(
        conn: &'a mut Self::Connection,
        sql: &'static str,
        params: &'a [Param<'a>],
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// `sql`, written for PostgreSQL and SQLite, as this database spells it: the same, but on
    /// MySQL ([`positional`](crate::positional)'s spellings).
    fn spelled(sql: &str) -> String {
        sql.to_owned()
    }

    /// The one integer `sql` selects.
    fn count<'a>(pool: &'a Pool<Self>, sql: &'a str) -> impl Future<Output = i64> + Send + 'a;

    /// The text column `sql` selects, row by row.
    fn strings<'a>(
        pool: &'a Pool<Self>,
        sql: &'a str,
    ) -> impl Future<Output = Vec<String>> + Send + 'a;

    /// Runs the statements of `sql`.
    fn run_sql<'a>(pool: &'a Pool<Self>, sql: &'a str) -> impl Future<Output = ()> + Send + 'a;
}

/// A database the event tests run on: a backend of both crates (`idem-runtime`'s and
/// `idem-events'`), with the SQL of the event tests' consumer.
pub trait EventBackend: TestBackend + idem_events::Backend {
    /// Creates the event tables (`idem_events::migrate`) and `test_applied`, where the event
    /// tests' consumer records each message it applies (with no unique constraint: a message
    /// applied twice shows as two rows).
    fn prepare_events(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;

    /// The message ids in `test_applied`, one per application.
    fn applied(pool: &Pool<Self>) -> impl Future<Output = Vec<String>> + Send;

    /// Records `message` in `test_applied`, in the consumer's transaction.
    fn apply<'a>(
        tx: &'a mut Transaction<'static, Self>,
        message: &'a idem_events::Message,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// Creates idem's tables (its migrations) and the test app's on `pool`: what a service of the
/// suite does when it starts.
pub async fn migrate_and_create_tables<DB: TestBackend>(pool: &Pool<DB>) {
    idem_runtime::migrate(pool).await.expect("idem's tables");
    DB::create_tables(pool)
        .await
        .expect("the test app's tables");
}

/// Runs `sql` in the handler's transaction.
pub async fn run<DB: TestBackend>(
    tx: &mut Transaction<'_, DB>,
    sql: &'static str,
    params: &[Param<'_>],
) -> Result<u64, sqlx::Error> {
    DB::execute(&mut **tx, sql, params).await
}

/// Runs `sql` on a connection of `pool`, outside any handler's transaction.
pub async fn run_on<DB: TestBackend>(
    pool: &Pool<DB>,
    sql: &'static str,
    params: &[Param<'_>],
) -> Result<u64, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    DB::execute(&mut conn, sql, params).await
}

/// The tables both databases spell alike. `test_child`'s foreign key is checked at COMMIT only
/// (SQLite enforces it because sqlx turns `foreign_keys` on).
macro_rules! shared_tables {
    () => {
        "CREATE TABLE IF NOT EXISTS test_effects (route text NOT NULL, tenant text NOT NULL);
         CREATE TABLE IF NOT EXISTS test_unique (id integer PRIMARY KEY);
         CREATE TABLE IF NOT EXISTS test_parent (id integer PRIMARY KEY);
         CREATE TABLE IF NOT EXISTS test_child (
             parent integer REFERENCES test_parent (id) DEFERRABLE INITIALLY DEFERRED
         );
         CREATE TABLE IF NOT EXISTS test_transfers (
             id text PRIMARY KEY, tenant text NOT NULL, entry bigint NOT NULL, amount bigint NOT NULL
         );
         CREATE TABLE IF NOT EXISTS test_stock_moves (tenant text NOT NULL, units bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS test_bookings (tenant text NOT NULL, transfer text NOT NULL);"
    };
}

/// The statements a test sends on a pool, alike on every database (sqlx's executors are per
/// database type): `TestBackend::{count, strings, run_sql}`.
macro_rules! pool_queries {
    () => {
        async fn count<'a>(pool: &'a Pool<Self>, sql: &'a str) -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(Self::spelled(sql)))
                .fetch_one(pool)
                .await
                .unwrap_or_else(|error| panic!("{sql}: {error}"))
        }

        async fn strings<'a>(pool: &'a Pool<Self>, sql: &'a str) -> Vec<String> {
            sqlx::query_scalar(sqlx::AssertSqlSafe(Self::spelled(sql)))
                .fetch_all(pool)
                .await
                .unwrap_or_else(|error| panic!("{sql}: {error}"))
        }

        async fn run_sql<'a>(pool: &'a Pool<Self>, sql: &'a str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(Self::spelled(sql)))
                .execute(pool)
                .await
                .unwrap_or_else(|error| panic!("{sql}: {error}"));
        }
    };
}

/// The same body for each database: sqlx's executors and encoders are per database type.
macro_rules! test_backend {
    ($db:ty, $generated_id:literal) => {
        impl TestBackend for $db {
            async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
                let tables = concat!(
                    shared_tables!(),
                    "CREATE TABLE IF NOT EXISTS test_entries (id ",
                    $generated_id,
                    " PRIMARY KEY, tenant text NOT NULL, amount bigint NOT NULL, note text NOT NULL);"
                );
                sqlx::raw_sql(tables).execute(pool).await.map(|_| ())
            }

            async fn execute<'a>(
                conn: &'a mut Self::Connection,
                sql: &'static str,
                params: &'a [Param<'a>],
            ) -> Result<u64, sqlx::Error> {
                let mut query = sqlx::query(sql);
                for param in params {
                    query = match *param {
                        Param::Text(text) => query.bind(text),
                        Param::Int(int) => query.bind(int),
                    };
                }
                Ok(query.execute(conn).await?.rows_affected())
            }

            async fn fetch_int<'a>(
                conn: &'a mut Self::Connection,
                sql: &'static str,
                params: &'a [Param<'a>],
            ) -> Result<Option<i64>, sqlx::Error> {
                let mut query = sqlx::query_scalar(sql);
                for param in params {
                    query = match *param {
                        Param::Text(text) => query.bind(text),
                        Param::Int(int) => query.bind(int),
                    };
                }
                query.fetch_optional(conn).await
            }

            pool_queries!();
        }

        impl EventBackend for $db {
            async fn prepare_events(pool: &Pool<Self>) {
                idem_events::migrate(pool).await.expect("migrate the event tables");
                sqlx::query(
                    "CREATE TABLE test_applied (message_id TEXT NOT NULL, topic TEXT NOT NULL)",
                )
                .execute(pool)
                .await
                .expect("create test_applied");
            }

            async fn applied(pool: &Pool<Self>) -> Vec<String> {
                sqlx::query_scalar("SELECT message_id FROM test_applied")
                    .fetch_all(pool)
                    .await
                    .expect("read test_applied")
            }

            async fn apply<'a>(
                tx: &'a mut Transaction<'static, Self>,
                message: &'a idem_events::Message,
            ) -> Result<(), sqlx::Error> {
                sqlx::query("INSERT INTO test_applied (message_id, topic) VALUES ($1, $2)")
                    .bind(message.id())
                    .bind(message.topic())
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }
        }
    };
}

// Only the type of a generated id is spelt per database.
test_backend!(Postgres, "bigserial");
test_backend!(Sqlite, "integer");

/// The test app's tables on MySQL: texts that compare exactly (`utf8mb4_bin`), InnoDB. MySQL
/// checks a foreign key at once: it has no deferred constraints.
const MYSQL_TABLES: &str = "\
    CREATE TABLE IF NOT EXISTS test_effects (
        route VARCHAR(255) COLLATE utf8mb4_bin NOT NULL,
        tenant VARCHAR(255) COLLATE utf8mb4_bin NOT NULL
    ) ENGINE = InnoDB;
    CREATE TABLE IF NOT EXISTS test_unique (id INTEGER PRIMARY KEY) ENGINE = InnoDB;
    CREATE TABLE IF NOT EXISTS test_parent (id INTEGER PRIMARY KEY) ENGINE = InnoDB;
    CREATE TABLE IF NOT EXISTS test_child (
        parent INTEGER, FOREIGN KEY (parent) REFERENCES test_parent (id)
    ) ENGINE = InnoDB;
    CREATE TABLE IF NOT EXISTS test_transfers (
        id VARCHAR(255) COLLATE utf8mb4_bin PRIMARY KEY,
        tenant VARCHAR(255) COLLATE utf8mb4_bin NOT NULL,
        entry BIGINT NOT NULL, amount BIGINT NOT NULL
    ) ENGINE = InnoDB;
    CREATE TABLE IF NOT EXISTS test_stock_moves (
        tenant VARCHAR(255) COLLATE utf8mb4_bin NOT NULL, units BIGINT NOT NULL
    ) ENGINE = InnoDB;
    CREATE TABLE IF NOT EXISTS test_bookings (
        tenant VARCHAR(255) COLLATE utf8mb4_bin NOT NULL,
        transfer VARCHAR(255) COLLATE utf8mb4_bin NOT NULL
    ) ENGINE = InnoDB;
    CREATE TABLE IF NOT EXISTS test_entries (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        tenant VARCHAR(255) COLLATE utf8mb4_bin NOT NULL,
        amount BIGINT NOT NULL, note TEXT NOT NULL
    ) ENGINE = InnoDB;";

/// `sql` with MySQL's positional parameters, and `params` in the order they take them.
fn positional_query<'a>(
    sql: &str,
    params: &'a [Param<'a>],
) -> (sqlx::AssertSqlSafe<String>, Vec<Param<'a>>) {
    let (sql, order) = crate::positional(sql);
    let params = order.into_iter().map(|n| params[n]).collect();
    (sqlx::AssertSqlSafe(sql), params)
}

impl TestBackend for MySql {
    fn spelled(sql: &str) -> String {
        crate::spelled(sql)
    }

    async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(MYSQL_TABLES).execute(pool).await.map(|_| ())
    }

    async fn execute<'a>(
        conn: &'a mut Self::Connection,
        sql: &'static str,
        params: &'a [Param<'a>],
    ) -> Result<u64, sqlx::Error> {
        let (sql, params) = positional_query(sql, params);
        let mut query = sqlx::query(sql);
        for param in params {
            query = match param {
                Param::Text(text) => query.bind(text),
                Param::Int(int) => query.bind(int),
            };
        }
        Ok(query.execute(conn).await?.rows_affected())
    }

    async fn fetch_int<'a>(
        conn: &'a mut Self::Connection,
        sql: &'static str,
        params: &'a [Param<'a>],
    ) -> Result<Option<i64>, sqlx::Error> {
        let (sql, params) = positional_query(sql, params);
        let mut query = sqlx::query_scalar(sql);
        for param in params {
            query = match param {
                Param::Text(text) => query.bind(text),
                Param::Int(int) => query.bind(int),
            };
        }
        query.fetch_optional(conn).await
    }

    pool_queries!();
}

impl EventBackend for MySql {
    async fn prepare_events(pool: &Pool<Self>) {
        idem_events::migrate(pool)
            .await
            .expect("migrate the event tables");
        sqlx::query(
            "CREATE TABLE test_applied (message_id VARCHAR(1024) COLLATE utf8mb4_bin NOT NULL, \
             topic VARCHAR(255) COLLATE utf8mb4_bin NOT NULL) ENGINE = InnoDB",
        )
        .execute(pool)
        .await
        .expect("create test_applied");
    }

    async fn applied(pool: &Pool<Self>) -> Vec<String> {
        sqlx::query_scalar("SELECT message_id FROM test_applied")
            .fetch_all(pool)
            .await
            .expect("read test_applied")
    }

    async fn apply<'a>(
        tx: &'a mut Transaction<'static, Self>,
        message: &'a idem_events::Message,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO test_applied (message_id, topic) VALUES (?, ?)")
            .bind(message.id())
            .bind(message.topic())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}
