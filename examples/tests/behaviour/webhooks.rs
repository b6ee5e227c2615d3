//! The payments service's webhook receiver, `POST /v1/webhooks/processor`, as a real process on
//! each database: deliveries signed as Standard Webhooks v1 specifies (with the
//! `standardwebhooks` crate, as a sender would), their `webhook-id` the idempotency key.
//! A redelivery is replayed and credits once; a delivery while the first of its id runs is
//! 409; another body under a delivered id is 422; a missing or malformed id is 400; a
//! signature that does not verify is 401 and leaves nothing behind; other event types are
//! acknowledged and not applied; and the simulated processor's own deliveries, redelivered
//! after a timeout and after a lost answer, then replayed on purpose, credit once, and so do
//! the two binaries run side by side, as the README runs them. Also: both binaries refuse a
//! malformed `WEBHOOK_SECRET` at start. Deliveries over two processes, to a process killed
//! mid-delivery, beside a tenant using their ids and beside forged ones: [`processes`].

mod processes;

use std::sync::{Arc, Mutex};

use crate::support::{self, Database, Process, on_every_database, start_payments, wait_until};

use idem_examples::{
    processor_webhooks::{Delivery, WebhookSender},
    webhook_secret::{DEFAULT_SECRET, WebhookSecret},
};
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};
use sqlx::{Postgres, Transaction, pool::PoolConnection};

on_every_database!(
    a_redelivery_is_replayed_and_credits_once,
    a_delivery_while_the_first_of_its_id_runs_is_409_with_retry_after,
    another_body_under_a_delivered_id_is_422,
    a_missing_or_malformed_webhook_id_is_400,
    a_bad_missing_or_stale_signature_is_401_and_the_genuine_delivery_then_credits_once,
    other_event_types_are_acknowledged_and_not_applied,
    a_credit_without_a_tenant_or_a_positive_amount_is_400,
    the_processors_redeliveries_and_replays_credit_once,
    the_processor_binary_and_the_payments_binary_close_the_loop,
);

/// How far from the server's clock a timestamp may be (Standard Webhooks: 5 minutes).
const TOLERANCE_SECS: i64 = 5 * 60;

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
        .try_into()
        .expect("a timestamp")
}

/// The `webhook-signature` of `body` sent as `id` at `timestamp`, with `secret`.
fn signature(secret: &str, id: &str, timestamp: i64, body: &str) -> String {
    standardwebhooks::Webhook::new(secret)
        .expect("a secret")
        .sign(id, timestamp, body.as_bytes())
        .expect("a signature")
}

fn credit(tenant: &str, amount: i64) -> String {
    json!({"type": "balance.credited", "data": {"tenant": tenant, "amount": amount}}).to_string()
}

/// One delivery to the receiver: its headers as a sender sets them (`None`: left out).
struct Webhook<'a> {
    id: Option<&'a str>,
    timestamp: Option<i64>,
    signature: Option<String>,
    body: String,
}

impl<'a> Webhook<'a> {
    /// A delivery of `body` as `id`, signed now with the service's secret.
    fn signed(id: &'a str, body: String) -> Self {
        let timestamp = now();
        Self {
            id: Some(id),
            timestamp: Some(timestamp),
            signature: Some(signature(DEFAULT_SECRET, id, timestamp, &body)),
            body,
        }
    }

    async fn send(&self, client: &Client, base: &str) -> Response {
        self.try_send(client, base)
            .await
            .expect("the service answers")
    }

    /// [`Webhook::send`], for a test in which the service may die before it answers.
    async fn try_send(&self, client: &Client, base: &str) -> reqwest::Result<Response> {
        let mut request = client
            .post(format!("{base}/v1/webhooks/processor"))
            .header("content-type", "application/json")
            .body(self.body.clone());
        if let Some(id) = self.id {
            request = request.header("webhook-id", id);
        }
        if let Some(timestamp) = self.timestamp {
            request = request.header("webhook-timestamp", timestamp.to_string());
        }
        if let Some(signature) = &self.signature {
            request = request.header("webhook-signature", signature);
        }
        request.send().await
    }
}

