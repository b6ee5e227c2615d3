//! The test app's two resources, written once for both databases: entries, written in the
//! handler's transaction (transactional mode), and transfers of an entry, executed by the
//! downstream service (external mode, with a derived key).

use std::sync::{Arc, atomic::Ordering};

use axum::{
    Extension, Json, Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use idem_runtime::{IdempotencyContext, Store, idempotent};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::Transaction;

use crate::{
    Calls, Tenant,
    test_app::{Param, TestBackend, run_on},
};

/// `POST /test/entries`, `POST /test/stored-5xx`, `POST /test/bare-entries`,
/// `POST /test/transfers`, and the entries whose fingerprint counts some fields only:
/// `POST /test/entries-by-fields` and `POST /test/entries-but-fields`.
pub fn routes<DB: TestBackend>() -> Router<Store<DB>> {
    Router::new()
        .route("/test/entries", post(create_entry::<DB>))
        .route("/test/stored-5xx", post(create_entry_then_fail::<DB>))
        .route("/test/bare-entries", post(create_entry_bare::<DB>))
        .route("/test/transfers", post(create_transfer::<DB>))
        .route(
            "/test/entries-by-fields",
            post(create_entry_by_fields::<DB>),
        )
        .route(
            "/test/entries-but-fields",
            post(create_entry_but_fields::<DB>),
        )
}

/// The body of `POST /test/entries`.
#[derive(Debug, Deserialize)]
pub struct NewEntry {
    /// Positive.
    amount: i64,
    /// Free text; `"unavailable"` makes the handler answer 503 after its write.
    note: String,
}

/// Writes the entry in `tx`; returns its id.
async fn insert<DB: TestBackend>(
    tx: &mut Transaction<'_, DB>,
    tenant: &Tenant,
    entry: &NewEntry,
) -> i64 {
    let sql = "INSERT INTO test_entries (tenant, amount, note) VALUES ($1, $2, $3) RETURNING id";
    let params = [
        Param::Text(&tenant.0),
        Param::Int(entry.amount),
        Param::Text(&entry.note),
    ];
    DB::fetch_int(&mut **tx, sql, &params)
        .await
        .expect("insert entry")
        .expect("an id")
}

fn created(id: i64, entry: &NewEntry) -> Response {
    let body = json!({"id": id, "amount": entry.amount, "note": entry.note});
    let location = format!("/test/entries/{id}");
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(body),
    )
        .into_response()
}

/// 201 with the entry and its `Location`; 400 (a final answer) for an amount that is not
/// positive; 503 (not stored, the write undone) for the note `"unavailable"`.
#[idempotent(scope = "tenant", retention = "24h")]
async fn create_entry<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
    Json(entry): Json<NewEntry>,
) -> Response {
    calls.entries.fetch_add(1, Ordering::SeqCst);
    if entry.amount <= 0 {
        return (StatusCode::BAD_REQUEST, "the amount must be positive").into_response();
    }
    let id = insert(tx, &tenant, &entry).await;
    if entry.note == "unavailable" {
        return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
    }
    created(id, &entry)
}

/// [`create_entry`], the same request being the same `amount` and `note` whatever else the body
/// holds (a client's `sent_at`, say).
#[idempotent(scope = "tenant", retention = "24h", fingerprint_only = ["/amount", "/note"])]
async fn create_entry_by_fields<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
    Json(entry): Json<NewEntry>,
) -> Response {
    record(&calls, tx, &tenant, &entry).await
}

/// [`create_entry`], the same request being the same body but its `sent_at` and `trace/id`.
#[idempotent(scope = "tenant", retention = "24h", fingerprint_except = ["/sent_at", "/trace/id"])]
async fn create_entry_but_fields<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
    Json(entry): Json<NewEntry>,
) -> Response {
    record(&calls, tx, &tenant, &entry).await
}

/// Counts the run, writes the entry, answers 201 with it.
async fn record<DB: TestBackend>(
    calls: &Calls,
    tx: &mut Transaction<'_, DB>,
    tenant: &Tenant,
    entry: &NewEntry,
) -> Response {
    calls.entries.fetch_add(1, Ordering::SeqCst);
    let id = insert(tx, tenant, entry).await;
    created(id, entry)
}

