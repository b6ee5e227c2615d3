//! One handler for both databases: generic over the backend, routed per database.
use axum::{
    Router,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use idem_runtime::{Backend, Store, idempotent};
use sqlx::{Postgres, Sqlite, Transaction};

#[idempotent(scope = "tenant")]
async fn create<DB: Backend>(tenant: String, tx: &mut Transaction<'_, DB>) -> (StatusCode, String) {
    let _ = &tx;
    (StatusCode::CREATED, tenant)
}

/// With `state`, the checks are generic too.
#[idempotent(scope = "tenant", state = Store<DB>)]
async fn checked<DB>(tenant: String, tx: &mut Transaction<'_, DB>) -> StatusCode
where
    DB: Backend,
{
    let _ = (tenant, tx);
    StatusCode::CREATED
}

/// An answer whose type names the database.
struct Named<DB>(std::marker::PhantomData<DB>);

impl<DB> IntoResponse for Named<DB> {
    fn into_response(self) -> Response {
        StatusCode::NO_CONTENT.into_response()
    }
}

#[idempotent(scope = "tenant")]
async fn named<DB: Backend>(tenant: String, tx: &mut Transaction<'_, DB>) -> Named<DB> {
    let _ = (tenant, tx);
    Named(std::marker::PhantomData)
}

fn routes<DB: Backend>() -> Router<Store<DB>> {
    Router::new()
        .route("/payments", post(create::<DB>))
        .route("/checked", post(checked::<DB>))
        .route("/named", post(named::<DB>))
}

pub fn main() {
    let _postgres: Router<Store<Postgres>> = routes();
    let _sqlite: Router<Store<Sqlite>> = routes();
}
