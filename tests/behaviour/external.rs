//! External mode through the test app's transfers, on both backends: the claim is committed
//! before the downstream call, a duplicate within the lease gets 409, a takeover after the
//! lease runs the handler again, and the derived key makes the downstream service execute once.

use axum::http::StatusCode;
use idem_runtime::ProblemKind;
use idem_runtime::{IdempotencyContext, StoreOptions};
use idem_tests::{
    App, Downstream, Options, Req, TestApp, backend_tests, entry, unreachable_url, until_called,
    wait_until,
};

fn transfer(tenant: &str, key: &str, entry: i64) -> Req {
    Req::post("/test/transfers")
        .tenant(tenant)
        .key(key)
        .json(&format!(r#"{{"entry": {entry}, "amount": 50}}"#))
}

/// Writes an entry of `tenant`; returns its id.
async fn entry_of(app: &App, tenant: &str) -> i64 {
    let key = format!("entry-of-{tenant}");
    let request = Req::post("/test/entries")
        .tenant(tenant)
        .key(&key)
        .json(&entry(100, "n1"));
    let reply = app.send(request.build()).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    reply.json()["id"].as_i64().expect("an entry id")
}

/// Sends transfer `r1` of tenant `t1` in the background; returns once its claim is taken.
async fn spawn_transfer(app: &App, entry: i64) -> tokio::task::JoinHandle<idem_tests::Reply> {
    let task = tokio::spawn({
        let app = app.clone();
        async move { app.send(transfer("t1", "r1", entry).build()).await }
    });
    wait_until("the transfer's claim", || async {
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

    async fn a_transfer_runs_once_and_is_replayed(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let entry = entry_of(&app, "t1").await;
        let first = app.send(transfer("t1", "r1", entry).build()).await;
        assert_eq!(
            first.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        let body = first.json();
        assert_eq!(body["entry"], entry);
        let id = body["id"].as_str().unwrap();
        assert_eq!(
            first.header("location"),
            Some(format!("/test/transfers/{id}").as_str())
        );
        let second = app.send(transfer("t1", "r1", entry).build()).await;
        assert!(second.replayed());
        assert_eq!(second.body, first.body);
        assert_eq!(downstream.executed(), 1);
        assert_eq!(app.calls.transfers.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(app.count("test_transfers").await, 1);
        // Completed under the route's 24 h retention, counted from the completion.
        assert_eq!(app.retention_secs("r1").await, 24 * 3600);
    }

    async fn a_transfer_of_an_unknown_or_foreign_entry_is_a_stored_404(db) {
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let foreign = entry_of(&app, "someone_else").await;
        for (key, entry) in [("r1", foreign + 1000), ("r2", foreign)] {
            let first = app.send(transfer("t1", key, entry).build()).await;
            assert_eq!(first.status, StatusCode::NOT_FOUND);
            let second = app.send(transfer("t1", key, entry).build()).await;
            assert!(second.replayed());
            assert_eq!(second.status, StatusCode::NOT_FOUND);
        }
        assert_eq!(downstream.executed(), 0);
    }

    async fn an_unreachable_downstream_is_a_503_that_stores_nothing(db) {
        let down = App::with_downstream(db, &unreachable_url()).await;
        let entry = entry_of(&down, "t1").await;
        let reply = down.send(transfer("t1", "r1", entry).build()).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(down.keys_named("r1").await, 0, "the claim was released");
        assert_eq!(down.count("test_transfers").await, 0);

        let downstream = Downstream::start().await;
        let service = std::sync::Arc::new(TestApp::downstream(&downstream.url));
        let up = down.sibling_serving(Options::default(), service).await;
        let retry = up.send(transfer("t1", "r1", entry).build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(!retry.replayed());
        assert_eq!(downstream.executed(), 1);
    }

    async fn a_duplicate_within_the_lease_gets_409_with_the_lease_left(db) {
        let downstream = Downstream::gated().await;
        // A default Retry-After far from the lease: a value within the lease must come from it.
        let settings = StoreOptions::default().with_retry_after(std::time::Duration::from_secs(30));
        let options = Options { store_options: settings, ..Options::default() };
        let app = App::serving(db, options, TestApp::downstream(&downstream.url)).await;
        let entry = entry_of(&app, "t1").await;
        let first = spawn_transfer(&app, entry).await;
        // The downstream service has the transfer and holds its answer: the claim is in
        // progress. Its lease is moved a minute ahead, so that a slow machine cannot let it run
        // out first.
        downstream.until_executed(1).await;
        app.renew_lease("r1").await;
        let duplicate = app.send(transfer("t1", "r1", entry).build()).await;
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
        downstream.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(
            app.send(transfer("t1", "r1", entry).build())
                .await
                .replayed()
        );
        assert_eq!(downstream.executed(), 1);
    }

    async fn a_takeover_after_the_lease_executes_once_downstream(db) {
        let downstream = Downstream::gated().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let entry = entry_of(&app, "t1").await;
        let first = spawn_transfer(&app, entry).await;
        downstream.until_executed(1).await;
        // The first request is stuck past its lease (as if its process had stalled).
        app.lapse_lease("r1").await;
        let takeover = app.send(transfer("t1", "r1", entry).build()).await;
        assert_eq!(takeover.status, StatusCode::CREATED);
        assert!(!takeover.replayed(), "the handler ran again");
        downstream.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(
            first.json()["id"],
            takeover.json()["id"],
            "the downstream service executed once"
        );
        assert_eq!(downstream.executed(), 1);
        let keys = downstream.keys();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], keys[1], "the takeover sent the same downstream key");
        // The takeover owns the key; the first request's late completion was refused.
        let replay = app.send(transfer("t1", "r1", entry).build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, takeover.body);
    }

    async fn a_cancelled_external_request_releases_its_key(db) {
        let downstream = Downstream::gated().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let entry = entry_of(&app, "t1").await;
        let first = spawn_transfer(&app, entry).await;
        downstream.until_executed(1).await;
        // The client hangs up after the downstream service executed the transfer.
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        wait_until("the cancelled request's claim to be released", || async {
            app.keys_named("r1").await == 0
        })
        .await;
        let retry = app.send(transfer("t1", "r1", entry).build()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert_eq!(downstream.executed(), 1, "the derived key deduplicated");
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
        let downstream = Downstream::start().await;
        let app = App::with_downstream(db, &downstream.url).await;
        let a = entry_of(&app, "tenant_a").await;
        let b = entry_of(&app, "tenant_b").await;
        let ta = app.send(transfer("tenant_a", "same-key", a).build()).await;
        let tb = app.send(transfer("tenant_b", "same-key", b).build()).await;
        assert_eq!(
            (ta.status, tb.status),
            (StatusCode::CREATED, StatusCode::CREATED)
        );
        assert_ne!(
            ta.json()["id"],
            tb.json()["id"],
            "two transfers: the downstream keys differ"
        );
        let keys = downstream.keys();
        assert_eq!(keys.len(), 2);
        assert_ne!(keys[0], keys[1], "one client key, two scopes, two downstream keys");
        for key in &keys {
            assert!(!key.contains("same-key"), "the downstream key reveals the client's: {key}");
        }
        // Each is the documented derivation of (scope, key, label).
        assert_eq!(keys[0], IdempotencyContext::new("tenant_a", "same-key").derive("transfer"));
        assert_eq!(keys[1], IdempotencyContext::new("tenant_b", "same-key").derive("transfer"));
    }
}
