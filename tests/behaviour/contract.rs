//! Every row of the guide's "What a request gets" table (`docs/guide/requests.md`), through the
//! suite's test app, on both backends: each test runs against a fresh PostgreSQL database
//! (`#[sqlx::test]`) and a fresh SQLite file.

use axum::http::StatusCode;
use idem_runtime::{ProblemKind, StoreOptions};
use idem_tests::{
    App, Options, Req, StatementLog, TestDb, backend_tests, entry, until_called,
    until_queued_writers, wait_until,
};
use serde_json::json;

const ENTRIES: &str = "/test/entries";

fn post(tenant: &str, key: &str, body: &str) -> Req {
    Req::post(ENTRIES).tenant(tenant).key(key).json(body)
}

/// Runs of the entries handler.
fn entry_runs(app: &App) -> usize {
    app.calls.entries.load(std::sync::atomic::Ordering::SeqCst)
}

async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut outputs = Vec::with_capacity(handles.len());
    for handle in handles {
        outputs.push(handle.await.expect("request task"));
    }
    outputs
}

backend_tests! {
    async fn missing_key_is_400_and_the_handler_does_not_run(db) {
        let app = App::new(db).await;
        let reply = app
            .send(
                Req::post(ENTRIES)
                    .tenant("t1")
                    .json(&entry(100, "n1"))
                    .build(),
            )
            .await;
        assert_eq!(
            reply.problem(StatusCode::BAD_REQUEST),
            ProblemKind::MissingKey.type_uri()
        );
        assert_eq!(app.count("test_entries").await, 0);
        assert_eq!(app.count("idem_keys").await, 0);
    }

    async fn malformed_keys_are_400_and_the_handler_does_not_run(db) {
        let app = App::new(db).await;
        let too_long = "k".repeat(256);
        let quoted_too_long = format!("\"{too_long}\"");
        for bad in [
            "",
            "\"\"",
            too_long.as_str(),
            quoted_too_long.as_str(),
            "a b",
            "\"a b\"",
            "\"unterminated",
            "\"k\";p=1",
            "caf\u{e9}",
        ] {
            let request = Req::post(ENTRIES)
                .tenant("t1")
                .header("idempotency-key", bad)
                .json(&entry(100, "n1"));
            // `caf\u{e9}` is not visible ASCII; http accepts it as opaque bytes.
            let reply = app.send(request.build()).await;
            assert_eq!(
                reply.problem(StatusCode::BAD_REQUEST),
                ProblemKind::MalformedKey.type_uri(),
                "key {bad:?}"
            );
        }
        let twice = Req::post(ENTRIES)
            .tenant("t1")
            .key("a")
            .key("b")
            .json(&entry(100, "n1"));
        let reply = app.send(twice.build()).await;
        assert_eq!(
            reply.problem(StatusCode::BAD_REQUEST),
            ProblemKind::MalformedKey.type_uri()
        );
        assert!(reply.json()["detail"].as_str().unwrap().contains("2 times"));
        assert_eq!(app.count("test_entries").await, 0);
        assert_eq!(app.count("idem_keys").await, 0);
    }

    async fn first_request_runs_once_and_is_stored_with_its_writes(db) {
        let app = App::new(db).await;
        let reply = app
            .send(post("t1", "k1", &entry(4200, "n1")).build())
            .await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        let body = reply.json();
        assert_eq!(body["amount"], 4200);
        assert_eq!(
            reply.header("location"),
            Some(format!("/test/entries/{}", body["id"]).as_str())
        );
        assert_eq!(entry_runs(&app), 1);
        assert_eq!(app.count("test_entries").await, 1);
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
        assert_eq!(app.retention_secs("k1").await, 24 * 3600);
    }

    async fn retry_replays_status_body_and_headers_without_running_the_handler(db) {
        let app = App::new(db).await;
        let first = app
            .send(post("t1", "k1", &entry(100, "n1")).build())
            .await;
        let second = app
            .send(post("t1", "k1", &entry(100, "n1")).build())
            .await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(second.replayed());
        assert_eq!(second.body, first.body);
        assert_eq!(second.header("location"), first.header("location"));
        assert_eq!(second.header("content-type"), Some("application/json"));
        assert_eq!(entry_runs(&app), 1, "the retry did not run the handler");
        assert_eq!(app.count("test_entries").await, 1);
    }

    async fn quoted_and_bare_keys_are_the_same_key(db) {
        let app = App::new(db).await;
        let first = app
            .send(post("t1", "\"8e03978e-40d5\"", &entry(100, "n1")).build())
            .await;
        let second = app
            .send(post("t1", "8e03978e-40d5", &entry(100, "n1")).build())
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(second.replayed());
        assert_eq!(second.body, first.body);
    }

    async fn reordered_json_is_the_same_request(db) {
        let app = App::new(db).await;
        let first = app
            .send(
                post(
                    "t1",
                    "k1",
                    r#"{"amount":100,"note":"n1"}"#,
                )
                .build(),
            )
            .await;
        let reordered = "{\n  \"note\" : \"n1\",\n   \"amount\": 100\n}";
        let second = app.send(post("t1", "k1", reordered).build()).await;
        assert!(second.replayed(), "status {}", second.status);
        assert_eq!(second.body, first.body);
        assert_eq!(app.count("test_entries").await, 1);
    }

    async fn same_key_with_a_different_body_is_422(db) {
        let app = App::new(db).await;
        app.send(post("t1", "k1", &entry(100, "n1")).build())
            .await;
        let reply = app
            .send(post("t1", "k1", &entry(999, "n1")).build())
            .await;
        assert_eq!(
            reply.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert_eq!(app.count("test_entries").await, 1);
    }

    async fn a_retry_that_changes_only_fields_the_fingerprint_leaves_out_is_replayed(db) {
        let app = App::new(db).await;
        for (route, counted) in [
            ("/test/entries-by-fields", json!({"amount": 5, "note": "n", "x": 1})),
            ("/test/entries-but-fields", json!({"amount": 5, "note": "n", "x": 1, "trace": {"hop": 1}})),
        ] {
            let key = format!("k{route}");
            let send = |body: serde_json::Value| {
                let request = Req::post(route).tenant("t1").key(&key).json(&body.to_string());
                app.send(request.build())
            };
            let mut first_body = counted.clone();
            first_body["sent_at"] = json!("10:00:00");
            first_body["trace"]["id"] = json!("a");
            let first = send(first_body).await;
            assert_eq!(first.status, StatusCode::CREATED, "{route}: {:?}", first.body);
            // Another `sent_at` and trace id, the fields that count unchanged: the same request.
            let mut retry = counted.clone();
            retry["sent_at"] = json!("10:00:07");
            retry["trace"]["id"] = json!("b");
            let again = send(retry).await;
            assert!(again.replayed(), "{route}: status {} {:?}", again.status, again.body);
            assert_eq!(again.body, first.body, "{route}");
            // A field that counts changed: another request under the same key.
            let mut other = counted.clone();
            other["amount"] = json!(6);
            assert_eq!(
                send(other).await.problem(StatusCode::UNPROCESSABLE_ENTITY),
                ProblemKind::KeyReused.type_uri(),
                "{route}"
            );
        }
        // `x` counts where all but `sent_at` and `trace/id` count, not where only the amount
        // and the note do.
        let changed_x = |route: &str| {
            let body = json!({"amount": 5, "note": "n", "x": 2, "trace": {"hop": 1}});
            Req::post(route).tenant("t1").key(&format!("k{route}")).json(&body.to_string())
        };
        assert!(app.send(changed_x("/test/entries-by-fields").build()).await.replayed());
        assert_eq!(
            app.send(changed_x("/test/entries-but-fields").build())
                .await
                .problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert_eq!(entry_runs(&app), 2, "each route's handler ran once");
        assert_eq!(app.count("test_entries").await, 2);
    }

    async fn an_external_retry_that_changes_only_fields_the_fingerprint_leaves_out_is_replayed(db) {
        let app = App::new(db).await;
        let send = |body: serde_json::Value| {
            let request = Req::post("/test/external-but-fields").tenant("t1").key("k1");
            app.send(request.json(&body.to_string()).build())
        };
        let first = send(json!({"amount": 5, "sent_at": "10:00:00"})).await;
        assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
        let again = send(json!({"amount": 5, "sent_at": "10:00:07"})).await;
        assert!(again.replayed(), "status {} {:?}", again.status, again.body);
        assert_eq!(again.body, first.body);
        assert_eq!(
            send(json!({"amount": 6, "sent_at": "10:00:00"}))
                .await
                .problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert_eq!(app.calls.external.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    async fn same_key_with_another_query_or_route_is_422(db) {
        let app = App::new(db).await;
        app.send(post("t1", "k1", &entry(100, "n1")).build())
            .await;
        let query = Req::post("/test/entries?expand=note")
            .tenant("t1")
            .key("k1")
            .json(&entry(100, "n1"));
        assert_eq!(
            app.send(query.build())
                .await
                .problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        let other_route = Req::post("/test/stored-5xx")
            .tenant("t1")
            .key("k1")
            .json(&entry(100, "n1"));
        let reply = app.send(other_route.build()).await;
        assert_eq!(
            reply.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert!(
            reply.json()["detail"]
                .as_str()
                .unwrap()
                .contains("POST /test/entries")
        );
        assert_eq!(entry_runs(&app), 1);
        assert_eq!(app.count("test_entries").await, 1);
    }

    async fn two_tenants_with_the_same_key_get_two_entries(db) {
        let app = App::new(db).await;
        let a = app
            .send(post("tenant_a", "shared", &entry(100, "n1")).build())
            .await;
        let b = app
            .send(post("tenant_b", "shared", &entry(100, "n1")).build())
            .await;
        assert_eq!(
            (a.status, b.status),
            (StatusCode::CREATED, StatusCode::CREATED)
        );
        assert!(!b.replayed());
        assert_ne!(a.json()["id"], b.json()["id"]);
        assert_eq!(app.count("test_entries").await, 2);
    }

    async fn global_keys_are_shared_by_all_callers(db) {
        let app = App::new(db).await;
        let a = app
            .send(Req::post("/test/global").key("g1").json("\"x\"").build())
            .await;
        let b = app
            .send(Req::post("/test/global").key("g1").json("\"x\"").build())
            .await;
        assert_eq!(a.status, StatusCode::CREATED);
        assert!(b.replayed());
        assert_eq!(
            app.calls.global.load(std::sync::atomic::Ordering::SeqCst),
            1
        );
    }

    async fn a_5xx_not_stored_lets_the_retry_succeed(db) {
        let app = App::new(db).await;
        let first = app
            .send(Req::post("/test/flaky").tenant("t1").key("k1").build())
            .await;
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.count("test_effects").await, 0);
        let second = app
            .send(Req::post("/test/flaky").tenant("t1").key("k1").build())
            .await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert_eq!(&second.body[..], b"call 2");
        let third = app
            .send(Req::post("/test/flaky").tenant("t1").key("k1").build())
            .await;
        assert!(third.replayed());
        assert_eq!(&third.body[..], b"call 2");
        assert_eq!(app.count("test_effects").await, 1);
    }

    async fn a_panicking_handler_leaves_no_write_and_no_key(db) {
        let app = App::new(db).await;
        let first = app
            .send(Req::post("/test/panic").tenant("t1").key("k1").build())
            .await;
        assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(app.count("test_effects").await, 0);
        assert_eq!(app.keys_named("k1").await, 0);
        // The dropped transaction released the key: the retry runs the handler again.
        let second = app
            .send(Req::post("/test/panic").tenant("t1").key("k1").build())
            .await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(!second.replayed());
        assert_eq!(app.count("test_effects").await, 1);
    }

    async fn a_dropped_request_leaves_no_write_and_no_key(db) {
        let app = App::new(db).await;
        let request = Req::post("/test/slow").tenant("t1").key("k1").build();
        let in_flight = tokio::spawn({
            let app = app.clone();
            async move { app.send(request).await }
        });
        // The handler body runs only after its key is claimed.
        until_called(&app.calls.slow, 1).await;
        assert_eq!(app.keys_in_flight(), 1, "the running handler holds its key");
        // The client goes away mid-request: the handler's future is dropped.
        in_flight.abort();
        assert!(in_flight.await.unwrap_err().is_cancelled());
        // The database lets go once the dropped transaction's rollback has run.
        wait_until("the dropped request's key and lock to be released", || async {
            app.keys_in_flight() == 0 && app.db_locks().await == 0
        })
        .await;
        assert_eq!(app.count("test_effects").await, 0);
        assert_eq!(app.keys_named("k1").await, 0);
        app.gate.add_permits(1);
        let retry = app
            .send(Req::post("/test/slow").tenant("t1").key("k1").build())
            .await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(app.count("test_effects").await, 1);
    }

    async fn a_duplicate_while_the_first_runs_gets_409_at_once(db) {
        let app = App::new(db).await;
        let first = tokio::spawn({
            let app = app.clone();
            async move {
                app.send(Req::post("/test/slow").tenant("t1").key("k1").build())
                    .await
            }
        });
        // The handler body runs only after its key is claimed.
        until_called(&app.calls.slow, 1).await;
        let duplicate = app
            .send(Req::post("/test/slow").tenant("t1").key("k1").build())
            .await;
        assert_eq!(
            duplicate.problem(StatusCode::CONFLICT),
            ProblemKind::InProgress.type_uri()
        );
        assert_eq!(duplicate.header("retry-after"), Some("1"));
        assert!(
            !first.is_finished(),
            "the 409 came while the first request was still running"
        );
        assert_eq!(app.calls.slow.load(std::sync::atomic::Ordering::SeqCst), 1);
        app.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        let retry = app
            .send(Req::post("/test/slow").tenant("t1").key("k1").build())
            .await;
        assert!(retry.replayed());
        assert_eq!(app.count("test_effects").await, 1);
    }

    async fn fifty_concurrent_requests_with_one_key_make_one_entry(db) {
        // A pool large enough for every request to hold a connection at once.
        let options = Options {
            connections: Some(55),
            ..Options::default()
        };
        let app = App::build(db, options).await;
        let replies = futures_join_all((0..50).map(|_| {
            let app = app.clone();
            async move {
                app.send(post("t1", "race", &entry(100, "n1")).build())
                    .await
            }
        }))
        .await;
        let executed: Vec<_> = replies
            .iter()
            .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
            .collect();
        assert_eq!(executed.len(), 1, "exactly one request ran the handler");
        for reply in &replies {
            assert!(
                reply.status == StatusCode::CREATED || reply.status == StatusCode::CONFLICT,
                "unexpected {}: {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            );
            if reply.status == StatusCode::CREATED {
                assert_eq!(
                    reply.body, executed[0].body,
                    "every 201 is the same entry"
                );
            }
        }
        assert_eq!(app.count("test_entries").await, 1);
        let retry = app
            .send(post("t1", "race", &entry(100, "n1")).build())
            .await;
        assert!(retry.replayed());
        assert_eq!(retry.body, executed[0].body);
    }


    async fn concurrent_replays_of_a_finished_key_all_replay(db) {
        let app = App::new(db).await;
        let first = app.send(post("t1", "k1", &entry(100, "n1")).build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let replies = futures_join_all((0..20).map(|_| {
            let app = app.clone();
            async move { app.send(post("t1", "k1", &entry(100, "n1")).build()).await }
        }))
        .await;
        for reply in replies {
            assert!(reply.replayed(), "{}: {}", reply.status, String::from_utf8_lossy(&reply.body));
            assert_eq!(reply.body, first.body);
        }
    }

    async fn replays_and_409s_do_not_wait_behind_queued_writers(db) {
        // A small pool: a long handler and two queued writers must not starve the readers.
        let options = Options {
            connections: Some(3),
            ..Options::default()
        };
        let app = App::build(db, options).await;
        let done = app.send(post("t1", "done", &entry(100, "n1")).build()).await;
        let slow = tokio::spawn({
            let app = app.clone();
            async move { app.send(Req::post("/test/slow").tenant("t1").key("s1").build()).await }
        });
        until_called(&app.calls.slow, 1).await;
        let queued: Vec<_> = ["n1", "n2"]
            .into_iter()
            .map(|key| {
                let app = app.clone();
                tokio::spawn(async move { app.send(post("t1", key, &entry(100, "n1")).build()).await })
            })
            .collect();
        // The writers wait for their turn: SQLite's single writer is the slow handler, so they
        // queue in the process; PostgreSQL and MySQL let them write beside it, so they finish.
        if !app.is_single_writer() {
            for request in &queued {
                wait_until("the writers to finish beside the slow handler", || async {
                    request.is_finished()
                })
                .await;
            }
        } else {
            until_queued_writers(&app, 2).await;
        }
        let limit = idem_tests::DEADLINE;
        let replay = tokio::time::timeout(limit, app.send(post("t1", "done", &entry(100, "n1")).build()))
            .await
            .expect("the replay did not wait for the writers");
        assert!(replay.replayed());
        assert_eq!(replay.body, done.body);
        let duplicate = tokio::time::timeout(limit, app.send(Req::post("/test/slow").tenant("t1").key("s1").build()))
            .await
            .expect("the duplicate did not wait for the writers");
        assert_eq!(duplicate.status, StatusCode::CONFLICT);
        assert!(!slow.is_finished());
        app.gate.add_permits(1);
        assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
        for request in queued {
            assert_eq!(request.await.unwrap().status, StatusCode::CREATED);
        }
    }

    async fn an_expired_key_is_a_new_request(db) {
        let app = App::new(db).await;
        let first = app
            .send(post("t1", "k1", &entry(100, "n1")).build())
            .await;
        // Past its retention, before any purge has run.
        app.expire_all_keys().await;
        let second = app
            .send(post("t1", "k1", &entry(100, "n1")).build())
            .await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(!second.replayed());
        assert_ne!(second.json()["id"], first.json()["id"]);
        assert_eq!(app.count("test_entries").await, 2);
        assert_eq!(
            app.keys_named("k1").await,
            1,
            "the expired row was replaced"
        );
        // Even with a different body: the old request is forgotten.
        app.expire_all_keys().await;
        let third = app
            .send(post("t1", "k1", &entry(555, "n1")).build())
            .await;
        assert_eq!(third.status, StatusCode::CREATED);
        let fourth = app
            .send(post("t1", "k1", &entry(555, "n1")).build())
            .await;
        assert!(fourth.replayed());
        assert_eq!(fourth.body, third.body);
    }

    async fn a_5xx_is_not_stored_its_writes_are_undone_and_a_retry_runs_again(db) {
        let app = App::new(db).await;
        let request = || post("t1", "k1", &entry(100, "unavailable")).build();
        let first = app.send(request()).await;
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.count("test_entries").await, 0, "the attempt's insert was rolled back");
        assert_eq!(app.keys_named("k1").await, 0, "the key was released");
        let second = app.send(request()).await;
        assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!second.replayed(), "a 5xx is not replayed by default");
        assert_eq!(entry_runs(&app), 2);
    }

    async fn a_stored_5xx_is_replayed_and_its_writes_undone(db) {
        let app = App::new(db).await;
        let request = || {
            Req::post("/test/stored-5xx").tenant("t1").key("k1").json(&entry(100, "n1")).build()
        };
        let first = app.send(request()).await;
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.count("test_entries").await, 0, "the handler's insert was undone");
        assert_eq!(app.response_status("k1").await, 503);
        assert_eq!(app.retention_secs("k1").await, 7 * 86400);
        let second = app.send(request()).await;
        assert!(second.replayed());
        assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(second.body, first.body);
        assert_eq!(entry_runs(&app), 1);
        assert_eq!(app.count("test_entries").await, 0);
    }

    async fn a_4xx_from_the_handler_is_final_and_replayed(db) {
        let app = App::new(db).await;
        for (key, amount) in [("k1", 0), ("k2", -5)] {
            let first = app.send(post("t1", key, &entry(amount, "n1")).build()).await;
            assert_eq!(first.status, StatusCode::BAD_REQUEST);
            let second = app.send(post("t1", key, &entry(amount, "n1")).build()).await;
            assert!(second.replayed());
            assert_eq!(second.body, first.body);
        }
        assert_eq!(entry_runs(&app), 2);
        assert_eq!(app.count("test_entries").await, 0);
    }

    async fn extractor_rejections_store_nothing_and_leave_the_key_free(db) {
        let app = App::new(db).await;
        let no_tenant = Req::post(ENTRIES).key("k1").json(&entry(100, "n1"));
        assert_eq!(app.send(no_tenant.build()).await.status, StatusCode::UNAUTHORIZED);
        let bad_json = app.send(post("t1", "k1", "{\"amount\": 100,").build()).await;
        assert_eq!(bad_json.status, StatusCode::BAD_REQUEST);
        let wrong_type = app.send(post("t1", "k1", r#"{"amount": "a lot", "note": "n"}"#).build()).await;
        assert_eq!(wrong_type.status, StatusCode::UNPROCESSABLE_ENTITY);
        let no_content_type = Req::post(ENTRIES).tenant("t1").key("k1").build();
        let reply = app.send(no_content_type).await;
        assert_eq!(reply.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(entry_runs(&app), 0);
        assert_eq!(app.count("idem_keys").await, 0);
        // The key is still free for a good request.
        let good = app.send(post("t1", "k1", &entry(100, "n1")).build()).await;
        assert_eq!(good.status, StatusCode::CREATED);
        assert!(!good.replayed());
    }

    async fn bodies_over_the_limit_are_413_and_store_nothing(db) {
        let settings = StoreOptions::default().with_max_request_body(64);
        let options = Options {
            store_options: settings,
            ..Options::default()
        };
        let app = App::build(db, options).await;
        let big = format!(
            r#"{{"amount": 1, "note": "{}"}}"#,
            "n".repeat(100)
        );
        let reply = app.send(post("t1", "k1", &big).build()).await;
        assert_eq!(
            reply.problem(StatusCode::PAYLOAD_TOO_LARGE),
            ProblemKind::BodyTooLarge.type_uri()
        );
        assert_eq!(app.count("idem_keys").await, 0);
        assert_eq!(app.count("test_entries").await, 0);
    }

    async fn responses_over_the_limit_roll_back_the_writes(db) {
        let settings = StoreOptions::default().with_max_response_body(16);
        let options = Options {
            store_options: settings,
            ..Options::default()
        };
        let app = App::build(db, options).await;
        let reply = app
            .send(post("t1", "k1", &entry(100, "n1")).build())
            .await;
        assert_eq!(
            reply.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::ResponseTooLarge.type_uri()
        );
        assert_eq!(app.count("test_entries").await, 0);
        assert_eq!(app.count("idem_keys").await, 0);
    }
}

/// Posts an entry to the handler without idempotency, which must create it.
async fn bare_entry(app: &App) {
    let bare = app
        .send(
            Req::post("/test/bare-entries")
                .tenant("t1")
                .json(&entry(100, "n1"))
                .build(),
        )
        .await;
    assert_eq!(bare.status, StatusCode::CREATED, "{:?}", bare.body);
}

/// Posts a request that succeeds to the route whose 5xx outcomes are stored, under `key`.
async fn stored_5xx_success(app: &App, key: &str) {
    let reply = app
        .send(
            Req::post("/test/stored-5xx")
                .tenant("t1")
                .key(key)
                .json(&entry(100, "ok"))
                .build(),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
}

/// PostgreSQL only: the statement budget is PostgreSQL's (SQLite runs in-process, where a
/// statement costs microseconds and the claim reads before it locks).
#[sqlx::test(migrations = false)]
async fn a_first_execution_adds_two_statements_and_a_replay_writes_nothing(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = App::new(TestDb::Postgres(Box::new(connect))).await;
    // Warm the connection's prepared statements, as in a running service.
    app.send(post("t1", "warm", &entry(100, "n1")).build())
        .await;
    bare_entry(&app).await;

    let log = StatementLog::default();
    let _guard = log.install();
    bare_entry(&app).await;
    let bare = log.take();
    let first = app.send(post("t1", "k1", &entry(100, "n1")).build()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let first = log.take();
    let replay = app.send(post("t1", "k1", &entry(100, "n1")).build()).await;
    assert!(replay.replayed());
    let replay = log.take();
    println!(
        "bare ({}): {bare:#?}\nfirst ({}): {first:#?}\nreplay ({}): {replay:#?}",
        bare.len(),
        first.len(),
        replay.len()
    );

    // sqlx does not log BEGIN (it is sent with the first query); both paths send one.
    assert_eq!(bare.len(), 2, "INSERT, COMMIT: {bare:#?}");
    assert_eq!(first.len(), bare.len() + 2, "claim and complete only");
    let added: Vec<&String> = first.iter().filter(|s| s.contains("idem_")).collect();
    assert_eq!(added.len(), 2, "{added:#?}");
    let writes = ["INSERT", "UPDATE", "DELETE", "COMMIT"];
    assert!(
        replay
            .iter()
            .all(|s| !writes.iter().any(|w| s.to_uppercase().starts_with(w))),
        "a replay writes nothing: {replay:#?}"
    );
    // The read-only transaction is rolled back as its connection returns to the pool.
    assert_eq!(replay.len(), 1, "the claim alone: {replay:#?}");

    // A route whose 5xx outcomes are stored costs its successes nothing more.
    stored_5xx_success(&app, "k2").await;
    let stored_5xx = log.take();
    assert_eq!(
        stored_5xx.len(),
        first.len(),
        "a replay_5xx route's success runs what any first execution runs: {stored_5xx:#?}"
    );
}

/// SQLite runs every statement on its connection's thread, one call each, and idem's writers
/// hold the write lock from the claim's `BEGIN IMMEDIATE` to the `COMMIT`: the claim's
/// savepoint is released in the completion's own call, and a `replay_5xx` route's undo point is
/// taken in the `BEGIN`'s, not in calls of their own.
#[tokio::test]
async fn on_sqlite_a_first_execution_adds_three_statements_and_a_replay_5xx_route_none_more() {
    let app = App::new(TestDb::sqlite()).await;
    app.send(post("t1", "warm", &entry(100, "n1")).build())
        .await;
    let log = StatementLog::default();
    log.install_for_process();
    log.take();
    bare_entry(&app).await;
    let bare = log.take();
    let first = app.send(post("t1", "k1", &entry(100, "n1")).build()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // A connection the pool opens on the way sets itself up first (`PRAGMA …`): not the
    // request's.
    let first: Vec<String> = log
        .take()
        .into_iter()
        .filter(|s| !s.starts_with("PRAGMA"))
        .collect();
    println!("bare: {bare:#?}\nfirst: {first:#?}");
    assert!(!bare.is_empty(), "the bare handler's statements are logged");

    // The lock-free read (replays skip the write lock), the read under the lock, and the
    // completion with the release of the claim's savepoint.
    assert_eq!(
        first.len(),
        bare.len() + 3,
        "bare {bare:#?}\nfirst {first:#?}"
    );
    let completion: Vec<&String> = first
        .iter()
        .filter(|s| s.contains("INSERT INTO idem_keys"))
        .collect();
    assert_eq!(completion.len(), 1, "{first:#?}");
    assert!(
        completion[0].starts_with("RELEASE SAVEPOINT idem_claim;"),
        "{completion:#?}"
    );

    // A route whose 5xx outcomes are stored takes its undo point with the claim's `BEGIN`
    // (which sqlx does not log), not in a call of its own.
    stored_5xx_success(&app, "k2").await;
    let stored_5xx: Vec<String> = log
        .take()
        .into_iter()
        .filter(|s| !s.starts_with("PRAGMA"))
        .collect();
    assert_eq!(
        stored_5xx.len(),
        first.len(),
        "a replay_5xx route's success runs what any first execution runs: {stored_5xx:#?}"
    );
}