/// `(balance, credits)` of `tenant`, through `GET /v1/balance`.
async fn balance(client: &Client, base: &str, tenant: &str) -> (i64, i64) {
    let answer = client
        .get(format!("{base}/v1/balance"))
        .bearer_auth(tenant)
        .send()
        .await
        .expect("the service answers");
    assert_eq!(answer.status(), StatusCode::OK);
    let body: Value = answer.json().await.expect("JSON");
    (
        body["balance"].as_i64().expect("a balance"),
        body["credits"].as_i64().expect("a count"),
    )
}

/// The service on `database`; it calls no processor here.
async fn service(client: &Client, database: &Database) -> (Process, String) {
    start_payments(client, database, "http://127.0.0.1:9").await
}

fn is_problem(answer: &Response) -> bool {
    answer.headers()["content-type"] == "application/problem+json"
}

async fn a_redelivery_is_replayed_and_credits_once(database: Database) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;
    assert_eq!(
        balance(&client, &base, "t1").await,
        (0, 0),
        "never credited"
    );

    let first = Webhook::signed("msg_1", credit("t1", 500))
        .send(&client, &base)
        .await;
    assert_eq!(first.status(), StatusCode::OK);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.unwrap();
    assert_eq!(first, json!({"credited": 500}));

    // A sender signs each attempt anew: another timestamp, another signature, the same bytes.
    let mut again = Webhook::signed("msg_1", credit("t1", 500));
    again.timestamp = Some(now() - 60);
    again.signature = Some(signature(
        DEFAULT_SECRET,
        "msg_1",
        now() - 60,
        &credit("t1", 500),
    ));
    let again = again.send(&client, &base).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first);

    assert_eq!(
        balance(&client, &base, "t1").await,
        (500, 1),
        "credited once"
    );
    assert_eq!(database.count("balance_credits").await, 1);
    assert_eq!(balance(&client, &base, "t2").await, (0, 0));
}

/// What the test holds so that a delivery, once it has the key, waits in the database until
/// the test lets it go.
enum Blocker {
    /// A transaction holding `LOCK TABLE balance_credits IN EXCLUSIVE MODE`: the credit's
    /// `INSERT` waits, its key claimed.
    Postgres(Transaction<'static, Postgres>),
    /// A connection holding `LOCK TABLES balance_credits WRITE`: likewise.
    MySql(PoolConnection<sqlx::MySql>),
    /// A connection holding SQLite's write lock (`BEGIN IMMEDIATE`): the claim itself waits for
    /// it, the key held in the service's process all the same.
    Sqlite(PoolConnection<sqlx::Sqlite>),
}

impl Blocker {
    async fn hold(database: &Database) -> Self {
        match database {
            Database::Postgres { pool, .. } => {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("LOCK TABLE balance_credits IN EXCLUSIVE MODE")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                Self::Postgres(tx)
            }
            Database::MySql { pool, .. } => {
                let mut locked = pool.acquire().await.unwrap();
                sqlx::raw_sql("LOCK TABLES balance_credits WRITE")
                    .execute(&mut *locked)
                    .await
                    .unwrap();
                Self::MySql(locked)
            }
            Database::Sqlite { pool, .. } => {
                let mut locked = pool.acquire().await.unwrap();
                sqlx::raw_sql("BEGIN IMMEDIATE")
                    .execute(&mut *locked)
                    .await
                    .unwrap();
                Self::Sqlite(locked)
            }
        }
    }

    async fn release(self) {
        match self {
            Self::Postgres(tx) => tx.commit().await.unwrap(),
            Self::MySql(mut locked) => {
                sqlx::raw_sql("UNLOCK TABLES")
                    .execute(&mut *locked)
                    .await
                    .unwrap();
            }
            Self::Sqlite(mut locked) => {
                sqlx::raw_sql("ROLLBACK")
                    .execute(&mut *locked)
                    .await
                    .unwrap();
            }
        }
    }
}

async fn a_delivery_while_the_first_of_its_id_runs_is_409_with_retry_after(database: Database) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;
    let blocker = Blocker::hold(&database).await;

