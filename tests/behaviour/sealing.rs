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
}
