//! What a final answer says: a replay or not, and the problem of an error.

use reqwest::{Response, StatusCode};
use serde::Deserialize;

/// The header a server built with idem sets on a replayed answer.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Whether `response` is the replay of an earlier attempt's answer
/// (`Idempotent-Replayed: true`).
pub fn replayed(response: &Response) -> bool {
    response
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// An RFC 9457 problem (`application/problem+json`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct Problem {
    /// The problem type's URI.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// A short summary of the problem type.
    #[serde(default)]
    pub title: Option<String>,
    /// The HTTP status, as the server wrote it.
    #[serde(default)]
    pub status: Option<u16>,
    /// What happened this time.
    #[serde(default)]
    pub detail: Option<String>,
    /// The occurrence's URI.
    #[serde(default)]
    pub instance: Option<String>,
}

/// A final answer that is not a success, or a request that could not get one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server answered with an error status and a problem document.
    #[error("{status}: {}", problem.detail.as_deref().or(problem.title.as_deref()).unwrap_or("no detail"))]
    Problem {
        /// The answer's status.
        status: StatusCode,
        /// The problem.
        problem: Problem,
    },
    /// The server answered with an error status and a body that is not a problem.
    #[error("{status}: {body}")]
    Status {
        /// The answer's status.
        status: StatusCode,
        /// The body, as text.
        body: String,
    },
    /// No answer: the connection failed on every attempt, or a middleware refused the request
    /// (a key store that failed, a key that belongs to another request).
    #[error(transparent)]
    Request(#[from] reqwest_middleware::Error),
    /// The answer's body could not be read.
    #[error("the answer's body could not be read: {0}")]
    Body(#[from] reqwest::Error),
}

/// `response` if its status is a success; otherwise its problem (or body) as an [`Error`].
///
/// # Errors
///
/// [`Error::Problem`] or [`Error::Status`] for a 4xx or 5xx answer, [`Error::Body`] when its
/// body cannot be read.
pub async fn check(response: Response) -> Result<Response, Error> {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return Ok(response);
    }
    let problem_json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("application/problem+json"));
    let body = response.bytes().await?;
    if problem_json && let Ok(problem) = serde_json::from_slice::<Problem>(&body) {
        return Err(Error::Problem { status, problem });
    }
    Err(Error::Status {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}