/// Writes the entry, then answers 503; with `replay_5xx` the 503 is stored (and the write
/// undone with the handler's other writes), kept a week. The note `"ok"` succeeds instead (201).
#[idempotent(scope = "tenant", retention = "7d", replay_5xx = true)]
async fn create_entry_then_fail<DB: TestBackend>(
    tenant: Tenant,
    Extension(calls): Extension<Arc<Calls>>,
    tx: &mut Transaction<'_, DB>,
    Json(entry): Json<NewEntry>,
) -> Response {
    let call = calls.entries.fetch_add(1, Ordering::SeqCst) + 1;
    let id = insert(tx, &tenant, &entry).await;
    if entry.note == "ok" {
        return created(id, &entry);
    }
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("failed on call {call}"),
    )
        .into_response()
}

/// The same write without idempotency: the baseline of the statement count.
async fn create_entry_bare<DB: TestBackend>(
    tenant: Tenant,
    State(store): State<Store<DB>>,
    Json(entry): Json<NewEntry>,
) -> Response {
    let mut tx = store.pool().begin().await.expect("begin");
    let id = insert(&mut tx, &tenant, &entry).await;
    tx.commit().await.expect("commit");
    created(id, &entry)
}

/// Where transfers are executed.
#[derive(Debug, Clone)]
pub struct DownstreamClient {
    url: String,
    http: reqwest::Client,
}

impl DownstreamClient {
    /// A client of the downstream service at `url`.
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            http: reqwest::Client::new(),
        }
    }

    /// Executes a transfer, at most once per `key`; `None` when the service cannot be reached
    /// or refuses.
    async fn transfer(&self, key: &str, request: &NewTransfer) -> Option<Value> {
        let body = json!({"entry": request.entry, "amount": request.amount});
        self.post(key, &body).await
    }

    /// Sends `body` as a transfer under `key`; `None` when the service cannot be reached or
    /// refuses.
    pub(crate) async fn post(&self, key: &str, body: &Value) -> Option<Value> {
        let response = self
            .http
            .post(format!("{}/transfers", self.url))
            .header("idempotency-key", key)
            .json(body)
            .send()
            .await
            .ok()?;
        if !response.status().is_success() {
            return None;
        }
        response.json().await.ok()
    }
}

/// The body of `POST /test/transfers`.
#[derive(Debug, Deserialize)]
pub struct NewTransfer {
    /// One of the caller's entries.
    entry: i64,
    /// Any amount.
    amount: i64,
}

/// External mode: 404 (stored) for an entry that is not the caller's; else the downstream
/// service executes the transfer under a key derived from the client's (503, not stored, when
/// it cannot be reached), the transfer is written (idempotently: a takeover may find it
/// there), and the answer is 201 with it.
#[idempotent(external, scope = "tenant", retention = "24h", lease = "5s", backend = DB)]
async fn create_transfer<DB: TestBackend>(
    tenant: Tenant,
    ctx: IdempotencyContext,
    Extension(calls): Extension<Arc<Calls>>,
    Extension(downstream): Extension<DownstreamClient>,
    State(store): State<Store<DB>>,
    Json(transfer): Json<NewTransfer>,
) -> Response {
    calls.transfers.fetch_add(1, Ordering::SeqCst);
    let mut conn = store.pool().acquire().await.expect("a connection");
    let sql = "SELECT count(*) FROM test_entries WHERE tenant = $1 AND id = $2";
    let params = [Param::Text(&tenant.0), Param::Int(transfer.entry)];
    let found = DB::fetch_int(&mut conn, sql, &params)
        .await
        .expect("look the entry up");
    drop(conn);
    if found != Some(1) {
        let message = format!("no entry {} for this tenant", transfer.entry);
        return (StatusCode::NOT_FOUND, message).into_response();
    }
    let Some(executed) = downstream
        .transfer(&ctx.derive("transfer"), &transfer)
        .await
    else {
        return (StatusCode::SERVICE_UNAVAILABLE, "downstream unavailable").into_response();
    };
    let id = executed["id"].as_str().expect("a transfer id").to_owned();
    let sql = "INSERT INTO test_transfers (id, tenant, entry, amount) VALUES ($1, $2, $3, $4) \
               ON CONFLICT (id) DO NOTHING";
    let params = [
        Param::Text(&id),
        Param::Text(&tenant.0),
        Param::Int(transfer.entry),
        Param::Int(transfer.amount),
    ];
    run_on(store.pool(), sql, &params)
        .await
        .expect("record the transfer");
    let location = format!("/test/transfers/{id}");
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(executed),
    )
        .into_response()
}
