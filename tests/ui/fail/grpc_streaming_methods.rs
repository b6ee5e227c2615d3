#[path = "../grpc/service.rs"]
mod service;

use idem_runtime::idempotent;
use service::{Api, Pay, Tenant};
use sqlx::{Postgres, Transaction};
use tonic::{Request, Response, Status, Streaming};

mod uploads_server {
    use super::Pay;

    #[tonic::async_trait]
    pub trait Uploads: Send + Sync + 'static {
        type WatchStream: Send + 'static;

        async fn upload(
            &self,
            request: tonic::Request<tonic::Streaming<Pay>>,
        ) -> Result<tonic::Response<Pay>, tonic::Status>;

        async fn watch(
            &self,
            request: tonic::Request<Pay>,
        ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status>;
    }

    pub struct UploadsServer<T>(pub T);

    impl<T> tonic::server::NamedService for UploadsServer<T> {
        const NAME: &'static str = "test.v1.Uploads";
    }
}

#[idem_runtime::grpc]
#[tonic::async_trait]
impl uploads_server::Uploads for Api {
    type WatchStream = ();

    #[idempotent(scope = "tenant")]
    async fn upload(
        &self,
        tenant: Tenant,
        tx: &mut Transaction<'_, Postgres>,
        request: Request<Streaming<Pay>>,
    ) -> Result<Response<Pay>, Status> {
        let _ = (tenant, tx, request);
        Err(Status::unimplemented("upload"))
    }

    #[idempotent(scope = "tenant")]
    async fn watch(
        &self,
        tenant: Tenant,
        tx: &mut Transaction<'_, Postgres>,
        request: Request<Pay>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let _ = (tenant, tx, request);
        Ok(Response::new(()))
    }
}

fn main() {}
