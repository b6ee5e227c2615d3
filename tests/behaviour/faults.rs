//! Every documented answer to a fault, on both backends where the fault exists: a COMMIT the
//! database refuses, a connection cut during COMMIT, an empty scope, an unreachable database, a
//! handler whose statement failed, a completion that fails, an exhausted pool; and two outcomes
//! that are easy to get wrong: a 3xx, and one handler nested under two prefixes.

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use idem_runtime::{
    ProblemKind, Store,
    tasks::{Purge, PurgeOptions, Recovery, RecoveryOptions, ReleaseAbandoned},
};
use idem_tests::{
    AnyStore, App, CommitCutter, Options, Parts, Req, TestApp, TestDb, backend_tests, entry,
    until_called,
};

fn post(key: &str) -> Req {
    Req::post("/test/entries")
        .tenant("t1")
        .key(key)
        .json(&entry(100, "n1"))
}

backend_tests! {
    async fn a_commit_the_database_refuses_is_500_commit_refused_and_stores_nothing(db) {
        let app = App::new(db).await;
        if app.is_mysql() {
            // MySQL checks every constraint at once: it has no deferred ones, and refuses a
            // COMMIT on one server only for a lost connection (tested as an unknown outcome).
            // A Galera cluster refuses one at certification: the cluster tests cover that.
            return;
        }
        let request = || Req::post("/test/deferred").tenant("t1").key("k1").build();
        let reply = app.send(request()).await;
        assert_eq!(
            reply.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::CommitRefused.type_uri()
        );
        assert_eq!(app.count("test_effects").await, 0, "the handler's writes were refused");
        assert_eq!(app.keys_named("k1").await, 0, "nothing was stored");
        let retry = app.send(request()).await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR, "the retry ran again");
        assert_eq!(app.calls.deferred.load(Ordering::SeqCst), 2);
    }

    // A scope with NUL cannot come from a header; the example's `hostile.rs` sends one through a path.
    async fn an_empty_or_overlong_scope_is_400_invalid_scope_and_stores_nothing(db) {
        let app = App::new(db).await;
        let request = |account: &str| {
            Req::post("/test/account").header("x-account", account).key("k1").build()
        };
        let long = "a".repeat(idem_runtime::MAX_SCOPE_LEN + 1);
        for (account, what) in [("", "is empty"), (long.as_str(), "bytes long")] {
            let reply = app.send(request(account)).await;
            assert_eq!(
                reply.problem(StatusCode::BAD_REQUEST),
                ProblemKind::InvalidScope.type_uri()
            );
            let detail = reply.json()["detail"].as_str().unwrap().to_owned();
            assert!(detail.contains(what), "{detail}");
        }
        assert_eq!(app.count("idem_keys").await, 0);
        let fits = "a".repeat(idem_runtime::MAX_SCOPE_LEN);
        assert_eq!(app.send(request(&fits)).await.status, StatusCode::CREATED);
        // The same key under a real scope is a first request.
        let reply = app.send(request("acct_1")).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
    }

    async fn a_failed_statement_in_the_handler_keeps_its_answer_as_the_database_allows(db) {
        let app = App::new(db).await;
        let request = || Req::post("/test/aborted").tenant("t1").key("k1").build();
        let first = app.send(request()).await;
        assert_eq!(first.status, StatusCode::CREATED, "the handler's answer stands");
        assert_eq!(&first.body[..], b"call 1");
        let second = app.send(request()).await;
        if app.is_postgres() {
            // PostgreSQL aborted the transaction at the failed statement: nothing can be
            // committed with the answer, so nothing is stored and a retry runs again.
            assert_eq!(app.count("test_effects").await, 0);
            assert_eq!(app.keys_named("k1").await, 0);
            assert!(!second.replayed());
            assert_eq!(&second.body[..], b"call 2");
        } else {
            // SQLite and MySQL undo the failed statement alone: the answer is stored with the
            // writes.
            assert_eq!(app.count("test_effects").await, 1);
            assert!(second.replayed());
            assert_eq!(&second.body[..], b"call 1");
        }
    }

    async fn a_completion_that_fails_rolls_back_the_handlers_writes(db) {
        let app = App::new(db).await;
        // The key table refuses this one key, as a full disk or a lost privilege would.
        if app.is_postgres() {
            app.execute(
                "CREATE FUNCTION test_poison() RETURNS trigger LANGUAGE plpgsql AS $$ \
                 BEGIN IF NEW.key = 'poison' THEN RAISE EXCEPTION 'poisoned key'; END IF; \
                 RETURN NEW; END $$; \
                 CREATE TRIGGER test_poison BEFORE INSERT OR UPDATE ON idem_keys \
                 FOR EACH ROW EXECUTE FUNCTION test_poison();",
            )
            .await;
        } else if app.is_mysql() {
            // MySQL's claim inserts the key's row and its completion updates it.
            app.execute(
                "CREATE TRIGGER test_poison BEFORE UPDATE ON idem_keys FOR EACH ROW \
                 BEGIN IF NEW.`key` = 'poison' THEN \
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'poisoned key'; END IF; END",
            )
            .await;
        } else {
            app.execute(
                "CREATE TRIGGER test_poison BEFORE INSERT ON idem_keys WHEN NEW.key = 'poison' \
                 BEGIN SELECT RAISE(ABORT, 'poisoned key'); END;",
            )
            .await;
        }
        let reply = app.send(post("poison").build()).await;
        assert_eq!(
            reply.problem(StatusCode::SERVICE_UNAVAILABLE),
            ProblemKind::StoreUnavailable.type_uri()
        );
        assert_eq!(app.count("test_entries").await, 0, "the entry was rolled back with the key");
        assert_eq!(app.count("idem_keys").await, 0, "the claim was rolled back too");
        assert_eq!(app.send(post("fine").build()).await.status, StatusCode::CREATED);
        assert_eq!(app.count("test_entries").await, 1);
    }

    async fn a_handler_that_ends_its_transaction_itself_gets_its_outcome_refused(db) {
        // One pooled connection: every request below runs on the connection the previous ones
        // left behind, so one left counted as inside a transaction would fail them all.
        let options = Options { connections: Some(1), ..Options::default() };
        let app = App::build(db, options).await;
        for (key, how) in [("k1", "commit"), ("k2", "rollback"), ("k3", "commit-begin")] {
            let request = || Req::post("/test/ends-its-transaction").tenant("t1").key(key).json(how);
            let reply = app.send(request().build()).await;
            assert_eq!(
                reply.problem(StatusCode::INTERNAL_SERVER_ERROR),
                ProblemKind::CommitRefused.type_uri(),
                "{how}"
            );
            // (MySQL: a handler's COMMIT commits the claim's row, which is expired from the
            // start: the retry takes it over.)
            assert_eq!(app.live_keys_named(key).await, 0, "{how}: no outcome was stored");
            // Nothing holds the key: a retry runs the handler again (and is refused again).
            let retry = app.send(request().build()).await;
            assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR, "{how}");
            assert!(!retry.replayed());
        }
        for how in ["commit+503", "rollback+503"] {
            let request = Req::post("/test/ends-its-transaction").tenant("t1").key("k5").json(how);
            let reply = app.send(request.build()).await;
            assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{how}");
        }
        assert_eq!(app.live_keys().await, 0);
        // The connection is whole: a request after them all completes and is stored.
        let after = app.send(Req::post("/test/entries").tenant("t1").key("k6").json(&idem_tests::entry(1, "n")).build()).await;
        assert_eq!(after.status, StatusCode::CREATED, "{:?}", after.body);
        assert_eq!(app.keys_named("k6").await, 1);
    }

    async fn a_3xx_outcome_is_stored_and_replayed_with_its_location(db) {
        let app = App::new(db).await;
        let request = || Req::post("/test/redirect").tenant("t1").key("k1").build();
        let first = app.send(request()).await;
        assert_eq!(first.status, StatusCode::SEE_OTHER);
        assert_eq!(first.header("location"), Some("/test/elsewhere/1"));
        let second = app.send(request()).await;
        assert!(second.replayed());
        assert_eq!(second.status, StatusCode::SEE_OTHER);
        assert_eq!(second.header("location"), Some("/test/elsewhere/1"));
        assert_eq!(second.body, first.body);
        assert_eq!(app.calls.redirect.load(Ordering::SeqCst), 1);
        assert_eq!(app.count("test_effects").await, 1);
    }

    async fn one_key_under_two_nest_prefixes_is_two_different_requests(db) {
        let app = App::new(db).await;
        app.gate.add_permits(1);
        let first = app
            .send(Req::post("/test/nest-a/x").tenant("t1").key("k1").build())
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        let other = app
            .send(Req::post("/test/nest-b/x").tenant("t1").key("k1").build())
            .await;
        assert_eq!(
            other.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        let detail = other.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("POST /test/nest-a/x"), "the full path is fingerprinted: {detail}");
        assert_eq!(app.calls.slow.load(Ordering::SeqCst), 1);
    }

    async fn a_duplicate_while_every_pooled_connection_is_busy_gets_409_at_once(db) {
        let options = Options { connections: Some(1), ..Options::default() };
        let app = App::build(db, options).await;
        let first = tokio::spawn({
            let app = app.clone();
            async move { app.send(Req::post("/test/slow").tenant("t1").key("k1").build()).await }
        });
        // The running handler holds the pool's only connection.
        until_called(&app.calls.slow, 1).await;
        let duplicate = app.send(Req::post("/test/slow").tenant("t1").key("k1").build()).await;
        // Waiting for a connection would end in the pool's timeout (a 503), not a 409.
        assert_eq!(
            duplicate.problem(StatusCode::CONFLICT),
            ProblemKind::InProgress.type_uri()
        );
        assert!(!first.is_finished());
        app.gate.add_permits(1);
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    }

    async fn problem_types_follow_the_stores_base(db) {
        let settings = idem_runtime::StoreOptions::default().with_problem_type_base("https://api.example.com/problems#".to_owned());
        let app = App::build(db, Options { store_options: settings, ..Options::default() }).await;
        let missing = app
            .send(Req::post("/test/entries").tenant("t1").json(&entry(100, "n1")).build())
            .await;
        assert_eq!(
            missing.problem(StatusCode::BAD_REQUEST),
            "https://api.example.com/problems#missingkey"
        );
        app.send(post("k1").build()).await;
        let reused = app
            .send(Req::post("/test/entries").tenant("t1").key("k1").json(&entry(7, "n1")).build())
            .await;
        assert_eq!(
            reused.problem(StatusCode::UNPROCESSABLE_ENTITY),
            "https://api.example.com/problems#keyreused"
        );
        // A step's error is made by the handler, where the store's settings are not seen.
        let step_failed = app
            .send(
                Req::post("/test/orders")
                    .tenant("t1")
                    .key("o1")
                    .json(r#"{"units": 2}"#)
                    .header("x-repeat", "take")
                    .build(),
            )
            .await;
        assert_eq!(
            step_failed.problem(StatusCode::INTERNAL_SERVER_ERROR),
            "https://api.example.com/problems#stepfailed"
        );
    }
}

