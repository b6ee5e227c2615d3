//! Real processes: `POST /v1/orders` in a `payments` binary that aborts (`$CRASH_AFTER`) right
//! after one of its steps, then a new process and a retry. Whatever the crash point, once the
//! retry has its 201 the stock went down once, the processor holds one charge, and there is one
//! order. Also: two retries racing after a crash, and the recovery task settling an order whose
//! client never came back. The processor runs in the test process, where it counts the charge
//! requests it is sent and can hold its first answer (`support::Processor`).

use crate::support;

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{Database, Process, Processor, start_payments, start_payments_with, wait_until};

const KEY: &str = "order-1";
const QUANTITY: i64 = 3;

/// Charge requests the processor received.
fn charge_requests(processor: &Processor) -> usize {
    processor.keys("/v1/charges").len()
}

async fn charges(client: &Client, processor: &Processor) -> Vec<Value> {
    get(client, &format!("{}/v1/charges", processor.url)).await
}

async fn get<T: serde::de::DeserializeOwned>(client: &Client, url: &str) -> T {
    client
        .get(url)
        .bearer_auth("t1")
        .send()
        .await
        .expect("an answer")
        .json()
        .await
        .expect("JSON")
}

async fn send_order(client: &Client, base: &str) -> reqwest::Result<reqwest::Response> {
    client
        .post(format!("{base}/v1/orders"))
        .bearer_auth("t1")
        .header("Idempotency-Key", KEY)
        .json(&json!({"sku": "sku-1", "quantity": QUANTITY, "customer": "cus_1"}))
        .send()
        .await
}

/// Sends the order to a service that aborts after `point`; returns once the process is gone.
async fn crash_at(client: &Client, database: &Database, processor: &Processor, point: &str) {
    let (mut crashing, base) =
        start_payments_with(client, database, &processor.url, &[("CRASH_AFTER", point)]).await;
    let answer = send_order(client, &base).await;
    assert!(answer.is_err(), "the process died mid-request: {answer:?}");
    let status = crashing.0.wait().expect("reap");
    assert!(!status.success(), "aborted: {status:?}");
    assert_eq!(database.key_status(KEY).await, "started");
}

/// A new process without a recovery task (`RECOVERY_EVERY=0`), so that only the test's retry
/// can take the crashed claim over once the test ends its lease.
async fn restart(client: &Client, database: &Database, processor: &Processor) -> (Process, String) {
    start_payments_with(client, database, &processor.url, &[("RECOVERY_EVERY", "0")]).await
}

/// After the retry's 201: the stock went down once, one charge, one order, and a replay.
async fn assert_one_order(client: &Client, base: &str, processor: &Processor, retry: Value) {
    let stock: Value = get(client, &format!("{base}/v1/inventory/sku-1")).await;
    assert_eq!(stock["stock"], 100 - QUANTITY, "the stock went down once");
    let charges = charges(client, processor).await;
    assert_eq!(charges.len(), 1, "one charge: {charges:?}");
    let orders: Vec<Value> = get(client, &format!("{base}/v1/orders")).await;
    assert_eq!(orders.len(), 1, "one order: {orders:?}");
    assert_eq!(orders[0], retry);
    assert_eq!(retry["charge"], charges[0]["id"]);
    assert_eq!(retry["amount"], QUANTITY * 1000);
    assert_eq!(retry["status"], "confirmed");
    let replay = send_order(client, base).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.json::<Value>().await.unwrap(), retry);
}

/// Crash after `point`, restart, retry: one of everything; `calls` charge requests in all.
async fn crash_then_retry(database: Database, point: &str, calls: usize) {
    let client = Client::new();
    let processor = Processor::start(None).await;
    crash_at(&client, &database, &processor, point).await;

    let (_payments, base) = restart(&client, &database, &processor).await;
    database.lease_ends_in(KEY, -1).await;
    let retry = send_order(&client, &base).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    let retry: Value = retry.json().await.unwrap();
    assert_one_order(&client, &base, &processor, retry).await;
    assert_eq!(charge_requests(&processor), calls, "charge requests");
    let keys = processor.keys("/v1/charges");
    assert!(
        keys.windows(2).all(|pair| pair[0] == pair[1]),
        "every charge request carried the same derived key: {keys:?}"
    );
}

