//! What idem leaves on a PostgreSQL connection once a request, a purge or a recovery pass is
//! done with it: nothing. A pooler (PgBouncer in transaction mode, RDS Proxy, Supavisor) hands
//! a server connection to another client after each transaction, so a session `SET`, a session
//! lock or a `LISTEN` left by one request would reach another client, or pin the connection.

use axum::http::StatusCode;
use idem_runtime::tasks::{PurgeOptions, ReleaseAbandoned};
use idem_tests::{App, Db, Downstream, Options, Req, TestApp, TestDb};
use sqlx::PgPool;

/// What a session carries beyond its transactions, as one line per kind: settings whose source
/// is the session (`SET`, `set_config(…, false)`), idem's claim marker, advisory locks,
/// `LISTEN` channels, temporary tables, and an open transaction.
async fn session_state(pool: &PgPool) -> Vec<String> {
    let row: (String, String, i64, i64, i64, String) = sqlx::query_as(
        "SELECT \
           (SELECT coalesce(string_agg(name || '=' || setting, ', ' ORDER BY name), '') \
              FROM pg_settings WHERE source = 'session'), \
           coalesce(current_setting('idem.claim', true), ''), \
           (SELECT count(*) FROM pg_locks \
              WHERE pid = pg_backend_pid() AND locktype = 'advisory'), \
           (SELECT count(*) FROM pg_listening_channels()), \
           (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()), \
           (SELECT coalesce(backend_xid::text, '') FROM pg_stat_activity \
              WHERE pid = pg_backend_pid())",
    )
    .fetch_one(pool)
    .await
    .expect("read the session's state");
    vec![
        format!("session settings: {:?}", row.0),
        format!("idem.claim: {:?}", row.1),
        format!("advisory locks: {}", row.2),
        format!("listening channels: {}", row.3),
        format!("temporary tables: {}", row.4),
        format!("transaction id: {:?}", row.5),
    ]
}

/// Sends `request`, checks its status, then that the connection carries what it carried
/// `before` the first request.
async fn expect(app: &App, before: &[String], request: Req, status: StatusCode) {
    let reply = app.send(request.build()).await;
    assert_eq!(reply.status, status, "{:?}", reply.body);
    unchanged(app, before, &format!("a request answered {status}")).await;
}

/// Checks that the app's one connection carries what it carried `before`, `after` something.
async fn unchanged(app: &App, before: &[String], after: &str) {
    let Db::Postgres(pool) = &app.db else {
        unreachable!("a PostgreSQL app")
    };
    assert_eq!(
        session_state(pool).await,
        before,
        "idem left state on its connection beyond the transactions of {after}"
    );
}

#[sqlx::test(migrations = false)]
async fn postgres_requests_purge_and_recovery_leave_no_session_state_on_their_connection(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let downstream = Downstream::start().await;
    // One pooled connection: every statement below, idem's and the test's, runs on it, and the
    // state is read after each request and pass.
    let options = Options {
        connections: Some(1),
        ..Options::default()
    };
    let app = App::serving(
        TestDb::Postgres(Box::new(connect)),
        options,
        TestApp::downstream(&downstream.url),
    )
    .await;
    let Db::Postgres(pool) = &app.db else {
        unreachable!("a PostgreSQL app")
    };
    let before = session_state(pool).await;

    let entry = || {
        Req::post("/test/entries")
            .tenant("t1")
            .key("entry")
            .json(&idem_tests::entry(100, "n1"))
    };
    // A claim that completes, its replay, a stored 5xx, a 5xx rolled back, a COMMIT refused.
    expect(&app, &before, entry(), StatusCode::CREATED).await;
    expect(&app, &before, entry(), StatusCode::CREATED).await;
    let stored_5xx = Req::post("/test/stored-5xx")
        .tenant("t1")
        .key("stored")
        .json(&idem_tests::entry(100, "n2"));
    expect(&app, &before, stored_5xx, StatusCode::SERVICE_UNAVAILABLE).await;
    let flaky = Req::post("/test/flaky").tenant("t1").key("flaky");
    expect(&app, &before, flaky, StatusCode::SERVICE_UNAVAILABLE).await;
    let deferred = Req::post("/test/deferred").tenant("t1").key("deferred");
    expect(&app, &before, deferred, StatusCode::INTERNAL_SERVER_ERROR).await;
    // External mode: a claim committed on its own, the body outside, the completion after.
    app.gate.add_permits(1);
    let external = Req::post("/test/external-slow")
        .tenant("t1")
        .key("external");
    expect(&app, &before, external, StatusCode::CREATED).await;
    // Steps, each recorded on the key.
    let order = Req::post("/test/orders")
        .tenant("t1")
        .key("order")
        .json(r#"{"units": 2}"#);
    expect(&app, &before, order, StatusCode::CREATED).await;
    // A purge pass, and a recovery pass over an abandoned claim.
    app.abandoned_claim("t1", "abandoned", "/test/orders", &[7; 32])
        .await;
    app.purge(PurgeOptions::default()).await;
    unchanged(&app, &before, "a purge pass").await;
    let recovered = app.recover(&ReleaseAbandoned).await;
    assert_eq!(recovered.released, 1, "{recovered:?}");
    unchanged(&app, &before, "a recovery pass").await;
}
