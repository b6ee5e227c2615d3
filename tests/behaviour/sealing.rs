//! Stored answers sealed at rest, on every database: with encryption keys no column of the key
//! table holds an answer's body, headers or a step's output, replays open, keys rotate (the
//! first seals, all open), and an answer that does not open is a 500 that runs nothing.

use axum::http::StatusCode;
use idem_runtime::{
    ProblemKind, StoreOptions,
    seal::EncryptionKeys,
    tasks::{AbandonedClaim, RecoveryHook, Verdict},
};
use idem_tests::{App, Downstream, Options, Req, TestApp, TestBackend, backend_tests, entry};

/// A customer id no answer would hold by chance.
const CUSTOMER: &str = "cus_7Qx9sealed";

fn keys(ids: &[(&str, u8)]) -> EncryptionKeys {
    EncryptionKeys::new(ids.iter().map(|(id, byte)| ((*id).to_owned(), [*byte; 32])))
        .expect("valid keys")
}

fn sealing(ids: &[(&str, u8)]) -> Options {
    Options {
        store_options: StoreOptions::default().with_encryption_keys(keys(ids)),
        ..Options::default()
    }
}

fn post(key: &str) -> Req {
    Req::post("/test/entries")
        .tenant("t1")
        .key(key)
        .json(&entry(4200, CUSTOMER))
}

/// Whether any row of the key table shows `needle`, in its text or in its stored body.
async fn table_shows(app: &App, needle: &str) -> bool {
    app.key_table_contents().await.iter().any(|(text, body)| {
        text.contains(needle)
            || body
                .windows(needle.len())
                .any(|window| window == needle.as_bytes())
    })
}

/// The id of the key that sealed `key`'s answer (scope `t1`), if sealed.
async fn sealed_with(app: &App, key: &str) -> Option<String> {
    let found = app
        .store()
        .inspect("t1", key, false)
        .await
        .expect("inspect");
    found.expect("the key has a row").sealed_with
}

/// A recovery hook that would release whatever claim it is handed, its steps undone or not: it
/// must not be handed one whose steps cannot be read.
struct ReleasesAll;

impl<DB: TestBackend> RecoveryHook<DB> for ReleasesAll {
    async fn recover(&self, _claim: AbandonedClaim<DB>) -> Verdict {
        Verdict::Release
    }
}

