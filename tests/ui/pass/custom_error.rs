//! A custom error type implementing `IntoResponse`, reached through `?` and `From`.

use axum::{
    Json, Router,
    extract::{FromRef, Path},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use idem_runtime::{Store, idempotent};
use serde::Deserialize;
use sqlx::{Postgres, Transaction};

#[derive(Clone)]
struct AppState {
    store: Store<Postgres>,
}

impl FromRef<AppState> for Store<Postgres> {
    fn from_ref(state: &AppState) -> Self {
        state.store.clone()
    }
}

enum ApiError {
    Invalid(String),
    Database(sqlx::Error),
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Invalid(message) => (StatusCode::BAD_REQUEST, message).into_response(),
            Self::Database(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    }
}

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
}

#[idempotent(scope = "account", replay_5xx = false)]
async fn create_payment(
    Path(account): Path<String>,
    tx: &mut Transaction<'_, Postgres>,
    Json(body): Json<NewPayment>,
) -> Result<StatusCode, ApiError> {
    if body.amount <= 0 {
        return Err(ApiError::Invalid(String::from("`amount` must be positive")));
    }
    sqlx::query("INSERT INTO payments (account, amount) VALUES ($1, $2)")
        .bind(&account)
        .bind(body.amount)
        .execute(&mut **tx)
        .await?;
    Ok(StatusCode::CREATED)
}

fn router() -> Router<AppState> {
    Router::new().route("/accounts/{account}/payments", post(create_payment))
}

pub fn main() {
    let _ = router;
}
