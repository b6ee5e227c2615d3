//! Extraction: the handler's last extractor, wrapped so that the key is taken from its source
//! and validated (400), the body buffered up to the limit (413) and the request fingerprinted
//! before the wrapped extractor runs on the buffered request. An extractor that refuses the
//! request (a signature that does not verify) therefore refuses it before the key is claimed.

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{FromRef, FromRequest, FromRequestParts, Request},
    response::{IntoResponse, Response},
};
use http_body_util::BodyExt;
use tracing::field::Empty;

use idem_key::Fingerprint;

use super::{
    outcome::{Call, Outcome, end, key_problem},
    request::{Fingerprinted, IdemRequest},
};
use crate::{
    backend::Backend,
    key_source::{KeyFrom, KeySource, StandardKey},
    problem::ProblemKind,
    store::Store,
};

/// Marks the [`FromRequest`] impl of [`Input`] whose inner extractor consumes the body.
#[derive(Debug)]
pub enum ViaBody {}

/// Marks the [`FromRequest`] impl of [`Input`] whose inner extractor reads only the parts.
#[derive(Debug)]
pub enum ViaParts {}

/// The handler's last extractor, run after the idempotency key and body have been taken; `K`
/// says where the key is ([`StandardKey`]: the `Idempotency-Key` header, required).
#[derive(Debug)]
pub struct Input<T, DB: Backend, K = StandardKey> {
    /// What the wrapped extractor produced.
    pub value: T,
    /// The key, fingerprint and store of this request.
    pub request: IdemRequest<DB>,
    key: std::marker::PhantomData<fn() -> K>,
}

/// The request's key from its source: `Ok(None)` for a request without one where the key is
/// optional, the 400 to answer where it is missing or malformed.
fn take_key(
    (source, optional): (KeySource, bool),
    headers: &http::HeaderMap,
    body: &[u8],
    base: &str,
) -> Result<Option<idem_key::IdempotencyKey>, Response> {
    match source.take_http(headers, body) {
        Ok(key) => Ok(Some(key)),
        Err(refused) if refused.missing && optional => Ok(None),
        Err(refused) => Err(key_problem(source, &refused, base)),
    }
}

async fn prepare<S, DB, K>(
    request: Request,
    state: &S,
) -> Result<(Request, IdemRequest<DB>), Response>
where
    S: Send + Sync,
    DB: Backend,
    K: KeyFrom,
    Store<DB>: FromRef<S>,
{
    let store = Store::<DB>::from_ref(state);
    let (parts, body) = request.into_parts();
    // Inside `Router::nest` the handler sees its path without the prefix; the fingerprint must
    // see the whole path, or two resources under different prefixes would share keys.
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let route: Arc<str> = parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".into(), |matched| matched.as_str().into());
    let span = tracing::info_span!(
        "idempotency",
        method = %parts.method,
        path = %path,
        key_id = Empty,
        outcome = Empty,
        status = Empty,
    );
    let base = store.options().problem_type_base();
    // A key in a header is looked at before the body is read: a request without one is
    // refused without reading a body it may not need.
    let rule = K::rule();
    let in_body = matches!(rule.0, KeySource::BodyField(_));
    let mut key = None;
    if !in_body {
        key = take_key(rule, &parts.headers, &[], base)
            .map_err(|problem| end(&span, &route, Call::Http, Outcome::Rejected, problem))?;
    }
    let limit = store.options().max_request_body();
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            let problem = if error.is::<http_body_util::LengthLimitError>() {
                ProblemKind::BodyTooLarge.problem_under(
                    store.options().problem_type_base(),
                    format!("the request body is larger than {limit} bytes; nothing was stored"),
                )
            } else {
                axum_problem_bad_body(&error.to_string())
            };
            return Err(end(
                &span,
                &route,
                Call::Http,
                Outcome::Rejected,
                problem.into_response(),
            ));
        }
    };
    if in_body {
        key = take_key(rule, &parts.headers, &bytes, base)
            .map_err(|problem| end(&span, &route, Call::Http, Outcome::Rejected, problem))?;
    }
    let fingerprint = Fingerprint::of(&parts.method, &path, &parts.headers, &bytes);
    let mut content_type = http::HeaderMap::new();
    if let Some(value) = parts.headers.get(http::header::CONTENT_TYPE) {
        content_type.insert(http::header::CONTENT_TYPE, value.clone());
    }
    let fingerprinted = Fingerprinted {
        headers: content_type,
        body: bytes.clone(),
    };
    let idem = IdemRequest::new(
        store,
        key,
        (parts.method.clone(), path),
        fingerprint,
        (span, route),
        &parts.headers,
    )
    .with_fingerprinted(fingerprinted);
    Ok((Request::from_parts(parts, Body::from(bytes)), idem))
}

fn axum_problem_bad_body(reason: &str) -> crate::problem::Problem {
    crate::problem::Problem::new(
        http::StatusCode::BAD_REQUEST,
        "Request body could not be read",
    )
    .with_detail(format!("reading the request body failed: {reason}"))
}

impl<T, DB: Backend, K> Input<T, DB, K> {
    pub(super) fn accept<R: IntoResponse>(
        extracted: Result<T, R>,
        request: IdemRequest<DB>,
    ) -> Result<Self, Response> {
        match extracted {
            Ok(value) => Ok(Self {
                value,
                request,
                key: std::marker::PhantomData,
            }),
            Err(rejection) => Err(request.end(Outcome::Rejected, rejection.into_response())),
        }
    }
}

impl<S, T, DB, K> FromRequest<S, ViaBody> for Input<T, DB, K>
where
    S: Send + Sync,
    T: FromRequest<S>,
    DB: Backend,
    K: KeyFrom,
    Store<DB>: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (request, idem) = prepare::<S, DB, K>(request, state).await?;
        Self::accept(T::from_request(request, state).await, idem)
    }
}

impl<S, T, DB, K> FromRequest<S, ViaParts> for Input<T, DB, K>
where
    S: Send + Sync,
    T: FromRequestParts<S>,
    DB: Backend,
    K: KeyFrom,
    Store<DB>: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (request, idem) = prepare::<S, DB, K>(request, state).await?;
        let (mut parts, _) = request.into_parts();
        Self::accept(T::from_request_parts(&mut parts, state).await, idem)
    }
}
