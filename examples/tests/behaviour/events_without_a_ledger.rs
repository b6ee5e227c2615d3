//! The `payments` binary on RabbitMQ before any ledger has run, as a new user first starts it:
//! it declares the ledger's queue at start, so that events wait in the broker rather than in
//! the outbox; and an event the broker cannot route (no queue bound to its topic) costs the log
//! one warning per outage, not a line per message. On SQLite: the broker's side is the subject.

use std::process::{Command, Stdio};

use crate::support::{self, Database, Process, free_addr, wait_until_up};
use idem_tests::wait_until;
use idem_tests::{BrokerKind, TestBroker};
use reqwest::{Client, StatusCode};
use serde_json::json;

/// Payments each test makes.
const PAYMENTS: usize = 20;

/// The service, relaying to RabbitMQ through the test's own exchange, logging at `info` to a
/// file the test reads.
struct Service {
    _process: Process,
    base: String,
    log: std::path::PathBuf,
    client: Client,
}

impl Service {
    async fn start(database: &Database, names: &TestBroker, dir: &tempfile::TempDir) -> Self {
        let log = dir.path().join("payments.log");
        let addr = free_addr();
        let mut command = Command::new(env!("CARGO_BIN_EXE_payments"));
        database.configure(&mut command);
        let child = command
            .env("EVENTS", "rabbitmq")
            .env("EVENTS_STREAM", names.name())
            .env("RECOVERY_EVERY", "0")
            .env("ADDR", &addr)
            .env("GRPC_ADDR", free_addr())
            .env("PROCESSOR_URL", "http://127.0.0.1:9")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("the log file"))
            .spawn()
            .expect("start payments");
        let service = Self {
            _process: Process(child),
            base: format!("http://{addr}"),
            log,
            client: Client::new(),
        };
        wait_until_up(&service.client, &format!("{}/v1/payments", service.base)).await;
        service
    }

    async fn pay(&self, n: usize) {
        let answer = self
            .client
            .post(format!("{}/v1/payments", self.base))
            .bearer_auth("t1")
            .header("idempotency-key", format!("quiet-{n}"))
            .json(&json!({"amount": 100 + n, "currency": "usd", "customer": "cus_1"}))
            .send()
            .await
            .expect("the service answers");
        assert_eq!(answer.status(), StatusCode::CREATED);
    }

    /// Waits until the service has declared the ledger's queue, as its log says.
    async fn queue_declared(&self) {
        wait_until("the service to declare the ledger's queue", || {
            let log = self.log();
            async move { log.contains("the ledger's queue is declared") }
        })
        .await;
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).expect("read the service's log")
    }

    /// The service's `/metrics`.
    async fn metrics(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("the service answers")
            .text()
            .await
            .expect("the metrics")
    }

    /// How many times the relay has found its topic refused, from `/metrics`.
    async fn refusals(&self) -> u64 {
        self.metrics()
            .await
            .lines()
            .filter(|line| line.starts_with("idem_outbox_refused_total"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }
}

#[tokio::test]
async fn with_no_ledger_running_the_events_wait_in_the_ledgers_queue() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let names = TestBroker::new(BrokerKind::RabbitMq).used_by("ledger");
    let service = Service::start(&database, &names, &dir).await;
    // The declaration runs beside the start (a broker that does not answer must not hold it
    // up): on a loaded machine the payments could otherwise come first.
    service.queue_declared().await;
    for n in 0..PAYMENTS {
        service.pay(n).await;
    }
    wait_until("every event to wait in the ledger's queue", || {
        let names = &names;
        async move { names.waiting("ledger").await == PAYMENTS }
    })
    .await;
    let log = service.log();
    assert!(
        !log.contains("refuses the topic"),
        "no event was refused as unroutable:\n{log}"
    );
    // No pass failed, and the series says so from the start (an alert on its increase needs
    // it there before the first failure).
    let metrics = service.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|line| line == "idem_outbox_pass_failures_total 0"),
        "the relay's failed passes, at zero:\n{metrics}"
    );
}

#[tokio::test]
async fn an_unroutable_event_logs_one_warning_per_outage_not_one_per_message() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let names = TestBroker::new(BrokerKind::RabbitMq).used_by("ledger");
    let service = Service::start(&database, &names, &dir).await;
    // Nothing is bound to the topic once the queue the service declared is gone.
    service.queue_declared().await;
    support::delete_queue(&names, "ledger").await;
    for n in 0..PAYMENTS {
        service.pay(n).await;
    }
    // Two refused attempts at least: each brought every waiting message back.
    wait_until("the relay to be refused twice", || {
        let service = &service;
        async move { service.refusals().await >= 2 }
    })
    .await;
    let log = service.log();
    let returned = log.lines().filter(|line| line.contains("returned")).count();
    assert_eq!(returned, 0, "no line per returned message:\n{log}");
    let warnings = log
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("refuses the topic"))
        .count();
    assert_eq!(warnings, 1, "one warning for the outage:\n{log}");
}