/// A proxy in front of the test's PostgreSQL server, and the options that connect through it.
async fn behind_a_proxy(
    connect: sqlx::postgres::PgConnectOptions,
) -> (CommitCutter, sqlx::postgres::PgConnectOptions) {
    let upstream = format!("{}:{}", connect.get_host(), connect.get_port());
    let proxy = CommitCutter::start(upstream).await;
    let through_proxy = connect
        .host("127.0.0.1")
        .port(proxy.port())
        .ssl_mode(sqlx::postgres::PgSslMode::Disable);
    (proxy, through_proxy)
}

/// PostgreSQL only (SQLite has no connection to cut): the COMMIT reaches the server and
/// commits, but its answer never reaches the service.
#[sqlx::test(migrations = false)]
async fn a_connection_cut_during_commit_is_503_outcome_unknown_with_retry_after_and_the_retry_replays(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let (proxy, through_proxy) = behind_a_proxy(connect).await;
    let app = App::new(TestDb::Postgres(Box::new(through_proxy))).await;

    proxy.arm();
    let reply = app.send(post("k1").build()).await;
    assert_eq!(
        proxy.cuts(),
        1,
        "the entry's COMMIT was cut after the server answered"
    );
    assert_eq!(
        reply.problem(StatusCode::SERVICE_UNAVAILABLE),
        ProblemKind::OutcomeUnknown.type_uri()
    );
    assert_eq!(
        reply.header("retry-after"),
        Some("1"),
        "the store's retry_after"
    );
    // The server committed: the entry and its key are there, and the retry replays them.
    assert_eq!(app.count("test_entries").await, 1);
    assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    let retry = app.send(post("k1").build()).await;
    assert!(retry.replayed(), "{}: {:?}", retry.status, retry.body);
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(app.count("test_entries").await, 1);
}

