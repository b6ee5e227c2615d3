use axum::{
    extract::{FromRef, FromRequest, Request},
    http::StatusCode,
};
use idem_runtime::{Store, idempotent};
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

/// A body extractor of the application's own, as `axum::Json` with its own rejection.
struct ApiJson(String);

impl<S: Send + Sync> FromRequest<S> for ApiJson {
    type Rejection = StatusCode;

    async fn from_request(request: Request, state: &S) -> Result<Self, StatusCode> {
        let body = String::from_request(request, state)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Self(body))
    }
}

#[idempotent(scope = "tenant", state = AppState)]
async fn create(
    ApiJson(body): ApiJson,
    tenant: String,
    tx: &mut Transaction<'_, Postgres>,
) {
    let _ = (body, tenant, tx);
}

fn main() {}
