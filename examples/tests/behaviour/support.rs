//! What the process tests share: the service's database as the test sees it, the service's
//! binary as a child process, and waits with deadlines.

#![allow(dead_code, reason = "each test file uses part of it")]

use std::{
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

pub use idem_tests::wait_until;
use reqwest::Client;
use serde_json::Value;
use sqlx::{MySqlPool, PgPool, SqlitePool, postgres::PgConnectOptions};

/// The service's database, as the test looks into it.
pub enum Database {
    /// PostgreSQL, at `url` for the service.
    Postgres { pool: PgPool, url: String },
    /// A SQLite file, shared with the service's process (WAL lets both open it).
    Sqlite {
        pool: SqlitePool,
        path: std::path::PathBuf,
    },
    /// MySQL or MariaDB, at `url` for the service.
    MySql { pool: MySqlPool, url: String },
}

impl Database {
    pub fn configure(&self, command: &mut Command) {
        match self {
            Self::Postgres { url, .. } | Self::MySql { url, .. } => {
                command.env("DATABASE_URL", url);
            }
            Self::Sqlite { path, .. } => {
                command.env_remove("DATABASE_URL").env("SQLITE_PATH", path);
            }
        }
    }

    pub async fn key_status(&self, key: &str) -> String {
        let sql = "SELECT status FROM idem_keys WHERE key = $1";
        match self {
            Self::Postgres { pool, .. } => sqlx::query_scalar(sql).bind(key).fetch_one(pool).await,
            Self::Sqlite { pool, .. } => sqlx::query_scalar(sql).bind(key).fetch_one(pool).await,
            Self::MySql { pool, .. } => {
                sqlx::query_scalar("SELECT status FROM idem_keys WHERE `key` = ?")
                    .bind(key.as_bytes())
                    .fetch_one(pool)
                    .await
            }
        }
        .expect("the key's row")
    }

    /// Rows in `table` (a fixed name from the tests).
    pub async fn count(&self, table: &str) -> i64 {
        let sql = sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}"));
        match self {
            Self::Postgres { pool, .. } => sqlx::query_scalar(sql).fetch_one(pool).await,
            Self::Sqlite { pool, .. } => sqlx::query_scalar(sql).fetch_one(pool).await,
            Self::MySql { pool, .. } => sqlx::query_scalar(sql).fetch_one(pool).await,
        }
        .expect("a count")
    }

    /// Whether a statement of another session waits for a lock on `table` (a fixed name from
    /// the tests), as a test that holds one sees its request arrive there: PostgreSQL's
    /// ungranted locks of this database; MySQL's `INSERT INTO {table}` waiting for the
    /// table's metadata lock. Never on SQLite, whose only lock is the file's.
    pub async fn waits_for_a_lock_on(&self, table: &str) -> bool {
        let waiting = match self {
            Self::Postgres { pool, .. } => {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM pg_locks \
                     WHERE relation = to_regclass($1) AND NOT granted \
                     AND database = (SELECT oid FROM pg_database \
                                     WHERE datname = current_database())",
                )
                .bind(table)
                .fetch_one(pool)
                .await
            }
            Self::MySql { pool, .. } => {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM information_schema.processlist \
                     WHERE db = DATABASE() AND state = 'Waiting for table metadata lock' \
                     AND info LIKE CONCAT('INSERT INTO ', ?, '%')",
                )
                .bind(table)
                .fetch_one(pool)
                .await
            }
            Self::Sqlite { .. } => return false,
        };
        waiting.expect("the waiting sessions") > 0
    }

    /// The length of `key`'s lease, in milliseconds, as its claim set it.
    pub async fn lease_ms(&self, key: &str) -> i64 {
        match self {
            Self::Postgres { pool, .. } => {
                sqlx::query_scalar(
                    "SELECT (extract(epoch FROM lease_until - locked_at) * 1000)::int8 \
                     FROM idem_keys WHERE key = $1",
                )
                .bind(key)
                .fetch_one(pool)
                .await
            }
            Self::Sqlite { pool, .. } => {
                sqlx::query_scalar("SELECT lease_until - locked_at FROM idem_keys WHERE key = $1")
                    .bind(key)
                    .fetch_one(pool)
                    .await
            }
            Self::MySql { pool, .. } => {
                sqlx::query_scalar(
                    "SELECT TIMESTAMPDIFF(MICROSECOND, locked_at, lease_until) DIV 1000 \
                     FROM idem_keys WHERE `key` = ?",
                )
                .bind(key.as_bytes())
                .fetch_one(pool)
                .await
            }
        }
        .expect("the key's lease")
    }

    /// Moves the end of `key`'s lease to `secs` from now (negative: in the past), as the
    /// passing of time would.
    pub async fn lease_ends_in(&self, key: &str, secs: i64) {
        match self {
            Self::Postgres { pool, .. } => sqlx::query(
                "UPDATE idem_keys SET lease_until = now() + make_interval(secs => $2) \
                 WHERE key = $1",
            )
            .bind(key)
            .bind(secs as f64)
            .execute(pool)
            .await
            .map(|_| ()),
            Self::Sqlite { pool, .. } => sqlx::query(
                "UPDATE idem_keys \
                 SET lease_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) + $2 * 1000 \
                 WHERE key = $1",
            )
            .bind(key)
            .bind(secs)
            .execute(pool)
            .await
            .map(|_| ()),
            Self::MySql { pool, .. } => sqlx::query(
                "UPDATE idem_keys SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ? SECOND \
                 WHERE `key` = ?",
            )
            .bind(secs)
            .bind(key.as_bytes())
            .execute(pool)
            .await
            .map(|_| ()),
        }
        .expect("move the lease");
    }
}

