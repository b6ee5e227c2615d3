//! The payments service over gRPC, `idem.example.v1.Payments` (`proto/`), beside the HTTP API
//! and on the same database: `CreatePayment` records a payment as `POST /v1/payments` does, in
//! the same table, and is `#[idempotent]` with the same settings; `GetPayment` reads one of the
//! caller's payments, whichever protocol made it.

use idem_runtime::{Store, grpc::FromMetadata, idempotent};
use sqlx::Transaction;
use tonic::{Code, Request, Response, Status, metadata::MetadataMap};

use crate::{
    auth::Tenant,
    error::ApiError,
    payments::{self, AppState, NewTransfer, Transfer},
    sql::Sql,
};

/// The code tonic-prost-build generated from `proto/idem/example/v1/payments.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("idem.example.v1");
}

use proto::{
    CreatePaymentRequest, GetPaymentRequest, Payment,
    payments_server::{Payments, PaymentsServer},
};

/// The gRPC service, over the HTTP API's state.
#[derive(Debug)]
pub struct PaymentsApi<DB: Sql> {
    state: AppState<DB>,
}

impl<DB: Sql> PaymentsApi<DB> {
    /// The service over `state`: its store, and the processor it would call.
    pub fn new(state: AppState<DB>) -> Self {
        Self { state }
    }

    /// The service, ready to be added to a tonic server.
    pub fn server(self) -> PaymentsServer<Self> {
        PaymentsServer::new(self)
    }
}

impl<DB: Sql> axum::extract::FromRef<PaymentsApi<DB>> for Store<DB> {
    fn from_ref(api: &PaymentsApi<DB>) -> Self {
        api.state.store.clone()
    }
}

/// `authorization: Bearer <tenant>`, as over HTTP; without it, `UNAUTHENTICATED`.
impl FromMetadata for Tenant {
    fn from_metadata(
        metadata: &MetadataMap,
        _extensions: &tonic::Extensions,
    ) -> Result<Self, Status> {
        let value = metadata
            .get("authorization")
            .map(|value| value.as_encoded_bytes());
        Tenant::from_authorization(value).map_err(Status::unauthenticated)
    }
}

#[idem_runtime::grpc]
#[tonic::async_trait]
impl<DB: Sql> Payments for PaymentsApi<DB> {
    /// Charges a customer. The processor's magic customers behave as over HTTP: `cus_declined`
    /// records a declined payment and answers `FAILED_PRECONDITION` (final, replayed);
    /// `cus_unavailable` answers `UNAVAILABLE` with nothing recorded (a retry runs again).
    #[idempotent(scope = "tenant", retention = "24h", wait = "10s")]
    async fn create_payment(
        &self,
        tenant: Tenant,
        tx: &mut Transaction<'_, DB>,
        request: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let message = request.into_inner();
        let body = NewTransfer {
            amount: message.amount,
            currency: message.currency,
            customer: message.customer,
        };
        let transfer = payments::record_payment_in(&tenant, tx, body)
            .await
            .map_err(status_of)?;
        Ok(Response::new(payment_of(transfer)))
    }

    /// One of the caller's payments, made over gRPC or HTTP; `NOT_FOUND` otherwise.
    async fn get_payment(
        &self,
        request: Request<GetPaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let tenant = Tenant::from_metadata(request.metadata(), request.extensions())?;
        let transfer = payments::fetch_payment(&self.state, &tenant, &request.get_ref().id)
            .await
            .map_err(status_of)?;
        Ok(Response::new(payment_of(transfer)))
    }
}

fn payment_of(transfer: Transfer) -> Payment {
    Payment {
        id: transfer.id,
        amount: transfer.amount,
        currency: transfer.currency,
        customer: transfer.customer,
        status: transfer.status,
    }
}

/// The status of an error of the payments' code: as its HTTP answer says, in gRPC's words (a
/// database fault that passes with the same `retry-after`, and gRFC A6's pushback).
fn status_of(error: ApiError) -> Status {
    let error = error.transient_as_unavailable();
    let message = error.to_string();
    match error {
        ApiError::Unauthorized(_) | ApiError::BadSignature(_) => Status::unauthenticated(message),
        ApiError::Invalid(_) | ApiError::BadJson(..) => Status::invalid_argument(message),
        ApiError::Declined(_) => Status::failed_precondition(message),
        ApiError::NotFound(_) => Status::not_found(message),
        ApiError::Unavailable(_) => Status::unavailable(message),
        ApiError::DatabaseUnavailable { retry_after, .. } => {
            idem_runtime::grpc::retry_later(Code::Unavailable, message, retry_after)
        }
        ApiError::Database(error) => {
            tracing::error!(%error, "a statement failed");
            Status::internal("database error")
        }
        ApiError::Internal(_) | ApiError::Step(_) => Status::internal(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The method's own answer to a database fault that passes carries what idem's own
    /// `UNAVAILABLE` does, and what the HTTP route's 503 says in `Retry-After`.
    #[test]
    fn a_database_fault_that_passes_is_unavailable_with_retry_after_and_pushback() {
        let status = status_of(ApiError::Database(sqlx::Error::PoolTimedOut));
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(status.metadata().get("retry-after").unwrap(), "1");
        assert_eq!(
            status.metadata().get("grpc-retry-pushback-ms").unwrap(),
            "1000"
        );
    }

    /// A fault that does not pass is the method's `INTERNAL`, without its details.
    #[test]
    fn a_database_refusal_is_internal_without_its_details() {
        let status = status_of(ApiError::Database(sqlx::Error::RowNotFound));
        assert_eq!(
            (status.code(), status.message()),
            (Code::Internal, "database error")
        );
        assert!(status.metadata().get("retry-after").is_none());
    }
}
