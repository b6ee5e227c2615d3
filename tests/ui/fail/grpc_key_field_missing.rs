#[path = "../grpc/service.rs"]
mod service;

use idem_runtime::idempotent;
use service::{
    Api, Pay, Tenant,
    payments_server::{Payments, PaymentsServer},
};
use sqlx::{Postgres, Transaction};
use tonic::{Request, Response, Status};

// The key field must be a string field of the request message.
#[idem_runtime::grpc]
#[tonic::async_trait]
impl Payments for Api {
    #[idempotent(scope = "tenant", key_field = "request_id")]
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
