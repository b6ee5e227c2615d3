//! `state = ...` on an associated function, and on a handler generic over the database whose
//! concrete state provides a store for each database, and a const parameter in the return type.
use axum::{
    Router,
    extract::FromRef,
    http::{HeaderName, StatusCode, header},
    routing::post,
};
use idem_runtime::{Backend, Store, idempotent};
use sqlx::{Postgres, Sqlite, Transaction};

#[derive(Clone)]
struct AppState {
    postgres: Store<Postgres>,
    sqlite: Store<Sqlite>,
}

impl FromRef<AppState> for Store<Postgres> {
    fn from_ref(state: &AppState) -> Self {
        state.postgres.clone()
    }
}

impl FromRef<AppState> for Store<Sqlite> {
    fn from_ref(state: &AppState) -> Self {
        state.sqlite.clone()
    }
}

struct Payments;

impl Payments {
    #[idempotent(scope = "tenant", state = AppState)]
    async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) -> StatusCode {
        let _ = (tenant, tx);
        StatusCode::CREATED
    }
}

#[idempotent(scope = "tenant", state = AppState)]
async fn either<DB: Backend>(tenant: String, tx: &mut Transaction<'_, DB>) -> StatusCode {
    let _ = (tenant, tx);
    StatusCode::CREATED
}

#[idempotent(scope = "tenant")]
async fn headers<const N: usize>(
    tenant: String,
    tx: &mut Transaction<'_, Postgres>,
) -> (StatusCode, [(HeaderName, &'static str); N]) {
    let _ = (tenant, tx);
    let headers = std::array::from_fn(|_| (header::CACHE_CONTROL, "no-store"));
    (StatusCode::CREATED, headers)
}

fn router() -> Router<AppState> {
    Router::new()
        .route("/payments", post(Payments::create))
        .route("/postgres", post(either::<Postgres>))
        .route("/sqlite", post(either::<Sqlite>))
        .route("/headers", post(headers::<1>))
}

pub fn main() {
    let _ = router;
}
