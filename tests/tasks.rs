//! The background tasks: purge of expired keys and recovery of abandoned claims, against a real
//! PostgreSQL, with live requests running beside them.

use std::time::Duration;

use axum::http::{HeaderMap, Method, StatusCode, header::CONTENT_TYPE};
use idem_runtime::{
    CancellationToken, Store,
    fingerprint::Fingerprint,
    record::StoredResponse,
    tasks::{self, AbandonedClaim, PurgeOptions, Recovery, RecoveryHook, ReleaseAbandoned},
};
use idem_tests::{App, Req, executed_refunds, payment, spawn_processor};
use sqlx::PgPool;

/// Inserts `n` completed keys for `tenant`, expiring `expires_in` from now (negative: expired).
async fn seed_keys(pool: &PgPool, tenant: &str, n: i64, expires_in: &str) {
    sqlx::query(
        "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, response_status, \
           response_headers, response_body, expires_at) \
         SELECT $1, 'seed-' || $1 || '-' || g, 'POST', '/v1/payments', sha256(g::text::bytea), \
           'completed', 201, '[]'::jsonb, ''::bytea, now() + $3::interval \
         FROM generate_series(1, $2) g",
    )
    .bind(tenant)
    .bind(n)
    .bind(expires_in)
    .execute(pool)
    .await
    .expect("seed keys");
}

#[sqlx::test(migrations = false)]
async fn purge_deletes_exactly_the_expired_rows_in_batches_while_requests_go_on(pool: PgPool) {
    let app = App::new(pool.clone()).await;
    seed_keys(&pool, "old", 2500, "-1 hour").await;
    seed_keys(&pool, "live", 300, "1 hour").await;
    let store = Store::new(pool.clone());

    let purge = tokio::spawn(async move {
        store
            .purge_expired(PurgeOptions {
                batch_size: 1000,
                pause: Duration::ZERO,
            })
            .await
    });
    let mut requests = Vec::new();
    for i in 0..20 {
        let app = app.clone();
        requests.push(tokio::spawn(async move {
            app.send(
                Req::post("/v1/payments")
                    .tenant("t1")
                    .key(&format!("k{i}"))
                    .json(&payment(100, "cus_1"))
                    .build(),
            )
            .await
        }));
    }
    let report = purge.await.unwrap().expect("purge");
    for request in requests {
        assert_eq!(request.await.unwrap().status, StatusCode::CREATED);
    }
    assert_eq!(report.rows, 2500);
    assert_eq!(report.batches, 3, "1000 + 1000 + 500");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE scope = 'live'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 300, "live keys stay");
    assert_eq!(app.count("idem_keys").await, 320, "300 seeded + 20 new");
}

#[sqlx::test(migrations = false)]
async fn a_purged_key_runs_again(pool: PgPool) {
    let app = App::new(pool.clone()).await;
    let first = app
        .send(
            Req::post("/v1/payments")
                .tenant("t1")
                .key("k1")
                .json(&payment(100, "cus_1"))
                .build(),
        )
        .await;
    sqlx::query("UPDATE idem_keys SET expires_at = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    let report = Store::new(pool.clone())
        .purge_expired(PurgeOptions::default())
        .await
        .unwrap();
    assert_eq!((report.rows, report.batches), (1, 1));
    assert_eq!(app.keys_named("k1").await, 0);
    let second = app
        .send(
            Req::post("/v1/payments")
                .tenant("t1")
                .key("k1")
                .json(&payment(100, "cus_1"))
                .build(),
        )
        .await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!second.replayed());
    assert_ne!(second.json()["id"], first.json()["id"]);
}

#[sqlx::test(migrations = false)]
async fn the_purge_task_stops_when_cancelled(pool: PgPool) {
    App::new(pool.clone()).await;
    seed_keys(&pool, "old", 10, "-1 hour").await;
    let stop = CancellationToken::new();
    let task = tasks::spawn_purge(
        Store::new(pool.clone()),
        Duration::from_millis(20),
        PurgeOptions::default(),
        stop.clone(),
    );
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    task.await.expect("the task ends cleanly");
}

