#[path = "../grpc/service.rs"]
mod service;

use idem_runtime::idempotent;
use service::{Api, Pay, Tenant, payments_server::Payments};
use sqlx::{Postgres, Transaction};
use tonic::{Request, Response, Status};

// A tonic method takes its key from metadata or a message field, not a header.
#[idem_runtime::grpc]
#[tonic::async_trait]
impl Payments for Api {
    #[idempotent(scope = "tenant", key_header = "webhook-id")]
    async fn create_payment(
        &self,
        tenant: Tenant,
        tx: &mut Transaction<'_, Postgres>,
        request: Request<Pay>,
    ) -> Result<Response<Pay>, Status> {
        let _ = (tenant, tx);
        Ok(Response::new(request.into_inner()))
    }
}

fn main() {}
