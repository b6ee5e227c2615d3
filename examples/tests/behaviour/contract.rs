//! The example's HTTP contract, on both backends: what `/v1/payments`, `/v1/payouts` and their
//! reads answer, beyond what the library's own tests check (the idempotency rules themselves
//! are checked on the suite's test app in `tests/`).

use crate::service;

use axum::http::StatusCode;
use idem_tests::{Req, backend_tests};
use service::{payment, payment_statuses};

const PAYMENTS: &str = "/v1/payments";
const PAYOUTS: &str = "/v1/payouts";

fn pay(tenant: &str, key: &str, body: &str) -> Req {
    Req::post(PAYMENTS).tenant(tenant).key(key).json(body)
}

backend_tests! {
    async fn a_payment_is_201_with_its_location_and_a_retry_leaves_one_to_read(db) {
        let app = service::app(db).await;
        let first = app.send(pay("t1", "k1", &payment(4200, "cus_1")).build()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let body = first.json();
        assert_eq!(body["status"], "succeeded");
        assert_eq!(body["amount"], 4200);
        let id = body["id"].as_str().unwrap();
        let location = format!("/v1/payments/{id}");
        assert_eq!(first.header("location"), Some(location.as_str()));
        assert_eq!(app.retention_secs("k1").await, 24 * 3600);
        let retry = app.send(pay("t1", "k1", &payment(4200, "cus_1")).build()).await;
        assert!(retry.replayed());
        assert_eq!(retry.json(), body);
        let fetched = app.send(Req::get(&location).tenant("t1").build()).await;
        assert_eq!(fetched.json(), body);
        let listed = app.send(Req::get(PAYMENTS).tenant("t1").build()).await;
        assert_eq!(listed.json(), serde_json::json!([body]));
    }

    async fn a_tenant_cannot_read_another_tenants_payment(db) {
        let app = service::app(db).await;
        let id = service::paid(&app, "tenant_a", "cus_1").await;
        let foreign = app
            .send(Req::get(&format!("/v1/payments/{id}")).tenant("tenant_b").build())
            .await;
        assert_eq!(
            foreign.problem(StatusCode::NOT_FOUND),
            "tag:payments.idem.example,2026:not-found"
        );
        let listed = app.send(Req::get(PAYMENTS).tenant("tenant_b").build()).await;
        assert_eq!(listed.json(), serde_json::json!([]));
    }

    async fn declined_payment_is_stored_and_replayed_as_402(db) {
        let app = service::app(db).await;
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
        assert_eq!(payment_statuses(&app).await, ["declined"]);
    }

    async fn payment_503_is_not_stored_and_a_retry_runs_again(db) {
        let app = service::app(db).await;
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

    async fn payout_503_is_stored_and_replayed_and_its_writes_undone(db) {
        let app = service::app(db).await;
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
        let app = service::app(db).await;
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

    async fn extractor_rejections_store_nothing(db) {
        let app = service::app(db).await;
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
        let app = service::app(db).await;
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

    async fn unauthenticated_reads_are_401(db) {
        let app = service::app(db).await;
        let reply = app.send(Req::get(PAYMENTS).build()).await;
        reply.problem(StatusCode::UNAUTHORIZED);
        assert_eq!(reply.header("www-authenticate"), Some("Bearer"));
    }

    async fn lists_are_the_callers_newest_first(db) {
        let app = service::app(db).await;
        for (i, key) in ["a", "b", "c"].iter().enumerate() {
            app.send(pay("t1", key, &payment(100 + i as i64, "cus_1")).build())
                .await;
        }
        app.send(pay("t2", "a", &payment(7, "cus_1")).build()).await;
        if !app.is_postgres() && !app.is_mysql() {
            // SQLite's timestamps have milliseconds: requests that close together tie, and the
            // order must still be the order of creation. PostgreSQL's and MySQL's have
            // microseconds (`schema::Tables::NEWEST_FIRST` breaks their ties by id).
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
