//! The downstream service of the test app's external-mode route, on a loopback port: it executes
//! a transfer at most once per `Idempotency-Key` (a retry with the key gets the first answer),
//! notes every key it is sent, and can hold its first answer until the test opens a gate.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use crate::wait_until;

/// A running downstream service.
#[derive(Debug, Clone)]
pub struct Downstream {
    /// Its base URL.
    pub url: String,
    /// A permit lets a held first answer go.
    pub gate: Arc<tokio::sync::Semaphore>,
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    hold_first: bool,
    posts: AtomicUsize,
    keys: Mutex<Vec<String>>,
    executed: Mutex<HashMap<String, Value>>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Downstream {
    /// Starts one that answers at once.
    pub async fn start() -> Self {
        Self::spawn(false).await
    }

    /// Starts one whose first answer (given after the transfer is executed) waits for
    /// [`Downstream::gate`]; later answers go at once.
    pub async fn gated() -> Self {
        Self::spawn(true).await
    }

    async fn spawn(hold_first: bool) -> Self {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let inner = Arc::new(Inner {
            hold_first,
            posts: AtomicUsize::new(0),
            keys: Mutex::default(),
            executed: Mutex::default(),
            gate: Arc::clone(&gate),
        });
        let router = Router::new()
            .route("/transfers", post(transfer))
            .with_state(Arc::clone(&inner));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("serve downstream");
        });
        Self {
            url: format!("http://{addr}"),
            gate,
            inner,
        }
    }

    /// How many transfers it has executed (one per key).
    pub fn executed(&self) -> usize {
        self.inner.executed.lock().expect("executed").len()
    }

    /// Waits until it has executed `n` transfers.
    pub async fn until_executed(&self, n: usize) {
        wait_until(&format!("{n} transfers downstream"), || async {
            self.executed() >= n
        })
        .await;
    }

    /// The `Idempotency-Key` of every request, in order of arrival.
    pub fn keys(&self) -> Vec<String> {
        self.inner.keys.lock().expect("keys").clone()
    }
}

/// A URL where nothing listens: a port this test process reserved and never binds.
pub fn unreachable_url() -> String {
    format!("http://{}", crate::reserve_addr())
}

/// `POST /transfers`: executes the transfer once per key, answers 201 with it.
async fn transfer(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    Json(request): Json<Value>,
) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|key| key.to_str().ok())
    else {
        return (StatusCode::BAD_REQUEST, "an Idempotency-Key is required").into_response();
    };
    inner.keys.lock().expect("keys").push(key.to_owned());
    let answer = {
        let mut executed = inner.executed.lock().expect("executed");
        let next = executed.len() + 1;
        executed
            .entry(key.to_owned())
            .or_insert_with(|| {
                json!({"id": format!("tr_{next}"), "entry": request["entry"], "amount": request["amount"]})
            })
            .clone()
    };
    let first = inner.posts.fetch_add(1, Ordering::SeqCst) == 0;
    if inner.hold_first && first {
        inner.gate.acquire().await.expect("gate open").forget();
    }
    (StatusCode::CREATED, Json(answer)).into_response()
}
