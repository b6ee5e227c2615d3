use axum::{extract::FromRequestParts, http::request::Parts};
use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

/// An extractor, but not an `idem_runtime::IdempotencyScope`.
struct Caller(String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ();

    async fn from_request_parts(_parts: &mut Parts, _state: &S) -> Result<Self, ()> {
        Ok(Self(String::from("caller")))
    }
}

#[idempotent(scope = "caller")]
async fn create(caller: Caller, tx: &mut Transaction<'_, Postgres>) {
    let _ = (caller.0, tx);
}

fn main() {}
