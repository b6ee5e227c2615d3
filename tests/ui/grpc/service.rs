// A tonic service as tonic-prost-build generates it, by hand: the trait (async-trait), its
// server's name, and a message. The compile-fail cases of `#[grpc]` include it.

#[derive(Clone, PartialEq, prost::Message)]
pub struct Pay {
    #[prost(int64, tag = "1")]
    pub amount: i64,
}

pub mod payments_server {
    use super::Pay;

    #[tonic::async_trait]
    pub trait Payments: Send + Sync + 'static {
        async fn create_payment(
            &self,
            request: tonic::Request<Pay>,
        ) -> Result<tonic::Response<Pay>, tonic::Status>;
    }

    pub struct PaymentsServer<T>(pub T);

    impl<T> tonic::server::NamedService for PaymentsServer<T> {
        const NAME: &'static str = "test.v1.Payments";
    }
}

/// The caller, from the `authorization` metadata.
pub struct Tenant(pub String);

impl idem_runtime::grpc::FromMetadata for Tenant {
    fn from_metadata(
        metadata: &tonic::metadata::MetadataMap,
        _: &tonic::Extensions,
    ) -> Result<Self, tonic::Status> {
        metadata
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .map(|value| Self(value.to_owned()))
            .ok_or_else(|| tonic::Status::unauthenticated("no authorization"))
    }
}

impl idem_runtime::IdempotencyScope for Tenant {
    fn idempotency_scope(&self) -> std::borrow::Cow<'_, str> {
        std::borrow::Cow::Borrowed(&self.0)
    }
}

pub struct Api {
    pub store: idem_runtime::Store<sqlx::Postgres>,
}

impl axum::extract::FromRef<Api> for idem_runtime::Store<sqlx::Postgres> {
    fn from_ref(api: &Api) -> Self {
        api.store.clone()
    }
}