macro_rules! crash_points {
    ($($point:literal: $postgres:ident, $sqlite:ident, $mysql:ident, $calls:literal;)*) => {$(
        #[sqlx::test(migrations = false)]
        async fn $postgres(_: PgPoolOptions, connect: PgConnectOptions) {
            crash_then_retry(support::postgres(connect).await, $point, $calls).await;
        }

        #[tokio::test]
        async fn $sqlite() {
            let dir = tempfile::tempdir().expect("a temporary directory");
            crash_then_retry(support::sqlite(&dir).await, $point, $calls).await;
        }

        #[tokio::test]
        async fn $mysql() {
            support::on_mysql(|database| crash_then_retry(database, $point, $calls)).await;
        }
    )*};
}

// The charge requests the processor sees: after `reserve` the retry makes the only one; after
// `charge-call` the charge happened but was not recorded, so the retry asks again (same key,
// the processor answers the charge it made); after `charge` and `ship` it is recorded, and the
// retry does not ask again.
crash_points! {
    "reserve": postgres_crash_after_reserve_then_retry, sqlite_crash_after_reserve_then_retry,
        mysql_crash_after_reserve_then_retry, 1;
    "charge-call": postgres_crash_after_the_charge_call_then_retry,
        sqlite_crash_after_the_charge_call_then_retry,
        mysql_crash_after_the_charge_call_then_retry, 2;
    "charge": postgres_crash_after_charge_then_retry, sqlite_crash_after_charge_then_retry,
        mysql_crash_after_charge_then_retry, 1;
    "ship": postgres_crash_after_ship_then_retry, sqlite_crash_after_ship_then_retry,
        mysql_crash_after_ship_then_retry, 1;
}

/// After a crash, two retries at once: the first takes the key over and resumes (held at the
/// processor), the second gets 409 meanwhile.
async fn racing_retries(database: Database) {
    let client = Client::new();
    let processor = Processor::start(Some("/v1/charges")).await;
    crash_at(&client, &database, &processor, "reserve").await;
    let (_payments, base) = restart(&client, &database, &processor).await;
    database.lease_ends_in(KEY, -1).await;

    let first = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move { send_order(&client, &base).await.unwrap() }
    });
    wait_until("the resumed order to reach the processor", || async {
        charge_requests(&processor) == 1
    })
    .await;
    let second = send_order(&client, &base).await.unwrap();
    assert_eq!(second.status(), StatusCode::CONFLICT);
    assert!(second.headers().contains_key("retry-after"));

    processor.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first: Value = first.json().await.unwrap();
    assert_one_order(&client, &base, &processor, first).await;
}

#[sqlx::test(migrations = false)]
async fn postgres_two_retries_after_a_crash_one_resumes_the_other_is_409(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    racing_retries(support::postgres(connect).await).await;
}

#[tokio::test]
async fn sqlite_two_retries_after_a_crash_one_resumes_the_other_is_409() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    racing_retries(support::sqlite(&dir).await).await;
}

#[tokio::test]
async fn mysql_two_retries_after_a_crash_one_resumes_the_other_is_409() {
    support::on_mysql(racing_retries).await;
}

/// A crash after `point` and a client that never retries: the new process's recovery task
/// settles the order once its lease has ended.
async fn settled_by_recovery(database: Database, point: &str) {
    let client = Client::new();
    let processor = Processor::start(None).await;
    crash_at(&client, &database, &processor, point).await;
    database.lease_ends_in(KEY, -1).await;
    let (_payments, base) = start_payments(&client, &database, &processor.url).await;

    if point != "reserve" {
        // Finished: the order shipped, and a late retry replays its 201.
        wait_until("the recovery to finish the order", || async {
            database.key_status(KEY).await == "completed"
        })
        .await;
        let orders: Vec<Value> = get(&client, &format!("{base}/v1/orders")).await;
        assert_eq!(orders.len(), 1);
        let late = send_order(&client, &base).await.unwrap();
        assert_eq!(late.status(), StatusCode::CREATED);
        assert_eq!(late.headers()["idempotent-replayed"], "true");
        assert_eq!(
            late.headers()["location"],
            format!("/v1/orders/{}", orders[0]["id"].as_str().unwrap())
        );
        assert_eq!(late.json::<Value>().await.unwrap(), orders[0]);
        let stock: Value = get(&client, &format!("{base}/v1/inventory/sku-1")).await;
        assert_eq!(stock["stock"], 100 - QUANTITY);
        assert_eq!(charges(&client, &processor).await.len(), 1);
    } else {
        // Not charged: the stock is given back and the key released.
        wait_until("the recovery to release the order's key", || async {
            database.count("idem_keys").await == 0
        })
        .await;
        let stock: Value = get(&client, &format!("{base}/v1/inventory/sku-1")).await;
        assert_eq!(stock["stock"], 100, "the reservation was given back");
        assert_eq!(database.count("orders").await, 0);
        assert!(charges(&client, &processor).await.is_empty());
    }
}

