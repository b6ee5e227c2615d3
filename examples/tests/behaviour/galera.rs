//! Three `payments` processes, each on its own node of a three-node MariaDB Galera cluster, as
//! a service spread over data centres would run: nothing joins them but the cluster's rows.
//! Duplicates spread over them make one payment per key, every answer is the payment, its
//! replay or a 409 with `Retry-After`, and every retry replays; SIGKILL of one node while
//! payments flow loses no completed payment, and the services on the other nodes go on.
//!
//! The tests need the cluster of `scripts/galera up DIR` (`$GALERA_CLUSTER_DIR`): they are
//! ignored in the suite, and scripts/test runs them one at a time against a cluster of their
//! own.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

use crate::support::{Database, Process, spawn_payments_with, wait_until, wait_until_up};
use idem_tests::{GALERA_NODES, GaleraCluster};
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::MySqlPool;

/// One service per node, on a database of the test's own.
struct Services {
    cluster: GaleraCluster,
    database: String,
    /// Each node's service and its base URL, in node order.
    running: Vec<(Process, String)>,
}

impl Services {
    /// Starts a service at each node, one after the other: the first creates the database and
    /// its tables, and each node has them (a causal read) before its service starts there.
    async fn start(client: &Client, test: &str) -> Self {
        let cluster = GaleraCluster::from_env();
        let database = format!("idem_galera_{test}_{}", std::process::id());
        let mut running = Vec::new();
        for node in GALERA_NODES {
            cluster.caught_up(node).await;
            let at = Database::MySql {
                pool: MySqlPool::connect_lazy_with(cluster.options(node, "mysql")),
                url: cluster.database_url(node, &database),
            };
            let (process, base) = spawn_payments_with(&at, "http://127.0.0.1:9", &[]);
            wait_until_up(client, &format!("{base}/v1/payments")).await;
            running.push((process, base));
        }
        Self {
            cluster,
            database,
            running,
        }
    }

    fn base(&self, i: usize) -> &str {
        &self.running[i % self.running.len()].1
    }

    /// The payments at `node` (once it has applied what the cluster committed), per customer.
    async fn payments_at(&self, node: &str) -> BTreeMap<String, i64> {
        self.cluster.caught_up(node).await;
        let pool = MySqlPool::connect_with(self.cluster.options(node, &self.database))
            .await
            .unwrap_or_else(|e| panic!("connect to {node}: {e}"));
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT CONVERT(customer USING utf8mb4), COUNT(*) FROM payments GROUP BY customer",
        )
        .fetch_all(&pool)
        .await
        .unwrap_or_else(|e| panic!("count the payments at {node}: {e}"));
        pool.close().await;
        rows.into_iter().collect()
    }

    /// Stops the services and drops the database (from n1).
    async fn finish(self) {
        drop(self.running);
        let url = self.cluster.node_url("n1");
        idem_tests::MySqlDb::drop_named_on(&url, &self.database).await;
    }
}

fn payment(customer: &str) -> Value {
    json!({"amount": 1500, "currency": "usd", "customer": customer})
}

async fn post(client: &Client, base: &str, key: &str, body: &Value) -> Answer {
    let reply = client
        .post(format!("{base}/v1/payments"))
        .bearer_auth("t1")
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .expect("the service answers");
    Answer::of(reply).await
}

/// What a client heard.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: bool,
    body: String,
}

impl Answer {
    async fn of(reply: reqwest::Response) -> Self {
        let status = reply.status();
        let replayed = reply.headers().get("idempotent-replayed").is_some();
        let retry_after = reply.headers().contains_key("retry-after");
        let body = reply.text().await.expect("a body");
        Self {
            status,
            replayed,
            retry_after,
            body,
        }
    }

    fn executed(&self) -> bool {
        self.status == StatusCode::CREATED && !self.replayed
    }
}

