//! The background tasks: purge of expired keys and recovery of abandoned claims, on both
//! backends, with live requests running beside them.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::http::{HeaderMap, Method, StatusCode, header::CONTENT_TYPE};
use idem_client::{Action, IdempotentRetry, KeyStore, KeyStoreError, RetryPolicy, StoredKey};
use idem_key::Fingerprint;
use idem_runtime::{
    Backend, CancellationToken, IdempotencyContext, ProblemKind,
    admin::Unparked,
    tasks::{
        AbandonedClaim, PurgeOptions, RecoveryHook, RecoveryOptions, ReleaseAbandoned,
        StoredResponse, Verdict,
    },
};
use idem_tests::{App, Db, Downstream, Req, TestDb, backend_tests, entry, wait_until};

const TRANSFERS: &str = "/test/transfers";

/// The fingerprint of the transfer request `body` (as `POST /test/transfers` sees it).
fn transfer_fingerprint(body: &str) -> Vec<u8> {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
    Fingerprint::of(&Method::POST, TRANSFERS, &headers, body.as_bytes())
        .as_bytes()
        .to_vec()
}

fn transfer_body(entry: i64) -> String {
    format!(r#"{{"entry": {entry}, "amount": 50}}"#)
}

fn post(key: &str) -> Req {
    Req::post("/test/entries")
        .tenant("t1")
        .key(key)
        .json(&entry(100, "n1"))
}

/// Completes every abandoned claim with a fixed answer, as a hook that found the charge
/// downstream would.
struct CompleteWith(StoredResponse);

impl<DB: Backend> RecoveryHook<DB> for CompleteWith {
    async fn recover(&self, claim: AbandonedClaim<DB>) -> Verdict {
        assert_eq!(claim.path, TRANSFERS);
        // The hook can ask downstream with the key the handler used: the same derivation.
        assert_eq!(
            claim.context().derive("transfer"),
            IdempotencyContext::new("t1", "abandoned").derive("transfer")
        );
        Verdict::Complete(self.0.clone())
    }
}

/// Counts the attempts a retrying middleware in front of it makes.
#[derive(Clone, Default)]
struct CountAttempts(Arc<AtomicUsize>);

impl CountAttempts {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

#[tonic::async_trait]
impl reqwest_middleware::Middleware for CountAttempts {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut axum::http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        self.0.fetch_add(1, Ordering::SeqCst);
        next.run(request, extensions).await
    }
}

/// A client's key store that gives its action a key the test chose (the key of a claim the
/// test made), and shows what it keeps.
#[derive(Clone)]
struct ChosenKey {
    key: &'static str,
    kept: Arc<std::sync::Mutex<Option<StoredKey>>>,
}

impl ChosenKey {
    fn new(key: &'static str) -> Self {
        Self {
            key,
            kept: Arc::default(),
        }
    }

    fn kept(&self) -> Option<String> {
        self.kept
            .lock()
            .unwrap()
            .as_ref()
            .map(|kept| kept.key.clone())
    }
}

impl KeyStore for ChosenKey {
    fn load(&self, _: &str) -> Result<Option<StoredKey>, KeyStoreError> {
        Ok(self.kept.lock().unwrap().clone())
    }

    fn save(&self, _: &str, key: &StoredKey) -> Result<(), KeyStoreError> {
        *self.kept.lock().unwrap() = Some(key.clone());
        Ok(())
    }

    /// The kept key, or the chosen one for the candidate's request.
    fn load_or_save(&self, _: &str, candidate: &StoredKey) -> Result<StoredKey, KeyStoreError> {
        let mut kept = self.kept.lock().unwrap();
        Ok(kept
            .get_or_insert_with(|| StoredKey {
                key: self.key.to_owned(),
                fingerprint: candidate.fingerprint.clone(),
            })
            .clone())
    }

    fn remove(&self, _: &str) -> Result<(), KeyStoreError> {
        *self.kept.lock().unwrap() = None;
        Ok(())
    }
}

/// Never settles a claim, as a hook whose downstream service never answers.
struct FailEveryTime;

impl<DB: Backend> RecoveryHook<DB> for FailEveryTime {
    async fn recover(&self, _: AbandonedClaim<DB>) -> Verdict {
        Verdict::Failed("the processor did not answer".into())
    }
}

/// Leaves every claim for later, as a hook waiting on a settlement that never comes.
struct KeepEveryTime;

impl<DB: Backend> RecoveryHook<DB> for KeepEveryTime {
    async fn recover(&self, _: AbandonedClaim<DB>) -> Verdict {
        Verdict::Keep
    }
}

/// Runs recovery passes on `key` with `hook` until one parks it, ending the recovery's lease
/// between passes as its running out would; asserts that each pass before took the claim and
/// kept it, and that the parking came on round `rounds`.
async fn recover_until_parked<H>(app: &App, hook: &H, key: &str, rounds: u32)
where
    H: RecoveryHook<sqlx::Postgres> + RecoveryHook<sqlx::Sqlite> + RecoveryHook<sqlx::MySql>,
{
    let options = RecoveryOptions::default().with_max_attempts(rounds);
    for round in 1..rounds {
        let report = app.recover_with(hook, &options).await;
        assert_eq!(
            (report.found, report.kept, report.parked),
            (1, 1, 0),
            "round {round} of {rounds}: {report:?}"
        );
        app.lapse_lease(key).await;
    }
    let report = app.recover_with(hook, &options).await;
    assert_eq!(
        (report.found, report.kept, report.parked),
        (1, 0, 1),
        "round {rounds}, the last: {report:?}"
    );
}

backend_tests! {
    async fn a_claim_the_hook_never_settles_is_parked_and_no_retry_or_pass_takes_it_over(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let body = transfer_body(1);
        app.abandoned_claim("t1", "stuck", TRANSFERS, &transfer_fingerprint(&body)).await;
        recover_until_parked(&app, &FailEveryTime, "stuck", 3).await;

        let parked = app.store().parked().await.expect("list parked claims");
        assert_eq!(parked.len(), 1, "{parked:?}");
        assert_eq!((parked[0].scope.as_str(), parked[0].key.as_str()), ("t1", "stuck"));
        assert_eq!((parked[0].method.as_str(), parked[0].path.as_str()), ("POST", TRANSFERS));
        assert_eq!(parked[0].attempts, 3);
        assert_eq!(parked[0].last_error.as_deref(), Some("the processor did not answer"));
        assert_eq!(app.store().stats().await.expect("stats").parked, 1);

        // Past its key's retention too: neither the purge, nor a pass, nor a retry takes it.
        app.expire_all_keys().await;
        assert_eq!(app.purge(PurgeOptions::default()).await.rows, 0);
        let report = app.recover(&FailEveryTime).await;
        assert_eq!(report.found, 0, "{report:?}");
        let retry = app
            .send(Req::post(TRANSFERS).tenant("t1").key("stuck").json(&body).build())
            .await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(retry.json()["type"], ProblemKind::ClaimParked.type_uri());
        assert!(retry.headers.get("retry-after").is_none(), "a person must look first");
        assert_eq!(downstream.executed(), 0, "the handler did not run");
        assert_eq!(app.store().parked().await.expect("list").len(), 1, "still parked");

        // idem's client retries a 500, but not this one: no retry gets another answer.
        let attempts = CountAttempts::default();
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(IdempotentRetry::new(
                RetryPolicy::default()
                    .with_max_attempts(5)
                    .with_backoff(Duration::from_millis(1), Duration::from_millis(5)),
            ))
            .with(attempts.clone())
            .build();
        let answer = client
            .post(format!("http://{}{TRANSFERS}", app.serve().await))
            .header("authorization", "Bearer t1")
            .header("content-type", "application/json")
            .header("idempotency-key", "stuck")
            .body(body.clone())
            .send()
            .await
            .expect("an answer");
        assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let Err(idem_client::Error::Problem { problem, .. }) = idem_client::check(answer).await
        else {
            panic!("the problem reaches the caller whole");
        };
        assert_eq!(problem.kind, Some(ProblemKind::ClaimParked.type_uri()));
        assert_eq!(attempts.count(), 1, "one attempt");
    }

    async fn a_hook_that_keeps_a_claim_every_time_gets_it_parked_too(db) {
        let app = App::new(db).await;
        app.abandoned_claim("t1", "kept", TRANSFERS, &transfer_fingerprint(&transfer_body(1)))
            .await;
        recover_until_parked(&app, &KeepEveryTime, "kept", 2).await;
        let parked = app.store().parked().await.expect("list parked claims");
        assert_eq!((parked.len(), parked[0].attempts), (1, 2), "{parked:?}");
        assert_eq!(parked[0].last_error, None, "kept, never failed");
    }

    async fn a_resumed_claim_goes_back_to_the_hook_with_its_rounds_counted_afresh(db) {
        let app = App::new(db).await;
        // The key `CompleteWith` expects.
        let body = transfer_body(1);
        app.abandoned_claim("t1", "abandoned", TRANSFERS, &transfer_fingerprint(&body)).await;
        recover_until_parked(&app, &FailEveryTime, "abandoned", 2).await;
        app.expire_all_keys().await;

        assert_eq!(app.store().resume_parked("t1", "abandoned").await.unwrap(), Unparked::Done);
        assert_eq!(
            app.store().resume_parked("t1", "abandoned").await.unwrap(),
            Unparked::NotParked,
            "resumed already"
        );
        assert_eq!(app.store().resume_parked("t1", "none").await.unwrap(), Unparked::Missing);
        assert!(app.store().parked().await.unwrap().is_empty());
        // The recovery's again, not a retry's: a retry before the pass is still refused.
        let early = app
            .send(Req::post(TRANSFERS).tenant("t1").key("abandoned").json(&body).build())
            .await;
        assert_eq!(early.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(early.json()["type"], ProblemKind::ClaimParked.type_uri());
        // Kept alive past its retention for the recovery, which has two rounds again.
        recover_until_parked(&app, &FailEveryTime, "abandoned", 2).await;

        app.store().resume_parked("t1", "abandoned").await.unwrap();
        let answer = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: br#"{"id":"tr_settled_by_hand"}"#.to_vec(),
        };
        let report = app.recover(&CompleteWith(answer)).await;
        assert_eq!((report.found, report.completed), (1, 1), "{report:?}");
        let retry = app
            .send(Req::post(TRANSFERS).tenant("t1").key("abandoned").json(&body).build())
            .await;
        assert!(retry.replayed());
        assert_eq!(retry.json()["id"], "tr_settled_by_hand");
    }

    async fn an_abandoned_claim_lets_the_next_retry_run(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let entry = app.send(post("e1").build()).await.json()["id"].as_i64().unwrap();
        let body = transfer_body(entry);
        app.abandoned_claim("t1", "stuck", TRANSFERS, &transfer_fingerprint(&body)).await;
        assert_eq!(
            app.store().abandon_parked("t1", "stuck").await.unwrap(),
            Unparked::NotParked,
            "a claim in flight is not an operator's to abandon"
        );
        assert_eq!(
            app.store().abandon_parked("t1", "e1").await.unwrap(),
            Unparked::NotParked,
            "nor a completed key"
        );
        recover_until_parked(&app, &FailEveryTime, "stuck", 1).await;

        assert_eq!(app.store().abandon_parked("t1", "stuck").await.unwrap(), Unparked::Done);
        assert_eq!(app.store().abandon_parked("t1", "stuck").await.unwrap(), Unparked::Missing);
        let retry = app
            .send(Req::post(TRANSFERS).tenant("t1").key("stuck").json(&body).build())
            .await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(!retry.replayed());
        assert_eq!(downstream.executed(), 1);
    }

    async fn an_action_answered_parked_keeps_its_key_and_runs_once_abandoned(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let entry = app.send(post("e1").build()).await.json()["id"].as_i64().unwrap();
        let body = transfer_body(entry);
        app.abandoned_claim("t1", "stuck", TRANSFERS, &transfer_fingerprint(&body)).await;
        recover_until_parked(&app, &FailEveryTime, "stuck", 1).await;

        let keys = ChosenKey::new("stuck");
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(
                IdempotentRetry::new(
                    RetryPolicy::default()
                        .with_max_attempts(5)
                        .with_backoff(Duration::from_millis(1), Duration::from_millis(5)),
                )
                .with_store(keys.clone()),
            )
            .build();
        let url = format!("http://{}{TRANSFERS}", app.serve().await);
        let transfer = || {
            client
                .post(&url)
                .header("authorization", "Bearer t1")
                .header("content-type", "application/json")
                .body(body.clone())
                .with_extension(Action("transfer".into()))
                .send()
        };
        let parked = transfer().await.expect("an answer");
        assert_eq!(parked.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(keys.kept().as_deref(), Some("stuck"), "not the action's answer: its key is kept");
        assert_eq!(downstream.executed(), 0);

        // A person abandons the claim: the action's next run sends the kept key, and runs.
        assert_eq!(app.store().abandon_parked("t1", "stuck").await.unwrap(), Unparked::Done);
        let answer = transfer().await.expect("an answer");
        assert_eq!(answer.status(), StatusCode::CREATED);
        assert_eq!(keys.kept(), None, "the action has its answer: its key is forgotten");
        assert_eq!(downstream.executed(), 1);
        let replay = app
            .send(Req::post(TRANSFERS).tenant("t1").key("stuck").json(&body).build())
            .await;
        assert!(replay.replayed(), "the run was the kept key's: {}", replay.status);
    }

    async fn purge_deletes_exactly_the_expired_rows_in_batches_while_requests_go_on(db) {
        let app = App::new(db).await;
        app.seed_keys("old", 2500, -3600).await;
        app.seed_keys("live", 300, 3600).await;

        let purge = tokio::spawn({
            let app = app.clone();
            async move {
                app.purge(PurgeOptions::default()
                    .with_batch_size(1000)
                    .with_pause(Duration::ZERO))
                .await
            }
        });
        let mut requests = Vec::new();
        for i in 0..20 {
            let app = app.clone();
            requests.push(tokio::spawn(async move {
                app.send(post(&format!("k{i}")).build()).await
            }));
        }
        let report = purge.await.unwrap();
        for request in requests {
            assert_eq!(request.await.unwrap().status, StatusCode::CREATED);
        }
        assert_eq!(report.rows, 2500);
        assert_eq!(report.batches, 3, "1000 + 1000 + 500");
        assert_eq!(app.count("idem_keys").await, 320, "300 live seeded + 20 new stay");
    }

    async fn a_purged_key_runs_again(db) {
        let app = App::new(db).await;
        let first = app.send(post("k1").build()).await;
        app.expire_all_keys().await;
        let report = app.purge(PurgeOptions::default()).await;
        assert_eq!((report.rows, report.batches), (1, 1));
        assert_eq!(app.keys_named("k1").await, 0);
        let second = app.send(post("k1").build()).await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(!second.replayed());
        assert_ne!(second.json()["id"], first.json()["id"]);
    }

    async fn a_forgotten_key_runs_again_and_another_scopes_still_replays(db) {
        let app = App::new(db).await;
        let first = app.send(post("k1").build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(app.send(post("k1").build()).await.replayed());
        let other = Req::post("/test/entries").tenant("t2").key("k1").json(&entry(100, "n1"));
        let theirs = app.send(other.clone().build()).await;

        let forgotten = app.store().forget("t1").await.expect("forget t1");
        assert_eq!(
            (forgotten.deleted, forgotten.in_flight_left, forgotten.parked_left),
            (1, 0, 0)
        );
        let second = app.send(post("k1").build()).await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(!second.replayed(), "a forgotten key runs the handler again");
        assert_ne!(second.json()["id"], first.json()["id"]);
        let again = app.send(other.build()).await;
        assert!(again.replayed(), "another scope's key is not forgotten");
        assert_eq!(again.json()["id"], theirs.json()["id"]);
    }

    async fn the_purge_task_stops_when_cancelled(db) {
        let app = App::new(db).await;
        app.seed_keys("old", 10, -3600).await;
        let stop = CancellationToken::new();
        let task = app.spawn_purge(Duration::from_millis(20), stop.clone());
        wait_until("the purge task to delete the expired keys", || async {
            app.count("idem_keys").await == 0
        })
        .await;
        stop.cancel();
        task.await.expect("the task ends cleanly");
    }

    async fn recovery_releases_abandoned_claims_only(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let entry = app.send(post("e1").build()).await.json()["id"].as_i64().unwrap();
        let body = transfer_body(entry);
        let fingerprint = transfer_fingerprint(&body);
        app.abandoned_claim("t1", "abandoned", TRANSFERS, &fingerprint).await;
        // A claim still within its lease is someone's work in progress.
        app.abandoned_claim("t1", "running", TRANSFERS, &fingerprint).await;
        app.renew_lease("running").await;

        // A retry would take the abandoned key over by itself; the recovery is for the keys
        // that nobody retries, and releases them.
        let report = app.recover(&ReleaseAbandoned).await;
        assert_eq!((report.found, report.released, report.completed), (1, 1, 0));
        assert!(report.oldest >= Duration::from_secs(59), "age {:?}", report.oldest);
        assert_eq!(app.keys_named("abandoned").await, 0);
        assert_eq!(app.key_status("running").await.as_deref(), Some("started"));
        assert_eq!(app.keys_with_status("completed").await, 1, "the entry's key is untouched");

        let retry = app
            .send(Req::post(TRANSFERS).tenant("t1").key("abandoned").json(&body).build())
            .await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(!retry.replayed());
        assert_eq!(downstream.executed(), 1);
    }

    async fn a_recovery_hook_can_complete_a_claim_and_retries_replay_it(db) {
        let app = App::new(db).await;
        let body = transfer_body(1);
        app.abandoned_claim("t1", "abandoned", TRANSFERS, &transfer_fingerprint(&body)).await;
        let answer = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: br#"{"id":"tr_found_downstream"}"#.to_vec(),
        };
        let expiry_before = app.retention_secs("abandoned").await;
        let report = app.recover(&CompleteWith(answer)).await;
        assert_eq!((report.found, report.completed), (1, 1));
        // Completed by the recovery, the key keeps the expiry its claim was given.
        assert_eq!(app.retention_secs("abandoned").await, expiry_before);
        let retry = app
            .send(Req::post(TRANSFERS).tenant("t1").key("abandoned").json(&body).build())
            .await;
        assert!(retry.replayed());
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(retry.json()["id"], "tr_found_downstream");
    }

    async fn the_recovery_task_runs_until_cancelled(db) {
        let app = App::new(db).await;
        let fingerprint = transfer_fingerprint(&transfer_body(1));
        app.abandoned_claim("t1", "abandoned", TRANSFERS, &fingerprint).await;
        let stop = CancellationToken::new();
        let task = app.spawn_recovery(ReleaseAbandoned, Duration::from_millis(20), stop.clone());
        wait_until("the recovery task to release the abandoned claim", || async {
            app.keys_named("abandoned").await == 0
        })
        .await;
        stop.cancel();
        task.await.expect("the task ends cleanly");
    }
}

/// PostgreSQL and MySQL (on SQLite the purge waits for the single write lock like any writer):
/// an expired row that a live transaction holds, as a claim replacing it does, is passed over
/// rather than waited for, and purged by a later pass once released.
#[sqlx::test(migrations = false)]
async fn a_purge_passes_over_an_expired_row_a_live_transaction_holds(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = App::new(TestDb::Postgres(Box::new(connect))).await;
    app.seed_keys("old", 2500, -3600).await;
    let Db::Postgres(pool) = &app.db else {
        unreachable!("a PostgreSQL app")
    };
    let mut live = pool.begin().await.expect("begin");
    let held = sqlx::query("DELETE FROM idem_keys WHERE key = 'seed-old-1'")
        .execute(&mut *live)
        .await
        .expect("hold one expired row");
    assert_eq!(held.rows_affected(), 1);
    purge_passes_over_the_held_row(&app, live, async |live| {
        live.rollback().await.expect("rollback");
    })
    .await;
}

/// [`a_purge_passes_over_an_expired_row_a_live_transaction_holds`] on MySQL.
#[tokio::test]
async fn mysql_a_purge_passes_over_an_expired_row_a_live_transaction_holds() {
    let database = idem_tests::MySqlDb::create().await;
    let name = database.name().to_owned();
    {
        let app = App::new(TestDb::MySql(Box::new(database))).await;
        app.seed_keys("old", 2500, -3600).await;
        let Db::MySql(pool) = &app.db else {
            unreachable!("a MySQL app")
        };
        // By the primary key: at REPEATABLE READ (sqlx's `begin` here) a DELETE that scans
        // locks every row it passes over, not only the one it deletes.
        let mut live = pool.begin().await.expect("begin");
        let held =
            sqlx::query("DELETE FROM idem_keys WHERE scope = 'old' AND `key` = 'seed-old-1'")
                .execute(&mut *live)
                .await
                .expect("hold one expired row");
        assert_eq!(held.rows_affected(), 1);
        purge_passes_over_the_held_row(&app, live, async |live| {
            live.rollback().await.expect("rollback");
        })
        .await;
    }
    idem_tests::MySqlDb::drop_named(&name).await;
}

/// Purges 2,500 expired rows while `live` holds one of them: every other row goes without
/// waiting for `live`; after `release`, a second pass takes the last.
async fn purge_passes_over_the_held_row<T>(app: &App, live: T, release: impl AsyncFnOnce(T)) {
    let options = PurgeOptions::default()
        .with_batch_size(1000)
        .with_pause(Duration::ZERO);
    let report = tokio::time::timeout(idem_tests::DEADLINE, app.purge(options))
        .await
        .expect("the purge waited for the live transaction");
    assert_eq!(report.rows, 2499, "every expired row but the held one");
    release(live).await;
    assert_eq!(app.purge(options).await.rows, 1, "the released row");
    assert_eq!(app.count("idem_keys").await, 0);
}

/// PostgreSQL: an adaptive purge runs its statements back to back while the database has
/// nothing else to do, and pauses between them while another session runs a statement.
#[expect(
    clippy::async_yields_async,
    reason = "the closure starts the busy session and yields what ends it"
)]
#[sqlx::test(migrations = false)]
async fn an_adaptive_purge_pauses_only_while_another_session_is_at_work(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = App::new(TestDb::Postgres(Box::new(connect))).await;
    let Db::Postgres(pool) = &app.db else {
        unreachable!("a PostgreSQL app")
    };
    adaptive_purge_pauses_only_while_busy(&app, async || {
        let sleeper = tokio::spawn({
            let pool = pool.clone();
            async move { sqlx::query("SELECT pg_sleep(600)").execute(&pool).await }
        });
        let sleeping = "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' \
             AND query = 'SELECT pg_sleep(600)' AND datname = current_database()";
        wait_until(
            "the other session's statement to be seen running",
            || async {
                sqlx::query_scalar::<_, i64>(sleeping)
                    .fetch_one(pool)
                    .await
                    .unwrap()
                    == 1
            },
        )
        .await;
        async move {
            sqlx::query(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
                 WHERE query = 'SELECT pg_sleep(600)' AND datname = current_database()",
            )
            .execute(pool)
            .await
            .expect("cancel the other session's statement");
            let cancelled = sleeper.await.expect("the sleeper's task");
            assert!(cancelled.is_err(), "cancelled, not finished");
        }
    })
    .await;
}