    // Two deliveries of one id at once: the one that takes the key waits on the test's lock,
    // so the other certainly arrives while the key is held, whichever comes first.
    let send = || {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            Webhook::signed("msg_1", credit("t1", 700))
                .send(&client, &base)
                .await
        })
    };
    let deliveries = [send(), send()];
    wait_until("one of two deliveries of an id to be answered", || {
        std::future::ready(deliveries.iter().any(tokio::task::JoinHandle::is_finished))
    })
    .await;
    let refused_first = deliveries[0].is_finished();
    let [a, b] = deliveries;
    let (refused, running) = if refused_first { (a, b) } else { (b, a) };
    let refused = refused.await.unwrap();
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    assert!(is_problem(&refused));
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After in seconds");
    assert!(retry_after >= 1, "Retry-After: {retry_after}");
    assert!(
        !running.is_finished(),
        "the first is still held by the test"
    );

    blocker.release().await;
    let running = running.await.unwrap();
    assert_eq!(running.status(), StatusCode::OK);
    assert_eq!(
        running.json::<Value>().await.unwrap(),
        json!({"credited": 700})
    );
    assert_eq!(balance(&client, &base, "t1").await, (700, 1));

    // The refused delivery, sent again, is now replayed.
    let again = Webhook::signed("msg_1", credit("t1", 700))
        .send(&client, &base)
        .await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(balance(&client, &base, "t1").await, (700, 1));
}

async fn another_body_under_a_delivered_id_is_422(database: Database) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;
    let first = Webhook::signed("msg_1", credit("t1", 300))
        .send(&client, &base)
        .await;
    assert_eq!(first.status(), StatusCode::OK);

    for body in [
        credit("t1", 301),
        credit("t2", 300),
        json!({"type": "refund.succeeded", "data": {}}).to_string(),
    ] {
        let other = Webhook::signed("msg_1", body.clone())
            .send(&client, &base)
            .await;
        assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(is_problem(&other));
    }
    assert_eq!(balance(&client, &base, "t1").await, (300, 1));
    assert_eq!(balance(&client, &base, "t2").await, (0, 0));
}

async fn a_missing_or_malformed_webhook_id_is_400(database: Database) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;
    let long = "m".repeat(256);
    // Each is signed over the id it carries: the refusal is the key's, not the signature's.
    for id in [
        None,
        Some(""),
        Some("msg 1"),
        Some(long.as_str()),
        Some("msg_é"),
    ] {
        let body = credit("t1", 100);
        let timestamp = now();
        let webhook = Webhook {
            id,
            timestamp: Some(timestamp),
            signature: Some(signature(
                DEFAULT_SECRET,
                id.unwrap_or_default(),
                timestamp,
                &body,
            )),
            body,
        };
        let answer = webhook.send(&client, &base).await;
        assert_eq!(answer.status(), StatusCode::BAD_REQUEST, "{id:?}");
        assert!(is_problem(&answer), "{id:?}");
    }
    assert_eq!(database.count("idem_keys").await, 0);
    assert_eq!(balance(&client, &base, "t1").await, (0, 0));
}