/// PostgreSQL only: a request dropped while its `BEGIN`, which carries the key's lock, is on the
/// wire (its client went away) leaves neither the lock nor a transaction behind on the pooled
/// connection: the claim runs to its end and its transaction is rolled back.
#[sqlx::test(migrations = false)]
async fn a_request_dropped_during_its_claim_leaves_the_key_free(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let (proxy, through_proxy) = behind_a_proxy(connect).await;
    // One pooled connection: whatever the dropped claim leaves on it, the next request meets.
    let options = Options {
        connections: Some(1),
        ..Options::default()
    };
    let app = App::build(TestDb::Postgres(Box::new(through_proxy)), options).await;

    proxy.hold_next_claim();
    let request = tokio::spawn({
        let app = app.clone();
        async move { app.send(post("k1").build()).await }
    });
    idem_tests::wait_until("the claim's answer to be held", || async {
        proxy.held() == 1
    })
    .await;
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
    proxy.release();

    let locks = tokio::time::timeout(idem_tests::DEADLINE, app.db_locks())
        .await
        .expect("the pooled connection answers");
    assert_eq!(locks, 0, "no lock is left behind");
    let retry = app.send(post("k1").build()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed());
}

/// Nothing listens where the pool points, and sqlx keeps retrying the connection until the
/// pool's acquire timeout (an hour here): the answer is a 503 at the store's own
/// `StoreOptions::acquire_timeout` (5 s), well within the test's deadline.
#[tokio::test]
async fn an_unreachable_postgres_is_503_store_unavailable_without_waiting_for_the_pool() {
    let port = idem_tests::reserve_port();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(3600))
        .connect_lazy_with(
            sqlx::postgres::PgConnectOptions::new()
                .host("127.0.0.1")
                .port(port)
                .username("postgres"),
        );
    store_unavailable(AnyStore::Postgres(Store::new(pool))).await;
}

