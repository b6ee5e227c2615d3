//! The test app's multi-step handler, written once for both databases: `POST /test/orders`
//! takes stock (a database step), has the downstream service execute a transfer (an external
//! step, under the key derived for it), and books the order (a database step).
//!
//! Headers that the fingerprint does not cover steer a request without changing it (a retry
//! without them is the same request): `x-fail-after: <step>` answers 503 once that step is
//! done, `x-panic-after: <step>` panics then; `x-hold: take` makes the handler wait for the
//! test's gate before the `take` step; `x-repeat: take` runs `take` twice, under a name the macro
//! cannot see; `x-overlap: take` then runs two steps at once.

use std::sync::{Arc, atomic::Ordering};

use axum::{
    Extension, Json, Router,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use idem_runtime::{StepError, Steps, Store, idempotent};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{
    Calls, Tenant,
    entries::DownstreamClient,
    test_app::{Param, TestBackend},
};

/// `POST /test/orders`.
pub fn routes<DB: TestBackend>() -> Router<Store<DB>> {
    Router::new().route("/test/orders", post(create_order::<DB>))
}

/// The body of `POST /test/orders`.
#[derive(Debug, Deserialize)]
pub struct NewOrder {
    /// Units of stock to take.
    units: i64,
}

/// Why an order failed.
#[derive(Debug)]
pub enum OrderError {
    /// A step could not run or be recorded.
    Step(StepError),
    /// The downstream service could not be reached.
    Unavailable,
    /// A step's own statement failed.
    Database(sqlx::Error),
    /// `x-fail-after` asked for it.
    FailedOnPurpose(String),
}

impl From<StepError> for OrderError {
    fn from(error: StepError) -> Self {
        Self::Step(error)
    }
}

impl IntoResponse for OrderError {
    fn into_response(self) -> Response {
        match self {
            Self::Step(error) => error.into_response(),
            Self::Unavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, "downstream unavailable").into_response()
            }
            Self::Database(error) => {
                (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
            }
            Self::FailedOnPurpose(step) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("failed after {step}"),
            )
                .into_response(),
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok())
}

/// Answers 503 if `x-fail-after` names `step`.
fn fail_after(headers: &HeaderMap, step: &str) -> Result<(), OrderError> {
    assert!(
        header(headers, "x-panic-after") != Some(step),
        "x-panic-after: {step}"
    );
    match header(headers, "x-fail-after") {
        Some(name) if name == step => Err(OrderError::FailedOnPurpose(step.to_owned())),
        _ => Ok(()),
    }
}

/// Takes `units` from the stock (a row in `test_stock_moves`), once per order.
async fn take<DB: TestBackend>(
    conn: &mut DB::Connection,
    tenant: &str,
    units: i64,
) -> Result<Value, OrderError> {
    let sql = "INSERT INTO test_stock_moves (tenant, units) VALUES ($1, $2)";
    DB::execute(conn, sql, &[Param::Text(tenant), Param::Int(-units)])
        .await
        .map_err(OrderError::Database)?;
    Ok(json!({ "units": units }))
}

/// External mode with steps: `take`, `transfer`, `book`; 201 with every step's output.
#[idempotent(external, scope = "tenant", retention = "24h", lease = "5s")]
async fn create_order<DB: TestBackend>(
    tenant: Tenant,
    steps: Steps<DB>,
    headers: HeaderMap,
    Extension(calls): Extension<Arc<Calls>>,
    Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
    Extension(downstream): Extension<DownstreamClient>,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<Value>), OrderError> {
    if header(&headers, "x-hold") == Some("take") {
        gate.acquire().await.expect("the gate").forget();
    }
    let taken: Value = steps
        .step("take", async |conn| {
            calls.take.fetch_add(1, Ordering::SeqCst);
            take::<DB>(conn, &tenant.0, order.units).await
        })
        .await?;
    if header(&headers, "x-repeat") == Some("take") {
        let name = String::from("take");
        steps
            .step(&name, async |conn| {
                take::<DB>(conn, &tenant.0, order.units).await
            })
            .await?;
    }
    if header(&headers, "x-overlap") == Some("take") {
        // Two steps at once: the second is refused while the first runs. The first's work
        // waits until the second has been answered, so the two overlap however the calls are
        // scheduled (a second that is not refused ends the wait too: the test then fails on its
        // answer, not on a hang).
        let answered = tokio::sync::Notify::new();
        let held = async |key: &str| {
            answered.notified().await;
            Ok::<_, OrderError>(key.to_owned())
        };
        let note = async |key: &str| Ok::<_, OrderError>(key.to_owned());
        let second = async {
            let second = steps.call("b", note).await;
            answered.notify_one();
            second
        };
        let (first, second) = tokio::join!(steps.call("a", held), second);
        let _: String = first?;
        let _: String = second?;
    }
    fail_after(&headers, "take")?;

    let transfer: Value = steps
        .call("transfer", async |key| {
            calls.transfer.fetch_add(1, Ordering::SeqCst);
            let body = json!({ "entry": 0, "amount": order.units });
            downstream
                .post(key, &body)
                .await
                .ok_or(OrderError::Unavailable)
        })
        .await?;
    fail_after(&headers, "transfer")?;

    let id = transfer["id"].as_str().unwrap_or_default().to_owned();
    let booked: Value = steps
        .step("book", async |conn| {
            calls.book.fetch_add(1, Ordering::SeqCst);
            let sql = "INSERT INTO test_bookings (tenant, transfer) VALUES ($1, $2)";
            DB::execute(conn, sql, &[Param::Text(&tenant.0), Param::Text(&id)])
                .await
                .map_err(OrderError::Database)?;
            Ok::<_, OrderError>(json!({ "transfer": id }))
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "take": taken, "transfer": transfer, "book": booked })),
    ))
}
