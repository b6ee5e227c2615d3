//! What `#[idempotent]` puts in a handler's signature, and the checks it makes at the handler's
//! definition. They show in the compiler's errors about an annotated handler (a router whose
//! state does not provide the store, an argument that reads the body but is not last); an
//! application never names them.

/// The handler's last argument, wrapped: the request's key and body are read (and the body
/// fingerprinted) before the argument's own extractor runs. It is an Axum extractor for a state
/// that provides the store (`Store<DB>: FromRef<S>`).
pub use crate::flow::Input;

/// Where a handler's key is, named by the third parameter of [`Input`]: `#[idempotent]` names
/// a [`KeyAt`] for a handler with `key_header`, `key_pointer` or `key_optional`.
pub use crate::key_source::{KeyAt, KeyFrom, StandardKey};

/// The check that `#[idempotent(state = S)]`'s state provides the store names Axum's own trait,
/// so that its error is the missing `FromRef` impl alone.
pub use axum::extract::FromRef;

/// `#[idempotent(state = S)]`: an extractor of nothing, for state `S` only, that makes the
/// handler an Axum handler of that one state (a router built with it is not inferred to have
/// another).
pub struct StateIs<S>(::core::marker::PhantomData<fn() -> S>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for StateIs<S> {
    type Rejection = ::core::convert::Infallible;

    async fn from_request_parts(
        _: &mut http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Self(::core::marker::PhantomData))
    }
}

/// `#[idempotent(state = S)]`: every argument but the last reads only the request's parts.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not the last argument, but it is not an extractor of the request's parts",
    label = "only the last argument may read the request body; move this one last",
    note = "every argument but the last must implement `axum::extract::FromRequestParts<{S}>`"
)]
pub trait LeadingArgument<S> {}

impl<S, T: axum::extract::FromRequestParts<S>> LeadingArgument<S> for T {}

/// Compiles only when `T` is an extractor of the request's parts for state `S`.
pub fn reads_only_parts<T: LeadingArgument<S>, S>() {}
