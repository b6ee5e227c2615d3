//! The service as its guide page leaves it, run as a process: a transfer runs once, its retry
//! with the same key gets the first answer back, marked replayed, and moves no more money.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
};

mod bank {
    tonic::include_proto!("bank.v1");
}

use bank::{CreateTransferRequest, transfers_client::TransfersClient};

/// The service's process, killed when dropped.
struct Service(Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the service on a SQLite file in `dir` and free ports; its gRPC address.
fn start(dir: &std::path::Path) -> (Service, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_transfers"))
        .env("TRANSFERS_DB", dir.join("transfers.db"))
        .env("TRANSFERS_ADDR", "127.0.0.1:0")
        .env("METRICS_ADDR", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .spawn()
        .expect("the service starts");
    let stdout = child.stdout.take().expect("its standard output");
    let service = Service(child);
    // Its first line says where it serves, once it does: a read that ends without it means the
    // service stopped.
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("the service's first line");
    let addr = line
        .trim()
        .strip_prefix("serving bank.v1.Transfers on ")
        .unwrap_or_else(|| panic!("the service did not say where it serves: {line:?}"))
        .to_owned();
    (service, addr)
}

fn transfer(key: &str, amount: i64) -> tonic::Request<CreateTransferRequest> {
    let mut request = tonic::Request::new(CreateTransferRequest {
        from: "alice-checking".into(),
        to: "alice-savings".into(),
        amount,
    });
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("a key"));
    request
        .metadata_mut()
        .insert("x-customer", "alice".parse().expect("a customer"));
    request
}

async fn balance(pool: &sqlx::SqlitePool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .expect("the account's balance")
}

#[tokio::test]
async fn a_transfer_runs_once_and_its_retry_is_replayed() {
    let dir = tempfile::tempdir().expect("a directory");
    let (_service, addr) = start(dir.path());
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("the service's address")
        .connect()
        .await
        .expect("a connection to the service");
    let mut client = TransfersClient::new(channel);

    let first = client
        .create_transfer(transfer("transfer-1", 250))
        .await
        .expect("the transfer");
    assert!(first.metadata().get("idempotent-replayed").is_none());
    let retry = client
        .create_transfer(transfer("transfer-1", 250))
        .await
        .expect("the retry");
    assert_eq!(
        retry
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.to_str().expect("text")),
        Some("true")
    );
    assert_eq!(retry.get_ref(), first.get_ref(), "the first answer, again");

    let reused = client
        .create_transfer(transfer("transfer-1", 999))
        .await
        .expect_err("the same key with another message");
    assert_eq!(reused.code(), tonic::Code::FailedPrecondition);

    let pool = idem_runtime::sqlite::connect(dir.path().join("transfers.db"))
        .await
        .expect("the service's database");
    assert_eq!(balance(&pool, "alice-checking").await, 750, "moved once");
    assert_eq!(balance(&pool, "alice-savings").await, 250, "moved once");
}