/// A child process that is killed when the test ends, however it ends.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback address for a service the test starts as a child process: reserved for this test
/// process, so that nothing takes it before the child binds it or between a kill and a restart.
pub fn free_addr() -> String {
    idem_tests::reserve_addr()
}

/// `DATABASE_URL` pointed at `database`.
pub fn url_of(database: &str) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set by scripts/test");
    let (without_query, query) = match base.split_once('?') {
        Some((url, query)) => (url.to_owned(), format!("?{query}")),
        None => (base.clone(), String::new()),
    };
    let (server, _) = without_query.rsplit_once('/').expect("a database path");
    format!("{server}/{database}{query}")
}

pub async fn wait_until_up(client: &Client, url: &str) {
    wait_until(&format!("{url} to answer"), || async {
        client.get(url).bearer_auth("probe").send().await.is_ok()
    })
    .await;
}

pub async fn start_payments(
    client: &Client,
    database: &Database,
    processor: &str,
) -> (Process, String) {
    start_payments_with(client, database, processor, &[]).await
}

/// [`start_payments`], with more environment variables (`CRASH_AFTER`).
pub async fn start_payments_with(
    client: &Client,
    database: &Database,
    processor: &str,
    env: &[(&str, &str)],
) -> (Process, String) {
    let (process, base) = spawn_payments_with(database, processor, env);
    wait_until_up(client, &format!("{base}/v1/payments")).await;
    (process, base)
}

/// Starts the service as [`start_payments_with`] does, without waiting for it to answer.
pub fn spawn_payments_with(
    database: &Database,
    processor: &str,
    env: &[(&str, &str)],
) -> (Process, String) {
    let addr = free_addr();
    let mut command = Command::new(env!("CARGO_BIN_EXE_payments"));
    database.configure(&mut command);
    // No event relay unless the test asks for one (`EVENTS`); gRPC on a port of its own
    // unless the test names one (`GRPC_ADDR`).
    command.env("EVENTS", "off").env("GRPC_ADDR", free_addr());
    command.envs(env.iter().copied());
    let child = command
        .env("ADDR", &addr)
        .env("PROCESSOR_URL", processor)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start payments");
    (Process(child), format!("http://{addr}"))
}

