//! A database that stops answering (a partition: packets dropped, connections open, nothing
//! refused) and the store's database deadline (`StoreOptions::database_timeout`): a request in
//! flight is answered 503 with `Retry-After` within the deadline, wherever it was frozen (before
//! its claim, in its handler, around its COMMIT), its connection is closed rather than pooled,
//! and once the database answers again a retry with the same key completes it exactly once.
//!
//! PostgreSQL is put behind a [`PartitionProxy`], which holds bytes until the test heals it; on
//! SQLite the stall is a lock holder that never lets go until the test says so. Every test has
//! a deadline of [`TEST_DEADLINE`], and every answer must come within [`DATABASE_TIMEOUT`] and
//! a generous [`MARGIN`]: without the deadline, these requests wait as long as the partition.

use std::{future::Future, sync::atomic::Ordering, time::Duration};

use axum::http::StatusCode;
use idem_runtime::{ProblemKind, StoreOptions};
use idem_tests::{
    App, Cue, Db, Options, PartitionProxy, Reply, Req, TestDb, entry, until_called, wait_within,
};
use sqlx::{
    Connection,
    postgres::{PgConnectOptions, PgPoolOptions, PgSslMode},
};

/// The store's database deadline here.
const DATABASE_TIMEOUT: Duration = Duration::from_secs(2);

/// How late past [`DATABASE_TIMEOUT`] an answer may come on a loaded machine.
const MARGIN: Duration = Duration::from_secs(10);

/// How long a whole test may take: only a hang reaches it.
const TEST_DEADLINE: Duration = Duration::from_secs(30);

/// The store's settings: the defaults, with a short database deadline.
fn options() -> StoreOptions {
    StoreOptions::default().with_database_timeout(DATABASE_TIMEOUT)
}

/// Runs a test's body within [`TEST_DEADLINE`].
async fn within_test_deadline(body: impl Future<Output = ()>) {
    tokio::time::timeout(TEST_DEADLINE, body)
        .await
        .unwrap_or_else(|_| panic!("the test did not end within {TEST_DEADLINE:?}"));
}

/// Waits for `condition`, within the test's deadline, saying what it waited for.
async fn wait_for<F, Fut>(what: &str, condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_within(TEST_DEADLINE * 2 / 3, what, condition).await;
}

/// Sends `request` to `app`; its answer must come within the database deadline and the margin.
async fn answered(app: &App, request: &Req) -> Reply {
    tokio::time::timeout(DATABASE_TIMEOUT + MARGIN, app.send(request.build()))
        .await
        .unwrap_or_else(|_| {
            panic!("no answer within the database deadline ({DATABASE_TIMEOUT:?}) and {MARGIN:?}")
        })
}

/// [`answered`], in a task of its own.
fn spawn_answered(app: &App, request: Req) -> tokio::task::JoinHandle<Reply> {
    let app = app.clone();
    tokio::spawn(async move { answered(&app, &request).await })
}

/// Asserts a 503 problem of `kind` that says when to retry (the store's `retry_after`, 1 s).
fn assert_503(reply: &Reply, kind: ProblemKind) {
    assert_eq!(
        reply.problem(StatusCode::SERVICE_UNAVAILABLE),
        kind.type_uri()
    );
    assert_eq!(
        reply.header("retry-after"),
        Some("1"),
        "the store's retry_after"
    );
}

/// A new entry under `key`.
fn post(key: &str) -> Req {
    Req::post("/test/entries")
        .tenant("t1")
        .key(key)
        .json(&entry(100, "n1"))
}

/// The test app with [`options`] and a pool of `connections` (default 10), on the test's
/// PostgreSQL database behind a partition proxy.
async fn partitioned(connect: PgConnectOptions, connections: Option<u32>) -> (PartitionProxy, App) {
    let (proxy, through_proxy) = behind_a_partition_proxy(connect).await;
    let options = Options {
        store_options: options(),
        connections,
    };
    let app = App::build(TestDb::Postgres(Box::new(through_proxy)), options).await;
    (proxy, app)
}

