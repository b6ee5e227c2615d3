//! Real processes: the payments service runs as its own binary and is killed with SIGKILL
//! between the processor's refund and the completion of the key. The processor runs in the test
//! process (it outlives the service either way), where the test holds its answer until the
//! service is dead: the kill lands between the two steps on any machine, however slow.
//! (These tests live beside the binaries so that Cargo builds them and hands over their paths.)

use crate::support;

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{
    Database, Processor, refunds_executed, start_payments, start_payments_with, wait_until,
};

#[sqlx::test(migrations = false)]
async fn postgres_service_killed_after_the_refund_is_retried_safely(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    killed_after_the_refund(support::postgres(connect).await).await;
}

#[tokio::test]
async fn sqlite_service_killed_after_the_refund_is_retried_safely() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    killed_after_the_refund(support::sqlite(&dir).await).await;
}

#[tokio::test]
async fn mysql_service_killed_after_the_refund_is_retried_safely() {
    support::on_mysql(killed_after_the_refund).await;
}

async fn killed_after_the_refund(database: Database) {
    let client = Client::new();
    let processor = Processor::start(Some("/v1/refunds")).await;

    let (mut payments, base) = start_payments(&client, &database, &processor.url).await;
    let payment = support::paid(&client, &base, "pay-1", 900).await;
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

    // The processor records the refund and holds its answer: kill the service in between,
    // after the side effect and before the completion.
    let in_flight = tokio::spawn(send_refund(base.clone()));
    wait_until("the processor to record the refund", || async {
        !refunds_executed(&client, &processor.url).await.is_empty()
    })
    .await;
    payments.0.kill().expect("SIGKILL");
    payments.0.wait().expect("reap");
    processor.gate.add_permits(1);
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client saw the connection die"
    );
    assert_eq!(
        database.key_status("refund-1").await,
        "started",
        "the crash left the claim behind"
    );
    assert_eq!(
        database.lease_ms("refund-1").await,
        5000,
        "the claim's lease is the route's 5 s"
    );

    // A new process, without a recovery task (which would release the claim once its lease
    // ends: only the retries here may act on it). While the lease runs (a minute left, here), a
    // retry is told to come back when it ends.
    database.lease_ends_in("refund-1", 60).await;
    let (_payments, base) = start_payments_with(
        &client,
        &database,
        &processor.url,
        &[("RECOVERY_EVERY", "0")],
    )
    .await;
    let early = send_refund(base.clone()).await.unwrap();
    assert_eq!(early.status(), StatusCode::CONFLICT);
    let retry_after: u64 = early.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (50..=60).contains(&retry_after),
        "Retry-After is the lease's remainder: {retry_after}"
    );

    // After the lease, the retry takes the key over and runs the handler again; the processor
    // sees the same derived key and does not refund twice.
    database.lease_ends_in("refund-1", -1).await;
    let late = send_refund(base.clone()).await.unwrap();
    assert_eq!(late.status(), StatusCode::CREATED);
    assert!(late.headers().get("idempotent-replayed").is_none());
    let late: Value = late.json().await.unwrap();
    let executed = refunds_executed(&client, &processor.url).await;
    assert_eq!(
        executed.len(),
        1,
        "one refund at the processor: {executed:?}"
    );
    assert_eq!(late["id"], executed[0]["id"]);
    let keys = processor.keys("/v1/refunds");
    assert_eq!(keys.len(), 2, "the crashed attempt and the takeover");
    assert_eq!(keys[0], keys[1], "both sent the same derived key");

    let replay = send_refund(base).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.json::<Value>().await.unwrap(), late);
}