/// A SQLite file that cannot be opened (its directory does not exist).
#[tokio::test]
async fn an_unopenable_sqlite_file_is_503_store_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(3600))
        .connect_lazy_with(
            sqlx::sqlite::SqliteConnectOptions::new().filename(dir.path().join("missing/dir/x.db")),
        );
    store_unavailable(AnyStore::Sqlite(Store::new(pool))).await;
}

/// Sends an entry to the test app over `store` and checks the answer is 503
/// `StoreUnavailable` with `Retry-After`, and that it came before the test's deadline (the pools here would wait
/// an hour).
async fn store_unavailable(store: AnyStore) {
    let reply = send_to_test_app(store, post("k1").build()).await;
    assert_eq!(
        reply.problem(StatusCode::SERVICE_UNAVAILABLE),
        ProblemKind::StoreUnavailable.type_uri()
    );
    assert_eq!(
        reply.header("retry-after"),
        Some("1"),
        "the store's retry_after"
    );
}

/// Sends `request` to the test app over `store`, within the test's deadline.
async fn send_to_test_app(
    store: AnyStore,
    request: axum::http::Request<axum::body::Body>,
) -> idem_tests::Reply {
    let parts = Parts {
        store: store.clone(),
        calls: std::sync::Arc::default(),
        gate: std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let router = match store {
        AnyStore::Postgres(store) => TestApp::default().routes(store, parts),
        AnyStore::Sqlite(store) => TestApp::default().routes(store, parts),
        AnyStore::MySql(store) => TestApp::default().routes(store, parts),
    };
    tokio::time::timeout(idem_tests::DEADLINE, async {
        let response = tower::ServiceExt::oneshot(router, request).await.unwrap();
        idem_tests::Reply::read(response).await
    })
    .await
    .expect("the answer did not wait for the pool's acquire timeout")
}

/// A store over a PostgreSQL database that `migrate` never ran on.
#[sqlx::test(migrations = false)]
async fn a_store_never_migrated_on_postgres_says_to_run_migrate_in_its_answer_and_its_log(
    pool: sqlx::PgPool,
) {
    not_migrated(AnyStore::Postgres(Store::new(pool))).await;
}

/// A store over a new SQLite file that `migrate` never ran on.
#[tokio::test]
async fn a_store_never_migrated_on_sqlite_says_to_run_migrate_in_its_answer_and_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let pool = sqlx::sqlite::SqlitePoolOptions::new().connect_lazy_with(
        sqlx::sqlite::SqliteConnectOptions::new()
            .filename(dir.path().join("new.db"))
            .create_if_missing(true),
    );
    not_migrated(AnyStore::Sqlite(Store::new(pool))).await;
}