/// A partition proxy in front of the server of `connect`, and the options that reach it through
/// the proxy.
async fn behind_a_partition_proxy(connect: PgConnectOptions) -> (PartitionProxy, PgConnectOptions) {
    let upstream = format!("{}:{}", connect.get_host(), connect.get_port());
    let proxy = PartitionProxy::postgres(upstream).await;
    let through_proxy = connect
        .host("127.0.0.1")
        .port(proxy.port())
        .ssl_mode(PgSslMode::Disable);
    (proxy, through_proxy)
}

/// Once healed, waits until the server has ended every transaction the timed-out requests
/// left (their connections were closed): no key's lock is held.
async fn until_no_lock(app: &App) {
    wait_for("the server to end the abandoned transactions", || async {
        app.db_locks().await == 0
    })
    .await;
}

/// Sends `request` again; it must run the handler (a first execution) and be stored, so that
/// one more copy replays it.
async fn retry_runs_once(app: &App, request: &Req) {
    let retry = answered(app, request).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed(), "the first execution");
    let again = answered(app, request).await;
    assert!(again.replayed(), "{}: {:?}", again.status, again.body);
    assert_eq!(again.body, retry.body);
}

/// The claim's message is held: the request never reaches its handler, and is answered 503
/// `StoreUnavailable` while the database is still unreachable.
#[sqlx::test(migrations = false)]
async fn a_request_frozen_before_its_claim_is_503_store_unavailable_and_its_retry_runs_once(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (proxy, app) = partitioned(connect, None).await;
        proxy.freeze_at(Cue::claim());
        let reply = answered(&app, &post("k1")).await;
        assert_eq!(proxy.cued(), 1, "the freeze began at the claim");
        assert!(
            proxy.is_frozen(),
            "answered while the database is unreachable"
        );
        assert_503(&reply, ProblemKind::StoreUnavailable);
        assert_eq!(app.calls.entries.load(Ordering::SeqCst), 0);

        proxy.heal();
        until_no_lock(&app).await;
        retry_runs_once(&app, &post("k1")).await;
        assert_eq!(app.count("test_entries").await, 1);
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    })
    .await;
}

/// The handler's INSERT is held: 503 `StoreUnavailable` (no COMMIT was sent); the server rolls
/// the request's transaction back when its connection closes, so nothing is committed, and the
/// retry runs the handler once more.
#[sqlx::test(migrations = false)]
async fn a_request_frozen_in_its_handler_is_503_store_unavailable_commits_nothing_and_its_retry_runs_once(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (proxy, app) = partitioned(connect, None).await;
        proxy.freeze_at(Cue::statement("INSERT INTO test_entries"));
        let reply = answered(&app, &post("k1")).await;
        assert_eq!(proxy.cued(), 1, "the freeze began at the handler's INSERT");
        assert!(
            proxy.is_frozen(),
            "answered while the database is unreachable"
        );
        assert_503(&reply, ProblemKind::StoreUnavailable);

        proxy.heal();
        until_no_lock(&app).await;
        assert_eq!(app.count("test_entries").await, 0, "nothing was committed");
        assert_eq!(app.keys_named("k1").await, 0);
        retry_runs_once(&app, &post("k1")).await;
        assert_eq!(app.calls.entries.load(Ordering::SeqCst), 2);
        assert_eq!(app.count("test_entries").await, 1);
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    })
    .await;
}

/// The COMMIT reaches the server and commits; its answer is held: the service cannot know, and
/// says so (503 `OutcomeUnknown`); the retry replays what was committed.
#[sqlx::test(migrations = false)]
async fn a_request_whose_commit_committed_unanswered_is_503_outcome_unknown_and_its_retry_replays(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (proxy, app) = partitioned(connect, None).await;
        proxy.freeze_after(Cue::commit());
        let reply = answered(&app, &post("k1")).await;
        assert_eq!(
            proxy.cued(),
            1,
            "the freeze began after the COMMIT was sent"
        );
        assert!(
            proxy.is_frozen(),
            "answered while the database is unreachable"
        );
        assert_503(&reply, ProblemKind::OutcomeUnknown);

        proxy.heal();
        let retry = answered(&app, &post("k1")).await;
        assert!(retry.replayed(), "{}: {:?}", retry.status, retry.body);
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(app.calls.entries.load(Ordering::SeqCst), 1);
        assert_eq!(app.count("test_entries").await, 1);
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    })
    .await;
}

