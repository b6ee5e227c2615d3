//! Multi-step handlers (`Steps`): recovery points recorded on the key, a retry or a takeover
//! resuming after the last one, a step fenced by the claim it runs under, and the recovery of
//! abandoned claims with steps, on both backends, through the test app's `POST /test/orders`.

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use idem_runtime::{
    ProblemKind, StepError,
    admin::Unparked,
    tasks::{AbandonedClaim, RecoveryHook, RecoveryOptions, ReleaseAbandoned, Verdict},
};
use idem_tests::{
    App, Downstream, Param, Req, TestBackend, backend_tests, unreachable_url, wait_until,
};
use serde_json::{Value, json};

fn order(key: &str) -> Req {
    Req::post("/test/orders")
        .tenant("t1")
        .key(key)
        .json(r#"{"units": 2}"#)
}

/// How many times each step of `POST /test/orders` ran: (take, transfer, book).
fn runs(app: &App) -> (usize, usize, usize) {
    (
        app.calls.take.load(Ordering::SeqCst),
        app.calls.transfer.load(Ordering::SeqCst),
        app.calls.book.load(Ordering::SeqCst),
    )
}

/// Gives back what an abandoned order's `take` step took, as a step of its own, then releases
/// the key: the compensation an application's hook would run.
struct GiveBack;

impl<DB: TestBackend> RecoveryHook<DB> for GiveBack {
    async fn recover(&self, claim: AbandonedClaim<DB>) -> Verdict {
        let steps = claim.steps();
        assert_eq!(steps.recovery_point().as_deref(), Some("take"));
        let taken: Value = steps.output("take").unwrap().expect("take was recorded");
        let units = taken["units"].as_i64().unwrap();
        let given_back = steps
            .step("give-back", async |conn| {
                let sql = "INSERT INTO test_stock_moves (tenant, units) VALUES ($1, $2)";
                DB::execute(conn, sql, &[Param::Text("t1"), Param::Int(units)])
                    .await
                    .map_err(StepError::database)
            })
            .await;
        match given_back {
            Ok(_) => Verdict::Release,
            Err(_) => Verdict::Keep,
        }
    }
}

/// A compensation that fails every time: the stock cannot be given back.
struct GiveBackFails;

impl<DB: TestBackend> RecoveryHook<DB> for GiveBackFails {
    async fn recover(&self, claim: AbandonedClaim<DB>) -> Verdict {
        assert_eq!(claim.steps().recovery_point().as_deref(), Some("take"));
        Verdict::Failed("the stock service refused the give-back".into())
    }
}

backend_tests! {
    async fn a_claim_with_steps_whose_compensation_keeps_failing_is_parked_with_its_steps(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let failed = app.send(order("o1").header("x-fail-after", "take").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);

        let options = RecoveryOptions::default().with_max_attempts(2);
        let report = app.recover_with(&GiveBackFails, &options).await;
        assert_eq!((report.found, report.kept), (1, 1), "{report:?}");
        app.lapse_lease("o1").await;
        let report = app.recover_with(&GiveBackFails, &options).await;
        assert_eq!((report.found, report.parked), (1, 1), "{report:?}");

        // Parked: the retry does not resume after `take` as it would for a lapsed claim.
        let retry = app.send(order("o1").build()).await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(retry.json()["type"], ProblemKind::ClaimParked.type_uri());
        assert_eq!(runs(&app), (1, 0, 0), "nothing ran again");
        assert_eq!(app.recorded_steps("o1").await, ["take"], "the steps are kept");
        let parked = app.store().parked().await.expect("list parked claims");
        assert_eq!(
            parked[0].last_error.as_deref(),
            Some("the stock service refused the give-back")
        );

        // Resumed, the recovery's hook sees the steps again and can compensate.
        assert_eq!(app.store().resume_parked("t1", "o1").await.unwrap(), Unparked::Done);
        let report = app.recover(&GiveBack).await;
        assert_eq!((report.found, report.released), (1, 1), "{report:?}");
        assert_eq!(app.units_taken().await, 0, "the stock was given back");
        let retry = app.send(order("o1").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
    }

    async fn a_retry_after_a_5xx_resumes_after_the_last_recorded_step(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let failed = app.send(order("o1").header("x-fail-after", "take").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.recorded_steps("o1").await, ["take"]);
        assert_eq!(runs(&app), (1, 0, 0));

        let retry = app.send(order("o1").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&retry.body));
        assert!(!retry.replayed());
        assert_eq!(runs(&app), (1, 1, 1), "the recorded take did not run again");
        assert_eq!(retry.json()["take"], json!({ "units": 2 }), "its recorded output");
        assert_eq!(app.units_taken().await, 2);
        assert_eq!(app.count("test_bookings").await, 1);
        assert_eq!(downstream.executed(), 1);
        assert_eq!(app.recorded_steps("o1").await, ["take", "transfer", "book"]);

        let replay = app.send(order("o1").build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, retry.body);
        assert_eq!(runs(&app), (1, 1, 1));
    }

    async fn a_panic_after_a_recorded_step_keeps_it_for_the_retry(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let panicked = app.send(order("o1").header("x-panic-after", "take").build()).await;
        assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
        // The dropped claim lets go of the key in a task of its own.
        wait_until("the panicked claim's lease to end", || async {
            let retry = app.send(order("o1").build()).await;
            retry.status == StatusCode::CREATED
        })
        .await;
        assert_eq!(runs(&app), (1, 1, 1), "take was kept and not run again");
        assert_eq!(app.units_taken().await, 2);
    }

    async fn a_retry_after_an_external_step_was_recorded_does_not_call_again(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let failed = app.send(order("o1").header("x-fail-after", "transfer").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.recorded_steps("o1").await, ["take", "transfer"]);

        let retry = app.send(order("o1").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(runs(&app), (1, 1, 1));
        assert_eq!(downstream.keys().len(), 1, "one call downstream");
        assert_eq!(retry.json()["book"]["transfer"], retry.json()["transfer"]["id"]);
    }

    async fn a_takeover_resumes_and_the_late_request_loses_its_step(db) {
        let downstream = Downstream::gated().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let first = tokio::spawn({
            let app = app.clone();
            async move { app.send(order("o1").build()).await }
        });
        // `take` is recorded and the transfer executed; its answer is held downstream.
        downstream.until_executed(1).await;
        app.lapse_lease("o1").await;

        let takeover = app.send(order("o1").build()).await;
        assert_eq!(takeover.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&takeover.body));
        assert_eq!(runs(&app), (1, 2, 1), "take was resumed, the unrecorded call made again");
        assert_eq!(downstream.executed(), 1, "under the same derived key");
        let keys = downstream.keys();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], keys[1]);

        downstream.gate.add_permits(1);
        let first = first.await.unwrap();
        first.problem(StatusCode::CONFLICT);
        assert_eq!(app.units_taken().await, 2);
        assert_eq!(app.count("test_bookings").await, 1);
        let replay = app.send(order("o1").build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, takeover.body);
    }

    async fn a_database_step_that_lost_its_claim_rolls_its_writes_back(db) {
        let app = App::with_downstream(db, &unreachable_url()).await;
        let first = tokio::spawn({
            let app = app.clone();
            async move { app.send(order("o1").header("x-hold", "take").build()).await }
        });
        wait_until("the order's claim", || async {
            app.key_status("o1").await.as_deref() == Some("started")
        })
        .await;
        // Another owner takes the key before the step runs (on SQLite nothing can while a
        // step's transaction holds the write lock).
        app.steal_claim("o1").await;
        app.gate.add_permits(1);

        let reply = first.await.unwrap();
        let kind = reply.problem(StatusCode::CONFLICT);
        assert!(kind.ends_with("#inprogress"), "{kind}");
        assert_eq!(app.count("test_stock_moves").await, 0, "the step's write was rolled back");
        assert!(app.recorded_steps("o1").await.is_empty());
    }

    async fn a_step_name_used_twice_is_a_500_problem_and_records_nothing_more(db) {
        let app = App::new(db).await;
        let reply = app.send(order("o1").header("x-repeat", "take").build()).await;
        let kind = reply.problem(StatusCode::INTERNAL_SERVER_ERROR);
        assert!(kind.ends_with("#stepfailed"), "{kind}");
        assert!(reply.json()["detail"].as_str().unwrap().contains("\"take\" is used twice"));
        assert_eq!(app.recorded_steps("o1").await, ["take"]);
        assert_eq!(app.units_taken().await, 2);
    }

    async fn two_steps_at_once_are_a_500_problem(db) {
        let app = App::new(db).await;
        let reply = app.send(order("o1").header("x-overlap", "take").build()).await;
        let kind = reply.problem(StatusCode::INTERNAL_SERVER_ERROR);
        assert!(kind.ends_with("#stepfailed"), "{kind}");
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("steps run one at a time"), "{detail}");
        assert_eq!(app.recorded_steps("o1").await, ["take", "a"], "the overlapping step recorded nothing");
    }

    async fn an_expired_key_forgets_its_recorded_steps(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let failed = app.send(order("o1").header("x-fail-after", "take").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        app.expire_all_keys().await;

        let retry = app.send(order("o1").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(runs(&app), (2, 1, 1), "a new request, from the first step");
        assert_eq!(app.recorded_steps("o1").await, ["take", "transfer", "book"]);
    }

    async fn the_default_recovery_leaves_a_claim_with_steps_for_its_retry(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let failed = app.send(order("o1").header("x-fail-after", "take").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);

        let report = app.recover(&ReleaseAbandoned).await;
        assert_eq!(report.found, 0, "{report:?}");
        assert_eq!(app.recorded_steps("o1").await, ["take"]);
        let retry = app.send(order("o1").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(runs(&app), (1, 1, 1));
    }

    async fn a_recovery_hook_sees_the_recovery_point_and_compensates_before_releasing(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let failed = app.send(order("o1").header("x-fail-after", "take").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.units_taken().await, 2);

        let report = app.recover(&GiveBack).await;
        assert_eq!((report.found, report.released), (1, 1), "{report:?}");
        assert_eq!(app.units_taken().await, 0, "the stock was given back");
        assert_eq!(app.keys_named("o1").await, 0);

        let retry = app.send(order("o1").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(runs(&app), (2, 1, 1), "released: the retry starts over");
        assert_eq!(app.units_taken().await, 2);
    }
}

/// A database whose key table predates recovery points: idem's migrations before
/// `20261130000001_steps`, applied as that earlier version of idem applied them, and a key
/// completed under them.
mod upgrade {
    use std::borrow::Cow;

    use axum::http::{HeaderMap, Method, StatusCode, header::CONTENT_TYPE};
    use idem_key::Fingerprint;
    use idem_tests::{App, Downstream, TestDb};
    use sqlx::{
        migrate::Migrator,
        postgres::{PgConnectOptions, PgPoolOptions},
    };

    use super::order;

    const FIRST_STEPS_MIGRATION: i64 = 20261130000001;

    fn before_steps(mut migrator: Migrator) -> Migrator {
        let earlier: Vec<_> = migrator
            .migrations
            .iter()
            .filter(|migration| migration.version < FIRST_STEPS_MIGRATION)
            .cloned()
            .collect();
        assert!(!earlier.is_empty() && earlier.len() < migrator.migrations.len());
        migrator.migrations = Cow::Owned(earlier);
        migrator.dangerous_set_table_name("_idem_migrations");
        migrator
    }

    /// `POST /test/orders` with `{"units": 2}`, completed with a 201 before the upgrade, created
    /// and expiring at the two times `times` writes.
    fn completed(times: &str) -> sqlx::AssertSqlSafe<String> {
        sqlx::AssertSqlSafe(format!(
            "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
               response_status, response_headers, response_body, created_at, expires_at) \
             VALUES ('t1', 'old', 'POST', '/test/orders', $1, 'completed', 201, \
               '[[\"content-type\",\"text/plain\"]]', $2, {times})"
        ))
    }

    fn fingerprint() -> Vec<u8> {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
        Fingerprint::of(&Method::POST, "/test/orders", &headers, br#"{"units": 2}"#)
            .as_bytes()
            .to_vec()
    }

    /// After the upgrade the earlier key still replays, and a multi-step handler records and
    /// resumes its steps.
    async fn upgraded(app: App, downstream: &Downstream) {
        let replay = app.send(order("old").build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(replay.body, "made before the upgrade");

        let failed = app
            .send(order("new").header("x-fail-after", "take").build())
            .await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        let retry = app.send(order("new").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(super::runs(&app), (1, 1, 1));
        assert_eq!(downstream.executed(), 1);
    }

    #[sqlx::test(migrations = false)]
    async fn postgres_an_existing_key_table_is_upgraded_for_steps(
        _: PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        let pool = PgPoolOptions::new()
            .connect_with(connect.clone())
            .await
            .unwrap();
        before_steps(sqlx::migrate!("../idem-runtime/migrations/postgres"))
            .run(&pool)
            .await
            .expect("the earlier migrations");
        sqlx::query(completed("now(), now() + interval '1 day'"))
            .bind(fingerprint())
            .bind(b"made before the upgrade".to_vec())
            .execute(&pool)
            .await
            .expect("a key completed before the upgrade");
        pool.close().await;

        let downstream = Downstream::start().await;
        let app = App::with_downstream(TestDb::Postgres(Box::new(connect)), &downstream.url).await;
        upgraded(app, &downstream).await;
    }

    #[tokio::test]
    async fn sqlite_an_existing_key_table_is_upgraded_for_steps() {
        let dir = tempfile::tempdir().unwrap();
        let pool = sqlx::SqlitePool::connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(dir.path().join("test.db"))
                .create_if_missing(true),
        )
        .await
        .unwrap();
        before_steps(sqlx::migrate!("../idem-runtime/migrations/sqlite"))
            .run(&pool)
            .await
            .expect("the earlier migrations");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        sqlx::query(completed("$3, $4"))
            .bind(fingerprint())
            .bind(b"made before the upgrade".to_vec())
            .bind(now)
            .bind(now + 86_400_000)
            .execute(&pool)
            .await
            .expect("a key completed before the upgrade");
        pool.close().await;

        let downstream = Downstream::start().await;
        let app = App::with_downstream(TestDb::Sqlite(dir), &downstream.url).await;
        upgraded(app, &downstream).await;
    }
}