/// A payment of `amount` by `cus_1` for the tenant `t1` under `key`, through the service at
/// `base`: the payment as answered.
pub async fn paid(client: &Client, base: &str, key: &str, amount: i64) -> Value {
    client
        .post(format!("{base}/v1/payments"))
        .bearer_auth("t1")
        .header("Idempotency-Key", key)
        .json(&serde_json::json!({"amount": amount, "currency": "usd", "customer": "cus_1"}))
        .send()
        .await
        .expect("the service answers")
        .json()
        .await
        .expect("a JSON payment")
}

pub async fn refunds_executed(client: &Client, processor: &str) -> Vec<Value> {
    client
        .get(format!("{processor}/v1/refunds"))
        .send()
        .await
        .expect("processor answers")
        .json()
        .await
        .expect("a JSON list")
}

/// The database of a `#[sqlx::test]`, as the service's `DATABASE_URL` names it.
pub async fn postgres(connect: PgConnectOptions) -> Database {
    let name = connect.get_database().expect("a test database").to_owned();
    let pool = PgPool::connect_with(connect).await.expect("connect");
    Database::Postgres {
        pool,
        url: url_of(&name),
    }
}

/// A fresh SQLite file in `dir`, opened as the service opens it.
pub async fn sqlite(dir: &tempfile::TempDir) -> Database {
    let path = dir.path().join("payments.db");
    let pool = idem_examples::schema::connect_sqlite(&path)
        .await
        .expect("open the file");
    Database::Sqlite { pool, path }
}

/// A fresh database on the MySQL (MariaDB) server at `$MYSQL_URL`, as the service's
/// `DATABASE_URL` names it, and its name: the test drops it at its end with
/// `idem_tests::MySqlDb::drop_named` (as [`on_mysql`] does); a failed test leaves it behind,
/// for `scripts/test` to drop.
pub async fn mysql() -> (Database, String) {
    let database = idem_tests::MySqlDb::create().await;
    let pool = MySqlPool::connect_with(database.options().clone())
        .await
        .unwrap_or_else(|e| panic!("connect to the test database {}: {e}", database.name()));
    let url = database.url();
    (Database::MySql { pool, url }, database.name().to_owned())
}

/// Runs `test` on a fresh MySQL database ([`mysql`]), and drops the database once `test` is
/// done with it (its pool and processes gone, so that nothing holds the database).
pub async fn on_mysql<F: Future<Output = ()>>(test: impl FnOnce(Database) -> F) {
    let (database, name) = mysql().await;
    test(database).await;
    idem_tests::MySqlDb::drop_named(&name).await;
}