/// The COMMIT itself is held, then dropped with its connection when the service closes it: 503
/// `OutcomeUnknown` (the service cannot tell this from the case above); the server rolled back,
/// and the retry runs the handler, a first execution.
#[sqlx::test(migrations = false)]
async fn a_request_whose_commit_never_arrived_is_503_outcome_unknown_and_its_retry_runs_the_handler(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (proxy, app) = partitioned(connect, None).await;
        proxy.freeze_at(Cue::commit());
        let reply = answered(&app, &post("k1")).await;
        assert_eq!(proxy.cued(), 1, "the freeze began at the COMMIT");
        assert!(
            proxy.is_frozen(),
            "answered while the database is unreachable"
        );
        assert_503(&reply, ProblemKind::OutcomeUnknown);
        wait_for(
            "the request's connection, its COMMIT held, to be closed",
            || async { proxy.abandoned() >= 1 },
        )
        .await;

        proxy.heal();
        until_no_lock(&app).await;
        assert_eq!(
            app.count("test_entries").await,
            0,
            "the COMMIT never arrived"
        );
        retry_runs_once(&app, &post("k1")).await;
        assert_eq!(app.calls.entries.load(Ordering::SeqCst), 2);
        assert_eq!(app.count("test_entries").await, 1);
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    })
    .await;
}

/// A timed-out request's connection is closed, not handed back to the pool: with one pooled
/// connection, the proxy sees its client close it while still frozen, and the pool holds no
/// connection; after heal the pool opens a new one and the retry completes.
#[sqlx::test(migrations = false)]
async fn the_connection_of_a_request_past_its_deadline_is_closed_not_pooled(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (proxy, app) = partitioned(connect, Some(1)).await;
        let Db::Postgres(pool) = &app.db else {
            unreachable!("a PostgreSQL app")
        };
        assert_eq!(pool.size(), 1, "the pool's one connection is open");
        let opened = proxy.connections();
        proxy.freeze_at(Cue::statement("INSERT INTO test_entries"));
        let reply = answered(&app, &post("k1")).await;
        assert_503(&reply, ProblemKind::StoreUnavailable);
        assert_eq!(
            proxy.connections(),
            opened,
            "the request ran on the pooled connection"
        );
        // A connection handed back to the pool would stay open (its return ping held).
        wait_for(
            "the timed-out request's connection to be closed",
            || async { proxy.abandoned() == 1 },
        )
        .await;
        assert!(proxy.is_frozen());
        assert_eq!(
            pool.size(),
            0,
            "the pool kept the timed-out request's connection"
        );

        proxy.heal();
        until_no_lock(&app).await;
        retry_runs_once(&app, &post("k1")).await;
        assert_eq!(app.count("test_entries").await, 1);
    })
    .await;
}

/// The service's close is lost in the partition too (the server hears nothing of the
/// timed-out request): the server ends the request's idle transaction by itself, at the
/// `idle_in_transaction_session_timeout` the claim set to the deadline, and the key is free
/// while the partition lasts; after heal the retry runs once.
#[sqlx::test(migrations = false)]
async fn a_server_that_never_hears_its_client_go_frees_the_key_by_itself(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        // Not through the proxy: it sees the server while the service cannot.
        let direct = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(connect.clone())
            .await
            .expect("connect to the test database");
        let (proxy, app) = partitioned(connect, None).await;
        proxy.lose_closes();
        proxy.freeze_at(Cue::statement("INSERT INTO test_entries"));
        let reply = answered(&app, &post("k1")).await;
        assert_503(&reply, ProblemKind::StoreUnavailable);
        wait_for("the service to close the request's connection", || async {
            proxy.abandoned() == 1
        })
        .await;
        wait_for("the server to end the vanished client's transaction", || async {
            let sql = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
            sqlx::query_scalar::<_, i64>(sql).fetch_one(&direct).await.unwrap() == 0
        })
        .await;
        assert!(proxy.is_frozen(), "the key was freed during the partition");

        proxy.heal();
        retry_runs_once(&app, &post("k1")).await;
        assert_eq!(app.count("test_entries").await, 1);
    })
    .await;
}

