//! Two `payments` processes on a three-node PostgreSQL cluster under Patroni in synchronous
//! mode, reached through HAProxy, as production PostgreSQL fails over. With the primary's
//! postmaster SIGKILLed while retrying clients make payments and refund each (the refund goes
//! to the processor under a key derived from the request's): no acknowledged payment is lost,
//! none is made twice, every key replays its payment, every refund was made once at the
//! processor, both services go on without a restart, and every answer a client saw on the way
//! was the payment, its replay, or a 409 or 503 with `Retry-After`.
//!
//! Run against `PG_HA_SYNCHRONOUS=off scripts/pg-ha up`, the same test shows what asynchronous
//! replication costs: it fails, naming the acknowledged payments the new primary lacks and
//! what their retries did (paid again, under new ids).
//!
//! The test needs the cluster of `scripts/pg-ha up DIR` (`$PG_HA_DIR`): it is ignored in the
//! suite, and scripts/test runs it against a cluster of its own.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use crate::support::{
    Database, Processor, refunds_executed, spawn_payments_with, wait_until, wait_until_up,
};
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::PgPool;

/// Retrying clients, each with keys of its own, half of them on each service.
const CLIENTS: usize = 8;
/// Payments acknowledged before the kill, and after it (on both services together).
const BEFORE: usize = 40;
const AFTER: usize = 40;

/// The cluster `scripts/pg-ha up` started, as its `env` file describes it.
struct Cluster {
    dir: PathBuf,
    /// HAProxy's URL, on the `postgres` database.
    url: String,
}

impl Cluster {
    fn from_env() -> Self {
        let dir = PathBuf::from(
            std::env::var("PG_HA_DIR").expect("PG_HA_DIR is set by scripts/test (scripts/pg-ha)"),
        );
        let env = std::fs::read_to_string(dir.join("env")).expect("the cluster's env file");
        let url = env
            .lines()
            .find_map(|line| line.strip_prefix("PG_HA_URL="))
            .expect("PG_HA_URL in the env file")
            .to_owned();
        Self { dir, url }
    }

    /// HAProxy's URL on `database`.
    fn url_of(&self, database: &str) -> String {
        let (server, _) = self.url.rsplit_once('/').expect("a database path");
        format!("{server}/{database}")
    }

    /// The postmaster of the node HAProxy routes to now (the primary), read from its data
    /// directory, and the node's name.
    async fn primary_postmaster(&self) -> (String, u32) {
        let pool = PgPool::connect(&self.url)
            .await
            .expect("connect to HAProxy");
        let port: i32 = sqlx::query_scalar("SELECT inet_server_port()")
            .fetch_one(&pool)
            .await
            .expect("the primary's port");
        pool.close().await;
        for node in ["n1", "n2", "n3"] {
            let config = std::fs::read_to_string(self.dir.join(node).join("patroni.yml"))
                .expect("a node's configuration");
            if config.contains(&format!("listen: 127.0.0.1:{port}\n")) {
                let pid = std::fs::read_to_string(self.dir.join(node).join("data/postmaster.pid"))
                    .expect("the primary's postmaster.pid");
                let pid = pid.lines().next().expect("a pid").trim().parse();
                return (node.to_owned(), pid.expect("a numeric pid"));
            }
        }
        panic!("no node listens on {port}")
    }
}

fn payment(customer: &str) -> Value {
    json!({"amount": 1500, "currency": "usd", "customer": customer})
}

/// What one attempt got: an answer, or no answer at all.
#[derive(Debug)]
enum Heard {
    Answer {
        status: StatusCode,
        replayed: bool,
        retry_after: bool,
        body: Value,
    },
    Nothing(String),
}

async fn post(client: &Client, base: &str, key: &str) -> Heard {
    post_to(client, base, "/v1/payments", key, &payment(key)).await
}

async fn post_to(client: &Client, base: &str, path: &str, key: &str, body: &Value) -> Heard {
    let sent = client
        .post(format!("{base}{path}"))
        .bearer_auth("t1")
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await;
    match sent {
        Ok(reply) => {
            let status = reply.status();
            let replayed = reply.headers().contains_key("idempotent-replayed");
            let retry_after = reply.headers().contains_key("retry-after");
            let body = reply.json().await.unwrap_or(Value::Null);
            Heard::Answer {
                status,
                replayed,
                retry_after,
                body,
            }
        }
        Err(error) => Heard::Nothing(error.to_string()),
    }
}

/// What a client was told of one key: the payment's id, and whether the answer that told it
/// was the execution itself (not a replay of an execution whose answer was lost).
struct Told {
    key: String,
    id: String,
    executed: bool,
}

/// Sends `key` to `base` until it is paid (201, executed or replayed), retrying 409 and 503 as
/// a client that honours `Retry-After` would (sooner: the test has a deadline). Any other
/// answer, or none, is noted in `wrong` and retried too.
async fn pay(client: &Client, base: &str, key: &str, wrong: &Mutex<Vec<String>>) -> Told {
    until_final(client, base, "/v1/payments", key, &payment(key), wrong)
        .await
        .expect("a payment is never 404")
}