/// One test per database: each `$test` is an `async fn $test(database: Database)` of the
/// calling module, run as `postgres::$test`, `sqlite::$test` and `mysql::$test`.
macro_rules! on_every_database {
    ($($test:ident),* $(,)?) => {
        mod postgres {
            $(
                #[sqlx::test(migrations = false)]
                async fn $test(
                    _: sqlx::postgres::PgPoolOptions,
                    connect: sqlx::postgres::PgConnectOptions,
                ) {
                    super::$test(crate::support::postgres(connect).await).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $test() {
                    let dir = tempfile::tempdir().expect("a temporary directory");
                    super::$test(crate::support::sqlite(&dir).await).await;
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test]
                async fn $test() {
                    crate::support::on_mysql(super::$test).await;
                }
            )*
        }
    };
}
pub(crate) use on_every_database;

/// The example's processor on a loopback port of the test process (it outlives the service's
/// process either way). It notes the `Idempotency-Key` of every `POST`, per path; with a `held`
/// path, its first answer there waits (after the refund or charge is made) until [`gate`] has a
/// permit, so that a test can kill the service between the side effect and its record on any
/// machine, however slow.
///
/// [`gate`]: Self::gate
pub struct Processor {
    pub url: String,
    pub gate: Arc<tokio::sync::Semaphore>,
    keys: Arc<Mutex<Vec<(String, String)>>>,
    holding: Arc<AtomicBool>,
}

impl Processor {
    pub async fn start(held: Option<&'static str>) -> Self {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let keys = Arc::new(Mutex::new(Vec::new()));
        let holding = Arc::new(AtomicBool::new(held.is_some()));
        let router = {
            let (gate, keys, holding) =
                (Arc::clone(&gate), Arc::clone(&keys), Arc::clone(&holding));
            idem_examples::processor::router().layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let (gate, keys, holding) =
                        (Arc::clone(&gate), Arc::clone(&keys), Arc::clone(&holding));
                    async move {
                        let path = request.uri().path().to_owned();
                        let post = request.method() == axum::http::Method::POST;
                        if post && let Some(key) = request.headers().get("idempotency-key") {
                            let key = key.to_str().expect("a text key").to_owned();
                            keys.lock().expect("keys").push((path.clone(), key));
                        }
                        let hold = post
                            && held == Some(path.as_str())
                            && holding.swap(false, Ordering::SeqCst);
                        let response = next.run(request).await;
                        if hold {
                            gate.acquire().await.expect("gate open").forget();
                        }
                        response
                    }
                },
            ))
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("serve processor");
        });
        Self {
            url,
            gate,
            keys,
            holding,
        }
    }

    /// Holds the next answer on the `held` path too, as the first one was (until [`gate`] has a
    /// permit): for a test that kills the service mid-call more than once.
    ///
    /// [`gate`]: Self::gate
    pub fn hold_next(&self) {
        // A permit given to an answer that was never held to the end (the service died and
        // the processor dropped the answer with its connection) would let this one through.
        self.gate.forget_permits(self.gate.available_permits());
        self.holding.store(true, Ordering::SeqCst);
    }

    /// The `Idempotency-Key` of every `POST` to `path`, in order of arrival.
    pub fn keys(&self, path: &str) -> Vec<String> {
        let keys = self.keys.lock().expect("keys");
        keys.iter()
            .filter(|(posted, _)| posted == path)
            .map(|(_, key)| key.clone())
            .collect()
    }
}

/// Deletes `consumer`'s queue (not the exchange): its topic is then bound to nothing.
pub async fn delete_queue(names: &idem_tests::TestBroker, consumer: &str) {
    let url = idem_tests::broker_url(idem_tests::BrokerKind::RabbitMq);
    let queue = idem_events::rabbitmq::RabbitMq::new(&url, names.name()).queue(consumer);
    let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .expect("delete the queue");
}

/// Starts `binary` (`payments` or `processor`) on a fresh SQLite file with `env` set, and waits
/// for it to exit, as it must for a setting it refuses: its exit code and standard error.
pub async fn exit_at_start(binary: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    exit_at_start_within(idem_tests::DEADLINE, binary, env).await
}

/// [`exit_at_start`], failing unless `binary` exits within `limit`. `env` may name the database
/// itself (`DATABASE_URL`, `SQLITE_PATH`).
pub async fn exit_at_start_within(
    limit: std::time::Duration,
    binary: &str,
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let child = Command::new(binary)
        .env_remove("DATABASE_URL")
        .env_remove("MIGRATION_DATABASE_URL")
        .env("SQLITE_PATH", dir.path().join("payments.db"))
        .env("EVENTS", "off")
        .env("ADDR", free_addr())
        .env("GRPC_ADDR", free_addr())
        .env("PROCESSOR_ADDR", free_addr())
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the binary");
    // Killed when dropped, should it not exit.
    let mut child = Process(child);
    let mut status = None;
    idem_tests::wait_within(limit, &format!("{binary} to exit with {env:?}"), || {
        status = status.or_else(|| child.0.try_wait().expect("the child's status"));
        std::future::ready(status.is_some())
    })
    .await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().expect("piped"), &mut stderr)
        .expect("read stderr");
    (status.and_then(|s| s.code()), stderr)
}