/// The whole database freezes with requests in every stage: two in their handlers waiting for
/// the test (their deadline passes there, or at their completion, which meets the freeze), one
/// frozen at its handler's INSERT, two sent
/// after the freeze (held before their claim, at the pool's test of an idle connection or a new
/// connection's startup). Every one is answered 503 `StoreUnavailable`
/// with `Retry-After` while the database is still unreachable; after heal, each key's retry
/// completes it exactly once.
#[sqlx::test(migrations = false)]
async fn every_request_in_flight_when_the_database_freezes_is_503_and_each_key_completes_once_after_heal(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (proxy, app) = partitioned(connect, None).await;
        let slow = |key: &str| Req::post("/test/slow").tenant("t1").key(key);
        let in_handler: Vec<_> = ["s1", "s2"]
            .into_iter()
            .map(|key| spawn_answered(&app, slow(key)))
            .collect();
        until_called(&app.calls.slow, 2).await;
        proxy.freeze_at(Cue::statement("INSERT INTO test_entries"));
        let at_insert = spawn_answered(&app, post("e1"));
        wait_for("the entry's INSERT to be held", || async {
            proxy.cued() == 1
        })
        .await;
        let before_claim: Vec<_> = ["b1", "b2"]
            .into_iter()
            .map(|key| spawn_answered(&app, post(key)))
            .collect();
        // The slow handlers answer; their completion meets the frozen database.
        app.gate.add_permits(2);

        let mut replies = Vec::new();
        for request in in_handler
            .into_iter()
            .chain([at_insert])
            .chain(before_claim)
        {
            replies.push(request.await.expect("the request's task"));
        }
        assert!(
            proxy.is_frozen(),
            "every answer came while the database is unreachable"
        );
        for reply in &replies {
            assert_503(reply, ProblemKind::StoreUnavailable);
        }

        proxy.heal();
        until_no_lock(&app).await;
        assert_eq!(app.count("idem_keys").await, 0, "nothing was committed");
        assert_eq!(app.count("test_entries").await, 0);
        assert_eq!(app.count("test_effects").await, 0);
        app.gate.add_permits(2);
        for key in ["s1", "s2"] {
            retry_runs_once(&app, &slow(key)).await;
        }
        for key in ["e1", "b1", "b2"] {
            retry_runs_once(&app, &post(key)).await;
        }
        assert_eq!(app.keys_with_status("completed").await, 5);
        assert_eq!(app.count("test_entries").await, 3);
        assert_eq!(app.count("test_effects").await, 2);
    })
    .await;
}

/// SQLite: another connection holds the write lock and does not let go (a stalled writer, the
/// SQLite form of a database that stops answering). Of two requests sent together, one takes
/// the store's one turn to write and waits for the lock in `BEGIN IMMEDIATE` (the pool's busy
/// timeout, 30 s, far longer than the deadline), the other queues for that turn; both are
/// answered 503 `StoreUnavailable` within the deadline, and once the holder lets go each retry
/// completes its key once.
#[tokio::test]
async fn a_request_behind_a_stalled_sqlite_lock_holder_is_503_store_unavailable_and_its_retry_runs_once()
 {
    within_test_deadline(async {
        let options = Options {
            store_options: options(),
            connections: None,
        };
        let app = App::build(TestDb::sqlite(), options).await;
        let Db::Sqlite(pool) = &app.db else {
            unreachable!("a SQLite app")
        };
        let mut holder = sqlx::SqliteConnection::connect_with(&pool.connect_options())
            .await
            .expect("open the SQLite file");
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut holder)
            .await
            .expect("take the write lock");

        let stalled = [
            spawn_answered(&app, post("k1")),
            spawn_answered(&app, post("k2")),
        ];
        for request in stalled {
            let reply = request.await.expect("the request's task");
            assert_503(&reply, ProblemKind::StoreUnavailable);
        }
        assert_eq!(app.calls.entries.load(Ordering::SeqCst), 0);

        sqlx::raw_sql("ROLLBACK")
            .execute(&mut holder)
            .await
            .expect("let the write lock go");
        until_no_lock(&app).await;
        for key in ["k1", "k2"] {
            retry_runs_once(&app, &post(key)).await;
        }
        assert_eq!(app.calls.entries.load(Ordering::SeqCst), 2);
        assert_eq!(app.count("test_entries").await, 2);
        assert_eq!(app.keys_with_status("completed").await, 2);
    })
    .await;
}

