//! Real processes on real brokers: the `payments` binary relays `payment.succeeded` events and
//! the `ledger` binary consumes them. Both are killed several times: with SIGKILL while events
//! flow, and by aborts at chosen points (`$CRASH_AFTER`): the service after the broker
//! confirmed a batch but before it marked it published, the ledger inside its handler and after
//! its commit but before its acknowledgement. In the end every tenant's ledger holds exactly
//! one entry per succeeded payment and their sum, whatever was delivered twice.
//!
//! On RabbitMQ, Redis and a single NATS server; and on a three-node NATS cluster (the `cluster_`
//! tests, ignored in the suite: scripts/test runs them against `scripts/nats-cluster`), where
//! the server holding the ledger's connection and then the one holding the relay's are killed
//! with SIGKILL while payments flow, on top of the kills of the processes.

use crate::support;

use std::{
    cell::Cell,
    collections::BTreeMap,
    process::{Command, Stdio},
};

use idem_tests::{BrokerKind, NatsCluster, TestBroker, broker_url};
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{Database, Process, free_addr, spawn_payments_with, wait_until};

const TENANTS: [&str; 3] = ["t1", "t2", "t3"];

/// (entries, balance) per tenant.
type Ledgers = BTreeMap<String, (i64, i64)>;

/// How long a message the ledger's process took may stay unacknowledged on NATS before
/// JetStream delivers it again (`$NATS_ACK_WAIT`, seconds): short, so that the messages of a
/// killed ledger come back soon.
const NATS_ACK_WAIT: &str = "2";

struct Run {
    client: Client,
    database: Database,
    broker: &'static str,
    names: TestBroker,
    /// `$NATS_URL` of the processes (NATS only): the server, or the cluster's three.
    nats_url: String,
    ledger_addr: String,
    sent: Cell<usize>,
}

impl Run {
    fn new(database: Database, broker: &'static str) -> Self {
        let kind = match broker {
            "redis" => BrokerKind::Redis,
            "nats" => BrokerKind::Nats,
            _ => BrokerKind::RabbitMq,
        };
        Self::with(database, broker, TestBroker::new(kind), broker_url(kind))
    }

    /// A run on NATS whose processes know the cluster's three servers.
    fn on_cluster(database: Database, cluster: &NatsCluster) -> Self {
        let names = TestBroker::at(BrokerKind::Nats, &cluster.node_url("n1"));
        Self::with(database, "nats", names, cluster.url().to_owned())
    }

    fn with(database: Database, broker: &'static str, names: TestBroker, nats_url: String) -> Self {
        Self {
            client: Client::new(),
            database,
            broker,
            // The ledger's process reads as the consumer `ledger`.
            names: names.used_by("ledger"),
            nats_url,
            ledger_addr: free_addr(),
            sent: Cell::new(0),
        }
    }

