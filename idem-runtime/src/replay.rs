//! Capturing a handler's response for storage, and rebuilding it for a replay.

use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode, header};
use http_body_util::BodyExt;

use crate::record::StoredResponse;

/// The header a replayed response carries, with the value `true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The response headers that are stored and replayed.
pub const REPLAYED_HEADERS: [HeaderName; 2] = [header::CONTENT_TYPE, header::LOCATION];

/// Why a response could not be captured.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The body is longer than the limit.
    #[error("the response body is larger than {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body stream failed.
    #[error("the response body failed: {0}")]
    Body(#[source] axum::Error),
}

/// A response whose body has been read into memory: the original parts, to answer the first
/// request exactly as the handler built it, and the stored form, for replays.
#[derive(Debug)]
pub struct Captured {
    parts: http::response::Parts,
    body: Bytes,
}

impl Captured {
    /// Reads the body of `response`, up to `limit` bytes.
    ///
    /// # Errors
    ///
    /// [`CaptureError::TooLarge`] over the limit, [`CaptureError::Body`] if the stream fails.
    pub async fn read(response: Response, limit: usize) -> Result<Self, CaptureError> {
        let (parts, body) = response.into_parts();
        let limited = http_body_util::Limited::new(body, limit);
        match limited.collect().await {
            Ok(collected) => Ok(Self {
                parts,
                body: collected.to_bytes(),
            }),
            Err(error) => match error.downcast::<http_body_util::LengthLimitError>() {
                Ok(_) => Err(CaptureError::TooLarge { limit }),
                Err(other) => Err(CaptureError::Body(axum::Error::new(other))),
            },
        }
    }

    /// The stored form: status, replayable headers, body.
    pub fn to_stored(&self) -> StoredResponse {
        let headers = REPLAYED_HEADERS
            .iter()
            .flat_map(|name| {
                self.parts.headers.get_all(name).iter().map(|value| {
                    // Each byte as the character of the same number (Latin-1), so that values
                    // with non-ASCII bytes survive the JSON column exactly.
                    let text = value.as_bytes().iter().map(|&b| char::from(b)).collect();
                    (name.as_str().to_owned(), text)
                })
            })
            .collect();
        StoredResponse {
            status: self.parts.status.as_u16(),
            headers,
            body: self.body.to_vec(),
        }
    }

    /// The response as the handler built it.
    pub fn into_response(self) -> Response {
        Response::from_parts(self.parts, Body::from(self.body))
    }
}

impl StoredResponse {
    /// Reads `response` into the form idem stores: its status, its `Content-Type` and
    /// `Location` headers, and its body (at most `limit` bytes). A recovery hook can build the
    /// answer it completes a claim with this way, from a response made as a handler makes one.
    ///
    /// # Errors
    ///
    /// [`CaptureError::TooLarge`] when the body is longer than `limit`, [`CaptureError::Body`]
    /// when its stream fails.
    pub async fn from_response(response: Response, limit: usize) -> Result<Self, CaptureError> {
        Ok(Captured::read(response, limit).await?.to_stored())
    }

    /// The answer a retry gets: this status, headers and body, marked with
    /// `Idempotent-Replayed: true`.
    pub fn replay(self) -> Response {
        replay(self)
    }
}

/// Rebuilds a stored response, marked with `Idempotent-Replayed: true`.
pub fn replay(stored: StoredResponse) -> Response {
    #[cfg(feature = "grpc")]
    let code = crate::stored_grpc::AnsweredCode::of_stored(
        stored
            .headers
            .iter()
            .find(|(name, _)| name == header::CONTENT_TYPE.as_str())
            .map(|(_, value)| value.as_str()),
        &stored.body,
    );
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, stored.body).into_response();
    let headers = response.headers_mut();
    headers.remove(header::CONTENT_TYPE);
    for (name, value) in stored.headers {
        let bytes: Option<Vec<u8>> = value.chars().map(|c| u8::try_from(c).ok()).collect();
        if let (Ok(name), Some(Ok(value))) = (
            HeaderName::from_bytes(name.as_bytes()),
            bytes.map(|b| HeaderValue::from_bytes(&b)),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    #[cfg(feature = "grpc")]
    if let Some(code) = code {
        response.extensions_mut().insert(code);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn capture_keeps_replayable_headers_and_replay_marks_them() {
        let response = (
            StatusCode::CREATED,
            [
                (header::LOCATION, "/v1/payments/pay_1"),
                (header::CONTENT_TYPE, "application/json"),
                (header::SET_COOKIE, "session=1"),
            ],
            r#"{"id":"pay_1"}"#,
        )
            .into_response();
        let captured = Captured::read(response, 1024).await.unwrap();
        let stored = captured.to_stored();
        assert_eq!(stored.status, 201);
        assert_eq!(stored.headers.len(), 2);
        let replayed = replay(stored);
        assert_eq!(replayed.status(), StatusCode::CREATED);
        assert_eq!(replayed.headers()[header::LOCATION], "/v1/payments/pay_1");
        assert_eq!(replayed.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(replayed.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(replayed.headers().get(header::SET_COOKIE).is_none());
        let original = captured.into_response();
        assert_eq!(original.headers()[header::SET_COOKIE], "session=1");
    }

    #[tokio::test]
    async fn non_ascii_header_bytes_survive_storage() {
        let location = HeaderValue::from_bytes(b"/files/caf\xe9").unwrap();
        let response = (
            StatusCode::CREATED,
            [(header::LOCATION, location.clone())],
            "",
        )
            .into_response();
        let stored = Captured::read(response, 1024).await.unwrap().to_stored();
        let json = serde_json::to_string(&stored.headers).unwrap();
        let back: Vec<(String, String)> = serde_json::from_str(&json).unwrap();
        let replayed = replay(StoredResponse {
            headers: back,
            ..stored
        });
        assert_eq!(replayed.headers()[header::LOCATION], location);
    }

    #[tokio::test]
    async fn capture_refuses_bodies_over_the_limit() {
        let response = (StatusCode::OK, "x".repeat(11)).into_response();
        let error = Captured::read(response, 10).await.unwrap_err();
        assert!(matches!(error, CaptureError::TooLarge { limit: 10 }));
    }
}
