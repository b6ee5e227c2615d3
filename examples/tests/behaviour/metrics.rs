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
    let metrics = scrape(&client, &format!("{base}/metrics")).await;
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

/// A service that never spawned the purge still exports when the last purge pass got through:
/// the time its first `Store` was made, from which `IdemPurgeBehind` counts the hour. Without
/// it the series would not exist, and `time() - max(...)` of a series that does not exist is
/// empty: the alert could never fire for a purge that was forgotten.
#[tokio::test]
async fn a_service_without_a_purge_task_exports_its_start_as_the_purges_last_success() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let client = Client::new();
    let unix_now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64()
    };
    let before = unix_now();
    let (_service, base) = support::start_payments_with(
        &client,
        &database,
        "http://127.0.0.1:9",
        &[("PURGE_EVERY", "0")],
    )
    .await;
    let up = unix_now();
    let metrics = scrape(&client, &format!("{base}/metrics")).await;
    let last_success = sample(&metrics, "idem_purge_last_success_timestamp_seconds", &[""]);
    assert!(
        last_success.is_some_and(|at| (before.floor()..=up).contains(&at)),
        "idem_purge_last_success_timestamp_seconds is the service's start ({before:.0} to \
         {up:.0}) without a purge pass, in:\n{metrics}"
    );
    assert!(
        !metrics.contains("idem_purge_deleted_total"),
        "no purge ran (it exports idem_purge_deleted_total when spawned):\n{metrics}"
    );
}

/// The metric names the alert rules (`deploy/prometheus/idem.rules.yml`) and the dashboard
/// (`deploy/grafana/idem.json`) read, as their queries write them (`_bucket` and `_count` of a
/// histogram included); the recording rules' own names, with a colon, left out.
fn series_the_rules_and_the_dashboard_name() -> std::collections::BTreeSet<String> {
    let rules = include_str!("../../../deploy/prometheus/idem.rules.yml");
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../../../deploy/grafana/idem.json"))
            .expect("the dashboard is JSON");
    let mut queries: Vec<String> = rules
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .map(str::to_owned)
        .collect();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().expect("a query").to_owned());
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for query in &queries {
        let mut rest = query.as_str();
        while let Some(at) = rest.find("idem_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            names.insert(name);
        }
    }
    names
}

/// The dashboard as Grafana's import reads it: it declares its data source as an input
/// (`__inputs`, asked for in the import dialog), which the data source variable takes by
/// default and every panel reads through; it narrows every query to the chosen services (`job`)
/// and processes (`instance`), so that several services in one Prometheus are not added
/// together; its panels link their alerts' runbooks by address; and a panel whose series may
/// rightly not exist (no duplicate waited yet, no outbox, no consumer) says so instead of an
/// empty "No data".
#[test]
fn the_dashboard_asks_for_its_data_source_on_import_and_narrows_every_query_to_the_chosen_services()
{
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../../../deploy/grafana/idem.json"))
            .expect("the dashboard is JSON");
    let inputs = dashboard["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs.iter().any(|input| input["name"] == "DS_PROMETHEUS"
            && input["type"] == "datasource"
            && input["pluginId"] == "prometheus"),
        "a Prometheus data source input: {inputs:?}"
    );
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    let variable = |name: &str| {
        variables
            .iter()
            .find(|variable| variable["name"] == name)
            .unwrap_or_else(|| panic!("a variable {name}: {variables:?}"))
    };
    assert_eq!(
        variable("datasource")["current"]["value"],
        "${DS_PROMETHEUS}",
        "the data source variable defaults to the one chosen on import"
    );
    for name in ["job", "instance", "route"] {
        assert_eq!(variable(name)["multi"], true, "{name} takes several values");
        assert_eq!(variable(name)["allValue"], ".*", "{name}'s All");
    }
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().expect("a title");
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{title} reads the chosen data source"
        );
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("a query");
            let mut rest = expr;
            while let Some(at) = rest.find("idem_") {
                let selector = &rest[at..];
                let name_end = selector
                    .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                    .unwrap_or(selector.len());
                assert!(
                    selector[name_end..].starts_with(r#"{job=~"$job",instance=~"$instance""#),
                    "{title}: every series read only from the chosen jobs and instances: {expr}"
                );
                rest = &selector[name_end..];
            }
        }
        for link in panel["links"].as_array().into_iter().flatten() {
            let url = link["url"].as_str().expect("a link's url");
            assert!(
                url.starts_with("https://")
                    && url.contains("/docs/guide/operations.md#idem")
                    && link["title"]
                        .as_str()
                        .is_some_and(|title| title.starts_with("Runbook: ")),
                "{title}: a runbook linked by its address: {link}"
            );
        }
    }
    let panel = |title: &str| {
        dashboard["panels"]
            .as_array()
            .expect("panels")
            .iter()
            .find(|panel| {
                panel["title"]
                    .as_str()
                    .is_some_and(|t| t.starts_with(title))
            })
            .unwrap_or_else(|| panic!("a panel {title}"))
    };
    for title in [
        "Duplicates that waited",
        "Outbox backlog",
        "Relay:",
        "Consumed messages",
    ] {
        assert!(
            panel(title)["fieldConfig"]["defaults"]["noValue"]
                .as_str()
                .is_some_and(|text| !text.is_empty()),
            "{title} says why it may be empty"
        );
    }
}