    fn env<'a>(&'a self, crash: &'a str) -> Vec<(&'a str, &'a str)> {
        let mut env = vec![
            ("EVENTS", self.broker),
            ("EVENTS_STREAM", self.names.name()),
            ("CRASH_AFTER", crash),
            ("RECOVERY_EVERY", "0"),
        ];
        if self.broker == "nats" {
            env.extend([
                ("NATS_URL", self.nats_url.as_str()),
                ("NATS_ACK_WAIT", NATS_ACK_WAIT),
            ]);
        }
        env
    }

    /// The key of the next payment.
    fn next_key(&self) -> usize {
        self.sent.set(self.sent.get() + 1);
        self.sent.get()
    }

    /// The name of the connection of the ledger's consumer (`ledger`) or of the relay, as the
    /// NATS servers list it.
    fn nats_connection(&self, role: &str) -> String {
        let stream = self.names.nats().stream().to_owned();
        match role {
            "ledger" => format!("idem-events consumer ledger {stream}"),
            _ => format!("idem-events relay {stream}"),
        }
    }

    async fn start_ledger(&self, crash: &str) -> Process {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ledger"));
        self.database.configure(&mut command);
        let child = command
            .envs(self.env(crash))
            .env("LEDGER_ADDR", &self.ledger_addr)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("start the ledger");
        let mut process = Process(child);
        let url = format!("http://{}/v1/ledger", self.ledger_addr);
        up_or_aborted(&self.client, &url, &mut process).await;
        process
    }

    async fn start_payments(&self, crash: &str) -> (Process, String) {
        let (mut process, base) =
            spawn_payments_with(&self.database, "http://127.0.0.1:9", &self.env(crash));
        up_or_aborted(&self.client, &format!("{base}/v1/payments"), &mut process).await;
        (process, base)
    }

    /// Sends one payment under `key`.
    async fn pay(
        &self,
        base: &str,
        tenant: &str,
        key: usize,
        customer: &str,
    ) -> reqwest::Result<reqwest::Response> {
        self.client
            .post(format!("{base}/v1/payments"))
            .bearer_auth(tenant)
            .header("Idempotency-Key", format!("pay-{key}"))
            .json(&json!({"amount": 100 + key, "currency": "EUR", "customer": customer}))
            .send()
            .await
    }

    /// Sends a round of payments, two per tenant and one declined; every one is answered.
    async fn pay_round(&self, base: &str) {
        for tenant in TENANTS {
            for customer in ["cus_1", "cus_declined", "cus_2"] {
                let key = self.next_key();
                let answer = self
                    .pay(base, tenant, key, customer)
                    .await
                    .expect("the service answers");
                let expected = if customer == "cus_declined" {
                    StatusCode::PAYMENT_REQUIRED
                } else {
                    StatusCode::CREATED
                };
                assert_eq!(answer.status(), expected);
            }
        }
    }

    /// What the ledgers must hold: the succeeded payments, counted and summed per tenant.
    async fn expected(&self) -> Ledgers {
        let sql = "SELECT tenant, count(*), CAST(sum(amount) AS BIGINT) FROM payments \
                   WHERE status = 'succeeded' GROUP BY tenant";
        self.grouped(sql).await
    }

    /// The ledger's entries, counted and summed per tenant, from its table.
    async fn entries(&self) -> Ledgers {
        let sql = "SELECT tenant, count(*), CAST(sum(amount) AS BIGINT) FROM ledger_entries \
                   GROUP BY tenant";
        self.grouped(sql).await
    }

    async fn grouped(&self, sql: &'static str) -> Ledgers {
        let rows: Vec<(String, i64, i64)> = match &self.database {
            Database::Postgres { pool, .. } => sqlx::query_as(sql).fetch_all(pool).await,
            Database::Sqlite { pool, .. } => sqlx::query_as(sql).fetch_all(pool).await,
            Database::MySql { pool, .. } => {
                // Tenants are bytes there, and a sum is cast to SIGNED.
                let sql = sql.replacen("SELECT tenant", "SELECT CONVERT(tenant USING utf8mb4)", 1);
                let (sql, _) = idem_tests::positional(&sql);
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .fetch_all(pool)
                    .await
            }
        }
        .expect("a grouped count");
        rows.into_iter().map(|(t, n, s)| (t, (n, s))).collect()
    }

    /// What `GET /v1/ledger` answers for each tenant.
    async fn served(&self) -> Ledgers {
        let mut ledgers = Ledgers::new();
        for tenant in TENANTS {
            let ledger: Value = self
                .client
                .get(format!("http://{}/v1/ledger", self.ledger_addr))
                .bearer_auth(tenant)
                .send()
                .await
                .expect("the ledger answers")
                .json()
                .await
                .expect("JSON");
            let entries = ledger["entries"].as_i64().expect("entries");
            if entries > 0 {
                ledgers.insert(
                    tenant.to_owned(),
                    (entries, ledger["balance"].as_i64().expect("balance")),
                );
            }
        }
        ledgers
    }

    async fn total_entries(&self) -> i64 {
        self.database.count("ledger_entries").await
    }

    /// Waits until every ledger holds its succeeded payments, or one went past them (an event
    /// applied twice, which the caller's comparison then reports).
    async fn caught_up(&self, what: &str) {
        let expected = self.expected().await;
        wait_until(what, || async {
            let served = self.served().await;
            served == expected
                || served
                    .iter()
                    .any(|(tenant, (n, _))| expected.get(tenant).is_none_or(|(m, _)| n > m))
        })
        .await;
    }
}

