//! The service's processes with their database or their broker behind a [`PartitionProxy`]: on
//! a freeze the link stops answering (bytes held, nothing refused or closed), as a network
//! partition would make it. While it lasts every request is answered 503 with `Retry-After`
//! within the contract's 15 s and the processes keep running; after the heal they recover by
//! themselves, retries complete each payment once, and the events flow, none lost or doubled.

use crate::support;

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use idem_tests::{BrokerKind, Cue, PartitionProxy, TestBroker, wait_within};
use reqwest::{Client, Response, StatusCode, header};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{Database, Process, free_addr, wait_until};
use tokio::task::JoinSet;

/// What the contract allows for any answer while the database or the broker does not answer,
/// and for the service to recover after the heal.
const WITHIN: Duration = Duration::from_secs(15);

/// The `host:port` and the rest of a PostgreSQL URL (`postgres://user@host:port/db?query`).
fn split_url(url: &str) -> (&str, &str, &str) {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let (user, rest) = match rest.split_once('@') {
        Some((user, rest)) => (&url[..scheme.len() + 3 + user.len() + 1], rest),
        None => (&url[..scheme.len() + 3], rest),
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    (user, &rest[..end], &rest[end..])
}

/// `database` as the service reaches it through `proxy` (without TLS, which the proxy cannot
/// read), and the address of the server itself, for the proxy.
fn behind(database: &Database, proxy: &PartitionProxy) -> Database {
    let Database::Postgres { pool, url } = database else {
        panic!("a partition is between a service and its PostgreSQL server");
    };
    let (before, _, after) = split_url(url);
    let separator = if after.contains('?') { '&' } else { '?' };
    Database::Postgres {
        pool: pool.clone(),
        url: format!(
            "{before}127.0.0.1:{}{after}{separator}sslmode=disable",
            proxy.port()
        ),
    }
}

/// A proxy in front of `database`'s PostgreSQL server.
async fn postgres_proxy(database: &Database) -> PartitionProxy {
    let Database::Postgres { url, .. } = database else {
        panic!("a partition is between a service and its PostgreSQL server");
    };
    PartitionProxy::postgres(split_url(url).1.to_owned()).await
}

/// Sends `request`, failing unless it is answered within [`WITHIN`].
async fn answered(what: &str, request: reqwest::RequestBuilder) -> Response {
    tokio::time::timeout(WITHIN, request.send())
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {WITHIN:?}"))
        .unwrap_or_else(|error| panic!("{what}: no answer: {error}"))
}

/// Checks that `answer` is a 503 problem with a `Retry-After` of at least a second.
fn assert_retry_later(what: &str, answer: &Response) {
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE, "{what}");
    let content_type = answer.headers().get(header::CONTENT_TYPE);
    assert_eq!(
        content_type.and_then(|value| value.to_str().ok()),
        Some("application/problem+json"),
        "{what}: a problem"
    );
    let retry_after = answer
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    assert!(
        retry_after.is_some_and(|seconds| seconds >= 1),
        "{what}: Retry-After in seconds, got {:?}",
        answer.headers().get(header::RETRY_AFTER)
    );
}

/// Starts the ledger's process on `database`, consuming `broker` at `amqp_url`, and waits until
/// it answers on `addr`.
async fn start_ledger(
    client: &Client,
    database: &Database,
    broker: &TestBroker,
    amqp_url: &str,
    addr: &str,
) -> Process {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ledger"));
    database.configure(&mut command);
    let child = command
        .env("EVENTS", "rabbitmq")
        .env("EVENTS_STREAM", broker.name())
        .env("AMQP_URL", amqp_url)
        .env("LEDGER_ADDR", addr)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start the ledger");
    support::wait_until_up(client, &format!("http://{addr}/v1/ledger")).await;
    Process(child)
}

/// Every `GET` route of the payments service, with an id where it takes one.
const READ_ROUTES: [&str; 9] = [
    "/v1/payments",
    "/v1/payments/pay_unknown",
    "/v1/payouts",
    "/v1/payouts/po_unknown",
    "/v1/refunds",
    "/v1/refunds/re_unknown",
    "/v1/orders",
    "/v1/orders/ord_unknown",
    "/v1/inventory/sku_1",
];

