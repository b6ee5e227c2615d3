//! `#[idempotent(timeout = "...")]`, on both backends: a handler that never returns is stopped
//! at its timeout, the client gets a 503 `HandlerTimedOut` problem, nothing is stored, and the
//! key is free at once, so a retry runs the handler again.
//!
//! The handlers here write their row, then wait on a gate that stays closed on their first
//! call; the tests never sleep, they wait on answers and counters under a deadline.

use std::{future::Future, sync::Arc, time::Duration};

use axum::{
    Extension, Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use idem_runtime::{ProblemKind, Store, StoreOptions};
use idem_tests::{App, Db, Probe, Reply, Req, TestBackend, TestDb, backend_tests};
use sqlx::Pool;
use tower::ServiceExt;

/// `/stuck` (transactional) and `/stuck-external`.
fn stuck_routes<DB: TestBackend>(probe: &Arc<Probe>) -> Router<Store<DB>> {
    Router::new()
        .route("/stuck", post(stuck::<DB>))
        .route("/stuck-external", post(stuck_external::<DB>))
        .layer(Extension(Arc::clone(probe)))
}

idem_tests::gated_handler! {
    /// Writes a row in its transaction, then waits on the gate.
    #[idempotent(scope = "tenant", retention = "1h", timeout = "3s")]
    async fn stuck;
}

idem_tests::gated_handler! {
    /// External mode: performs its side effect (a committed row, keyed by the derived key as a
    /// downstream call would be), then waits on the gate.
    #[idempotent(external, scope = "tenant", lease = "5s", timeout = "3s", backend = DB)]
    async fn stuck_external;
}

/// The test routes over `app`'s pool, and how many keys their store's handlers hold.
fn routes(app: &App, probe: &Arc<Probe>) -> (Router, Box<dyn Fn() -> usize>) {
    routes_with(app, probe, StoreOptions::default())
}

/// [`routes`] with a store of `settings`.
fn routes_with(
    app: &App,
    probe: &Arc<Probe>,
    settings: StoreOptions,
) -> (Router, Box<dyn Fn() -> usize>) {
    match &app.db {
        Db::Postgres(pool) => routes_on(pool, probe, settings),
        Db::Sqlite(pool) => routes_on(pool, probe, settings),
        Db::MySql(pool) => routes_on(pool, probe, settings),
    }
}

/// [`routes_with`] on one backend's `pool`.
fn routes_on<DB: TestBackend>(
    pool: &Pool<DB>,
    probe: &Arc<Probe>,
    settings: StoreOptions,
) -> (Router, Box<dyn Fn() -> usize>) {
    let store = Store::new(pool.clone()).with_options(settings);
    let router = stuck_routes(probe).with_state(store.clone());
    (router, Box::new(move || store.keys_in_flight()))
}

/// Awaits `future`, failing the test if it takes longer than [`idem_tests::DEADLINE`].
async fn deadline<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(idem_tests::DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {:?}", idem_tests::DEADLINE))
}

async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router
        .clone()
        .oneshot(request)
        .await
        .expect("the router is infallible");
    Reply::read(response).await
}

/// Asserts the 503 of a handler stopped at its 3 s timeout (long enough for a retry's body to
/// finish on a loaded machine), with the store's `Retry-After`.
fn assert_timed_out(reply: &Reply) {
    let kind = reply.problem(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(kind, ProblemKind::HandlerTimedOut.type_uri());
    assert_eq!(
        reply.header("retry-after"),
        Some("1"),
        "the store's retry_after"
    );
    let json = reply.json();
    assert_eq!(json["title"], ProblemKind::HandlerTimedOut.title());
    let detail = json["detail"].as_str().expect("a detail");
    assert!(
        detail.contains("took longer than 3s") && detail.contains("retry with the same key"),
        "{detail}"
    );
    assert!(!reply.replayed());
}

/// The app on `db`, its pool of one connection: a handler that kept it would stop every
/// request after it.
async fn on_one_connection(db: TestDb) -> App {
    let options = idem_tests::Options {
        connections: Some(1),
        ..idem_tests::Options::default()
    };
    App::build(db, options).await
}

/// The retry once the gate is open: the body ran again and completed (`call 2`), a first
/// execution, not a replay.
#[track_caller]
fn assert_ran_again(retry: &Reply, probe: &Probe) {
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed());
    assert_eq!(&retry.body[..], b"call 2");
    assert_eq!(
        (probe.started(), probe.finished()),
        (2, 1),
        "the body ran twice, finished once"
    );
}