/// Two instances on the test's database: one reaching it directly, one behind a partition proxy
/// whose freezes last while the other instance runs a request (its database deadline is the
/// test's).
async fn two_instances_one_behind_a_proxy(connect: PgConnectOptions) -> (App, PartitionProxy, App) {
    let direct = App::new(TestDb::Postgres(Box::new(connect.clone()))).await;
    let (proxy, through_proxy) = behind_a_partition_proxy(connect).await;
    let options = Options {
        store_options: StoreOptions::default().with_database_timeout(TEST_DEADLINE),
        connections: None,
    };
    let app = App::build(TestDb::Postgres(Box::new(through_proxy)), options).await;
    (direct, proxy, app)
}

/// PostgreSQL: a duplicate at another instance claims the key while the first request's
/// `COMMIT` is at the server and its answer not yet back (held): the first's completion
/// committed with its writes, so the duplicate replays it (or, if it came before the server let
/// the key go, is 409), and never runs the handler.
#[sqlx::test(migrations = false)]
async fn a_duplicate_that_claims_while_the_first_commits_replays_and_never_runs_the_handler(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (direct, proxy, app) = two_instances_one_behind_a_proxy(connect).await;
        proxy.freeze_after(Cue::commit());
        let request = post("k1");
        let first = {
            let (app, request) = (app.clone(), request.clone());
            tokio::spawn(async move { app.send(request.build()).await })
        };
        wait_for("the first's COMMIT to reach the server", || async {
            proxy.cued() == 1
        })
        .await;
        wait_for("the first's commit to be visible", || async {
            direct.count("idem_keys").await == 1
        })
        .await;
        let duplicate = answered(&direct, &request).await;
        assert!(
            duplicate.replayed() || duplicate.status == StatusCode::CONFLICT,
            "{}: {:?}",
            duplicate.status,
            duplicate.body
        );
        assert_eq!(
            direct.calls.entries.load(Ordering::SeqCst),
            0,
            "never run here"
        );
        proxy.heal();
        let first = first.await.expect("the first request's task");
        assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
        let again = answered(&direct, &request).await;
        assert!(again.replayed(), "{}: {:?}", again.status, again.body);
        assert_eq!(again.body, first.body);
        assert_eq!(direct.count("test_entries").await, 1);
        assert_eq!(app.calls.entries.load(Ordering::SeqCst), 1);
    })
    .await;
}