/// Writes a `started` claim whose lease ran out, as a crash between the external call and the
/// completion leaves it, for the refund request `body` with key `key`.
async fn abandoned_claim(pool: &PgPool, tenant: &str, key: &str, body: &str) {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
    let fingerprint = Fingerprint::of(&Method::POST, "/v1/refunds", &headers, body.as_bytes());
    sqlx::query(
        "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, expires_at, \
           locked_at, lease_until, claim_token) \
         VALUES ($1, $2, 'POST', '/v1/refunds', $3, 'started', now() + interval '1 day', \
           now() - interval '1 minute', now() - interval '55 seconds', 42)",
    )
    .bind(tenant)
    .bind(key)
    .bind(&fingerprint.as_bytes()[..])
    .execute(pool)
    .await
    .expect("insert claim");
}

fn refund_body(payment: &str) -> String {
    format!(r#"{{"payment": "{payment}", "amount": 50}}"#)
}

#[sqlx::test(migrations = false)]
async fn recovery_releases_abandoned_claims_only(pool: PgPool) {
    let processor = spawn_processor().await;
    let app = App::with_processor(pool.clone(), processor.clone()).await;
    let payment = app.paid("t1", "cus_1").await;
    let body = refund_body(&payment);
    abandoned_claim(&pool, "t1", "abandoned", &body).await;
    // A claim still within its lease is someone's work in progress.
    abandoned_claim(&pool, "t1", "running", &body).await;
    sqlx::query(
        "UPDATE idem_keys SET lease_until = now() + interval '1 minute' WHERE key = 'running'",
    )
    .execute(&pool)
    .await
    .unwrap();

    // A retry would take the abandoned key over by itself; the recovery is for the keys that
    // nobody retries, and releases them.
    let report = Store::new(pool.clone())
        .recover_abandoned(&ReleaseAbandoned, 100)
        .await
        .unwrap();
    assert_eq!((report.found, report.released, report.completed), (1, 1, 0));
    assert!(
        report.oldest >= Duration::from_secs(59),
        "age {:?}",
        report.oldest
    );
    assert_eq!(app.keys_named("abandoned").await, 0);
    assert_eq!(app.key_status("running").await.as_deref(), Some("started"));
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE status = 'completed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(completed, 1, "the payment's completed key is untouched");

    let retry = app
        .send(
            Req::post("/v1/refunds")
                .tenant("t1")
                .key("abandoned")
                .json(&body)
                .build(),
        )
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(executed_refunds(&processor).await.len(), 1);
}

/// Completes every abandoned claim with a fixed answer, as a hook that found the charge
/// downstream would.
struct CompleteWith(StoredResponse);

impl RecoveryHook for CompleteWith {
    async fn recover(&self, claim: AbandonedClaim) -> Recovery {
        assert_eq!(claim.path, "/v1/refunds");
        assert!(claim.context().derive("refund").starts_with("idem_"));
        Recovery::Complete(self.0.clone())
    }
}

#[sqlx::test(migrations = false)]
async fn a_recovery_hook_can_complete_a_claim_and_retries_replay_it(pool: PgPool) {
    let app = App::new(pool.clone()).await;
    let body = refund_body("pay_1");
    abandoned_claim(&pool, "t1", "abandoned", &body).await;
    let answer = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: br#"{"id":"re_found_downstream"}"#.to_vec(),
    };
    let report = Store::new(pool.clone())
        .recover_abandoned(&CompleteWith(answer), 100)
        .await
        .unwrap();
    assert_eq!((report.found, report.completed), (1, 1));
    let retry = app
        .send(
            Req::post("/v1/refunds")
                .tenant("t1")
                .key("abandoned")
                .json(&body)
                .build(),
        )
        .await;
    assert!(retry.replayed());
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.json()["id"], "re_found_downstream");
}

#[sqlx::test(migrations = false)]
async fn the_recovery_task_runs_until_cancelled(pool: PgPool) {
    let app = App::new(pool.clone()).await;
    abandoned_claim(&pool, "t1", "abandoned", &refund_body("pay_1")).await;
    let stop = CancellationToken::new();
    let task = tasks::spawn_recovery(
        Store::new(pool.clone()),
        ReleaseAbandoned,
        Duration::from_millis(20),
        stop.clone(),
    );
    while app.keys_named("abandoned").await > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    task.await.expect("the task ends cleanly");
}
