//! Multi-step handlers: `Steps<DB>` in external mode, a database step and an external step,
//! errors through `From<StepError>`; `Steps<Sqlite>` names the database without `backend`.

use axum::{
    Json, Router,
    extract::Path,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use idem_runtime::{StepError, Steps, Store, idempotent};
use sqlx::{Postgres, Sqlite};

enum OrderError {
    Step(StepError),
    Declined,
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
            Self::Declined => StatusCode::PAYMENT_REQUIRED.into_response(),
        }
    }
}

async fn charge(_key: &str, amount: i64) -> Result<String, OrderError> {
    if amount > 0 { Ok(String::from("ch_1")) } else { Err(OrderError::Declined) }
}

#[idempotent(external, scope = "tenant", retention = "24h", lease = "5s")]
async fn create_order(
    Path(tenant): Path<String>,
    steps: Steps<Postgres>,
    Json(quantity): Json<i64>,
) -> Result<(StatusCode, String), OrderError> {
    let reserved: i64 = steps
        .step("reserve", async |conn| {
            sqlx::query_scalar("SELECT $1::bigint")
                .bind(quantity)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| OrderError::Step(StepError::database(e)))
        })
        .await?;
    let charge: String = steps
        .call("charge", async |key| charge(key, reserved * 1000).await)
        .await?;
    Ok((StatusCode::CREATED, format!("{tenant} {charge}")))
}

#[idempotent(external, scope = "tenant")]
async fn create_order_sqlite(
    Path(tenant): Path<String>,
    steps: Steps<Sqlite>,
) -> Result<String, StepError> {
    let note: String = steps
        .call("note", async |key| Ok::<_, StepError>(key.to_owned()))
        .await?;
    Ok(format!("{tenant} {note}"))
}

fn router() -> Router<Store<Postgres>> {
    Router::new().route("/{tenant}/orders", post(create_order))
}

fn sqlite_router() -> Router<Store<Sqlite>> {
    Router::new().route("/{tenant}/orders", post(create_order_sqlite))
}

pub fn main() {
    let _ = (router, sqlite_router);
}