/// Waits until `process` answers at `url`, or has ended: one started with a crash point may
/// reach it (with work left by the process before it) before it answers.
async fn up_or_aborted(client: &Client, url: &str, process: &mut Process) {
    wait_until(&format!("{url} to answer or its process to end"), || {
        let ended = process.0.try_wait().expect("try_wait").is_some();
        let answers = client.get(url).bearer_auth("probe").send();
        async move { ended || answers.await.is_ok() }
    })
    .await;
}

/// Waits for `process` to end by itself (an abort at its crash point).
async fn aborts(process: &mut Process, what: &str) {
    wait_until(what, || {
        let exited = process.0.try_wait().expect("try_wait").is_some();
        async move { exited }
    })
    .await;
}

async fn every_ledger_equals_its_succeeded_payments(database: Database, broker: &'static str) {
    across_kills(Run::new(database, broker), None).await;
}

/// The kills of [`every_ledger_equals_its_succeeded_payments`], and with `cluster` the SIGKILL
/// of a NATS server while a round of payments flows: the one holding the ledger's connection,
/// then (once it is back) the one holding the relay's. Each process reconnects to another
/// server, and the ledgers catch up before the server is started again.
async fn across_kills(run: Run, cluster: Option<&NatsCluster>) {
    // The ledger first, so that its queue exists when the first events go out.
    let mut ledger = run.start_ledger("apply").await;
    let (mut payments, base) = run.start_payments("").await;

    // The ledger dies inside its handler, then after a commit before its ack.
    run.pay_round(&base).await;
    aborts(&mut ledger, "the ledger to abort inside its handler").await;
    let mut ledger = run.start_ledger("commit").await;
    aborts(&mut ledger, "the ledger to abort after a commit").await;
    let ledger = run.start_ledger("").await;

    if let Some(cluster) = cluster {
        let nats = run.names.nats();
        let (_client, jetstream) = nats.connect().await.expect("connect to NATS");
        let stream = jetstream
            .get_stream(nats.stream())
            .await
            .expect("the stream the processes created")
            .get_info()
            .await
            .expect("stream info");
        assert_eq!(stream.config.num_replicas, 3, "one replica per server");
        for role in ["ledger", "relay"] {
            let connection = run.nats_connection(role);
            let victim = cluster.holder_within(&connection).await;
            let guard = cluster.restart_on_drop(victim);
            let before = run.total_entries().await;
            tokio::join!(run.pay_round(&base), async {
                wait_until("the ledger to apply part of the round", || async {
                    run.total_entries().await > before
                })
                .await;
                cluster.kill(victim).await;
            });
            run.caught_up(&format!(
                "every ledger to catch up after {victim} was killed"
            ))
            .await;
            assert_eq!(
                run.served().await,
                run.expected().await,
                "after {victim} was killed"
            );
            let now = cluster.holder(&connection).await;
            assert!(
                now.is_some_and(|node| node != victim),
                "`{connection}` reconnected to another server: {now:?}"
            );
            cluster.restart(victim).await;
            drop(guard);
        }
    }

    // The service is killed right after a round, while its relay may be publishing; the next
    // one dies after the broker confirmed a batch, before marking it published.
    run.pay_round(&base).await;
    payments.0.kill().expect("SIGKILL the service");
    payments.0.wait().expect("reap");
    // Its relay publishes what the killed one left, or else this payment's event; either way
    // it aborts after the confirm. The payment's answer may be lost: it is sent again below.
    let (mut crashing, crashing_base) = run.start_payments("publish").await;
    let key = run.next_key();
    let _ = run.pay(&crashing_base, "t1", key, "cus_1").await;
    aborts(
        &mut crashing,
        "the service to abort after a confirmed batch",
    )
    .await;
    let (_payments, base) = run.start_payments("").await;
    let retried = run.pay(&base, "t1", key, "cus_1").await.expect("an answer");
    assert_eq!(retried.status(), StatusCode::CREATED);

    // The ledger is killed while it applies a round.
    let before = run.total_entries().await;
    run.pay_round(&base).await;
    wait_until("the ledger to apply part of the round", || async {
        run.total_entries().await > before
    })
    .await;
    let mut ledger = ledger;
    ledger.0.kill().expect("SIGKILL the ledger");
    ledger.0.wait().expect("reap");
    let _ledger = run.start_ledger("").await;

    let expected = run.expected().await;
    assert_eq!(
        expected.len(),
        TENANTS.len(),
        "every tenant has payments: {expected:?}"
    );
    run.caught_up("every ledger to catch up with its payments")
        .await;
    assert_eq!(run.served().await, expected, "GET /v1/ledger per tenant");
    assert_eq!(
        run.entries().await,
        expected,
        "one entry per succeeded payment"
    );
    assert_eq!(
        run.database.count("ledger_entries").await,
        expected.values().map(|(n, _)| n).sum::<i64>(),
    );
}