backend_tests! {
    async fn with_keys_no_column_holds_the_answer_and_its_replay_opens(db) {
        let app = App::build(db, sealing(&[("k1", 1)])).await;
        let first = app.send(post("p1").build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let location = first.header("location").expect("a Location").to_owned();
        let replay = app.send(post("p1").build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.header("location"), Some(location.as_str()));
        assert_eq!(replay.header("content-type"), first.header("content-type"));
        assert!(!table_shows(&app, CUSTOMER).await, "the answer's body is sealed");
        assert!(!table_shows(&app, &location).await, "its headers are sealed");
        assert!(table_shows(&app, "idem-sealed").await, "the row names its key");
        assert_eq!(app.response_status("p1").await, 201, "the status stays readable");
    }

    async fn without_keys_the_table_holds_the_answer_in_the_clear(db) {
        let app = App::new(db).await;
        let first = app.send(post("p1").build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(table_shows(&app, CUSTOMER).await, "the probe finds a clear answer");
        assert!(!table_shows(&app, "idem-sealed").await);
    }

    async fn an_answer_sealed_with_a_retired_key_opens_while_that_key_is_given(db) {
        let old = App::build(db, sealing(&[("old", 1)])).await;
        let first = old.send(post("p1").build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        // Rotated: a new key seals, the old one still opens.
        let rotated = old.sibling_with(sealing(&[("new", 2), ("old", 1)])).await;
        let replay = rotated.send(post("p1").build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        let second = rotated.send(post("p2").build()).await;
        assert_eq!(second.status, StatusCode::CREATED);
        let contents = rotated.key_table_contents().await;
        assert!(contents.iter().any(|(text, _)| text.contains(r#""idem-sealed", "new""#) || text.contains(r#""idem-sealed","new""#)), "{contents:?}");
        // The old key gone: its answer does not open, and nothing runs again.
        let runs = rotated.calls.entries.load(std::sync::atomic::Ordering::SeqCst);
        let retired = old.sibling_with(sealing(&[("new", 2)])).await;
        let refused = retired.send(post("p1").build()).await;
        assert_eq!(
            refused.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::AnswerUnreadable.type_uri()
        );
        assert_eq!(refused.header("retry-after"), None);
        let detail = refused.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("`old`"), "{detail}");
        assert_eq!(retired.calls.entries.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(rotated.calls.entries.load(std::sync::atomic::Ordering::SeqCst), runs);
        assert_eq!(retired.count("test_entries").await, 2, "nothing ran again");
        let opened = retired.send(post("p2").build()).await;
        assert!(opened.replayed(), "the new key's answer opens");
    }

    async fn a_store_without_keys_does_not_replay_a_sealed_answer(db) {
        let sealed = App::build(db, sealing(&[("k1", 1)])).await;
        assert_eq!(sealed.send(post("p1").build()).await.status, StatusCode::CREATED);
        let clear = sealed.sibling().await;
        let refused = clear.send(post("p1").build()).await;
        assert_eq!(
            refused.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::AnswerUnreadable.type_uri()
        );
        assert_eq!(clear.count("test_entries").await, 1, "nothing ran again");
    }

    async fn a_sealed_answer_copied_to_another_key_does_not_open(db) {
        let app = App::build(db, sealing(&[("k1", 1)])).await;
        assert_eq!(app.send(post("p1").build()).await.status, StatusCode::CREATED);
        let other = Req::post("/test/entries").tenant("t1").key("p2").json(&entry(1, "other"));
        assert_eq!(app.send(other.build()).await.status, StatusCode::CREATED);
        app.copy_answer("p1", "p2").await;
        let refused = app.send(other.build()).await;
        assert_eq!(
            refused.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::AnswerUnreadable.type_uri(),
            "p1's answer under p2 would be another customer's"
        );
        assert!(!refused.body.windows(CUSTOMER.len()).any(|w| w == CUSTOMER.as_bytes()));
        assert_eq!(app.count("test_entries").await, 2);
    }

    async fn a_steps_recorded_outputs_are_sealed_and_a_retry_resumes_from_them(db) {
        let downstream = Downstream::start().await;
        let app = App::serving(db, sealing(&[("k1", 1)]), TestApp::downstream(&downstream.url)).await;
        let order = || Req::post("/test/orders").tenant("t1").key("o1").json(r#"{"units": 2}"#);
        let failed = app.send(order().header("x-fail-after", "take").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.recorded_steps("o1").await, ["take"], "the step's name stays readable");
        assert!(!table_shows(&app, r#""units""#).await, "its output is sealed");
        let retry = app.send(order().build()).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&retry.body));
        assert_eq!(retry.json()["take"], serde_json::json!({ "units": 2 }), "the recorded output, opened");
        assert_eq!(app.calls.take.load(std::sync::atomic::Ordering::SeqCst), 1, "take did not run again");
        assert!(!table_shows(&app, r#""units""#).await);
    }

    async fn a_claim_whose_steps_do_not_open_is_neither_resumed_nor_released_but_parked(db) {
        let downstream = Downstream::start().await;
        let sealed = App::serving(db, sealing(&[("k1", 1)]), TestApp::downstream(&downstream.url)).await;
        let order = || Req::post("/test/orders").tenant("t1").key("o1").json(r#"{"units": 2}"#);
        let failed = sealed.send(order().header("x-fail-after", "take").build()).await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        // The key that sealed `take`'s output rotated out too soon.
        let retired = sealed.sibling_with(sealing(&[("k2", 2)])).await;
        let retry = retired.send(order().build()).await;
        assert_eq!(
            retry.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::AnswerUnreadable.type_uri(),
            "resuming without the recorded steps would run them again"
        );
        assert_eq!(retry.header("retry-after"), None);
        assert_eq!(retired.calls.take.load(std::sync::atomic::Ordering::SeqCst), 0);
        let report = retired.recover(&ReleasesAll).await;
        assert_eq!((report.found, report.parked, report.released), (1, 1, 0), "{report:?}");
        let parked = retired.send(order().build()).await;
        assert_eq!(
            parked.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::ClaimParked.type_uri()
        );
        assert_eq!(retired.recorded_steps("o1").await, ["take"], "kept for a person");
        assert_eq!(sealed.calls.take.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    async fn rekey_seals_again_with_the_first_key_every_answer_sealed_with_another_or_in_the_clear(db) {
        let clear = App::new(db).await;
        assert_eq!(clear.send(post("p1").build()).await.status, StatusCode::CREATED);
        let old = clear.sibling_with(sealing(&[("old", 1)])).await;
        let second = old.send(post("p2").build()).await;
        assert_eq!(second.status, StatusCode::CREATED);
        let rotated = old.sibling_with(sealing(&[("new", 2), ("old", 1)])).await;
        let third = rotated.send(post("p3").build()).await;
        assert_eq!(third.status, StatusCode::CREATED);
        assert!(table_shows(&rotated, CUSTOMER).await, "p1 is stored in the clear");

        let dry = rotated.store().rekey(true).await.expect("rekey --dry-run");
        assert_eq!((dry.read, dry.resealed, dry.current), (3, 2, 1), "{dry:?}");
        assert!(dry.dry_run && dry.is_complete(), "{dry:?}");
        assert_eq!(sealed_with(&rotated, "p1").await, None, "a dry run writes nothing");
        assert_eq!(sealed_with(&rotated, "p2").await.as_deref(), Some("old"));

        let done = rotated.store().rekey(false).await.expect("rekey");
        assert_eq!((done.read, done.resealed, done.current), (3, 2, 1), "{done:?}");
        assert!(done.is_complete() && done.unopened.is_empty(), "{done:?}");
        for key in ["p1", "p2", "p3"] {
            assert_eq!(sealed_with(&rotated, key).await.as_deref(), Some("new"), "{key}");
        }
        assert!(!table_shows(&rotated, CUSTOMER).await, "nothing is left in the clear");
        let again = rotated.store().rekey(false).await.expect("rekey again");
        assert_eq!((again.resealed, again.current), (0, 3), "{again:?}");

        // The old key retired: every answer still replays, the same bytes, and nothing runs.
        let retired = rotated.sibling_with(sealing(&[("new", 2)])).await;
        let runs = retired.count("test_entries").await;
        for (key, first) in [("p2", &second), ("p3", &third)] {
            let replay = retired.send(post(key).build()).await;
            assert!(replay.replayed(), "{key}");
            assert_eq!(replay.body, first.body, "{key}");
            assert_eq!(replay.header("location"), first.header("location"), "{key}");
        }
        assert!(retired.send(post("p1").build()).await.replayed());
        assert_eq!(retired.count("test_entries").await, runs, "nothing ran again");
    }

    async fn rekey_goes_through_every_batch_of_every_scope(db) {
        // Stored in the clear, over more rows than a page holds; the global scope `""` first.
        let clear = App::new(db).await;
        // Scopes and keys in both cases, where byte order and a collation's order differ
        // (`B` < `a` bytewise), and pages of 200 end inside them.
        for (scope, n) in [("", 7), ("a", 450), ("B", 1), ("z", 240), ("Z", 130)] {
            clear.seed_keys(scope, n, 3600).await;
        }
        for key in ["Upper-1", "lower-1", "Upper-2", "lower-2"] {
            assert_eq!(clear.send(post(key).build()).await.status, StatusCode::CREATED);
        }
        let app = clear.sibling_with(sealing(&[("new", 2)])).await;
        let all = 7 + 450 + 1 + 240 + 130 + 4;
        let done = app.store().rekey(false).await.expect("rekey");
        assert_eq!((done.read, done.resealed, done.current), (all, all, 0), "{done:?}");
        assert_eq!(done.from_clear, all, "{done:?}");
        let again = app.store().rekey(true).await.expect("rekey --dry-run");
        assert_eq!((again.read, again.resealed, again.current), (all, 0, all), "{again:?}");
        let clear = app
            .key_table_contents()
            .await
            .into_iter()
            .filter(|(text, _)| !text.contains("idem-sealed"))
            .count();
        assert_eq!(clear, 0, "every row sealed");
    }

    async fn rekey_leaves_what_does_not_open_and_names_the_key_it_needs(db) {
        let lost = App::build(db, sealing(&[("lost", 1)])).await;
        assert_eq!(lost.send(post("p1").build()).await.status, StatusCode::CREATED);
        let current = lost.sibling_with(sealing(&[("new", 2)])).await;
        assert_eq!(current.send(post("p2").build()).await.status, StatusCode::CREATED);
        let before = current.key_table_contents().await;
        let report = current.store().rekey(false).await.expect("rekey");
        assert_eq!((report.read, report.resealed, report.current), (2, 0, 1), "{report:?}");
        assert_eq!(report.unopened.get("lost"), Some(&1), "{report:?}");
        assert_eq!(report.unopened_keys, [("t1".to_owned(), "p1".to_owned())]);
        assert!(!report.is_complete());
        let mut after = current.key_table_contents().await;
        let mut before = before;
        before.sort();
        after.sort();
        assert_eq!(after, before, "a row that does not open is left as it is");
    }

    async fn rekey_seals_a_parked_claims_steps_again_and_leaves_a_claim_in_flight(db) {
        let downstream = Downstream::start().await;
        let old = App::serving(db, sealing(&[("old", 1)]), TestApp::downstream(&downstream.url)).await;
        let order = |key: &'static str| Req::post("/test/orders").tenant("t1").key(key).json(r#"{"units": 2}"#);
        for key in ["o1", "o2"] {
            let failed = old.send(order(key).header("x-fail-after", "take").build()).await;
            assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE, "{key}");
        }
        // o2 is in flight: its owner holds the lease. o1 is parked: a recovery without the key
        // its steps were sealed with gives up on it.
        old.renew_lease("o2").await;
        let without_old = old.sibling_with(sealing(&[("new", 2)])).await;
        let report = without_old.recover(&ReleasesAll).await;
        assert_eq!((report.found, report.parked), (1, 1), "{report:?}");

        let rotated = old.sibling_with(sealing(&[("new", 2), ("old", 1)])).await;
        let rekeyed = rotated.store().rekey(false).await.expect("rekey");
        assert_eq!((rekeyed.read, rekeyed.resealed), (1, 1), "only the parked claim: {rekeyed:?}");
        assert_eq!(rekeyed.in_flight_left, 1, "{rekeyed:?}");
        assert!(rekeyed.is_complete(), "{rekeyed:?}");
        let app = &rotated;
        let row_of = |key: &'static str| async move {
            app.key_table_contents()
                .await
                .into_iter()
                .map(|(text, _)| text)
                .find(|text| text.contains(&format!(" {key} ")))
                .expect("the key's row")
        };
        let parked = row_of("o1").await;
        assert!(parked.contains(r#""new""#) && !parked.contains(r#""old""#), "{parked}");
        let in_flight = row_of("o2").await;
        assert!(in_flight.contains(r#""old""#), "a claim in flight is its owner's: {in_flight}");
        // Inspected with the body, what the step saved is opened; without, it stays sealed.
        let opened = without_old.store().inspect("t1", "o1", true).await.expect("inspect");
        let opened = opened.expect("o1").steps.expect("steps");
        assert!(opened.contains(r#""units":2"#) && !opened.contains("idem-sealed"), "{opened}");
        let sealed = without_old.store().inspect("t1", "o1", false).await.expect("inspect");
        let sealed = sealed.expect("o1").steps.expect("steps");
        assert!(!sealed.contains("units") && sealed.contains("idem-sealed"), "{sealed}");
        // The parked claim's steps open with the new key alone: resumed, the recovery reads them.
        assert_eq!(without_old.store().resume_parked("t1", "o1").await.expect("resume"), idem_runtime::admin::Unparked::Done);
        let resumed = without_old.recover(&ReleasesAll).await;
        assert_eq!((resumed.found, resumed.parked, resumed.released), (1, 0, 1), "{resumed:?}");
    }
}

/// A row another transaction holds is skipped, not waited for, reported busy, left as it is,
/// and sealed by the next rekey: PostgreSQL and MySQL, where rows are locked one by one.
async fn rekey_skips_a_row_another_transaction_holds_and_says_so(db: idem_tests::TestDb) {
    let old = App::build(db, sealing(&[("old", 1)])).await;
    for key in ["p1", "p2"] {
        assert_eq!(
            old.send(post(key).build()).await.status,
            StatusCode::CREATED
        );
    }
    let rotated = old.sibling_with(sealing(&[("new", 2), ("old", 1)])).await;
    let held = rotated
        .while_row_held("t1", "p1", async {
            rotated.store().rekey(false).await.expect("rekey")
        })
        .await;
    assert_eq!((held.read, held.resealed, held.busy), (2, 1, 1), "{held:?}");
    assert!(!held.is_complete());
    assert_eq!(
        sealed_with(&rotated, "p1").await.as_deref(),
        Some("old"),
        "left as it is"
    );
    assert_eq!(sealed_with(&rotated, "p2").await.as_deref(), Some("new"));
    let again = rotated.store().rekey(false).await.expect("rekey again");
    assert_eq!(
        (again.resealed, again.current, again.busy),
        (1, 1, 0),
        "{again:?}"
    );
    assert_eq!(sealed_with(&rotated, "p1").await.as_deref(), Some("new"));
}

mod row_locks {
    use super::*;

    #[sqlx::test(migrations = false)]
    async fn postgres_rekey_skips_a_row_another_transaction_holds_and_says_so(
        _: sqlx::postgres::PgPoolOptions,
        connect: sqlx::postgres::PgConnectOptions,
    ) {
        rekey_skips_a_row_another_transaction_holds_and_says_so(idem_tests::TestDb::Postgres(
            Box::new(connect),
        ))
        .await;
    }

    #[tokio::test]
    async fn mysql_rekey_skips_a_row_another_transaction_holds_and_says_so() {
        let database = idem_tests::MySqlDb::create().await;
        let name = database.name().to_owned();
        rekey_skips_a_row_another_transaction_holds_and_says_so(idem_tests::TestDb::MySql(
            Box::new(database),
        ))
        .await;
        idem_tests::MySqlDb::drop_named(&name).await;
    }
}