/// A store over a MySQL database that `migrate` never ran on.
#[tokio::test]
async fn a_store_never_migrated_on_mysql_says_to_run_migrate_in_its_answer_and_its_log() {
    let database = idem_tests::MySqlDb::create().await;
    let name = database.name().to_owned();
    {
        let pool =
            sqlx::mysql::MySqlPoolOptions::new().connect_lazy_with(database.options().clone());
        not_migrated(AnyStore::MySql(Store::new(pool))).await;
    }
    idem_tests::MySqlDb::drop_named(&name).await;
}

/// Sends a transactional and an external request to the test app over `store`, whose
/// database has no key table, and checks that each is a 500 `StoreNotSetUp` without
/// `Retry-After`, and that the answers and the errors logged name
/// `idem_runtime::migrate`.
async fn not_migrated(store: AnyStore) {
    let log = idem_tests::CapturedLog::default();
    let _guard = tracing::subscriber::set_default(log.subscriber());
    let external = Req::post("/test/external-slow")
        .tenant("t1")
        .key("k2")
        .build();
    for request in [post("k1").build(), external] {
        let path = request.uri().path().to_owned();
        let reply = send_to_test_app(store.clone(), request).await;
        assert_eq!(
            reply.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::StoreNotSetUp.type_uri()
        );
        assert!(
            reply.header("retry-after").is_none(),
            "{path}: a setup error invites no retry"
        );
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("idem_runtime::migrate"), "{path}: {detail}");
    }
    let logged = log.text();
    assert!(
        logged.contains("ERROR") && logged.contains("idem_runtime::migrate"),
        "the log does not say to run migrate:\n{logged}"
    );
    // The background tasks say it too, so that a service with no traffic shows it.
    let stop = idem_runtime::CancellationToken::new();
    let purge = PurgeOptions::default();
    let recovery = RecoveryOptions::default();
    let tasks = match store {
        AnyStore::Postgres(store) => [
            Purge::new(store.clone(), purge).spawn(stop.clone()),
            Recovery::new(store, ReleaseAbandoned, recovery).spawn(stop.clone()),
        ],
        AnyStore::Sqlite(store) => [
            Purge::new(store.clone(), purge).spawn(stop.clone()),
            Recovery::new(store, ReleaseAbandoned, recovery).spawn(stop.clone()),
        ],
        AnyStore::MySql(store) => [
            Purge::new(store.clone(), purge).spawn(stop.clone()),
            Recovery::new(store, ReleaseAbandoned, recovery).spawn(stop.clone()),
        ],
    };
    for task in ["purging", "recovering"] {
        idem_tests::wait_until(
            &format!("the {task} task to say to run migrate"),
            || async {
                log.text()
                    .lines()
                    .any(|line| line.contains(task) && line.contains("idem_runtime::migrate"))
            },
        )
        .await;
    }
    for task in tasks {
        task.stop().await.expect("the task ends");
    }
}

