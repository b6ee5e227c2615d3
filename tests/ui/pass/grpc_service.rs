//! A tonic service with `#[idempotent]` methods in each mode: transactional with a scope read
//! from the metadata, external with a context, global; a method left unmarked; a service
//! generic over its database; and `#[grpc]` adding `#[tonic::async_trait]` itself. The servers
//! take them (`PaymentsServer::new`), so the rewritten methods are the trait's.

use idem_runtime::{IdempotencyContext, Store, idempotent};
use sqlx::{Postgres, Sqlite, Transaction};
use tonic::{Request, Response, Status};

#[path = "../grpc/service.rs"]
mod service;

use service::{Pay, Tenant, payments_server::{Payments, PaymentsServer}};

mod refunds_server {
    use super::Pay;

    #[tonic::async_trait]
    pub trait Refunds: Send + Sync + 'static {
        async fn refund(&self, request: tonic::Request<Pay>) -> Result<tonic::Response<Pay>, tonic::Status>;
        async fn status(&self, request: tonic::Request<Pay>) -> Result<tonic::Response<Pay>, tonic::Status>;
    }

    pub struct RefundsServer<T>(pub T);

    impl<T> RefundsServer<T> {
        pub fn new(inner: T) -> Self {
            Self(inner)
        }
    }

    impl<T> tonic::server::NamedService for RefundsServer<T> {
        const NAME: &'static str = "test.v1.Refunds";
    }
}

struct Transactional {
    store: Store<Postgres>,
}

impl axum::extract::FromRef<Transactional> for Store<Postgres> {
    fn from_ref(api: &Transactional) -> Self {
        api.store.clone()
    }
}

#[idem_runtime::grpc]
#[tonic::async_trait]
impl Payments for Transactional {
    #[idempotent(scope = "tenant", retention = "24h", wait = "10s", timeout = "5s")]
    async fn create_payment(
        &self,
        tenant: Tenant,
        tx: &mut Transaction<'_, Postgres>,
        request: Request<Pay>,
    ) -> Result<Response<Pay>, Status> {
        sqlx::query("SELECT 1").execute(&mut **tx).await.map_err(|e| Status::internal(e.to_string()))?;
        let _ = tenant;
        Ok(Response::new(request.into_inner()))
    }
}

/// External mode, `global`, and `#[tonic::async_trait]` left for `#[grpc]` to add.
struct External<DB: idem_runtime::Backend> {
    store: Store<DB>,
}

impl<DB: idem_runtime::Backend> axum::extract::FromRef<External<DB>> for Store<DB> {
    fn from_ref(api: &External<DB>) -> Self {
        api.store.clone()
    }
}

#[idem_runtime::grpc(server = refunds_server::RefundsServer)]
impl refunds_server::Refunds for External<Sqlite> {
    #[idempotent(global, external, lease = "10s", backend = Sqlite)]
    async fn refund(&self, ctx: IdempotencyContext, request: Request<Pay>) -> Result<Response<Pay>, Status> {
        let _ = ctx.derive("processor");
        Ok(Response::new(request.into_inner()))
    }

    async fn status(&self, request: Request<Pay>) -> Result<Response<Pay>, Status> {
        Ok(Response::new(request.into_inner()))
    }
}

pub fn main() {
    let _ = |store: Store<Postgres>| PaymentsServer(Transactional { store });
    let _ = |store: Store<Sqlite>| refunds_server::RefundsServer::new(External { store });
}
