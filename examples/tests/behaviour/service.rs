//! The example's service on the suite's harness: its router over a store on a fresh database,
//! the simulated card processor beside it, and a few helpers of the example's own.

#![allow(dead_code, reason = "each test file uses part of it")]

use idem_examples::{payments, processor, refunds::ProcessorClient, schema};
use idem_tests::{AnyStore, App, Building, Db, Options, Parts, Req, Service, TestDb};
use serde_json::Value;

/// The payments service, sending refunds to the processor at `processor` (default: the
/// processor's default address).
#[derive(Debug, Clone, Default)]
pub struct Payments {
    processor: Option<String>,
}

impl Service for Payments {
    fn build(&self, parts: Parts) -> Building<'_> {
        Box::pin(async move {
            match parts.store {
                AnyStore::Postgres(store) => self.router(store).await,
                AnyStore::Sqlite(store) => self.router(store).await,
                AnyStore::MySql(store) => self.router(store).await,
            }
        })
    }
}

impl Payments {
    async fn router<DB: idem_examples::sql::Sql>(
        &self,
        store: idem_runtime::Store<DB>,
    ) -> axum::Router {
        schema::create(store.pool()).await.expect("create tables");
        let mut state = payments::AppState::new(store);
        if let Some(url) = &self.processor {
            state.processor = ProcessorClient::new(url.clone());
        }
        payments::routes::<DB>().with_state(state)
    }
}

/// The payments service on `db`.
pub async fn app(db: TestDb) -> App {
    App::serving(db, Options::default(), Payments::default()).await
}

/// The payments service on `db`, sending refunds to the processor at `url`.
pub async fn with_processor(db: TestDb, url: String) -> App {
    let service = Payments {
        processor: Some(url),
    };
    App::serving(db, Options::default(), service).await
}

/// The payments service, sending refunds and charges to the processor at `url`.
pub fn payments_with(url: String) -> Payments {
    Payments {
        processor: Some(url),
    }
}

/// A valid payment body.
pub fn payment(amount: i64, customer: &str) -> String {
    format!(r#"{{"amount": {amount}, "currency": "usd", "customer": "{customer}"}}"#)
}

/// Makes a payment for `tenant` and returns its id.
pub async fn paid(app: &App, tenant: &str, customer: &str) -> String {
    let key = format!("pay-{tenant}-{customer}");
    let reply = app
        .send(
            Req::post("/v1/payments")
                .tenant(tenant)
                .key(&key)
                .json(&payment(100, customer))
                .build(),
        )
        .await;
    assert_eq!(reply.status, axum::http::StatusCode::CREATED);
    reply.json()["id"].as_str().expect("payment id").to_owned()
}

/// The statuses of all payments.
pub async fn payment_statuses(app: &App) -> Vec<String> {
    let sql = "SELECT status FROM payments";
    match &app.db {
        Db::Postgres(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
        Db::Sqlite(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
        Db::MySql(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
    }
    .expect("read payments")
}

/// Serves the simulated card processor on a loopback port; returns its base URL.
pub async fn spawn_processor() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        axum::serve(listener, processor::router())
            .await
            .expect("serve processor");
    });
    format!("http://{addr}")
}

/// The refunds the processor at `url` has executed.
pub async fn executed_refunds(url: &str) -> Vec<Value> {
    reqwest::get(format!("{url}/v1/refunds"))
        .await
        .expect("processor answers")
        .json()
        .await
        .expect("a JSON list")
}