async fn a_bad_missing_or_stale_signature_is_401_and_the_genuine_delivery_then_credits_once(
    database: Database,
) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;
    let body = credit("t1", 900);
    let other_secret = "whsec_b3RoZXItc2VjcmV0";
    let stale = now() - TOLERANCE_SECS - 60;
    let ahead = now() + TOLERANCE_SECS + 60;
    let forged = [
        (
            "another secret",
            Some(now()),
            Some(signature(other_secret, "msg_1", now(), &body)),
        ),
        (
            "another body",
            Some(now()),
            Some(signature(DEFAULT_SECRET, "msg_1", now(), &credit("t1", 1))),
        ),
        (
            "another id",
            Some(now()),
            Some(signature(DEFAULT_SECRET, "msg_2", now(), &body)),
        ),
        ("no signature", Some(now()), None),
        (
            "not a v1 signature",
            Some(now()),
            Some("v2,AAAA".to_owned()),
        ),
        (
            "no timestamp",
            None,
            Some(signature(DEFAULT_SECRET, "msg_1", now(), &body)),
        ),
        (
            "a stale timestamp",
            Some(stale),
            Some(signature(DEFAULT_SECRET, "msg_1", stale, &body)),
        ),
        (
            "a timestamp ahead",
            Some(ahead),
            Some(signature(DEFAULT_SECRET, "msg_1", ahead, &body)),
        ),
    ];
    for (what, timestamp, signature) in forged {
        let answer = Webhook {
            id: Some("msg_1"),
            timestamp,
            signature,
            body: body.clone(),
        }
        .send(&client, &base)
        .await;
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{what}");
        assert!(is_problem(&answer), "{what}");
        assert!(
            answer.headers().get("www-authenticate").is_none(),
            "{what}: no bearer challenge for a webhook"
        );
        assert_eq!(
            database.count("idem_keys").await,
            0,
            "{what}: nothing stored"
        );
    }
    assert_eq!(balance(&client, &base, "t1").await, (0, 0));

    let genuine = Webhook::signed("msg_1", body).send(&client, &base).await;
    assert_eq!(genuine.status(), StatusCode::OK);
    assert!(genuine.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        genuine.json::<Value>().await.unwrap(),
        json!({"credited": 900})
    );
    assert_eq!(balance(&client, &base, "t1").await, (900, 1));
}

async fn other_event_types_are_acknowledged_and_not_applied(database: Database) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;
    for (id, body) in [
        (
            "msg_1",
            json!({"type": "refund.succeeded", "data": {"tenant": "t1", "amount": 5}}),
        ),
        ("msg_2", json!({"type": "balance.debited", "data": {}})),
        ("msg_3", json!({"type": "balance.credited.v2"})),
    ] {
        let body = body.to_string();
        let first = Webhook::signed(id, body.clone()).send(&client, &base).await;
        assert_eq!(first.status(), StatusCode::OK, "{body}");
        assert_eq!(
            first.json::<Value>().await.unwrap(),
            json!({"ignored": true})
        );
        let again = Webhook::signed(id, body).send(&client, &base).await;
        assert_eq!(again.headers()["idempotent-replayed"], "true");
    }
    assert_eq!(balance(&client, &base, "t1").await, (0, 0));
    assert_eq!(database.count("balance_credits").await, 0);
}

async fn a_credit_without_a_tenant_or_a_positive_amount_is_400(database: Database) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;
    for (id, data) in [
        ("msg_1", json!({"amount": 5})),
        ("msg_2", json!({"tenant": "t1"})),
        ("msg_3", json!({"tenant": "t1", "amount": 0})),
        ("msg_4", json!({"tenant": "t1", "amount": -5})),
        ("msg_5", json!({"tenant": "t1", "amount": 2.5})),
        ("msg_6", json!({"tenant": "t1", "amount": "5"})),
    ] {
        let body = json!({"type": "balance.credited", "data": data}).to_string();
        let answer = Webhook::signed(id, body.clone()).send(&client, &base).await;
        assert_eq!(answer.status(), StatusCode::BAD_REQUEST, "{body}");
        assert!(is_problem(&answer), "{body}");
    }
    // A body that is not JSON at all, signed: 400 as well.
    let answer = Webhook::signed("msg_7", "not json".to_owned())
        .send(&client, &base)
        .await;
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    assert!(is_problem(&answer));
    assert_eq!(balance(&client, &base, "t1").await, (0, 0));
}

/// What the receiver answered each attempt the proxy passed on: its status and whether it was
/// a replay.
type Answers = Arc<Mutex<Vec<(StatusCode, bool)>>>;