/// Every series the alert rules and the dashboard name is exported by the services (the
/// payments service relaying to RabbitMQ, and the ledger consuming), after a payment, its
/// replay, and two requests sent together that may wait for each other: a metric renamed in the
/// code, and not in the rules or the dashboard, fails here.
#[tokio::test]
async fn every_series_the_rules_and_the_dashboard_name_is_exported_by_the_services() {
    let names = series_the_rules_and_the_dashboard_name();
    assert!(
        names.len() >= 12,
        "the rules and the dashboard name {names:?}"
    );
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let broker = idem_tests::TestBroker::new(idem_tests::BrokerKind::RabbitMq).used_by("ledger");
    let client = Client::new();
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let ledger_addr = support::free_addr();
    let mut ledger = std::process::Command::new(env!("CARGO_BIN_EXE_ledger"));
    database.configure(&mut ledger);
    let _ledger = support::Process(
        ledger
            .env("EVENTS", "rabbitmq")
            .env("EVENTS_STREAM", broker.name())
            .env("AMQP_URL", &amqp_url)
            .env("LEDGER_ADDR", &ledger_addr)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start the ledger"),
    );
    support::wait_until_up(&client, &format!("http://{ledger_addr}/v1/ledger")).await;
    let (_service, base) = support::start_payments_with(
        &client,
        &database,
        "http://127.0.0.1:9",
        &[
            ("EVENTS", "rabbitmq"),
            ("EVENTS_STREAM", broker.name()),
            ("AMQP_URL", &amqp_url),
        ],
    )
    .await;
    for _ in 0..2 {
        let paid = client
            .post(format!("{base}/v1/payments"))
            .bearer_auth(TENANT)
            .header("Idempotency-Key", KEY)
            .json(&json!({"amount": 4200, "currency": "usd", "customer": "cus_1"}))
            .send()
            .await
            .expect("a payment");
        assert_eq!(paid.status(), StatusCode::CREATED);
    }
    // Two requests under one key, sent together, that may wait for each other: one runs for
    // five seconds, the other waits for its outcome (`idem_wait_duration_seconds`).
    let slow = |key: &'static str| {
        client
            .post(format!("{base}/v1/payments"))
            .bearer_auth(TENANT)
            .header("Idempotency-Key", key)
            .header("Prefer", "wait=10")
            .json(&json!({"amount": 100, "currency": "usd", "customer": "cus_slower"}))
            .send()
    };
    let (one, two) = tokio::join!(slow("metrics-wait"), slow("metrics-wait"));
    let replays = [one, two]
        .into_iter()
        .map(|answer| answer.expect("an answer"))
        .filter(|answer| answer.headers().contains_key("preference-applied"))
        .count();
    assert_eq!(replays, 1, "one of the two requests waited for the other");
    // The relay publishes the payments' events and the ledger applies them, each in its own
    // time: the series are looked for until every one is there.
    let missing = || async {
        let exported = format!(
            "{}\n{}",
            scrape(&client, &format!("{base}/metrics")).await,
            scrape(&client, &format!("http://{ledger_addr}/metrics")).await
        );
        let missing: Vec<String> = names
            .iter()
            .filter(|name| {
                !exported.lines().any(|line| {
                    line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} "))
                })
            })
            .cloned()
            .collect();
        (missing, exported)
    };
    let found = tokio::time::timeout(idem_tests::DEADLINE, async {
        loop {
            let (missing, _) = missing().await;
            if missing.is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    if found.is_err() {
        let (missing, exported) = missing().await;
        panic!(
            "the rules and the dashboard name series no service exports (after {:?}): \
             {missing:?}\n{exported}",
            idem_tests::DEADLINE
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

/// The text a service's `/metrics` answers at `url`.
async fn scrape(client: &Client, url: &str) -> String {
    client
        .get(url)
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text")
}
