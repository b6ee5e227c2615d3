//! The example's orders, on both backends and in process: what `POST /v1/orders` and its reads
//! answer, a declined charge, an unavailable processor and a retry that resumes, too little
//! stock. (Crashes of a real process at each step are in `order_crashes.rs`.)

use crate::service;

use std::sync::Arc;

use axum::http::StatusCode;
use idem_tests::{App, Options, Req, backend_tests, unreachable_url};
use serde_json::Value;
use service::spawn_processor;

fn order(key: &str, sku: &str, quantity: i64, customer: &str) -> Req {
    let body = format!(r#"{{"sku": "{sku}", "quantity": {quantity}, "customer": "{customer}"}}"#);
    Req::post("/v1/orders").tenant("t1").key(key).json(&body)
}

async fn stock(app: &App, sku: &str) -> Value {
    let reply = app
        .send(
            Req::get(&format!("/v1/inventory/{sku}"))
                .tenant("t2")
                .build(),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    reply.json()["stock"].clone()
}

async fn charges(processor: &str) -> Vec<Value> {
    reqwest::get(format!("{processor}/v1/charges"))
        .await
        .expect("processor answers")
        .json()
        .await
        .expect("a JSON list")
}

backend_tests! {
    async fn an_order_is_201_takes_the_stock_once_and_charges_once(db) {
        let processor = spawn_processor().await;
        let app = service::with_processor(db, processor.clone()).await;
        assert_eq!(stock(&app, "sku-1").await, 100, "every SKU starts with 100");

        let first = app.send(order("o1", "sku-1", 3, "cus_1").build()).await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first.body));
        let body = first.json();
        let id = body["id"].as_str().unwrap();
        assert!(id.starts_with("ord_"), "{id}");
        assert_eq!(first.header("location"), Some(format!("/v1/orders/{id}").as_str()));
        assert_eq!((body["sku"].as_str(), body["quantity"].as_i64()), (Some("sku-1"), Some(3)));
        assert_eq!((body["customer"].as_str(), body["amount"].as_i64()), (Some("cus_1"), Some(3000)));
        assert_eq!(body["status"], "confirmed");
        let executed = charges(&processor).await;
        assert_eq!(executed.len(), 1);
        assert_eq!(body["charge"], executed[0]["id"]);
        assert_eq!(executed[0]["amount"], 3000);

        let retry = app.send(order("o1", "sku-1", 3, "cus_1").build()).await;
        assert!(retry.replayed());
        assert_eq!(retry.json(), body);
        assert_eq!(stock(&app, "sku-1").await, 97);
        assert_eq!(charges(&processor).await.len(), 1);
        let fetched = app.send(Req::get(&format!("/v1/orders/{id}")).tenant("t1").build()).await;
        assert_eq!(fetched.json(), body);
        let listed = app.send(Req::get("/v1/orders").tenant("t1").build()).await;
        assert_eq!(listed.json(), serde_json::json!([body]));
        let foreign = app.send(Req::get(&format!("/v1/orders/{id}")).tenant("t2").build()).await;
        assert_eq!(foreign.status, StatusCode::NOT_FOUND);
    }

    async fn a_declined_charge_gives_the_stock_back_and_replays_402(db) {
        let processor = spawn_processor().await;
        let app = service::with_processor(db, processor.clone()).await;
        let first = app.send(order("o1", "sku-1", 5, "cus_declined").build()).await;
        assert_eq!(
            first.problem(StatusCode::PAYMENT_REQUIRED),
            "tag:payments.idem.example,2026:card-declined"
        );
        assert_eq!(stock(&app, "sku-1").await, 100, "the reservation was given back");
        assert_eq!(app.recorded_steps("o1").await, ["reserve", "release"]);
        let retry = app.send(order("o1", "sku-1", 5, "cus_declined").build()).await;
        assert!(retry.replayed());
        assert_eq!(retry.status, StatusCode::PAYMENT_REQUIRED);
        assert_eq!(retry.body, first.body);
        assert_eq!(stock(&app, "sku-1").await, 100);
        assert!(charges(&processor).await.is_empty());
        assert_eq!(app.count("orders").await, 0);
    }

    async fn an_unavailable_processor_is_503_and_the_retry_resumes_at_charge(db) {
        let down = service::with_processor(db, unreachable_url()).await;
        let first = down.send(order("o1", "sku-1", 2, "cus_1").build()).await;
        assert_eq!(
            first.problem(StatusCode::SERVICE_UNAVAILABLE),
            "tag:payments.idem.example,2026:processor-unavailable"
        );
        assert_eq!(stock(&down, "sku-1").await, 98, "the recorded reservation stays");
        assert_eq!(down.recorded_steps("o1").await, ["reserve"]);

        let processor = spawn_processor().await;
        let service = Arc::new(service::payments_with(processor.clone()));
        let up = down.sibling_serving(Options::default(), service).await;
        let retry = up.send(order("o1", "sku-1", 2, "cus_1").build()).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&retry.body));
        assert!(!retry.replayed());
        assert_eq!(stock(&up, "sku-1").await, 98, "reserve was not run again");
        assert_eq!(charges(&processor).await.len(), 1);
        assert_eq!(up.recorded_steps("o1").await, ["reserve", "charge", "ship"]);
    }

    async fn too_little_stock_is_a_stored_400_that_takes_nothing(db) {
        let processor = spawn_processor().await;
        let app = service::with_processor(db, processor.clone()).await;
        let all = app.send(order("o1", "sku-1", 100, "cus_1").build()).await;
        assert_eq!(all.status, StatusCode::CREATED);
        let more = app.send(order("o2", "sku-1", 1, "cus_1").build()).await;
        assert_eq!(
            more.problem(StatusCode::BAD_REQUEST),
            "tag:payments.idem.example,2026:invalid-request"
        );
        let retry = app.send(order("o2", "sku-1", 1, "cus_1").build()).await;
        assert!(retry.replayed(), "final: stored");
        assert_eq!(stock(&app, "sku-1").await, 0);
        assert_eq!(charges(&processor).await.len(), 1);
    }

    async fn invalid_orders_are_400_before_any_step(db) {
        let app = service::with_processor(db, unreachable_url()).await;
        for (key, sku, quantity) in [("o1", "sku-1", 0), ("o2", "sku-1", -1), ("o3", "", 1), ("o4", "sku-1", 101)] {
            let reply = app.send(order(key, sku, quantity, "cus_1").build()).await;
            assert_eq!(
                reply.problem(StatusCode::BAD_REQUEST),
                "tag:payments.idem.example,2026:invalid-request",
                "{key}"
            );
            assert!(app.recorded_steps(key).await.is_empty());
        }
        assert_eq!(app.count("inventory").await, 0);
    }
}