/// Creates `test_at_commit()` with `function` (PL/pgSQL, and what it needs) and runs it as a
/// deferred trigger of `test_effects`, so at the COMMIT of each transaction that wrote there;
/// then sends `/test/flaky` with the key `k1` twice and returns the second answer. The first
/// call answers 503 and is rolled back (the trigger does not run); the second writes and
/// answers 201, and its COMMIT runs the trigger.
async fn flaky_at_commit(app: &App, function: &'static str) -> idem_tests::Reply {
    app.execute(function).await;
    app.execute(
        "CREATE CONSTRAINT TRIGGER test_at_commit AFTER INSERT ON test_effects \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_at_commit();",
    )
    .await;
    let request = || Req::post("/test/flaky").tenant("t1").key("k1").build();
    assert_eq!(
        app.send(request()).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    app.send(request()).await
}

/// A commit the database refuses because the transaction lost a conflict with another
/// (SQLSTATE 40001, as a multi-primary cluster answers the loser of two duplicates that
/// committed at different nodes) is a 409 with `Retry-After`, never a 500: nothing is stored,
/// and retrying is what the client should do. A deferred constraint trigger refuses the commit
/// here, as a cluster's certification would.
#[sqlx::test(migrations = false)]
async fn postgres_a_commit_refused_for_a_conflict_is_409_with_retry_after_and_stores_nothing(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = App::new(TestDb::Postgres(Box::new(connect))).await;
    let reply = flaky_at_commit(
        &app,
        "CREATE FUNCTION test_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN RAISE EXCEPTION 'lost a conflict' USING ERRCODE = 'serialization_failure'; END $$;",
    )
    .await;
    assert_eq!(
        reply.problem(StatusCode::CONFLICT),
        ProblemKind::InProgress.type_uri(),
        "{:?}",
        reply.body
    );
    assert_eq!(reply.header("retry-after"), Some("1"));
    let detail = reply.json()["detail"]
        .as_str()
        .expect("a detail")
        .to_owned();
    assert!(
        detail.contains("conflicted with another transaction"),
        "{detail}"
    );
    assert_eq!(
        app.count("test_effects").await,
        0,
        "the handler's writes were not committed"
    );
    assert_eq!(app.keys_named("k1").await, 0, "nothing was stored");
    // Nobody else committed the request: the retry runs it again.
    let retry = app
        .send(Req::post("/test/flaky").tenant("t1").key("k1").build())
        .await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert!(!retry.replayed());
    assert_eq!(app.calls.flaky.load(Ordering::SeqCst), 3);
}

/// A handler whose connection is ended mid-body (an administrator's `pg_terminate_backend` or
/// `KILL`, as a failover ends every connection to the old primary) meets the fault at its next
/// statement and answers 500, as a handler that passes its errors on does. Its transaction
/// cannot be rolled back on a connection that is gone, and nothing of it was committed: the
/// client gets a 503 with `Retry-After`, and the retry runs the handler again.
async fn a_handler_whose_connection_ends_is_503_with_retry_after_and_the_retry_runs_again(
    db: TestDb,
) {
    let app = App::new(db).await;
    let request = || {
        Req::post("/test/slow-then-write")
            .tenant("t1")
            .key("k1")
            .build()
    };
    let first = tokio::spawn({
        let app = app.clone();
        async move { app.send(request()).await }
    });
    until_called(&app.calls.slow_then_write, 1).await;
    assert_eq!(
        app.end_connections_in_transactions().await,
        1,
        "the handler's connection, inside its transaction"
    );
    // Both the first call and the retry go past the gate.
    app.gate.add_permits(2);
    let reply = first.await.expect("the first request");
    assert_eq!(
        reply.problem(StatusCode::SERVICE_UNAVAILABLE),
        ProblemKind::StoreUnavailable.type_uri(),
        "{:?}",
        reply.body
    );
    assert_eq!(
        reply.header("retry-after"),
        Some("1"),
        "the store's retry_after"
    );
    assert_eq!(app.count("test_effects").await, 0, "nothing was committed");
    assert_eq!(app.keys_named("k1").await, 0, "nothing was stored");
    let retry = app.send(request()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed());
    assert_eq!(app.calls.slow_then_write.load(Ordering::SeqCst), 2);
    assert_eq!(app.count("test_effects").await, 2, "the retry's two writes");
}

#[sqlx::test(migrations = false)]
async fn postgres_a_handler_whose_connection_ends_is_503_with_retry_after_and_the_retry_runs_again(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    a_handler_whose_connection_ends_is_503_with_retry_after_and_the_retry_runs_again(
        TestDb::Postgres(Box::new(connect)),
    )
    .await;
}

#[tokio::test]
async fn mysql_a_handler_whose_connection_ends_is_503_with_retry_after_and_the_retry_runs_again() {
    let database = idem_tests::MySqlDb::create().await;
    let name = database.name().to_owned();
    a_handler_whose_connection_ends_is_503_with_retry_after_and_the_retry_runs_again(
        TestDb::MySql(Box::new(database)),
    )
    .await;
    idem_tests::MySqlDb::drop_named(&name).await;
}

/// PostgreSQL: a server that ends the session while it commits (here the transaction's own
/// deferred trigger terminates its backend once, as a primary shut down or failed over answers
/// `57P01` to a COMMIT waiting on its standby) is a 503 `OutcomeUnknown` with `Retry-After`,
/// never a 500: the transaction may have committed, and only the retry can tell.
#[sqlx::test(migrations = false)]
async fn postgres_a_session_ended_during_commit_is_503_outcome_unknown_and_the_retry_runs_again(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = App::new(TestDb::Postgres(Box::new(connect))).await;
    // A sequence is not rolled back with its transaction: the trigger ends one session only.
    let reply = flaky_at_commit(
        &app,
        "CREATE SEQUENCE test_ended; \
         CREATE FUNCTION test_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF nextval('test_ended') = 1 THEN PERFORM pg_terminate_backend(pg_backend_pid()); \
         END IF; RETURN NULL; END $$;",
    )
    .await;
    let request = || Req::post("/test/flaky").tenant("t1").key("k1").build();
    assert_eq!(
        reply.problem(StatusCode::SERVICE_UNAVAILABLE),
        ProblemKind::OutcomeUnknown.type_uri(),
        "{:?}",
        reply.body
    );
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(
        app.count("test_effects").await,
        0,
        "the session ended before its commit"
    );
    assert_eq!(app.keys_named("k1").await, 0, "nothing was stored");
    let retry = app.send(request()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed());
    assert_eq!(app.calls.flaky.load(Ordering::SeqCst), 3);
}

/// PostgreSQL: a database that became read-only (a standby after a failover, or
/// `default_transaction_read_only`) refuses the claim with `25006`: a 503 with `Retry-After`,
/// nothing run, and once it takes writes again the retry runs the handler.
#[sqlx::test(migrations = false)]
async fn postgres_a_read_only_database_is_503_with_retry_after_and_runs_nothing(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let database = connect
        .get_database()
        .expect("sqlx::test names the database")
        .to_owned();
    // One pooled connection, ended below so that the next request opens it again.
    let options = Options {
        connections: Some(1),
        ..Options::default()
    };
    let app = App::build(TestDb::Postgres(Box::new(connect.clone())), options).await;
    // One connection, so that `pg_backend_pid()` is the same in each of its statements.
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect)
        .await
        .expect("an administrator's connection");
    let read_only = async |on: bool| {
        let set = format!(
            "ALTER DATABASE \"{database}\" SET default_transaction_read_only = {on}; \
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(set))
            .execute(&admin)
            .await
            .expect("switch the database's default");
        idem_tests::wait_until("the app's connection to be ended", || async {
            let others: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_one(&admin)
            .await
            .expect("count the other connections");
            others == 0
        })
        .await;
    };
    let request = || post("k1").build();
    read_only(true).await;
    let reply = app.send(request()).await;
    assert_eq!(
        reply.problem(StatusCode::SERVICE_UNAVAILABLE),
        ProblemKind::StoreUnavailable.type_uri(),
        "{:?}",
        reply.body
    );
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(
        app.calls.entries.load(Ordering::SeqCst),
        0,
        "the handler did not run"
    );
    read_only(false).await;
    let retry = app.send(request()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(app.calls.entries.load(Ordering::SeqCst), 1);
}