/// Sends a refund of part of `payment` to `base` under `key`, as [`pay`] does; `None` when the
/// service answers 404: the payment is not there (asynchronous replication lost it).
async fn refund(
    client: &Client,
    base: &str,
    key: &str,
    payment: &str,
    wrong: &Mutex<Vec<String>>,
) -> Option<Told> {
    let body = json!({"payment": payment, "amount": 500});
    until_final(client, base, "/v1/refunds", key, &body, wrong).await
}

async fn until_final(
    client: &Client,
    base: &str,
    path: &str,
    key: &str,
    body: &Value,
    wrong: &Mutex<Vec<String>>,
) -> Option<Told> {
    let deadline = tokio::time::Instant::now() + idem_tests::DEADLINE;
    loop {
        match post_to(client, base, path, key, body).await {
            Heard::Answer {
                status: StatusCode::CREATED,
                replayed,
                body,
                ..
            } => {
                let id = body["id"].as_str().expect("an id").to_owned();
                return Some(Told {
                    key: key.to_owned(),
                    id,
                    executed: !replayed,
                });
            }
            Heard::Answer {
                status: StatusCode::NOT_FOUND,
                ..
            } if path == "/v1/refunds" => return None,
            Heard::Answer {
                status,
                retry_after,
                body,
                ..
            } => {
                let retryable =
                    status == StatusCode::CONFLICT || status == StatusCode::SERVICE_UNAVAILABLE;
                if !(retryable && retry_after) {
                    wrong.lock().expect("wrong").push(format!(
                        "{key}: {status} (Retry-After: {retry_after}) {body}"
                    ));
                }
            }
            Heard::Nothing(error) => {
                wrong
                    .lock()
                    .expect("wrong")
                    .push(format!("{key}: no answer: {error}"));
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} not answered at {base}{path} within {:?}",
            idem_tests::DEADLINE
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many refunds the processor executed, per payment.
async fn refunded_at_processor(client: &Client, processor: &str) -> BTreeMap<String, usize> {
    let mut refunded = BTreeMap::new();
    for executed in refunds_executed(client, processor).await {
        let payment = executed["payment"]
            .as_str()
            .expect("a payment id")
            .to_owned();
        *refunded.entry(payment).or_insert(0) += 1;
    }
    refunded
}

#[tokio::test]
#[ignore = "needs the cluster of scripts/pg-ha (PG_HA_DIR); scripts/test runs it"]
async fn cluster_the_primary_killed_while_payments_flow_loses_no_acknowledged_payment_and_every_key_replays()
 {
    let cluster = Cluster::from_env();
    let database = format!("idem_pg_ha_{}", std::process::id());
    let admin = PgPool::connect(&cluster.url)
        .await
        .expect("connect to HAProxy");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .expect("create the test database");
    let url = cluster.url_of(&database);
    let pool = PgPool::connect(&url)
        .await
        .expect("connect to the test database");

    let client = Client::new();
    let processor = Processor::start(None).await;
    let mut services = Vec::new();
    for _ in 0..2 {
        let at = Database::Postgres {
            pool: pool.clone(),
            url: url.clone(),
        };
        let (process, base) = spawn_payments_with(&at, &processor.url, &[]);
        wait_until_up(&client, &format!("{base}/v1/payments")).await;
        services.push((process, base));
    }
    let bases: Vec<String> = services.iter().map(|(_, base)| base.clone()).collect();

    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicBool::new(false));
    let made = Arc::new(AtomicUsize::new(0));
    let made_after = Arc::new(Mutex::new([0_usize; 2]));
    let wrong = Arc::new(Mutex::new(Vec::new()));
    // When the kill was sent, and how long after it the first payment was acknowledged.
    let kill_sent = Arc::new(std::sync::OnceLock::<tokio::time::Instant>::new());
    let first_after = Arc::new(std::sync::OnceLock::<Duration>::new());
    let flows: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (client, base) = (client.clone(), bases[c % 2].clone());
            let (stop, killed, made, made_after, wrong) = (
                Arc::clone(&stop),
                Arc::clone(&killed),
                Arc::clone(&made),
                Arc::clone(&made_after),
                Arc::clone(&wrong),
            );
            let (kill_sent, first_after) = (Arc::clone(&kill_sent), Arc::clone(&first_after));
            tokio::spawn(async move {
                let (mut told, mut refunds) = (Vec::new(), Vec::new());
                while !stop.load(Ordering::SeqCst) {
                    let after_kill = killed.load(Ordering::SeqCst);
                    let key = format!("ha-{c}-{}", told.len());
                    let paid = pay(&client, &base, &key, &wrong).await;
                    let refund_key = format!("{key}-refund");
                    if let Some(refunded) =
                        refund(&client, &base, &refund_key, &paid.id, &wrong).await
                    {
                        refunds.push((refunded, paid.id.clone()));
                    }
                    told.push(paid);
                    made.fetch_add(1, Ordering::SeqCst);
                    if after_kill {
                        made_after.lock().expect("made_after")[c % 2] += 1;
                        if let Some(sent) = kill_sent.get() {
                            let _ = first_after.set(sent.elapsed());
                        }
                    }
                }
                (told, refunds)
            })
        })
        .collect();

    wait_until(&format!("{BEFORE} payments before the kill"), || async {
        made.load(Ordering::SeqCst) >= BEFORE
    })
    .await;
    let (node, postmaster) = cluster.primary_postmaster().await;
    kill_sent
        .set(tokio::time::Instant::now())
        .expect("one kill");
    let status = Command::new("kill")
        .args(["-KILL", &postmaster.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "SIGKILL {node}'s postmaster {postmaster}");
    killed.store(true, Ordering::SeqCst);
    wait_until(
        &format!("{AFTER} payments after {node}'s postmaster was killed, some at each service"),
        || async {
            let after = *made_after.lock().expect("made_after");
            after[0] + after[1] >= AFTER && after[0] > 0 && after[1] > 0
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let (mut told, mut refunds) = (Vec::new(), Vec::new());
    for flow in flows {
        let (paid, refunded) = flow.await.expect("a client");
        told.extend(paid);
        refunds.extend(refunded);
    }

    let wrong = wrong.lock().expect("wrong").clone();
    assert!(
        wrong.is_empty(),
        "answers other than a payment, or a 409 or 503 with Retry-After:\n{}",
        wrong.join("\n")
    );
    // Every refund a client was told of was made at the processor, once; no payment was
    // refunded twice there. Then the refunds lost with the old primary (asynchronous
    // replication only), retried, run the handler again under the same derived key: the
    // processor still refunds once.
    let refunded = refunded_at_processor(&client, &processor.url).await;
    for (Told { key, .. }, payment) in &refunds {
        assert_eq!(refunded.get(payment), Some(&1), "{key} at the processor");
    }
    assert!(
        refunded.values().all(|&n| n == 1),
        "a payment refunded twice at the processor: {refunded:?}"
    );
    let stored: Vec<String> = sqlx::query_scalar("SELECT id FROM refunds")
        .fetch_all(&pool)
        .await
        .expect("the refunds on the new primary");
    let lost_refunds: Vec<_> = refunds
        .iter()
        .filter(|(told, _)| !stored.contains(&told.id))
        .collect();
    for (Told { key, .. }, payment) in &lost_refunds {
        let again = refund(&client, &bases[0], key, payment, &Mutex::new(Vec::new())).await;
        let counted = refunded_at_processor(&client, &processor.url).await;
        eprintln!(
            "{key}: lost with the old primary; retried: {}; refunds of {payment} at the \
             processor: {:?}",
            again.map_or("404, its payment lost too".to_owned(), |t| format!(
                "{} {}",
                if t.executed {
                    "ran again as"
                } else {
                    "replayed"
                },
                t.id
            )),
            counted.get(payment.as_str())
        );
        assert_eq!(
            counted.get(payment.as_str()),
            Some(&1),
            "{key} at the processor"
        );
    }
    // Every payment a client was told of is on the new primary, once, under the id it was
    // told; no other payment was made.
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT customer, id FROM payments")
        .fetch_all(&pool)
        .await
        .expect("the payments on the new primary");
    let mut paid: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (customer, id) in rows {
        paid.entry(customer).or_default().push(id);
    }
    let lost: Vec<&str> = told
        .iter()
        .filter(|t| paid.get(&t.key) != Some(&vec![t.id.clone()]))
        .map(|t| t.key.as_str())
        .collect();
    if !lost.is_empty() {
        // What a retry of each does now (asynchronous replication shows it: the key went with
        // the payment, so the retry pays again, under a new id).
        let mut retried = Vec::new();
        for key in &lost {
            let again = pay(&client, &bases[0], key, &Mutex::new(Vec::new())).await;
            let first = &told.iter().find(|t| t.key == *key).expect("told").id;
            retried.push(format!(
                "{key}: told {first}, retried: {} {}",
                if again.executed {
                    "paid again as"
                } else {
                    "replayed"
                },
                again.id
            ));
        }
        panic!(
            "{} of {} acknowledged payments are not on the new primary as acknowledged:\n{}",
            lost.len(),
            told.len(),
            retried.join("\n")
        );
    }
    assert_eq!(paid.len(), told.len(), "one payment per key, no other");
    // Every key replays its payment, at either service.
    for (i, Told { key, id, .. }) in told.iter().enumerate() {
        match post(&client, &bases[i % 2], key).await {
            Heard::Answer {
                status: StatusCode::CREATED,
                replayed: true,
                body,
                ..
            } => assert_eq!(body["id"].as_str(), Some(id.as_str()), "{key} replayed"),
            other => panic!("{key} did not replay: {other:?}"),
        }
    }
    let executed = told.iter().filter(|t| t.executed).count();
    eprintln!("{} refunds, each made once at the processor", refunds.len());
    eprintln!(
        "{} payments ({executed} acknowledged by their execution, {} by a replay after a lost \
         answer); {node}'s postmaster killed after {BEFORE}; the first payment acknowledged \
         {:?} after the kill; made after the kill per service: {:?}",
        told.len(),
        told.len() - executed,
        first_after.get(),
        made_after.lock().expect("made_after")
    );

    drop(services);
    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {database} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .expect("drop the test database");
}