/// One more `request` under the key: the retry's outcome, replayed without running the body.
async fn assert_replays_the_retry(router: &Router, request: Request<Body>, probe: &Probe) {
    let replay = deadline("the replay", send(router, request)).await;
    assert!(replay.replayed());
    assert_eq!(&replay.body[..], b"call 2");
    assert_eq!(probe.started(), 2, "a replay does not run the body");
}

/// How many connections `app`'s pool has open, idle or in use.
fn pool_size(app: &App) -> u32 {
    match &app.db {
        Db::Postgres(pool) => pool.size(),
        Db::Sqlite(pool) => pool.size(),
        Db::MySql(pool) => pool.size(),
    }
}

/// The `route` column of every effect row, sorted.
async fn effect_routes(app: &App) -> Vec<String> {
    let sql = "SELECT route FROM test_effects ORDER BY route";
    match &app.db {
        Db::Postgres(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
        Db::Sqlite(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
        Db::MySql(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
    }
    .expect("read effects")
}

backend_tests! {
    async fn a_transactional_handler_past_its_timeout_is_rolled_back_and_frees_its_key(db) {
        // One pooled connection: the stopped handler's transaction must give it back.
        let app = on_one_connection(db).await;
        let probe = Probe::new();
        let (router, in_flight) = routes(&app, &probe);
        let request = || Req::post("/stuck").tenant("t1").key("k1").build();

        let first = deadline("stopping the stuck handler", send(&router, request())).await;
        assert_timed_out(&first);
        assert_eq!(probe.started(), 1, "the body ran and wrote its row");
        assert_eq!(probe.finished(), 0, "the body was stopped at the gate");
        assert_eq!(in_flight(), 0, "the process holds no key");
        // The write was rolled back and nothing stored; the connection is back in the pool.
        let effects = deadline("reading on the single pooled connection", app.count("test_effects")).await;
        assert_eq!(effects, 0, "the stopped handler's write was not committed");
        assert_eq!(app.keys_named("k1").await, 0, "nothing was stored");
        assert_eq!(app.db_locks().await, 0, "no advisory lock is left");

        // The key is free: a retry runs the handler again, which completes this time.
        probe.open(1);
        let retry = deadline("the retry on the single pooled connection", send(&router, request())).await;
        assert_ran_again(&retry, &probe);
        assert_eq!(effect_routes(&app).await, ["stuck"], "only the retry's write is committed");
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));

        assert_replays_the_retry(&router, request(), &probe).await;
    }

    async fn a_transactional_handler_past_the_database_deadline_is_503_store_unavailable_and_its_connection_closed(db) {
        // One pooled connection: the abandoned one must be closed, and a new one opened.
        let app = on_one_connection(db).await;
        let probe = Probe::new();
        // The deadline (1 s) comes before the handler's own timeout (3 s).
        let settings = StoreOptions::default().with_database_timeout(Duration::from_secs(1));
        let (router, in_flight) = routes_with(&app, &probe, settings);
        let request = || Req::post("/stuck").tenant("t1").key("k1").build();

        let first = deadline("the request past its deadline", send(&router, request())).await;
        let kind = first.problem(StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(kind, ProblemKind::StoreUnavailable.type_uri(), "{:?}", first.body);
        assert_eq!(first.header("retry-after"), Some("1"), "the store's retry_after");
        let detail = first.json()["detail"].as_str().expect("a detail").to_owned();
        assert!(
            detail.contains("did not answer within 1s") && detail.contains("nothing was committed"),
            "{detail}"
        );
        assert_eq!((probe.started(), probe.finished()), (1, 0), "the body was stopped at the gate");
        assert_eq!(in_flight(), 0, "the process holds no key");
        // Its connection was closed, not given back to the pool with the transaction in it.
        idem_tests::wait_until("the abandoned connection to close", || async {
            pool_size(&app) == 0
        })
        .await;
        assert_eq!(app.count("test_effects").await, 0, "nothing was committed");
        assert_eq!(app.keys_named("k1").await, 0, "nothing was stored");
        idem_tests::wait_until("the server to let go of the key's lock", || async {
            app.db_locks().await == 0
        })
        .await;

        // The retry runs the handler on a new connection, and completes.
        probe.open(1);
        let retry = deadline("the retry", send(&router, request())).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
        assert_eq!(&retry.body[..], b"call 2");
        assert_eq!(effect_routes(&app).await, ["stuck"], "only the retry's write is committed");
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    }

    async fn an_external_handler_past_its_timeout_releases_its_claim(db) {
        let app = App::new(db).await;
        let probe = Probe::new();
        let (router, _) = routes(&app, &probe);
        let request = || Req::post("/stuck-external").tenant("t1").key("k1").build();

        let first = deadline("stopping the stuck handler", send(&router, request())).await;
        assert_timed_out(&first);
        assert_eq!(probe.started(), 1, "the body ran and made its side effect");
        assert_eq!(probe.finished(), 0, "the body was stopped at the gate");
        assert_eq!(app.keys_named("k1").await, 0, "the `started` claim was released");
        assert_eq!(app.keys_with_status("started").await, 0);

        // The key is free at once, long before the 5 s lease would end: a retry runs the
        // handler again, which completes this time.
        probe.open(1);
        let retry = deadline("the retry", send(&router, request())).await;
        assert_ran_again(&retry, &probe);
        // The side effect was made twice, under one derived key: a downstream service that
        // honours it executes it once.
        let effects = effect_routes(&app).await;
        assert_eq!(effects.len(), 2);
        assert_eq!(effects[0], effects[1], "both runs used the same derived key");
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));

        assert_replays_the_retry(&router, request(), &probe).await;
    }
}

