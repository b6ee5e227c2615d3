//! The test app over a real TCP socket, on both backends: served by `axum::serve` on a loopback
//! port, driven by an HTTP client, exactly as a client would see it.

use idem_tests::{App, backend_tests, until_called};
use reqwest::{Client, StatusCode};

fn body(note: &str) -> serde_json::Value {
    serde_json::json!({"amount": 4200, "note": note})
}

backend_tests! {
    async fn a_duplicate_over_tcp_gets_409_at_once_while_the_first_runs(db) {
        let app = App::new(db).await;
        let addr = app.serve().await;
        let client = Client::new();
        let post = |key: &str| {
            client
                .post(format!("http://{addr}/test/slow"))
                .bearer_auth("tenant_tcp")
                .header("Idempotency-Key", key)
                .send()
        };
        // The first attempt runs until the test opens the gate; a duplicate comes meanwhile.
        let first = tokio::spawn(post("\"tcp-key-1\""));
        until_called(&app.calls.slow, 1).await;
        let duplicate = post("tcp-key-1").await.unwrap();
        assert_eq!(duplicate.status(), StatusCode::CONFLICT);
        assert_eq!(duplicate.headers()["retry-after"], "1");
        assert_eq!(duplicate.headers()["content-type"], "application/problem+json");
        assert!(!first.is_finished(), "the 409 did not wait for the first request");
        app.gate.add_permits(1);
        let first = first.await.unwrap().unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        let retry = post("tcp-key-1").await.unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(app.calls.slow.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    async fn a_client_retrying_over_tcp_gets_one_entry(db) {
        let app = App::new(db).await;
        let addr = app.serve().await;
        let client = Client::new();
        let url = format!("http://{addr}/test/entries");
        let post = |key: &str| {
            client
                .post(&url)
                .bearer_auth("tenant_tcp")
                .header("Idempotency-Key", key)
                .json(&body("n1"))
                .send()
        };
        let first = post("\"tcp-key-1\"").await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        let location = first.headers()["location"].to_str().unwrap().to_owned();
        let created: serde_json::Value = first.json().await.unwrap();

        // The retry, bare form of the same key: the same entry, marked as a replay.
        let retry = post("tcp-key-1").await.unwrap();
        assert_eq!(retry.status(), StatusCode::CREATED);
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(retry.headers()["location"].to_str().unwrap(), location);
        assert_eq!(retry.json::<serde_json::Value>().await.unwrap(), created);
        assert_eq!(app.calls.entries.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(app.count("test_entries").await, 1);
    }

    async fn problems_over_tcp_are_problem_json(db) {
        let app = App::new(db).await;
        let addr = app.serve().await;
        let client = Client::new();
        let url = format!("http://{addr}/test/entries");
        let missing = client.post(&url).bearer_auth("t").json(&body("n1")).send().await.unwrap();
        assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
        assert_eq!(missing.headers()["content-type"], "application/problem+json");
        let problem: serde_json::Value = missing.json().await.unwrap();
        assert_eq!(problem["status"], 400);
        let unauthenticated = client
            .post(&url)
            .header("Idempotency-Key", "k")
            .json(&body("n1"))
            .send()
            .await
            .unwrap();
        assert_eq!(unauthenticated.status(), StatusCode::UNAUTHORIZED);
    }
}