#[sqlx::test(migrations = false)]
async fn postgres_recovery_finishes_an_abandoned_order_that_was_charged(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    settled_by_recovery(support::postgres(connect).await, "charge").await;
}

#[tokio::test]
async fn sqlite_recovery_finishes_an_abandoned_order_that_was_charged() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    settled_by_recovery(support::sqlite(&dir).await, "charge").await;
}

#[tokio::test]
async fn mysql_recovery_finishes_an_abandoned_order_that_was_charged() {
    support::on_mysql(|database| settled_by_recovery(database, "charge")).await;
}

// The attempt died after the processor charged, before the charge was recorded: the hook
// finds the charge under the step's key and finishes the order.
#[sqlx::test(migrations = false)]
async fn postgres_recovery_finishes_an_abandoned_order_charged_but_not_recorded(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    settled_by_recovery(support::postgres(connect).await, "charge-call").await;
}

#[tokio::test]
async fn sqlite_recovery_finishes_an_abandoned_order_charged_but_not_recorded() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    settled_by_recovery(support::sqlite(&dir).await, "charge-call").await;
}

#[tokio::test]
async fn mysql_recovery_finishes_an_abandoned_order_charged_but_not_recorded() {
    support::on_mysql(|database| settled_by_recovery(database, "charge-call")).await;
}

/// A declined order whose process died after giving the stock back, before its 402 was
/// stored: the retry answers 402 without asking the processor again.
async fn declined_then_crash(database: Database) {
    let client = Client::new();
    let processor = Processor::start(None).await;
    let declined = json!({"sku": "sku-1", "quantity": QUANTITY, "customer": "cus_declined"});
    let send = |base: String| {
        let (client, declined) = (client.clone(), declined.clone());
        async move {
            client
                .post(format!("{base}/v1/orders"))
                .bearer_auth("t1")
                .header("Idempotency-Key", KEY)
                .json(&declined)
                .send()
                .await
        }
    };
    let (mut crashing, base) = start_payments_with(
        &client,
        &database,
        &processor.url,
        &[("CRASH_AFTER", "release")],
    )
    .await;
    assert!(send(base).await.is_err(), "the process died mid-request");
    crashing.0.wait().expect("reap");
    assert_eq!(charge_requests(&processor), 1);

    let (_payments, base) = restart(&client, &database, &processor).await;
    database.lease_ends_in(KEY, -1).await;
    let retry = send(base.clone()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::PAYMENT_REQUIRED);
    assert_eq!(
        charge_requests(&processor),
        1,
        "the charge was not tried again"
    );
    let stock: Value = get(&client, &format!("{base}/v1/inventory/sku-1")).await;
    assert_eq!(stock["stock"], 100, "given back once");
    let replay = send(base).await.unwrap();
    assert_eq!(replay.status(), StatusCode::PAYMENT_REQUIRED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

#[sqlx::test(migrations = false)]
async fn postgres_a_declined_order_that_crashed_after_giving_the_stock_back_stays_declined(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    declined_then_crash(support::postgres(connect).await).await;
}

#[tokio::test]
async fn sqlite_a_declined_order_that_crashed_after_giving_the_stock_back_stays_declined() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    declined_then_crash(support::sqlite(&dir).await).await;
}

#[tokio::test]
async fn mysql_a_declined_order_that_crashed_after_giving_the_stock_back_stays_declined() {
    support::on_mysql(declined_then_crash).await;
}

#[sqlx::test(migrations = false)]
async fn postgres_recovery_gives_back_the_stock_of_an_abandoned_order_not_charged(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    settled_by_recovery(support::postgres(connect).await, "reserve").await;
}

#[tokio::test]
async fn sqlite_recovery_gives_back_the_stock_of_an_abandoned_order_not_charged() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    settled_by_recovery(support::sqlite(&dir).await, "reserve").await;
}

#[tokio::test]
async fn mysql_recovery_gives_back_the_stock_of_an_abandoned_order_not_charged() {
    support::on_mysql(|database| settled_by_recovery(database, "reserve")).await;
}