/// Sends `key` to the service at `base` until it is not a 409 (each 409 with `Retry-After`).
async fn until_answered(client: &Client, base: &str, key: &str, body: &Value) -> Answer {
    let deadline = tokio::time::Instant::now() + idem_tests::DEADLINE;
    loop {
        let answer = post(client, base, key, body).await;
        if answer.status != StatusCode::CONFLICT {
            return answer;
        }
        assert!(
            answer.retry_after,
            "a 409 without Retry-After: {}",
            answer.body
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} still 409 at {base} after {:?}: {}",
            idem_tests::DEADLINE,
            answer.body
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
#[ignore = "needs the Galera cluster of scripts/galera (GALERA_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_duplicates_spread_over_three_nodes_make_one_payment_and_every_retry_replays_it() {
    const KEYS: usize = 12;
    const DUPLICATES: usize = 9;
    let client = Client::new();
    let services = Services::start(&client, "dup").await;

    let mut pending = Vec::new();
    for k in 0..KEYS {
        for d in 0..DUPLICATES {
            let (client, base) = (client.clone(), services.base(d).to_owned());
            pending.push(tokio::spawn(async move {
                let (key, customer) = (format!("key-{k}"), format!("cus_{k}"));
                (k, post(&client, &base, &key, &payment(&customer)).await)
            }));
        }
    }
    let mut executed: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let mut conflicts = 0;
    for reply in pending {
        let (k, answer) = reply.await.expect("request task");
        match answer.status {
            StatusCode::CREATED if !answer.replayed => {
                executed.entry(k).or_default().push(answer.body)
            }
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => {
                assert!(
                    answer.retry_after,
                    "a 409 without Retry-After: {}",
                    answer.body
                );
                conflicts += 1;
            }
            other => panic!(
                "key-{k}: {other}, not a payment, its replay or a 409: {}",
                answer.body
            ),
        }
    }
    for (k, bodies) in &executed {
        assert_eq!(
            bodies.len(),
            1,
            "key-{k} was executed more than once: {bodies:?}"
        );
    }
    eprintln!(
        "{} of {KEYS} keys answered with their payment in the first wave, {conflicts} answers were 409",
        executed.len()
    );

    // Every key, retried at every node, replays its one payment.
    for k in 0..KEYS {
        let (key, body) = (format!("key-{k}"), payment(&format!("cus_{k}")));
        let mut made = executed.get(&k).map(|bodies| bodies[0].clone());
        for node in 0..GALERA_NODES.len() {
            let answer = until_answered(&client, services.base(node), &key, &body).await;
            assert_eq!(answer.status, StatusCode::CREATED, "{key}: {}", answer.body);
            if answer.executed() {
                // Every request of the first wave was a 409: the retry made it.
                assert!(made.is_none(), "{key} was executed again by a retry");
                made = Some(answer.body);
                continue;
            }
            assert_eq!(
                Some(&answer.body),
                made.as_ref(),
                "{key}'s replay at node {node}"
            );
        }
    }
    for node in GALERA_NODES {
        let payments = services.payments_at(node).await;
        assert_eq!(
            payments.len(),
            KEYS,
            "one customer per key at {node}: {payments:?}"
        );
        assert!(
            payments.values().all(|&n| n == 1),
            "one payment per key at {node}: {payments:?}"
        );
    }
    services.finish().await;
}

#[tokio::test]
#[ignore = "needs the Galera cluster of scripts/galera (GALERA_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_a_node_killed_while_payments_flow_loses_no_completed_payment_and_the_others_go_on()
{
    const BEFORE: usize = 30;
    const AFTER: usize = 30;
    let client = Client::new();
    let services = Arc::new(Services::start(&client, "kill").await);
    let guard = GaleraCluster::from_env();
    let _restart = guard.restart_on_drop("n3");

    // Payments flow to each service, one after another under keys of their own, until
    // stopped: a service whose node is gone does not hold up the others.
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicBool::new(false));
    let made = Arc::new(AtomicUsize::new(0));
    let made_by_survivors = Arc::new(AtomicUsize::new(0));
    let flows: Vec<_> = (0..GALERA_NODES.len())
        .map(|node| {
            let (client, services) = (client.clone(), Arc::clone(&services));
            let (stop, killed, made, made_by_survivors) = (
                Arc::clone(&stop),
                Arc::clone(&killed),
                Arc::clone(&made),
                Arc::clone(&made_by_survivors),
            );
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let after_kill = killed.load(Ordering::SeqCst);
                    let key = format!("flow-{node}-{}", answers.len());
                    let answer = post(&client, services.base(node), &key, &payment(&key)).await;
                    if answer.executed() {
                        made.fetch_add(1, Ordering::SeqCst);
                        if after_kill && GALERA_NODES[node] != "n3" {
                            made_by_survivors.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    let refused = after_kill && answer.status != StatusCode::CREATED;
                    answers.push((key, answer));
                    if refused && GALERA_NODES[node] == "n3" {
                        // The killed node's service: one refusal shows it; no pile of keys to
                        // retry.
                        break;
                    }
                }
                answers
            })
        })
        .collect();

    wait_until(
        &format!("{BEFORE} payments made before the kill"),
        || async { made.load(Ordering::SeqCst) >= BEFORE },
    )
    .await;
    services.cluster.kill("n3").await;
    killed.store(true, Ordering::SeqCst);
    wait_until(
        &format!("{AFTER} payments made at the services on n1 and n2 after n3 was killed"),
        || async { made_by_survivors.load(Ordering::SeqCst) >= AFTER },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut answers = Vec::new();
    for flow in flows {
        answers.extend(flow.await.expect("a flow"));
    }

    // Every payment a client was told of is at both surviving nodes, once; every other key,
    // retried at a surviving node, is made once or replayed.
    let mut told = Vec::new();
    for (i, (key, answer)) in answers.iter().enumerate() {
        if answer.status == StatusCode::CREATED {
            assert!(!answer.replayed, "{key} was new: {}", answer.body);
            told.push(key.clone());
            continue;
        }
        let again = until_answered(&client, services.base(i % 2), key, &payment(key)).await;
        assert_eq!(
            again.status,
            StatusCode::CREATED,
            "{key} retried: {}",
            again.body
        );
    }
    for node in ["n1", "n2"] {
        let payments = services.payments_at(node).await;
        for key in &told {
            assert_eq!(payments.get(key), Some(&1), "{key}'s payment at {node}");
        }
        assert_eq!(
            payments.len(),
            answers.len(),
            "one payment per key at {node}"
        );
        assert!(
            payments.values().all(|&n| n == 1),
            "no key paid twice at {node}"
        );
    }
    eprintln!(
        "{} payments sent, {} answered 201 at once; the others were retried after n3 was killed",
        answers.len(),
        told.len()
    );

    services.cluster.restart("n3").await;
    let services = Arc::into_inner(services).expect("the flows are done");
    services.finish().await;
}