/// The processor's webhooks so far, as `GET /v1/webhooks/deliveries` lists them.
async fn deliveries(client: &Client, processor: &str) -> Vec<Delivery> {
    client
        .get(format!("{processor}/v1/webhooks/deliveries"))
        .send()
        .await
        .expect("the processor answers")
        .json()
        .await
        .expect("a JSON list")
}

/// Passes `request` on to `receiver`; what it answered, noted in `answers`.
async fn forward(receiver: &str, request: axum::extract::Request, answers: &Answers) -> u16 {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let mut forwarded = Client::new().post(receiver).body(body);
    for (name, value) in &parts.headers {
        if name != "host" && name != "content-length" {
            forwarded = forwarded.header(name, value);
        }
    }
    let answer = forwarded.send().await.expect("the receiver answers");
    let replayed = answer.headers().contains_key("idempotent-replayed");
    answers.lock().unwrap().push((answer.status(), replayed));
    answer.status().as_u16()
}

/// A proxy between the processor at `processor` and the receiver that loses the receiver's
/// first two answers, as a network would after the receiver committed: the first it holds
/// until the processor has given up waiting for it (its attempt timed out), the second it
/// turns into a 500; later ones pass. Every delivery reaches the receiver, each only once the
/// one before has been answered there. Returns its URL and what the receiver answered.
async fn losing_two_answers(receiver: String, processor: String) -> (String, Answers) {
    let answers = Answers::default();
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (first_answered, answered) = tokio::sync::watch::channel(false);
    let first_answered = Arc::new(first_answered);
    let router = {
        let answers = Arc::clone(&answers);
        axum::Router::new().fallback(move |request: axum::extract::Request| {
            let (answers, receiver, processor) =
                (Arc::clone(&answers), receiver.clone(), processor.clone());
            let (seen, first_answered, mut answered) = (
                Arc::clone(&seen),
                Arc::clone(&first_answered),
                answered.clone(),
            );
            async move {
                let attempt = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                if attempt == 1 {
                    // In a task of its own: it goes on after the processor hangs up.
                    tokio::spawn(async move {
                        forward(&receiver, request, &answers).await;
                        first_answered.send_replace(true);
                    });
                    wait_until("the processor's first attempt to time out", || async {
                        deliveries(&Client::new(), &processor)
                            .await
                            .first()
                            .is_some_and(|delivery| delivery.attempts.first() == Some(&0))
                    })
                    .await;
                    return axum::http::StatusCode::OK;
                }
                answered.wait_for(|done| *done).await.unwrap();
                let status = forward(&receiver, request, &answers).await;
                if attempt == 2 {
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    axum::http::StatusCode::from_u16(status).unwrap()
                }
            }
        })
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (url, answers)
}

async fn the_processors_redeliveries_and_replays_credit_once(database: Database) {
    let client = Client::new();
    // The processor's address is taken first, for the service; the service's receiver, behind
    // the proxy, is then given to the processor's webhooks.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let processor = format!("http://{}", listener.local_addr().unwrap());
    let (_service, base) = start_payments(&client, &database, &processor).await;
    let (proxy, answers) =
        losing_two_answers(format!("{base}/v1/webhooks/processor"), processor.clone()).await;
    let sender = WebhookSender::to(proxy, WebhookSecret::default())
        .with_attempt_timeout(std::time::Duration::from_millis(300))
        .delivering_twice(true);
    let router = idem_examples::processor::router_with(sender);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    // An order: the processor charges t1 3 × 1000 and sends `balance.credited` for it.
    let order = client
        .post(format!("{base}/v1/orders"))
        .bearer_auth("t1")
        .header("Idempotency-Key", "order-1")
        .json(&json!({"sku": "sku-1", "quantity": 3, "customer": "cus_1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(order.status(), StatusCode::CREATED);

    wait_until(
        "the processor to deliver its webhook after a timeout and a lost answer, and once more",
        || async {
            deliveries(&client, &processor)
                .await
                .first()
                .is_some_and(|delivery| delivery.attempts.len() == 4)
        },
    )
    .await;
    let delivered = deliveries(&client, &processor).await;
    assert_eq!(delivered.len(), 1, "one event: {delivered:?}");
    let delivery = &delivered[0];
    assert_eq!(delivery.kind, "balance.credited");
    assert!(delivery.delivered);
    assert_eq!(
        delivery.attempts,
        [0, 500, 200, 200],
        "timed out, answer lost, delivered, then the replay on purpose"
    );
    let answers = answers.lock().unwrap().clone();
    assert_eq!(
        answers,
        [
            (StatusCode::OK, false),
            (StatusCode::OK, true),
            (StatusCode::OK, true),
            (StatusCode::OK, true)
        ],
        "the receiver applied the event once and replayed it to every later attempt"
    );
    assert_eq!(balance(&client, &base, "t1").await, (3000, 1));
}

/// The two binaries as the README runs them, the processor given `WEBHOOK_URL` and
/// `WEBHOOK_DELIVER_TWICE=1`: an order's charge credits the ordering tenant once, a refund's
/// `refund.succeeded` is acknowledged and ignored, and every event, delivered twice, is
/// answered 200 both times.
async fn the_processor_binary_and_the_payments_binary_close_the_loop(database: Database) {
    let client = Client::new();
    let processor_addr = support::free_addr();
    let processor = format!("http://{processor_addr}");
    let (_service, base) = start_payments(&client, &database, &processor).await;
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_processor"))
        .env("PROCESSOR_ADDR", &processor_addr)
        .env("WEBHOOK_URL", format!("{base}/v1/webhooks/processor"))
        .env("WEBHOOK_DELIVER_TWICE", "1")
        .env_remove("WEBHOOK_SECRET")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start the processor");
    let _processor = Process(child);
    wait_until("the processor to answer", || async {
        client
            .get(format!("{processor}/v1/charges"))
            .send()
            .await
            .is_ok()
    })
    .await;

    let order = client
        .post(format!("{base}/v1/orders"))
        .bearer_auth("t1")
        .header("Idempotency-Key", "order-1")
        .json(&json!({"sku": "sku-1", "quantity": 2, "customer": "cus_1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(order.status(), StatusCode::CREATED);
    let payment = support::paid(&client, &base, "pay-1", 900).await;
    let refund = client
        .post(format!("{base}/v1/refunds"))
        .bearer_auth("t1")
        .header("Idempotency-Key", "refund-1")
        .json(&json!({"payment": payment["id"], "amount": 300}))
        .send()
        .await
        .unwrap();
    assert_eq!(refund.status(), StatusCode::CREATED);

    wait_until("both events to be delivered twice", || async {
        let sent = deliveries(&client, &processor).await;
        sent.len() == 2 && sent.iter().all(|delivery| delivery.attempts.len() == 2)
    })
    .await;
    let sent = deliveries(&client, &processor).await;
    let kinds: Vec<&str> = sent.iter().map(|delivery| delivery.kind.as_str()).collect();
    assert_eq!(kinds, ["balance.credited", "refund.succeeded"]);
    for delivery in &sent {
        assert_eq!(delivery.attempts, [200, 200], "{delivery:?}");
    }
    assert_eq!(balance(&client, &base, "t1").await, (2000, 1));
}

/// Both binaries refuse, at start, a secret that is not `whsec_<base64>`, naming the variable
/// and the form it takes: a typo does not run with a key nobody else has.
#[tokio::test]
async fn both_binaries_refuse_at_start_a_malformed_webhook_secret() {
    for binary in [
        env!("CARGO_BIN_EXE_payments"),
        env!("CARGO_BIN_EXE_processor"),
    ] {
        for value in ["aWRlbQ==", "whsec_", "whsec_not base64!"] {
            let (code, stderr) = support::exit_at_start(binary, &[("WEBHOOK_SECRET", value)]).await;
            assert_eq!(code, Some(1), "{binary} {value:?}: {stderr}");
            assert!(
                stderr.contains("WEBHOOK_SECRET") && stderr.contains("whsec_"),
                "{binary} {value:?}: the refusal names the variable and its form: {stderr}"
            );
        }
    }
}