/// PostgreSQL: a replay's transaction is given no transaction id, so its rollback writes
/// nothing (not even an abort record). Its `ROLLBACK`, sent as the connection goes back to the
/// pool, is held: the replayed answer is out, and the server shows the transaction open, idle,
/// without an id.
#[sqlx::test(migrations = false)]
async fn a_replays_transaction_is_given_no_transaction_id(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (direct, proxy, app) = two_instances_one_behind_a_proxy(connect).await;
        let request = post("k1");
        let first = answered(&app, &request).await;
        assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
        proxy.freeze_at(Cue::matching("the replay's ROLLBACK", |message| {
            message.kind() == Some(b'Q')
                && message
                    .sql()
                    .is_some_and(|sql| sql.trim().eq_ignore_ascii_case("ROLLBACK"))
        }));
        let replay = answered(&app, &request).await;
        assert!(replay.replayed(), "{}: {:?}", replay.status, replay.body);
        wait_for("the replay's ROLLBACK to be held", || async {
            proxy.cued() == 1
        })
        .await;
        let idem_tests::AnyStore::Postgres(store) = direct.store() else {
            unreachable!("a PostgreSQL app")
        };
        let idle: Vec<Option<String>> = sqlx::query_scalar(
            "SELECT backend_xid::text FROM pg_stat_activity \
             WHERE datname = current_database() AND state = 'idle in transaction'",
        )
        .fetch_all(store.pool())
        .await
        .expect("the server's sessions");
        assert_eq!(
            idle,
            vec![None],
            "one open transaction, the replay's, without an id"
        );
        proxy.heal();
        until_no_lock(&direct).await;
    })
    .await;
}

/// PostgreSQL: undoing the writes of a 5xx that is stored (`replay_5xx`) lets the key go for an
/// instant: one simple query rolls the transaction back, begins again and tries the lock again.
/// A transaction that was waiting for the key's lock takes it in that instant (here one that the
/// test queues on the lock while the undo is held at the proxy): the first request then answers
/// its own 5xx, not stored, and a retry runs the handler.
#[sqlx::test(migrations = false)]
async fn a_5xx_whose_key_is_taken_while_its_writes_are_undone_is_answered_not_stored(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    within_test_deadline(async {
        let (direct, proxy, app) = two_instances_one_behind_a_proxy(connect.clone()).await;
        proxy.freeze_at(Cue::statement("ROLLBACK; BEGIN"));
        let request = Req::post("/test/stored-5xx")
            .tenant("t1")
            .key("k1")
            .json(&entry(100, "n1"));
        let first = {
            let (app, request) = (app.clone(), request.clone());
            tokio::spawn(async move { app.send(request.build()).await })
        };
        wait_for("the 5xx's undo to be held", || async { proxy.cued() == 1 }).await;

        // Another transaction queues on the key's lock, which the first still holds.
        let mut other = sqlx::PgConnection::connect_with(&connect)
            .await
            .expect("connect");
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let waiter = tokio::spawn(async move {
            let mut tx = other.begin().await.expect("begin");
            sqlx::query(
                "SELECT pg_advisory_xact_lock((SELECT (classid::bigint << 32) | objid::bigint \
                 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())))",
            )
            .execute(&mut *tx)
            .await
            .expect("the key's lock, once the first lets it go");
            let _ = released.await;
            tx.rollback().await.expect("rollback");
        });
        wait_for(
            "the other transaction to wait for the key's lock",
            || async { waiting_for_advisory_locks(&direct).await == 1 },
        )
        .await;

        proxy.heal();
        let first = first.await.expect("the first request's task");
        assert_eq!(
            first.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{:?}",
            first.body
        );
        assert!(!first.replayed(), "its own answer");
        assert_eq!(
            first.header("retry-after"),
            None,
            "the handler's 503, not a problem of the store"
        );
        release.send(()).expect("the waiter holds the key");
        waiter.await.expect("the waiter's task");

        let retry = answered(&direct, &request).await;
        assert!(
            !retry.replayed(),
            "nothing was stored: the retry runs the handler"
        );
        assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(direct.calls.entries.load(Ordering::SeqCst), 1);
        let again = answered(&direct, &request).await;
        assert!(again.replayed(), "{}: {:?}", again.status, again.body);
        assert_eq!(
            direct.count("test_entries").await,
            0,
            "every 5xx's writes undone"
        );
    })
    .await;
}

/// How many advisory locks sessions of the test's database are waiting for.
async fn waiting_for_advisory_locks(app: &App) -> i64 {
    let idem_tests::AnyStore::Postgres(store) = app.store() else {
        unreachable!("a PostgreSQL app")
    };
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(store.pool())
    .await
    .expect("the server's locks")
}