/// [`an_adaptive_purge_pauses_only_while_another_session_is_at_work`] on MySQL.
#[expect(
    clippy::async_yields_async,
    reason = "the closure starts the busy session and yields what ends it"
)]
#[tokio::test]
async fn mysql_an_adaptive_purge_pauses_only_while_another_session_is_at_work() {
    let database = idem_tests::MySqlDb::create().await;
    let name = database.name().to_owned();
    {
        let app = App::new(TestDb::MySql(Box::new(database))).await;
        let Db::MySql(pool) = &app.db else {
            unreachable!("a MySQL app")
        };
        adaptive_purge_pauses_only_while_busy(&app, async || {
            let mut conn = pool.acquire().await.expect("a connection");
            let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                .fetch_one(&mut *conn)
                .await
                .expect("its id");
            let sleeper =
                tokio::spawn(
                    async move { sqlx::query("SELECT SLEEP(600)").execute(&mut *conn).await },
                );
            wait_until(
                "the other session's statement to be seen running",
                || async {
                    sqlx::query_scalar::<_, i64>(
                        "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                     WHERE ID = ? AND COMMAND IN ('Query', 'Execute')",
                    )
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
                        == 1
                },
            )
            .await;
            async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL QUERY {id}")))
                    .execute(pool)
                    .await
                    .expect("end the other session's statement");
                // MySQL's SLEEP ends early with 1; MariaDB's with an error.
                sleeper.await.expect("the sleeper's task").ok();
            }
        })
        .await;
    }
    idem_tests::MySqlDb::drop_named(&name).await;
}

/// Purges 500 expired keys in batches of 100 with the adaptive pacing on an idle database: no
/// pause; then 500 more while `busy` keeps another session running a statement (it returns
/// what ends it): a pause after each full batch.
async fn adaptive_purge_pauses_only_while_busy<Busy, End>(app: &App, busy: Busy)
where
    Busy: AsyncFnOnce() -> End,
    End: Future<Output = ()>,
{
    let options = PurgeOptions::default().with_batch_size(100);
    app.seed_keys("idle", 500, -3600).await;
    let idle = app.purge(options).await;
    assert_eq!((idle.rows, idle.batches), (500, 6), "{idle:?}");
    assert_eq!(
        idle.paused,
        Duration::ZERO,
        "nothing else at work: {idle:?}"
    );

    app.seed_keys("busy", 500, -3600).await;
    let end = busy().await;
    let beside = app.purge(options).await;
    end.await;
    assert_eq!((beside.rows, beside.batches), (500, 6), "{beside:?}");
    assert!(
        beside.paused > Duration::ZERO,
        "another session at work: {beside:?}"
    );
}
