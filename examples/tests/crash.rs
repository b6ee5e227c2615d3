//! Real processes: the payments service and the processor run as their own binaries, and the
//! service is killed with SIGKILL between the processor's refund and the completion of the key.
//! (These tests live beside the binaries so that Cargo builds them and hands over their paths.)

use std::{
    net::TcpListener,
    process::{Child, Command, Stdio},
    time::Duration,
};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::{
    PgPool, SqlitePool,
    postgres::{PgConnectOptions, PgPoolOptions},
};

/// The service's database, as the test looks into it.
enum Database {
    /// PostgreSQL, at `url` for the service.
    Postgres { pool: PgPool, url: String },
    /// A SQLite file, shared with the service's process (WAL lets both open it).
    Sqlite {
        pool: SqlitePool,
        path: std::path::PathBuf,
    },
}

impl Database {
    fn configure(&self, command: &mut Command) {
        match self {
            Self::Postgres { url, .. } => {
                command.env("DATABASE_URL", url);
            }
            Self::Sqlite { path, .. } => {
                command.env_remove("DATABASE_URL").env("SQLITE_PATH", path);
            }
        }
    }

    async fn key_status(&self, key: &str) -> String {
        let sql = "SELECT status FROM idem_keys WHERE key = $1";
        match self {
            Self::Postgres { pool, .. } => sqlx::query_scalar(sql).bind(key).fetch_one(pool).await,
            Self::Sqlite { pool, .. } => sqlx::query_scalar(sql).bind(key).fetch_one(pool).await,
        }
        .expect("the key's row")
    }

    /// Whether `key`'s lease is still running.
    async fn leased(&self, key: &str) -> bool {
        match self {
            Self::Postgres { pool, .. } => {
                sqlx::query_scalar("SELECT lease_until > now() FROM idem_keys WHERE key = $1")
                    .bind(key)
                    .fetch_one(pool)
                    .await
            }
            Self::Sqlite { pool, .. } => {
                sqlx::query_scalar(
                    "SELECT lease_until > CAST(unixepoch('subsec') * 1000 AS INTEGER) \
                 FROM idem_keys WHERE key = $1",
                )
                .bind(key)
                .fetch_one(pool)
                .await
            }
        }
        .expect("the key's lease")
    }
}

/// A child process that is killed when the test ends, however it ends.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.local_addr().expect("addr").to_string()
}

/// `DATABASE_URL` pointed at `database`.
fn url_of(database: &str) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set by scripts/test");
    let (without_query, query) = match base.split_once('?') {
        Some((url, query)) => (url.to_owned(), format!("?{query}")),
        None => (base.clone(), String::new()),
    };
    let (server, _) = without_query.rsplit_once('/').expect("a database path");
    format!("{server}/{database}{query}")
}

async fn wait_until_up(client: &Client, url: &str) {
    for _ in 0..300 {
        if client.get(url).bearer_auth("probe").send().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} did not come up");
}

async fn start_payments(
    client: &Client,
    database: &Database,
    processor: &str,
) -> (Process, String) {
    let addr = free_addr();
    let mut command = Command::new(env!("CARGO_BIN_EXE_payments"));
    database.configure(&mut command);
    let child = command
        .env("ADDR", &addr)
        .env("PROCESSOR_URL", processor)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start payments");
    let base = format!("http://{addr}");
    wait_until_up(client, &format!("{base}/v1/payments")).await;
    (Process(child), base)
}

async fn refunds_executed(client: &Client, processor: &str) -> Vec<Value> {
    client
        .get(format!("{processor}/v1/refunds"))
        .send()
        .await
        .expect("processor answers")
        .json()
        .await
        .expect("a JSON list")
}

#[sqlx::test(migrations = false)]
async fn postgres_service_killed_after_the_refund_is_retried_safely(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = connect.get_database().expect("a test database").to_owned();
    let pool = PgPool::connect_with(connect).await.expect("connect");
    killed_after_the_refund(Database::Postgres {
        pool,
        url: url_of(&name),
    })
    .await;
}

#[tokio::test]
async fn sqlite_service_killed_after_the_refund_is_retried_safely() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("payments.db");
    let pool = idem_examples::schema::connect_sqlite(&path)
        .await
        .expect("open the file");
    killed_after_the_refund(Database::Sqlite { pool, path }).await;
}

async fn killed_after_the_refund(database: Database) {
    let client = Client::new();

    let processor_addr = free_addr();
    let _processor = Process(
        Command::new(env!("CARGO_BIN_EXE_processor"))
            .env("PROCESSOR_ADDR", &processor_addr)
            .stdout(Stdio::null())
            .spawn()
            .expect("start processor"),
    );
    let processor = format!("http://{processor_addr}");
    wait_until_up(&client, &format!("{processor}/v1/refunds")).await;

    let (mut payments, base) = start_payments(&client, &database, &processor).await;
    let payment: Value = client
        .post(format!("{base}/v1/payments"))
        .bearer_auth("t1")
        .header("Idempotency-Key", "pay-1")
        .json(&json!({"amount": 900, "currency": "usd", "customer": "cus_slow"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let refund = json!({"payment": payment["id"], "amount": 300});
    let send_refund = |base: String| {
        let (client, refund) = (client.clone(), refund.clone());
        async move {
            client
                .post(format!("{base}/v1/refunds"))
                .bearer_auth("t1")
                .header("Idempotency-Key", "refund-1")
                .json(&refund)
                .send()
                .await
        }
    };

    // The processor records the refund at once and answers a second later (cus_slow): kill the
    // service in between, after the side effect and before the completion.
    let in_flight = tokio::spawn(send_refund(base.clone()));
    while refunds_executed(&client, &processor).await.is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    payments.0.kill().expect("SIGKILL");
    payments.0.wait().expect("reap");
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client saw the connection die"
    );
    assert_eq!(
        database.key_status("refund-1").await,
        "started",
        "the crash left the claim behind"
    );

    // A new process; a retry within the 5 s lease is told to come back later.
    let (_payments, base) = start_payments(&client, &database, &processor).await;
    assert!(
        database.leased("refund-1").await,
        "the restart took longer than the lease"
    );
    let early = send_refund(base.clone()).await.unwrap();
    assert_eq!(early.status(), StatusCode::CONFLICT);
    let retry_after: u64 = early.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=5).contains(&retry_after));

    // After the lease, the retry takes the key over and runs the handler again; the processor
    // sees the same derived key and does not refund twice.
    while database.leased("refund-1").await {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let late = send_refund(base.clone()).await.unwrap();
    assert_eq!(late.status(), StatusCode::CREATED);
    assert!(late.headers().get("idempotent-replayed").is_none());
    let late: Value = late.json().await.unwrap();
    let executed = refunds_executed(&client, &processor).await;
    assert_eq!(
        executed.len(),
        1,
        "one refund at the processor: {executed:?}"
    );
    assert_eq!(late["id"], executed[0]["id"]);

    let replay = send_refund(base).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.json::<Value>().await.unwrap(), late);
}
