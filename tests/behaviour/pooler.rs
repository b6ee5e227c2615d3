//! idem through PgBouncer (Debian's 1.18) in transaction mode, which cannot carry sqlx's
//! prepared statements: the key table's migrations (which also need a session of their own for
//! sqlx's advisory lock) fail at once, say to use a direct connection and leave nothing behind;
//! a service that runs there anyway answers 503 and logs what the pooler does, and what to do,
//! once, not per request.
//!
//! The tests need the pooler of `POOL_MODE=transaction scripts/pooler up`
//! (`$POOLER_TRANSACTION_URL`, in front of `$DATABASE_URL`'s server): it is ignored in the
//! suite, and scripts/test's pooler pass runs it against a pooler of its own.

use std::sync::Arc;

use axum::http::StatusCode;
use idem_runtime::{Error, ProblemKind, Store};
use idem_tests::{AnyStore, CapturedLog, Parts, Req, TestApp, TestBackend};
use sqlx::{
    Postgres,
    postgres::{PgConnectOptions, PgPoolOptions},
};

#[sqlx::test(migrations = false)]
#[ignore = "needs scripts/pooler: run by scripts/test"]
async fn migrate_through_a_transaction_mode_pooler_fails_at_once_and_says_to_use_a_direct_connection(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = connect.get_database().expect("a test database").to_owned();
    let direct = sqlx::PgPool::connect_with(connect).await.expect("connect");
    let pooled = PgPoolOptions::new()
        .max_connections(2)
        .connect(&idem_tests::pooler_url("POOLER_TRANSACTION_URL", &name))
        .await
        .expect("connect through the pooler");

    let migrated = tokio::time::timeout(idem_tests::DEADLINE, idem_runtime::migrate(&pooled))
        .await
        .expect("migrate answers");
    let Err(Error::Pooler { reason }) = migrated else {
        panic!("migrate through a transaction-mode pooler: {migrated:?}")
    };
    for said in ["transaction mode", "session mode", "a direct connection"] {
        assert!(reason.contains(said), "no {said:?} in: {reason}");
    }
    pooled.close().await;

    idem_tests::assert_nothing_left(&direct).await;
    idem_tests::release_pooled("POOLER_TRANSACTION_URL", &name);
}

#[sqlx::test(migrations = false)]
#[ignore = "needs scripts/pooler: run by scripts/test"]
async fn a_service_behind_a_transaction_mode_pooler_answers_503_and_logs_the_cause_once(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = connect.get_database().expect("a test database").to_owned();
    let direct = sqlx::PgPool::connect_with(connect).await.expect("connect");
    idem_runtime::migrate(&direct).await.expect("idem's tables");
    <Postgres as TestBackend>::create_tables(&direct)
        .await
        .expect("the test app's tables");
    // A service started without the start-up check, its pool through the pooler.
    let pooled = PgPoolOptions::new()
        .max_connections(8)
        .connect(&idem_tests::pooler_url("POOLER_TRANSACTION_URL", &name))
        .await
        .expect("connect through the pooler");
    let store = Store::new(pooled.clone());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    gate.add_permits(1);
    let parts = Parts {
        store: AnyStore::Postgres(store.clone()),
        calls: Arc::default(),
        gate,
    };
    let router = TestApp::default().routes(store, parts);

    let log = CapturedLog::default();
    let _guard = tracing::subscriber::set_default(log.subscriber());
    // External requests (the handler runs no statement: every failure is idem's), in waves of
    // 16 over the 8 connections, until the pooler has broken several.
    // Each failure is logged with its error (`error=`), wherever idem met it: the claim, the
    // completion.
    let failed = || {
        log.text()
            .lines()
            .filter(|line| {
                line.contains("error=")
                    && (line.contains("prepared statement") || line.contains("bind message"))
            })
            .count()
    };
    let mut sent = 0;
    let deadline = tokio::time::Instant::now() + idem_tests::DEADLINE;
    while failed() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{sent} requests through the pooler and fewer than 3 store failures:\n{}",
            log.text()
        );
        // Tasks of this test's one thread: what they log reaches the subscriber set above.
        let mut wave = tokio::task::JoinSet::new();
        for i in 0..16 {
            let request = Req::post("/test/external-slow")
                .tenant("t1")
                .key(&format!("k{}", sent + i))
                .build();
            let router = router.clone();
            wave.spawn(async move {
                let response = tower::ServiceExt::oneshot(router, request).await;
                idem_tests::Reply::read(response.expect("an answer")).await
            });
        }
        while let Some(reply) = wave.join_next().await {
            let reply = reply.expect("a request task");
            if reply.status != StatusCode::CREATED {
                assert_eq!(
                    reply.problem(StatusCode::SERVICE_UNAVAILABLE),
                    ProblemKind::StoreUnavailable.type_uri()
                );
            }
        }
        sent += 16;
    }
    let logged = log.text();
    assert_eq!(
        logged.matches("a pooler in transaction mode").count(),
        1,
        "the explanation, once:\n{logged}"
    );
    for said in [
        "session mode",
        "max_prepared_statements",
        "a direct connection",
    ] {
        assert!(logged.contains(said), "no {said:?} in:\n{logged}");
    }
    pooled.close().await;
    idem_tests::release_pooled("POOLER_TRANSACTION_URL", &name);
}
