//! Requests in, replies out.

use axum::{
    body::Body,
    http::{HeaderMap, Method, Request, StatusCode},
};
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::Value;

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
}

impl Reply {
    /// Reads a response.
    pub async fn read(response: axum::response::Response) -> Self {
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("read body").to_bytes();
        Self {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header as text, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("text header"))
    }

    /// Whether the response is a replay.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a problem+json of `status` and returns its `type`.
    pub fn problem(&self, status: StatusCode) -> String {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let json = self.json();
        assert_eq!(json["status"], status.as_u16());
        assert!(
            json["title"].is_string() && json["detail"].is_string(),
            "{json}"
        );
        json["type"].as_str().expect("problem type").to_owned()
    }
}

/// Builds a request.
#[derive(Debug, Clone)]
pub struct Req {
    method: Method,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Req {
    /// `POST path`.
    pub fn post(path: &str) -> Self {
        Self {
            method: Method::POST,
            path: path.to_owned(),
            headers: Vec::new(),
            body: String::new(),
        }
    }

    /// `GET path`.
    pub fn get(path: &str) -> Self {
        Self {
            method: Method::GET,
            ..Self::post(path)
        }
    }

    /// `Authorization: Bearer <tenant>`.
    pub fn tenant(self, tenant: &str) -> Self {
        self.header("authorization", &format!("Bearer {tenant}"))
    }

    /// `Idempotency-Key: <key>` (bare form).
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    /// Any header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// A JSON body, sent as written.
    pub fn json(mut self, body: &str) -> Self {
        self.body = body.to_owned();
        self.header("content-type", "application/json")
    }

    /// The request.
    pub fn build(&self) -> Request<Body> {
        let mut builder = Request::builder()
            .method(self.method.clone())
            .uri(&self.path);
        for (name, value) in &self.headers {
            builder = builder.header(name, value);
        }
        builder
            .body(Body::from(self.body.clone()))
            .expect("valid request")
    }
}

/// The body of a new entry of the test app.
pub fn entry(amount: i64, note: &str) -> String {
    format!(r#"{{"amount": {amount}, "note": "{note}"}}"#)
}