/// A PostgreSQL handler stopped in the middle of a statement.
mod sleeping {
    use axum::{Router, http::StatusCode, routing::post};
    use idem_runtime::{Store, idempotent};
    use idem_tests::Tenant;
    use sqlx::{Postgres, Transaction};

    /// `/sleeping`.
    pub fn routes() -> Router<Store<Postgres>> {
        Router::new().route("/sleeping", post(sleeping))
    }

    /// Sleeps for an hour inside one statement.
    #[idempotent(scope = "tenant", timeout = "1s")]
    async fn sleeping(tenant: Tenant, tx: &mut Transaction<'_, Postgres>) -> (StatusCode, String) {
        let _ = sqlx::query("SELECT pg_sleep(3600)")
            .execute(&mut **tx)
            .await;
        (StatusCode::CREATED, tenant.0)
    }
}

/// Dropping the body does not stop a statement the server is running, and the rollback would
/// wait for it: the handler's transaction carries the timeout as PostgreSQL's
/// `statement_timeout`, so the statement ends too, and with it the hold on the key and the
/// pool's only connection.
#[sqlx::test(migrations = false)]
async fn a_handler_stuck_in_a_statement_is_stopped_and_frees_its_connection(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = on_one_connection(idem_tests::TestDb::Postgres(Box::new(connect))).await;
    let Db::Postgres(pool) = &app.db else {
        unreachable!("a PostgreSQL app")
    };
    let router = sleeping::routes().with_state(Store::new(pool.clone()));
    let request = || Req::post("/sleeping").tenant("t1").key("k1").build();
    let reply = deadline(
        "the answer of a handler stuck in pg_sleep(3600)",
        send(&router, request()),
    )
    .await;
    assert_eq!(
        reply.problem(StatusCode::SERVICE_UNAVAILABLE),
        ProblemKind::HandlerTimedOut.type_uri()
    );
    assert_eq!(app.db_locks().await, 0, "the key's lock is released");
    assert_eq!(app.count("idem_keys").await, 0);
    let entry = Req::post("/test/entries")
        .tenant("t1")
        .key("p1")
        .json(&idem_tests::entry(100, "n1"));
    let written = deadline("an entry on the freed connection", app.send(entry.build())).await;
    assert_eq!(written.status, StatusCode::CREATED);
}