#[sqlx::test(migrations = false)]
async fn every_read_route_answers_503_with_retry_after_while_the_database_hangs(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let database = support::postgres(connect).await;
    let proxy = postgres_proxy(&database).await;
    let service_db = behind(&database, &proxy);
    let client = Client::new();
    let (mut payments, base) =
        support::start_payments(&client, &service_db, "http://127.0.0.1:9").await;
    let broker = TestBroker::new(BrokerKind::RabbitMq).used_by("ledger");
    let ledger_addr = free_addr();
    let mut ledger = start_ledger(
        &client,
        &service_db,
        &broker,
        &idem_tests::broker_url(BrokerKind::RabbitMq),
        &ledger_addr,
    )
    .await;
    let mut urls: Vec<String> = READ_ROUTES
        .iter()
        .map(|route| format!("{base}{route}"))
        .collect();
    urls.push(format!("http://{ledger_addr}/v1/ledger"));

    proxy.freeze();
    let mut reads = JoinSet::new();
    for url in &urls {
        let what = format!("GET {url}");
        let request = client.get(url).bearer_auth("t1");
        reads.spawn(async move { assert_retry_later(&what, &answered(&what, request).await) });
    }
    while let Some(read) = reads.join_next().await {
        read.expect("a read answered 503 in time");
    }
    assert!(
        payments.0.try_wait().expect("try_wait").is_none(),
        "payments runs"
    );
    assert!(
        ledger.0.try_wait().expect("try_wait").is_none(),
        "the ledger runs"
    );

    proxy.heal();
    // Every route answers as before (404 for the ids that do not exist), within 15 s of it.
    wait_within(
        WITHIN,
        "every read route to answer after the heal",
        || async {
            for url in &urls {
                let answer = client.get(url).bearer_auth("t1").send().await;
                if !answer.is_ok_and(|answer| {
                    matches!(answer.status(), StatusCode::OK | StatusCode::NOT_FOUND)
                }) {
                    return false;
                }
            }
            true
        },
    )
    .await;
}

#[sqlx::test(migrations = false)]
async fn a_read_whose_statement_hangs_closes_its_connection_instead_of_pooling_it(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let database = support::postgres(connect).await;
    let proxy = postgres_proxy(&database).await;
    let service_db = behind(&database, &proxy);
    let client = Client::new();
    let (_payments, base) =
        support::start_payments(&client, &service_db, "http://127.0.0.1:9").await;

    // The connection is had (its ping answered); the link stops as the SELECT goes out.
    proxy.freeze_at(Cue::statement("FROM payments"));
    let url = format!("{base}/v1/payments");
    let answer = answered("GET /v1/payments", client.get(&url).bearer_auth("t1")).await;
    assert_eq!(proxy.cued(), 1, "the freeze began at the read's statement");
    assert_retry_later("GET /v1/payments", &answer);
    // Closed by the service while the link is still frozen: not kept for another request.
    wait_until(
        "the service to close the connection of the read",
        || async { proxy.abandoned() >= 1 },
    )
    .await;

    proxy.heal();
    wait_within(
        WITHIN,
        "GET /v1/payments to answer 200 after the heal",
        || {
            let request = client.get(&url).bearer_auth("t1").send();
            async move {
                request
                    .await
                    .is_ok_and(|answer| answer.status() == StatusCode::OK)
            }
        },
    )
    .await;
}

/// The clients of the freeze test.
const CLIENTS: usize = 4;

/// `POST /v1/payments` under `key`, for the customer named by the key: each key's payment row
/// can be counted.
fn pay(client: &Client, base: &str, key: &str) -> reqwest::RequestBuilder {
    client
        .post(format!("{base}/v1/payments"))
        .bearer_auth("t1")
        .header("Idempotency-Key", key)
        .json(&serde_json::json!({"amount": 1000, "currency": "usd", "customer": key}))
}

/// The `type` of the problem `answer` carries.
async fn problem_type(answer: Response) -> String {
    let problem: serde_json::Value = answer.json().await.expect("a problem document");
    problem["type"].as_str().expect("a type").to_owned()
}

