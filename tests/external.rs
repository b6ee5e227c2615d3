//! External mode through the refunds route, on both backends: the claim is
//! committed before the processor call, a duplicate within the lease gets 409, a takeover after the lease runs the
//! handler again, and the derived key makes the processor refund once.

use axum::http::StatusCode;
use idem_runtime::ProblemKind;
use idem_runtime::{IdempotencyContext, Settings};
use idem_tests::{
    App, Options, Req, TestProcessor, backend_tests, executed_refunds, spawn_processor,
    until_called, wait_until,
};

fn refund(tenant: &str, key: &str, payment: &str) -> Req {
    Req::post("/v1/refunds")
        .tenant(tenant)
        .key(key)
        .json(&format!(r#"{{"payment": "{payment}", "amount": 50}}"#))
}

/// Sends refund `r1` of tenant `t1` in the background; returns once its claim is taken.
async fn spawn_refund(app: &App, payment: &str) -> tokio::task::JoinHandle<idem_tests::Reply> {
    let task = tokio::spawn({
        let (app, payment) = (app.clone(), payment.to_owned());
        async move { app.send(refund("t1", "r1", &payment).build()).await }
    });
    wait_until("the refund's claim", || async {
        app.key_status("r1").await.as_deref() == Some("started")
    })
    .await;
    task
}

backend_tests! {
    async fn a_late_completion_cannot_overwrite_the_takeover(db) {
        let app = App::new(db).await;
        let request = || Req::post("/test/external-slow").tenant("t1").key("r1").build();
        let first = tokio::spawn({
            let app = app.clone();
            async move { app.send(request()).await }
        });
        until_called(&app.calls.external, 1).await;
        // The first request is stuck past its lease; a retry takes the key over.
        app.lapse_lease("r1").await;
        let takeover = app.send(request()).await;
        assert_eq!(takeover.status, StatusCode::CREATED);
        assert_eq!(&takeover.body[..], b"call 2 for t1");
        // The first request finishes late; its completion must not replace the takeover's.
        app.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(&first.body[..], b"call 1 for t1", "the client still gets its answer");
        let replay = app.send(request()).await;
        assert!(replay.replayed());
        assert_eq!(&replay.body[..], b"call 2 for t1");
    }

    async fn a_refund_runs_once_and_is_replayed(db) {
        let processor = spawn_processor().await;
        let app = App::with_processor(db, processor.clone()).await;
        let payment = app.paid("t1", "cus_1").await;
        let first = app.send(refund("t1", "r1", &payment).build()).await;
        assert_eq!(
            first.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        let body = first.json();
        assert_eq!(body["status"], "refunded");
        assert_eq!(body["payment"], payment.as_str());
        let id = body["id"].as_str().unwrap();
        assert_eq!(
            first.header("location"),
            Some(format!("/v1/refunds/{id}").as_str())
        );
        let second = app.send(refund("t1", "r1", &payment).build()).await;
        assert!(second.replayed());
        assert_eq!(second.body, first.body);
        assert_eq!(executed_refunds(&processor).await.len(), 1);
        // Completed under the route's 24 h retention, counted from the completion.
        assert_eq!(app.retention_secs("r1").await, 24 * 3600);
        let listed = app
            .send(Req::get("/v1/refunds").tenant("t1").build())
            .await
            .json();
        assert_eq!(listed.as_array().unwrap().len(), 1);
        let fetched = app
            .send(Req::get(&format!("/v1/refunds/{id}")).tenant("t1").build())
            .await;
        assert_eq!(fetched.json(), body);
    }

    async fn a_refund_of_an_unknown_or_foreign_payment_is_a_stored_404(db) {
        let processor = spawn_processor().await;
        let app = App::with_processor(db, processor.clone()).await;
        let foreign = app.paid("someone_else", "cus_1").await;
        for (key, payment) in [("r1", "pay_missing"), ("r2", foreign.as_str())] {
            let first = app.send(refund("t1", key, payment).build()).await;
            first.problem(StatusCode::NOT_FOUND);
            let second = app.send(refund("t1", key, payment).build()).await;
            assert!(second.replayed());
            assert_eq!(second.status, StatusCode::NOT_FOUND);
        }
        assert!(executed_refunds(&processor).await.is_empty());
    }

    async fn an_unreachable_processor_is_a_503_that_stores_nothing(db) {
        // Nothing listens on this port: bind one, learn it, close it.
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", listener.local_addr().unwrap())
        };
        let down = App::with_processor(db, closed).await;
        let payment = down.paid("t1", "cus_1").await;
        let reply = down.send(refund("t1", "r1", &payment).build()).await;
        reply.problem(StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(down.keys_named("r1").await, 0, "the claim was released");
        assert_eq!(down.count("refunds").await, 0);

        let processor = spawn_processor().await;
        let up = down.sibling_with_processor(processor.clone()).await;
        let retry = up.send(refund("t1", "r1", &payment).build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(!retry.replayed());
        assert_eq!(executed_refunds(&processor).await.len(), 1);
    }

    async fn a_duplicate_within_the_lease_gets_409_with_the_lease_left(db) {
        let processor = TestProcessor::gated().await;
        // A default Retry-After far from the lease: a value within the lease must come from it.
        let mut settings = Settings::default();
        settings.retry_after = std::time::Duration::from_secs(30);
        let options = Options { settings, processor: Some(processor.url.clone()), ..Options::default() };
        let app = App::build(db, options).await;
        let payment = app.paid("t1", "cus_1").await;
        let first = spawn_refund(&app, &payment).await;
        // The processor has the refund and holds its answer: the claim is in progress. Its
        // lease is moved a minute ahead, so that a slow machine cannot let it run out first.
        processor.until_refunded(1).await;
        app.renew_lease("r1").await;
        let duplicate = app.send(refund("t1", "r1", &payment).build()).await;
        assert_eq!(
            duplicate.problem(StatusCode::CONFLICT),
            ProblemKind::InProgress.type_uri()
        );
        let retry_after: u64 = duplicate.header("retry-after").unwrap().parse().unwrap();
        assert!(
            (50..=60).contains(&retry_after),
            "the lease's remainder (a minute), not the default 30: {retry_after}"
        );
        assert!(!first.is_finished());
        processor.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(
            app.send(refund("t1", "r1", &payment).build())
                .await
                .replayed()
        );
        assert_eq!(processor.refunds().await.len(), 1);
    }

    async fn a_takeover_after_the_lease_refunds_once(db) {
        let processor = TestProcessor::gated().await;
        let app = App::with_processor(db, processor.url.clone()).await;
        let payment = app.paid("t1", "cus_1").await;
        let first = spawn_refund(&app, &payment).await;
        processor.until_refunded(1).await;
        // The first request is stuck past its lease (as if its process had stalled).
        app.lapse_lease("r1").await;
        let takeover = app.send(refund("t1", "r1", &payment).build()).await;
        assert_eq!(takeover.status, StatusCode::CREATED);
        assert!(!takeover.replayed(), "the handler ran again");
        processor.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(
            first.json()["id"],
            takeover.json()["id"],
            "the processor refunded once"
        );
        assert_eq!(processor.refunds().await.len(), 1);
        let keys = processor.keys();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], keys[1], "the takeover sent the same downstream key");
        // The takeover owns the key; the first request's late completion was refused.
        let replay = app.send(refund("t1", "r1", &payment).build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, takeover.body);
    }

    async fn a_cancelled_external_request_releases_its_key(db) {
        let processor = TestProcessor::gated().await;
        let app = App::with_processor(db, processor.url.clone()).await;
        let payment = app.paid("t1", "cus_1").await;
        let first = spawn_refund(&app, &payment).await;
        processor.until_refunded(1).await;
        // The client hangs up after the processor executed the refund.
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        wait_until("the cancelled request's claim to be released", || async {
            app.keys_named("r1").await == 0
        })
        .await;
        let retry = app.send(refund("t1", "r1", &payment).build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(
            processor.refunds().await.len(),
            1,
            "the derived key deduplicated"
        );
    }

    // The takeover rule is written twice, in PostgreSQL's `idem_start` and in SQLite's `start`:
    // this test and the two above pin each of its cases on both databases.
    async fn a_lapsed_claim_is_taken_over_only_by_the_same_request(db) {
        let app = App::new(db).await;
        let request = |body: &str| {
            Req::post("/test/external-slow").tenant("t1").key("x1").json(body)
        };
        let first = tokio::spawn({
            let app = app.clone();
            let request = request("1").build();
            async move { app.send(request).await }
        });
        until_called(&app.calls.external, 1).await;
        app.lapse_lease("x1").await;
        // Another request with the key: refused as a reuse, even though the lease ran out.
        let other = app.send(request("2").build()).await;
        assert_eq!(
            other.problem(StatusCode::UNPROCESSABLE_ENTITY),
            ProblemKind::KeyReused.type_uri()
        );
        assert_eq!(app.key_status("x1").await.as_deref(), Some("started"));
        // The same request takes it over.
        let takeover = app.send(request("1").build()).await;
        assert_eq!(takeover.status, StatusCode::CREATED);
        assert_eq!(&takeover.body[..], b"call 2 for t1");
        app.gate.add_permits(1);
        first.await.unwrap();
        // A completed key is never taken over, lease or not.
        let replay = app.send(request("1").build()).await;
        assert!(replay.replayed());
        assert_eq!(&replay.body[..], b"call 2 for t1");
    }

    async fn derived_keys_differ_per_scope_and_hide_the_client_key(db) {
        let processor = TestProcessor::gated().await;
        processor.gate.add_permits(1);
        let app = App::with_processor(db, processor.url.clone()).await;
        let a = app.paid("tenant_a", "cus_1").await;
        let b = app.paid("tenant_b", "cus_1").await;
        let ra = app.send(refund("tenant_a", "same-key", &a).build()).await;
        let rb = app.send(refund("tenant_b", "same-key", &b).build()).await;
        assert_eq!(
            (ra.status, rb.status),
            (StatusCode::CREATED, StatusCode::CREATED)
        );
        assert_ne!(
            ra.json()["id"],
            rb.json()["id"],
            "two refunds: the downstream keys differ"
        );
        let keys = processor.keys();
        assert_eq!(keys.len(), 2);
        assert_ne!(keys[0], keys[1], "one client key, two scopes, two downstream keys");
        for key in &keys {
            assert!(!key.contains("same-key"), "the downstream key reveals the client's: {key}");
        }
        // Each is the documented derivation of (scope, key, label).
        assert_eq!(keys[0], IdempotencyContext::new("tenant_a", "same-key").derive("refund"));
        assert_eq!(keys[1], IdempotencyContext::new("tenant_b", "same-key").derive("refund"));
    }
}
