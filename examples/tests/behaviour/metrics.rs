//! `GET /metrics` of the real `payments` binary: the library's counters and histograms through
//! the `metrics` facade and the example's Prometheus recorder, labelled by route template and
//! outcome, never by key, scope or raw path.

use crate::support;

use reqwest::{Client, StatusCode};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{Database, start_payments};

const KEY: &str = "metrics-key-5d7e";
const TENANT: &str = "tenant-metrics-91";

/// The value of the sample of `name` whose labels include every one of `labels`.
fn sample(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|line| {
            line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} "))
        })
        .find(|line| labels.iter().all(|label| line.contains(label)))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

async fn requests_are_counted_by_route_and_outcome(database: Database) {
    let client = Client::new();
    let (_service, base) = start_payments(&client, &database, "http://127.0.0.1:9").await;
    let pay = |key: &'static str| {
        client
            .post(format!("{base}/v1/payments"))
            .bearer_auth(TENANT)
            .header("Idempotency-Key", key)
            .json(&json!({"amount": 4200, "currency": "usd", "customer": "cus_1"}))
            .send()
    };
    assert_eq!(pay(KEY).await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(
        pay(KEY).await.unwrap().status(),
        StatusCode::CREATED,
        "the replay"
    );
    assert_eq!(
        pay("  ").await.unwrap().status(),
        StatusCode::BAD_REQUEST,
        "a malformed key"
    );

    let answer = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(answer.status(), StatusCode::OK);
    let metrics = answer.text().await.expect("text");
    let route = r#"route="/v1/payments""#;
    for (outcome, count) in [("executed", 1.0), ("replayed", 1.0), ("rejected", 1.0)] {
        assert_eq!(
            sample(
                &metrics,
                "idem_requests_total",
                &[route, &format!(r#"outcome="{outcome}""#)]
            ),
            Some(count),
            "{outcome} in:\n{metrics}"
        );
    }
    // The first execution claimed; the replay did too on PostgreSQL and MySQL, while SQLite
    // answers it from a read without a claim.
    let claims = sample(
        &metrics,
        "idem_claim_duration_seconds_count",
        &[r#"mode="transactional""#],
    );
    assert!(claims.is_some_and(|n| n >= 1.0), "claims timed:\n{metrics}");
    assert!(
        metrics.contains(r#"idem_claim_duration_seconds_bucket{mode="transactional",le="0.005"}"#),
        "a histogram with buckets:\n{metrics}"
    );
    assert!(metrics.contains("idem_purge_deleted_total"), "{metrics}");
    for secret in [KEY, TENANT] {
        assert!(
            !metrics.contains(secret),
            "{secret} appears in the metrics:\n{metrics}"
        );
    }
}

/// The series recorded only when their event happens (a recovery, a takeover, a purge) are
/// exported at zero from the start: an alert on the `increase()` of a series that is absent
/// until its first event never fires for that event.
#[tokio::test]
async fn series_of_rare_events_are_exported_at_zero_before_any_request() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let client = Client::new();
    let (_service, base) = start_payments(&client, &database, "http://127.0.0.1:9").await;
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    for (name, labels) in [
        ("idem_recovered_total", [r#"result="released""#]),
        ("idem_recovered_total", [r#"result="completed""#]),
        ("idem_recovered_total", [r#"result="kept""#]),
        ("idem_takeovers_total", [""]),
        ("idem_purge_deleted_total", [""]),
    ] {
        assert_eq!(
            sample(&metrics, name, &labels),
            Some(0.0),
            "{name} {labels:?} at zero in:\n{metrics}"
        );
    }
}

#[sqlx::test(migrations = false)]
async fn postgres_requests_are_counted_by_route_and_outcome(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    requests_are_counted_by_route_and_outcome(support::postgres(connect).await).await;
}

#[tokio::test]
async fn sqlite_requests_are_counted_by_route_and_outcome() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    requests_are_counted_by_route_and_outcome(support::sqlite(&dir).await).await;
}

#[tokio::test]
async fn mysql_requests_are_counted_by_route_and_outcome() {
    support::on_mysql(requests_are_counted_by_route_and_outcome).await;
}