#[sqlx::test(migrations = false)]
async fn payments_answer_503_while_the_database_hangs_and_retries_pay_once_after_the_heal(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let database = support::postgres(connect).await;
    let proxy = postgres_proxy(&database).await;
    let service_db = behind(&database, &proxy);
    let clients: Vec<Client> = (0..CLIENTS).map(|_| Client::new()).collect();
    // No recovery pass: the COMMIT the freeze begins after is a payment's.
    let (mut service, base) = support::start_payments_with(
        &clients[0],
        &service_db,
        "http://127.0.0.1:9",
        &[("RECOVERY_EVERY", "0")],
    )
    .await;
    for (n, client) in clients.iter().enumerate() {
        let answer = answered("a payment", pay(client, &base, &format!("c{n}-before"))).await;
        assert_eq!(answer.status(), StatusCode::CREATED);
    }

    // The next COMMIT reaches the server and commits; its answer, and everything else, is held.
    // All four clients pay at once: one of them commits unanswered, the others hang wherever
    // they were; once the link is frozen, each one also reads its payments.
    proxy.freeze_after(Cue::commit());
    let mut requests = JoinSet::new();
    for (n, client) in clients.iter().enumerate() {
        let key = format!("c{n}-frozen");
        let request = pay(client, &base, &key);
        requests.spawn(async move {
            let what = format!("POST {key} during the freeze");
            let answer = answered(&what, request).await;
            assert_retry_later(&what, &answer);
            problem_type(answer).await
        });
    }
    wait_until("a payment's COMMIT to begin the freeze", || async {
        proxy.cued() == 1
    })
    .await;
    for client in &clients {
        let request = client.get(format!("{base}/v1/payments")).bearer_auth("t1");
        requests.spawn(async move {
            let what = "GET /v1/payments during the freeze";
            let answer = answered(what, request).await;
            assert_retry_later(what, &answer);
            problem_type(answer).await
        });
    }
    let problems = requests.join_all().await;
    // The one whose COMMIT went through cannot know it committed; one whose COMMIT was sent
    // into the frozen link cannot know it did not.
    let unknown = problems
        .iter()
        .filter(|t| t.ends_with("outcomeunknown"))
        .count();
    assert!(
        unknown >= 1,
        "the COMMIT let through is of unknown outcome: {problems:?}"
    );
    // Requests that arrive while it lasts are answered alike.
    let mut late = JoinSet::new();
    for (n, client) in clients.iter().enumerate() {
        let key = format!("c{n}-late");
        let request = pay(client, &base, &key);
        late.spawn(async move {
            let what = format!("POST {key} while frozen");
            assert_retry_later(&what, &answered(&what, request).await);
        });
        let request = client.get(format!("{base}/v1/payments")).bearer_auth("t1");
        late.spawn(async move {
            let what = "GET /v1/payments while frozen";
            assert_retry_later(what, &answered(what, request).await);
        });
    }
    late.join_all().await;
    assert!(
        service.0.try_wait().expect("try_wait").is_none(),
        "the service still runs"
    );

    // Each client retries its keys until they are paid: within 15 s of the heal.
    proxy.heal();
    let mut retries = JoinSet::new();
    for (n, client) in clients.iter().enumerate() {
        for key in [format!("c{n}-frozen"), format!("c{n}-late")] {
            let (client, base) = (client.clone(), base.clone());
            retries.spawn(async move {
                let paid = std::sync::Mutex::new(None);
                wait_within(
                    WITHIN,
                    &format!("{key} to be paid after the heal"),
                    || async {
                        let Ok(answer) = pay(&client, &base, &key).send().await else {
                            return false;
                        };
                        // Until then, 503 (the service reconnects) or 409 (a claim not yet freed).
                        let status = answer.status();
                        assert!(
                            matches!(
                                status,
                                StatusCode::CREATED
                                    | StatusCode::SERVICE_UNAVAILABLE
                                    | StatusCode::CONFLICT
                            ),
                            "{key}: {status}"
                        );
                        if status != StatusCode::CREATED {
                            return false;
                        }
                        let body: serde_json::Value = answer.json().await.expect("a payment");
                        *paid.lock().expect("paid") =
                            Some(body["id"].as_str().expect("id").to_owned());
                        true
                    },
                )
                .await;
                let id = paid.into_inner().expect("paid").expect("an id");
                (key, id)
            });
        }
    }
    let paid = retries.join_all().await;

    let Database::Postgres { pool, .. } = &database else {
        unreachable!("on PostgreSQL")
    };
    for (key, id) in &paid {
        let rows: Vec<String> = sqlx::query_scalar("SELECT id FROM payments WHERE customer = $1")
            .bind(key)
            .fetch_all(pool)
            .await
            .expect("the key's payments");
        assert_eq!(
            rows,
            std::slice::from_ref(id),
            "{key} paid exactly once, as answered"
        );
    }
    for (key, _) in &paid {
        assert_eq!(database.key_status(key).await, "completed", "{key}");
    }
    // A key is held by its transaction's advisory lock: none is left on the server.
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(pool)
    .await
    .expect("a count");
    assert_eq!(held, 0, "no key stays claimed");
    assert_eq!(database.count("payments").await, (CLIENTS * 3) as i64);
    assert!(
        service.0.try_wait().expect("try_wait").is_none(),
        "the service still runs"
    );
}

