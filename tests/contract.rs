//! Every row of the README's "What a request gets" table, through the example's real router, on both backends: each test
//! runs against a fresh PostgreSQL database (`#[sqlx::test]`) and a fresh SQLite file.

use axum::http::StatusCode;
use idem_runtime::{ProblemKind, Settings};
use idem_tests::{
    App, Options, Req, StatementLog, TestDb, backend_tests, payment, until_called,
    until_queued_writers, wait_until,
};

const PAYMENTS: &str = "/v1/payments";
const PAYOUTS: &str = "/v1/payouts";

fn pay(tenant: &str, key: &str, body: &str) -> Req {
    Req::post(PAYMENTS).tenant(tenant).key(key).json(body)
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
                Req::post(PAYMENTS)
                    .tenant("t1")
                    .json(&payment(100, "cus_1"))
                    .build(),
            )
            .await;
        assert_eq!(
            reply.problem(StatusCode::BAD_REQUEST),
            ProblemKind::MissingKey.type_uri()
        );
        assert_eq!(app.count("payments").await, 0);
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
            let request = Req::post(PAYMENTS)
                .tenant("t1")
                .header("idempotency-key", bad)
                .json(&payment(100, "cus_1"));
            // `caf\u{e9}` is not visible ASCII; http accepts it as opaque bytes.
            let reply = app.send(request.build()).await;
            assert_eq!(
                reply.problem(StatusCode::BAD_REQUEST),
                ProblemKind::MalformedKey.type_uri(),
                "key {bad:?}"
            );
        }
        let twice = Req::post(PAYMENTS)
            .tenant("t1")
            .key("a")
            .key("b")
            .json(&payment(100, "cus_1"));
        let reply = app.send(twice.build()).await;
        assert_eq!(
            reply.problem(StatusCode::BAD_REQUEST),
            ProblemKind::MalformedKey.type_uri()
        );
        assert!(reply.json()["detail"].as_str().unwrap().contains("2 times"));
        assert_eq!(app.count("payments").await, 0);
        assert_eq!(app.count("idem_keys").await, 0);
    }

    async fn first_request_runs_once_and_is_stored_with_its_writes(db) {
        let app = App::new(db).await;
        let reply = app
            .send(pay("t1", "k1", &payment(4200, "cus_1")).build())
            .await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        let body = reply.json();
        let id = body["id"].as_str().unwrap();
        assert_eq!(body["status"], "succeeded");
        assert_eq!(body["amount"], 4200);
        assert_eq!(
            reply.header("location"),
            Some(format!("/v1/payments/{id}").as_str())
        );
        assert_eq!(app.count("payments").await, 1);
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
        assert_eq!(app.retention_secs("k1").await, 24 * 3600);
    }

    async fn retry_replays_status_body_and_headers_without_running_the_handler(db) {
        let app = App::new(db).await;
        let first = app
            .send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        let second = app
            .send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(second.replayed());
        assert_eq!(second.body, first.body);
        assert_eq!(second.header("location"), first.header("location"));
        assert_eq!(second.header("content-type"), Some("application/json"));
        assert_eq!(app.count("payments").await, 1);
        let listed = app.send(Req::get(PAYMENTS).tenant("t1").build()).await;
        assert_eq!(listed.json().as_array().unwrap().len(), 1);
    }

    async fn quoted_and_bare_keys_are_the_same_key(db) {
        let app = App::new(db).await;
        let first = app
            .send(pay("t1", "\"8e03978e-40d5\"", &payment(100, "cus_1")).build())
            .await;
        let second = app
            .send(pay("t1", "8e03978e-40d5", &payment(100, "cus_1")).build())
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(second.replayed());
        assert_eq!(second.body, first.body);
    }

    async fn reordered_json_is_the_same_request(db) {
        let app = App::new(db).await;
        let first = app
            .send(
                pay(
                    "t1",
                    "k1",
                    r#"{"amount":100,"currency":"usd","customer":"cus_1"}"#,
                )
                .build(),
            )
            .await;
        let reordered = "{\n  \"customer\" : \"cus_1\",\n  \"currency\": \"usd\",  \"amount\": 100\n}";
        let second = app.send(pay("t1", "k1", reordered).build()).await;
        assert!(second.replayed(), "status {}", second.status);
        assert_eq!(second.body, first.body);
        assert_eq!(app.count("payments").await, 1);
    }

    async fn same_key_with_a_different_body_is_422(db) {
        let app = App::new(db).await;
        app.send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        let reply = app
            .send(pay("t1", "k1", &payment(999, "cus_1")).build())
            .await;
        assert_eq!(
            reply.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert_eq!(app.count("payments").await, 1);
    }

    async fn same_key_with_another_query_or_route_is_422(db) {
        let app = App::new(db).await;
        app.send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        let query = Req::post("/v1/payments?expand=customer")
            .tenant("t1")
            .key("k1")
            .json(&payment(100, "cus_1"));
        assert_eq!(
            app.send(query.build())
                .await
                .problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        let payout = Req::post(PAYOUTS)
            .tenant("t1")
            .key("k1")
            .json(&payment(100, "cus_1"));
        let reply = app.send(payout.build()).await;
        assert_eq!(
            reply.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert!(
            reply.json()["detail"]
                .as_str()
                .unwrap()
                .contains("POST /v1/payments")
        );
        assert_eq!(app.count("payments").await, 1);
        assert_eq!(app.count("payouts").await, 0);
    }

    async fn two_tenants_with_the_same_key_get_two_payments(db) {
        let app = App::new(db).await;
        let a = app
            .send(pay("tenant_a", "shared", &payment(100, "cus_1")).build())
            .await;
        let b = app
            .send(pay("tenant_b", "shared", &payment(100, "cus_1")).build())
            .await;
        assert_eq!(
            (a.status, b.status),
            (StatusCode::CREATED, StatusCode::CREATED)
        );
        assert!(!b.replayed());
        assert_ne!(a.json()["id"], b.json()["id"]);
        assert_eq!(app.count("payments").await, 2);
        // Each tenant sees only its own payment.
        let id_a = a.json()["id"].as_str().unwrap().to_owned();
        let foreign = app
            .send(
                Req::get(&format!("/v1/payments/{id_a}"))
                    .tenant("tenant_b")
                    .build(),
            )
            .await;
        assert_eq!(
            foreign.problem(StatusCode::NOT_FOUND),
            "tag:payments.idem.example,2026:not-found"
        );
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

    async fn declined_payment_is_stored_and_replayed_as_402(db) {
        let app = App::new(db).await;
        let first = app
            .send(pay("t1", "k1", &payment(100, "cus_declined")).build())
            .await;
        assert_eq!(
            first.problem(StatusCode::PAYMENT_REQUIRED),
            "tag:payments.idem.example,2026:card-declined"
        );
        let second = app
            .send(pay("t1", "k1", &payment(100, "cus_declined")).build())
            .await;
        assert!(second.replayed());
        assert_eq!(second.status, StatusCode::PAYMENT_REQUIRED);
        assert_eq!(second.body, first.body);
        assert_eq!(
            second.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(app.payment_statuses().await, ["declined"]);
    }

    async fn payment_503_is_not_stored_and_a_retry_runs_again(db) {
        let app = App::new(db).await;
        let first = app
            .send(pay("t1", "k1", &payment(100, "cus_unavailable")).build())
            .await;
        assert_eq!(
            first.problem(StatusCode::SERVICE_UNAVAILABLE),
            "tag:payments.idem.example,2026:processor-unavailable"
        );
        assert_eq!(
            app.count("payments").await,
            0,
            "the attempt's insert was rolled back"
        );
        assert_eq!(app.keys_named("k1").await, 0, "the key was released");
        let second = app
            .send(pay("t1", "k1", &payment(100, "cus_unavailable")).build())
            .await;
        assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!second.replayed(), "a 5xx on payments is never replayed");
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

    async fn payout_503_is_stored_and_replayed_and_its_writes_undone(db) {
        let app = App::new(db).await;
        let payout = || {
            Req::post(PAYOUTS)
                .tenant("t1")
                .key("k1")
                .json(&payment(100, "cus_unavailable"))
        };
        let first = app.send(payout().build()).await;
        first.problem(StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            app.count("payouts").await,
            0,
            "the payout's insert was undone"
        );
        assert_eq!(app.response_status("k1").await, 503);
        assert_eq!(app.retention_secs("k1").await, 7 * 86400);
        let second = app.send(payout().build()).await;
        assert!(second.replayed());
        assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(second.body, first.body);
        assert_eq!(app.count("payouts").await, 0);
    }

    async fn payout_succeeds_with_its_own_location(db) {
        let app = App::new(db).await;
        let reply = app
            .send(
                Req::post(PAYOUTS)
                    .tenant("t1")
                    .key("k1")
                    .json(&payment(100, "cus_1"))
                    .build(),
            )
            .await;
        assert_eq!(reply.status, StatusCode::CREATED);
        let id = reply.json()["id"].as_str().unwrap().to_owned();
        assert_eq!(reply.json()["status"], "paid");
        assert_eq!(
            reply.header("location"),
            Some(format!("/v1/payouts/{id}").as_str())
        );
        let fetched = app
            .send(Req::get(&format!("/v1/payouts/{id}")).tenant("t1").build())
            .await;
        assert_eq!(fetched.json(), reply.json());
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

    async fn fifty_concurrent_requests_with_one_key_make_one_payment(db) {
        // A pool large enough for every request to hold a connection at once.
        let options = Options {
            connections: Some(55),
            ..Options::default()
        };
        let app = App::build(db, options).await;
        let replies = futures_join_all((0..50).map(|_| {
            let app = app.clone();
            async move {
                app.send(pay("t1", "race", &payment(100, "cus_1")).build())
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
                    "every 201 is the same payment"
                );
            }
        }
        assert_eq!(app.count("payments").await, 1);
        let retry = app
            .send(pay("t1", "race", &payment(100, "cus_1")).build())
            .await;
        assert!(retry.replayed());
        assert_eq!(retry.body, executed[0].body);
    }


    async fn concurrent_replays_of_a_finished_key_all_replay(db) {
        let app = App::new(db).await;
        let first = app.send(pay("t1", "k1", &payment(100, "cus_1")).build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let replies = futures_join_all((0..20).map(|_| {
            let app = app.clone();
            async move { app.send(pay("t1", "k1", &payment(100, "cus_1")).build()).await }
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
        let done = app.send(pay("t1", "done", &payment(100, "cus_1")).build()).await;
        let slow = tokio::spawn({
            let app = app.clone();
            async move { app.send(Req::post("/test/slow").tenant("t1").key("s1").build()).await }
        });
        until_called(&app.calls.slow, 1).await;
        let queued: Vec<_> = ["n1", "n2"]
            .into_iter()
            .map(|key| {
                let app = app.clone();
                tokio::spawn(async move { app.send(pay("t1", key, &payment(100, "cus_1")).build()).await })
            })
            .collect();
        // The writers wait for their turn: SQLite's single writer is the slow handler, so they
        // queue in the process; PostgreSQL lets them write beside it, so they finish.
        if app.is_postgres() {
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
        let replay = tokio::time::timeout(limit, app.send(pay("t1", "done", &payment(100, "cus_1")).build()))
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
            .send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        // Past its retention, before any purge has run.
        app.expire_all_keys().await;
        let second = app
            .send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(!second.replayed());
        assert_ne!(second.json()["id"], first.json()["id"]);
        assert_eq!(app.count("payments").await, 2);
        assert_eq!(
            app.keys_named("k1").await,
            1,
            "the expired row was replaced"
        );
        // Even with a different body: the old request is forgotten.
        app.expire_all_keys().await;
        let third = app
            .send(pay("t1", "k1", &payment(555, "cus_1")).build())
            .await;
        assert_eq!(third.status, StatusCode::CREATED);
        let fourth = app
            .send(pay("t1", "k1", &payment(555, "cus_1")).build())
            .await;
        assert!(fourth.replayed());
        assert_eq!(fourth.body, third.body);
    }

    async fn extractor_rejections_store_nothing(db) {
        let app = App::new(db).await;
        let no_auth = Req::post(PAYMENTS).key("k1").json(&payment(100, "cus_1"));
        let reply = app.send(no_auth.build()).await;
        assert_eq!(
            reply.problem(StatusCode::UNAUTHORIZED),
            "tag:payments.idem.example,2026:unauthorized"
        );
        // A tenant id longer than the example's tables index is refused as a bad token.
        let long_tenant = "t".repeat(idem_examples::auth::MAX_TENANT_LEN + 1);
        let reply = app.send(pay(&long_tenant, "k1", &payment(100, "cus_1")).build()).await;
        reply.problem(StatusCode::UNAUTHORIZED);
        let bad_json = app.send(pay("t1", "k1", "{\"amount\": 100,").build()).await;
        assert_eq!(
            bad_json.problem(StatusCode::BAD_REQUEST),
            "tag:payments.idem.example,2026:invalid-json"
        );
        let wrong_type = app
            .send(
                pay(
                    "t1",
                    "k1",
                    r#"{"amount": "a lot", "currency": "usd", "customer": "c"}"#,
                )
                .build(),
            )
            .await;
        assert_eq!(
            wrong_type.problem(StatusCode::UNPROCESSABLE_ENTITY),
            "tag:payments.idem.example,2026:invalid-json"
        );
        assert_eq!(app.count("idem_keys").await, 0);
        // The key is still free for a good request.
        let good = app
            .send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        assert_eq!(good.status, StatusCode::CREATED);
        assert!(!good.replayed());
    }

    async fn handler_validation_errors_are_400_and_final(db) {
        let app = App::new(db).await;
        for (key, body) in [
            ("k1", payment(0, "cus_1")),
            ("k2", payment(-5, "cus_1")),
            (
                "k3",
                r#"{"amount": 1, "currency": "usdollar", "customer": "cus_1"}"#.to_owned(),
            ),
        ] {
            let reply = app.send(pay("t1", key, &body).build()).await;
            assert_eq!(
                reply.problem(StatusCode::BAD_REQUEST),
                "tag:payments.idem.example,2026:invalid-request"
            );
            // A 4xx from the handler is a final outcome: replayed.
            assert!(app.send(pay("t1", key, &body).build()).await.replayed());
        }
        assert_eq!(app.count("payments").await, 0);
    }

    async fn bodies_over_the_limit_are_413_and_store_nothing(db) {
        let mut settings = Settings::default();
        settings.max_request_body = 64;
        let options = Options {
            settings,
            ..Options::default()
        };
        let app = App::build(db, options).await;
        let big = format!(
            r#"{{"amount": 1, "currency": "usd", "customer": "{}"}}"#,
            "c".repeat(100)
        );
        let reply = app.send(pay("t1", "k1", &big).build()).await;
        assert_eq!(
            reply.problem(StatusCode::PAYLOAD_TOO_LARGE),
            ProblemKind::BodyTooLarge.type_uri()
        );
        assert_eq!(app.count("idem_keys").await, 0);
        assert_eq!(app.count("payments").await, 0);
    }

    async fn responses_over_the_limit_roll_back_the_writes(db) {
        let mut settings = Settings::default();
        settings.max_response_body = 16;
        let options = Options {
            settings,
            ..Options::default()
        };
        let app = App::build(db, options).await;
        let reply = app
            .send(pay("t1", "k1", &payment(100, "cus_1")).build())
            .await;
        assert_eq!(
            reply.problem(StatusCode::INTERNAL_SERVER_ERROR),
            ProblemKind::ResponseTooLarge.type_uri()
        );
        assert_eq!(app.count("payments").await, 0);
        assert_eq!(app.count("idem_keys").await, 0);
    }

    async fn unauthenticated_reads_are_401(db) {
        let app = App::new(db).await;
        let reply = app.send(Req::get(PAYMENTS).build()).await;
        reply.problem(StatusCode::UNAUTHORIZED);
        assert_eq!(reply.header("www-authenticate"), Some("Bearer"));
    }

    async fn lists_are_the_callers_newest_first(db) {
        let app = App::new(db).await;
        for (i, key) in ["a", "b", "c"].iter().enumerate() {
            app.send(pay("t1", key, &payment(100 + i as i64, "cus_1")).build())
                .await;
        }
        app.send(pay("t2", "a", &payment(7, "cus_1")).build()).await;
        if !app.is_postgres() {
            // SQLite's timestamps have milliseconds: requests that close together tie, and the
            // order must still be the order of creation.
            app.execute("UPDATE payments SET created_at = '2026-01-01 00:00:00.000'").await;
        }
        let list = app
            .send(Req::get(PAYMENTS).tenant("t1").build())
            .await
            .json();
        let amounts: Vec<i64> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["amount"].as_i64().unwrap())
            .collect();
        assert_eq!(amounts, [102, 101, 100]);
    }
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
    app.send(pay("t1", "warm", &payment(100, "cus_1")).build())
        .await;
    app.send(
        Req::post("/test/bare-payments")
            .tenant("t1")
            .json(&payment(100, "cus_1"))
            .build(),
    )
    .await;

    let log = StatementLog::default();
    let _guard = log.install();
    let bare = app
        .send(
            Req::post("/test/bare-payments")
                .tenant("t1")
                .json(&payment(100, "cus_1"))
                .build(),
        )
        .await;
    assert_eq!(bare.status, StatusCode::CREATED);
    let bare = log.take();
    let first = app
        .send(pay("t1", "k1", &payment(100, "cus_1")).build())
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let first = log.take();
    let replay = app
        .send(pay("t1", "k1", &payment(100, "cus_1")).build())
        .await;
    assert!(replay.replayed());
    let replay = log.take();
    println!(
        "bare ({}): {bare:#?}\nfirst ({}): {first:#?}\nreplay ({}): {replay:#?}",
        bare.len(),
        first.len(),
        replay.len()
    );

    // sqlx does not log BEGIN (it is sent with the first query); both paths send one.
    assert_eq!(bare.len(), 3, "INSERT, UPDATE, COMMIT: {bare:#?}");
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
}