#[sqlx::test(migrations = false)]
async fn postgres_rabbitmq_every_ledger_equals_its_succeeded_payments_across_kills(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    every_ledger_equals_its_succeeded_payments(support::postgres(connect).await, "rabbitmq").await;
}

#[sqlx::test(migrations = false)]
async fn postgres_redis_every_ledger_equals_its_succeeded_payments_across_kills(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    every_ledger_equals_its_succeeded_payments(support::postgres(connect).await, "redis").await;
}

#[tokio::test]
async fn sqlite_rabbitmq_every_ledger_equals_its_succeeded_payments_across_kills() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    every_ledger_equals_its_succeeded_payments(support::sqlite(&dir).await, "rabbitmq").await;
}

#[tokio::test]
async fn sqlite_redis_every_ledger_equals_its_succeeded_payments_across_kills() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    every_ledger_equals_its_succeeded_payments(support::sqlite(&dir).await, "redis").await;
}

#[tokio::test]
async fn mysql_rabbitmq_every_ledger_equals_its_succeeded_payments_across_kills() {
    support::on_mysql(|database| every_ledger_equals_its_succeeded_payments(database, "rabbitmq"))
        .await;
}

#[tokio::test]
async fn mysql_redis_every_ledger_equals_its_succeeded_payments_across_kills() {
    support::on_mysql(|database| every_ledger_equals_its_succeeded_payments(database, "redis"))
        .await;
}

#[sqlx::test(migrations = false)]
async fn postgres_nats_every_ledger_equals_its_succeeded_payments_across_kills(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    every_ledger_equals_its_succeeded_payments(support::postgres(connect).await, "nats").await;
}

#[tokio::test]
async fn sqlite_nats_every_ledger_equals_its_succeeded_payments_across_kills() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    every_ledger_equals_its_succeeded_payments(support::sqlite(&dir).await, "nats").await;
}

#[tokio::test]
async fn mysql_nats_every_ledger_equals_its_succeeded_payments_across_kills() {
    support::on_mysql(|database| every_ledger_equals_its_succeeded_payments(database, "nats"))
        .await;
}

/// The kills on the three-node cluster, a NATS server's among them.
async fn every_ledger_equals_its_succeeded_payments_on_a_nats_cluster(database: Database) {
    let cluster = NatsCluster::from_env();
    for node in idem_tests::NATS_NODES {
        assert!(cluster.alive(node), "{node} is not running");
    }
    across_kills(Run::on_cluster(database, &cluster), Some(&cluster)).await;
}

#[sqlx::test(migrations = false)]
#[ignore = "needs the NATS cluster of scripts/nats-cluster (NATS_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_postgres_every_ledger_equals_its_succeeded_payments_across_kills_of_a_nats_server_too(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    every_ledger_equals_its_succeeded_payments_on_a_nats_cluster(support::postgres(connect).await)
        .await;
}

#[tokio::test]
#[ignore = "needs the NATS cluster of scripts/nats-cluster (NATS_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_sqlite_every_ledger_equals_its_succeeded_payments_across_kills_of_a_nats_server_too()
 {
    let dir = tempfile::tempdir().expect("a temporary directory");
    every_ledger_equals_its_succeeded_payments_on_a_nats_cluster(support::sqlite(&dir).await).await;
}

#[tokio::test]
#[ignore = "needs the NATS cluster of scripts/nats-cluster (NATS_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_mysql_every_ledger_equals_its_succeeded_payments_across_kills_of_a_nats_server_too()
 {
    support::on_mysql(every_ledger_equals_its_succeeded_payments_on_a_nats_cluster).await;
}