/// The payments the ledger must hold: the succeeded ones, by id.
async fn succeeded_payments(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT id FROM payments WHERE status = 'succeeded' ORDER BY id")
        .fetch_all(pool)
        .await
        .expect("the succeeded payments")
}

/// The payment of each ledger entry, by id, once per entry.
async fn ledger_payments(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT payment FROM ledger_entries ORDER BY payment")
        .fetch_all(pool)
        .await
        .expect("the ledger's entries")
}

/// Waits until the ledger holds one entry per succeeded payment, failing as soon as it holds
/// more (an event applied twice) or at the deadline.
async fn ledger_catches_up(pool: &sqlx::PgPool, what: &str) {
    let expected = succeeded_payments(pool).await;
    wait_until(what, || async {
        ledger_payments(pool).await.len() >= expected.len()
    })
    .await;
    assert_eq!(
        ledger_payments(pool).await,
        expected,
        "{what}: one ledger entry per succeeded payment"
    );
}

/// The payments service and the ledger on one PostgreSQL database, each reaching RabbitMQ
/// through a [`PartitionProxy`] of its own: a freeze stops both links, and each proxy's
/// counters are its process's alone.
struct BrokerRun {
    client: Client,
    pool: sqlx::PgPool,
    relay_link: PartitionProxy,
    ledger_link: PartitionProxy,
    service: Process,
    base: String,
    ledger: Process,
    ledger_addr: String,
    _broker: TestBroker,
}

impl BrokerRun {
    /// Starts the ledger, then the service relaying to it; `heartbeat` is the AMQP heartbeat
    /// both ask for, in seconds (the server's, 60 s, when `None`).
    async fn start(connect: PgConnectOptions, heartbeat: Option<u16>) -> Self {
        let database = support::postgres(connect).await;
        let Database::Postgres { pool, .. } = &database else {
            unreachable!("on PostgreSQL")
        };
        let pool = pool.clone();
        let broker = TestBroker::new(BrokerKind::RabbitMq).used_by("ledger");
        let relay_link = PartitionProxy::tcp(broker.address()).await;
        let ledger_link = PartitionProxy::tcp(broker.address()).await;
        let client = Client::new();
        // The ledger first: its queue is bound before the first event goes out.
        let ledger_addr = free_addr();
        let ledger_url = amqp_url(&ledger_link, heartbeat);
        let ledger = start_ledger(&client, &database, &broker, &ledger_url, &ledger_addr).await;
        let relay_url = amqp_url(&relay_link, heartbeat);
        let (service, base) = support::start_payments_with(
            &client,
            &database,
            "http://127.0.0.1:9",
            &[
                ("EVENTS", "rabbitmq"),
                ("EVENTS_STREAM", broker.name()),
                ("AMQP_URL", &relay_url),
                ("RECOVERY_EVERY", "0"),
            ],
        )
        .await;
        Self {
            client,
            pool,
            relay_link,
            ledger_link,
            service,
            base,
            ledger,
            ledger_addr,
            _broker: broker,
        }
    }

    fn freeze(&self) {
        self.relay_link.freeze();
        self.ledger_link.freeze();
    }

    fn heal(&self) {
        self.relay_link.heal();
        self.ledger_link.heal();
    }

    /// Pays under the keys `h<n>`, `n` in `keys`: each answered 201 within 15 s.
    async fn pay(&self, keys: std::ops::Range<usize>) {
        for n in keys {
            let key = format!("h{n}");
            let answer =
                answered(&format!("POST {key}"), pay(&self.client, &self.base, &key)).await;
            assert_eq!(answer.status(), StatusCode::CREATED, "{key}");
        }
    }

