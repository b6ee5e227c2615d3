//! # idem-key: the `Idempotency-Key` header as idem reads it
//!
//! The parts of idem that need neither a server nor a database, for clients, tests, fuzzers and
//! tools that must agree with the server on three things:
//!
//! - **Which keys are valid**, and how a header spells one ([`parse_key`], [`IdempotencyKey`]):
//!   the RFC 8941 Structured Field String of the IETF HTTPAPI draft *The Idempotency-Key HTTP
//!   Header Field* (draft-ietf-httpapi-idempotency-key-header), or the bare value Stripe's
//!   clients send; 1 to [`MAX_KEY_LEN`] visible ASCII characters either way.
//! - **When two requests are the same request** ([`Fingerprint`]): method, path with query, and
//!   body, a JSON body canonicalised first (RFC 8785); optionally only some of its fields
//!   ([`BodyFields`]).
//! - **Which key a downstream call gets** ([`derive_key`]): stable per (scope, key, label), and
//!   not revealing the client's key.
//!
//! ```
//! use http::{HeaderMap, Method, header::CONTENT_TYPE};
//! use idem_key::{Fingerprint, IDEMPOTENCY_KEY, parse_key};
//!
//! let mut headers = HeaderMap::new();
//! headers.insert(IDEMPOTENCY_KEY, "\"8e03978e-40d5-43e8\"".parse().unwrap());
//! headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
//! assert_eq!(parse_key(&headers).unwrap().as_str(), "8e03978e-40d5-43e8");
//!
//! let first = Fingerprint::of(&Method::POST, "/v1/payments", &headers, br#"{"a":1,"b":2}"#);
//! let retry = Fingerprint::of(&Method::POST, "/v1/payments", &headers, b"{ \"b\": 2, \"a\": 1 }");
//! assert_eq!(first, retry);
//! ```

mod derived;
mod fingerprint;
mod header;

pub use derived::derive_key;
pub use fingerprint::{BodyFields, Fingerprint};
pub use header::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, MAX_KEY_LEN, parse_key, parse_value};
