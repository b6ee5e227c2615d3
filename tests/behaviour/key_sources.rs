//! Keys the client does not send as `Idempotency-Key`, on every database: a webhook receiver
//! keyed by its `webhook-id` header whose last extractor checks the sender's signature (so a
//! forged delivery is refused before the key is claimed), a handler keyed by a field of its
//! JSON body, and handlers whose key is optional, in both modes.

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use idem_runtime::ProblemKind;
use idem_tests::{
    App, Req, backend_tests,
    key_sources::{SIGNATURE, sign},
    until_called,
};

/// A delivery of `body` under `id`, signed as the sender signs.
fn delivery(id: &str, body: &str) -> Req {
    Req::post("/test/hooks")
        .header("webhook-id", id)
        .header(SIGNATURE, &sign(id, body))
        .json(body)
}

/// A delivery of `body` under `id` whose signature is not the sender's.
fn forged(id: &str, body: &str) -> Req {
    Req::post("/test/hooks")
        .header("webhook-id", id)
        .header(SIGNATURE, &sign(id, "another body"))
        .json(body)
}

fn body_key(tenant: &str, body: &str) -> Req {
    Req::post("/test/body-key").tenant(tenant).json(body)
}

backend_tests! {
    async fn a_redelivery_under_the_same_header_key_is_replayed_and_runs_once(db) {
        let app = App::new(db).await;
        let first = app.send(delivery("msg_1", r#"{"n":1}"#).build()).await;
        assert_eq!(first.status, StatusCode::OK);
        assert!(!first.replayed());
        let again = app.send(delivery("msg_1", r#"{"n":1}"#).build()).await;
        assert_eq!(again.status, StatusCode::OK);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        let other = app.send(delivery("msg_2", r#"{"n":1}"#).build()).await;
        assert!(!other.replayed());
        assert_eq!(app.calls.hook.load(Ordering::SeqCst), 2);
        assert_eq!(app.count("test_effects").await, 2);
    }

    async fn the_header_key_is_the_only_key_read(db) {
        let app = App::new(db).await;
        // An `Idempotency-Key` does not stand in for the missing `webhook-id`.
        let body = r#"{"n":1}"#;
        let without = app
            .send(
                Req::post("/test/hooks")
                    .key("msg_1")
                    .header(SIGNATURE, &sign("", body))
                    .json(body)
                    .build(),
            )
            .await;
        assert_eq!(
            without.problem(StatusCode::BAD_REQUEST),
            ProblemKind::MissingKey.type_uri()
        );
        assert_eq!(without.json()["title"], "Idempotency key is missing");
        let detail = without.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("`webhook-id` header"), "{detail}");
        // Two deliveries under one `webhook-id` but different `Idempotency-Key`s are one.
        let first = app.send(delivery("msg_1", body).key("a").build()).await;
        let second = app.send(delivery("msg_1", body).key("b").build()).await;
        assert!(!first.replayed());
        assert!(second.replayed());
        assert_eq!(app.calls.hook.load(Ordering::SeqCst), 1);
    }

    async fn a_malformed_or_repeated_header_key_is_400_and_nothing_runs(db) {
        let app = App::new(db).await;
        let body = r#"{"n":1}"#;
        let too_long = "m".repeat(256);
        for bad in ["", "msg 1", too_long.as_str()] {
            let reply = app.send(delivery(bad, body).build()).await;
            assert_eq!(
                reply.problem(StatusCode::BAD_REQUEST),
                ProblemKind::MalformedKey.type_uri(),
                "webhook-id {bad:?}"
            );
            assert_eq!(reply.json()["title"], "Idempotency key is malformed");
        }
        let twice = delivery("msg_1", body).header("webhook-id", "msg_2");
        let reply = app.send(twice.build()).await;
        assert_eq!(
            reply.problem(StatusCode::BAD_REQUEST),
            ProblemKind::MalformedKey.type_uri()
        );
        assert_eq!(app.calls.hook.load(Ordering::SeqCst), 0);
        assert_eq!(app.count("idem_keys").await, 0);
    }

    async fn a_forged_delivery_is_refused_before_the_claim_and_the_genuine_one_then_runs_once(db) {
        let app = App::new(db).await;
        let body = r#"{"n":1}"#;
        let forgery = app.send(forged("msg_1", body).build()).await;
        assert_eq!(forgery.status, StatusCode::UNAUTHORIZED);
        let unsigned = Req::post("/test/hooks").header("webhook-id", "msg_1").json(body);
        assert_eq!(app.send(unsigned.build()).await.status, StatusCode::UNAUTHORIZED);
        assert_eq!(app.count("idem_keys").await, 0, "a forgery stores nothing");
        assert_eq!(app.calls.hook.load(Ordering::SeqCst), 0);
        let genuine = app.send(delivery("msg_1", body).build()).await;
        assert_eq!(genuine.status, StatusCode::OK);
        assert!(!genuine.replayed(), "the genuine delivery runs, not a replay of the forgery");
        // A forgery after it is still refused, not answered with the genuine outcome.
        let late = app.send(forged("msg_1", body).build()).await;
        assert_eq!(late.status, StatusCode::UNAUTHORIZED);
        assert_eq!(app.calls.hook.load(Ordering::SeqCst), 1);
        assert_eq!(app.count("test_effects").await, 1);
    }

    async fn a_forgery_sent_while_the_genuine_delivery_runs_neither_waits_nor_blocks_it(db) {
        let app = App::new(db).await;
        let body = r#"{"hold":true}"#;
        let genuine = tokio::spawn({
            let app = app.clone();
            async move { app.send(delivery("msg_1", body).build()).await }
        });
        until_called(&app.calls.hook, 1).await;
        // The key is held by the genuine delivery: a forgery gets its 401, not a 409.
        let forgery = app.send(forged("msg_1", body).build()).await;
        assert_eq!(forgery.status, StatusCode::UNAUTHORIZED);
        // A genuine redelivery while the first runs: 409, to be retried.
        let redelivery = app.send(delivery("msg_1", body).build()).await;
        assert_eq!(
            redelivery.problem(StatusCode::CONFLICT),
            ProblemKind::InProgress.type_uri()
        );
        assert!(redelivery.header("retry-after").is_some());
        assert!(!genuine.is_finished(), "the answers came while the first delivery ran");
        app.gate.add_permits(1);
        let genuine = genuine.await.unwrap();
        assert_eq!(genuine.status, StatusCode::OK);
        let after = app.send(delivery("msg_1", body).build()).await;
        assert!(after.replayed());
        assert_eq!(app.calls.hook.load(Ordering::SeqCst), 1);
    }

    async fn a_delivery_id_reused_with_another_body_is_422(db) {
        let app = App::new(db).await;
        let first = app.send(delivery("msg_1", r#"{"n":1}"#).build()).await;
        assert_eq!(first.status, StatusCode::OK);
        let other = app.send(delivery("msg_1", r#"{"n":2}"#).build()).await;
        assert_eq!(
            other.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert_eq!(app.calls.hook.load(Ordering::SeqCst), 1);
    }

    async fn a_key_in_a_body_field_is_replayed_and_the_body_still_counts(db) {
        let app = App::new(db).await;
        let body = r#"{"request_id": "r-1", "amount": 5}"#;
        let first = app.send(body_key("t1", body).build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        // `Idempotency-Key` is not read: the body's field is the key.
        let again = app.send(body_key("t1", body).key("ignored").build()).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        // The same key with another amount is another request under a used key.
        let other = app
            .send(body_key("t1", r#"{"request_id": "r-1", "amount": 6}"#).build())
            .await;
        assert_eq!(
            other.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        // Another caller's key of the same value is its own.
        let elsewhere = app.send(body_key("t2", body).build()).await;
        assert!(!elsewhere.replayed());
        assert_eq!(app.calls.body_key.load(Ordering::SeqCst), 2);
        assert_eq!(app.count("test_effects").await, 2);
    }

    async fn a_body_field_key_missing_not_a_string_or_malformed_is_400(db) {
        let app = App::new(db).await;
        for (body, kind) in [
            (r#"{"amount": 5}"#, ProblemKind::MissingKey),
            (r#"{"request_id": null}"#, ProblemKind::MissingKey),
            ("not json", ProblemKind::MissingKey),
            (r#"{"request_id": 7}"#, ProblemKind::MalformedKey),
            (r#"{"request_id": "a b"}"#, ProblemKind::MalformedKey),
            (r#"{"request_id": ""}"#, ProblemKind::MalformedKey),
        ] {
            let reply = app.send(body_key("t1", body).key("k1").build()).await;
            assert_eq!(
                reply.problem(StatusCode::BAD_REQUEST),
                kind.type_uri(),
                "body {body}"
            );
            let detail = reply.json()["detail"].as_str().unwrap().to_owned();
            assert!(detail.contains("`/request_id`"), "{detail}");
        }
        assert_eq!(app.calls.body_key.load(Ordering::SeqCst), 0);
        assert_eq!(app.count("idem_keys").await, 0);
    }

    async fn a_request_without_an_optional_key_runs_each_time_and_stores_nothing(db) {
        let app = App::new(db).await;
        let plain = || Req::post("/test/optional-key").tenant("t1");
        let first = app.send(plain().build()).await;
        let second = app.send(plain().build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(!second.replayed());
        assert_eq!(app.calls.optional.load(Ordering::SeqCst), 2);
        assert_eq!(app.count("test_effects").await, 2, "each run committed its writes");
        assert_eq!(app.count("idem_keys").await, 0, "nothing was stored");
        // A 5xx without a key rolls its writes back, as a keyed one does.
        let failed = app.send(plain().json("fail").build()).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(app.count("test_effects").await, 2);
        // With a key, the same handler is protected.
        let keyed = app.send(plain().key("k1").build()).await;
        let retry = app.send(plain().key("k1").build()).await;
        assert!(!keyed.replayed());
        assert!(retry.replayed());
        assert_eq!(app.calls.optional.load(Ordering::SeqCst), 4);
        assert_eq!(app.count("idem_keys").await, 1);
        // A malformed key is still refused: only a missing one is let through.
        let malformed = app.send(plain().key("a b").build()).await;
        assert_eq!(
            malformed.problem(StatusCode::BAD_REQUEST),
            ProblemKind::MalformedKey.type_uri()
        );
        assert_eq!(app.calls.optional.load(Ordering::SeqCst), 4);
    }

    async fn an_external_handler_without_an_optional_key_runs_each_time_and_stores_nothing(db) {
        let app = App::new(db).await;
        let plain = || Req::post("/test/optional-key-external").tenant("t1");
        assert_eq!(app.send(plain().build()).await.status, StatusCode::CREATED);
        assert_eq!(app.send(plain().build()).await.status, StatusCode::CREATED);
        assert_eq!(app.calls.optional_external.load(Ordering::SeqCst), 2);
        assert_eq!(app.count("idem_keys").await, 0);
        let keyed = app.send(plain().key("k1").build()).await;
        let retry = app.send(plain().key("k1").build()).await;
        assert!(!keyed.replayed());
        assert!(retry.replayed());
        assert_eq!(app.calls.optional_external.load(Ordering::SeqCst), 3);
    }
}