    fn assert_running(&mut self) {
        assert!(
            self.service.0.try_wait().expect("try_wait").is_none(),
            "payments runs"
        );
        assert!(
            self.ledger.0.try_wait().expect("try_wait").is_none(),
            "the ledger runs"
        );
    }

    /// `idem_messages_total` of the ledger's consumer for `outcome`, from its `/metrics`.
    async fn ledger_messages(&self, outcome: &str) -> u64 {
        let text = self
            .client
            .get(format!("http://{}/metrics", self.ledger_addr))
            .send()
            .await
            .expect("the ledger's metrics")
            .text()
            .await
            .expect("text");
        let label = format!("outcome=\"{outcome}\"");
        text.lines()
            .filter(|line| line.starts_with("idem_messages_total{") && line.contains(&label))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|count| count as u64)
            .sum()
    }
}

/// `$AMQP_URL` through `link`, asking for `heartbeat` seconds between heartbeats.
fn amqp_url(link: &PartitionProxy, heartbeat: Option<u16>) -> String {
    let mut url =
        reqwest::Url::parse(&idem_tests::broker_url(BrokerKind::RabbitMq)).expect("a broker URL");
    url.set_host(Some("127.0.0.1")).expect("a host");
    url.set_port(Some(link.port())).expect("a port");
    if let Some(seconds) = heartbeat {
        url.set_query(Some(&format!("heartbeat={seconds}")));
    }
    url.to_string()
}

#[sqlx::test(migrations = false)]
async fn payments_are_served_while_the_broker_hangs_and_every_event_reaches_the_ledger_once(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let mut run = BrokerRun::start(connect, None).await;
    run.pay(0..3).await;
    ledger_catches_up(&run.pool, "the first events to reach the ledger").await;

    // The broker stops answering: payments are made as usual, their events wait.
    run.freeze();
    run.pay(3..9).await;
    wait_until("the relay to publish into the frozen link", || async {
        run.relay_link.held_messages() > 0
    })
    .await;
    assert_eq!(
        ledger_payments(&run.pool).await.len(),
        3,
        "nothing crosses the freeze"
    );
    run.assert_running();

    run.heal();
    run.pay(9..12).await;
    assert_eq!(succeeded_payments(&run.pool).await.len(), 12);
    ledger_catches_up(&run.pool, "every event to reach the ledger after the heal").await;
    run.assert_running();
}

#[sqlx::test(migrations = false)]
async fn after_a_broker_freeze_past_the_heartbeat_an_event_whose_ack_was_lost_is_applied_once(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // Heartbeats every 2 s: a freeze outlasts them, and both processes give their link up.
    let mut run = BrokerRun::start(connect, Some(2)).await;
    let pool = run.pool.clone();
    run.pay(0..3).await;
    ledger_catches_up(&pool, "the first events to reach the ledger").await;

    // The ledger's next event waits on a lock the test holds, inside its transaction; the
    // broker freezes; the event commits, and its acknowledgement is caught in the freeze.
    let mut lock = pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE ledger_balances IN EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .expect("lock the balances");
    run.pay(3..4).await;
    wait_until("the ledger to wait for the balances' lock", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks WHERE relation = 'ledger_balances'::regclass \
             AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&pool)
        .await
        .expect("a count")
            > 0
    })
    .await;
    run.freeze();
    lock.commit().await.expect("release the balances");
    wait_until("the ledger to commit the event", || async {
        ledger_payments(&pool).await.len() == 4
    })
    .await;

    // Payments go on. Each process gives its connection up (the first a link sees closed while
    // frozen is the one it had: a new one is tried only after) and tries new ones.
    run.pay(4..8).await;
    wait_until(
        "the relay and the ledger to give their connections up",
        || async { run.relay_link.abandoned() >= 1 && run.ledger_link.abandoned() >= 1 },
    )
    .await;
    run.assert_running();

    run.heal();
    run.pay(8..10).await;
    assert_eq!(succeeded_payments(&pool).await.len(), 10);
    ledger_catches_up(&pool, "every event to reach the ledger after the heal").await;
    // The event whose acknowledgement was lost came again, and was skipped.
    wait_until("the ledger to skip the event delivered again", || async {
        run.ledger_messages("duplicate").await >= 1
    })
    .await;
    run.assert_running();
}
