//! Arbitrary method, path, `Content-Type` and body → `Fingerprint::of`.
//!
//! Besides "no panic": the fingerprint is deterministic, and a JSON body (under a JSON
//! content type) with no integer beyond 2^53 has the fingerprint of its re-serialisations
//! (compact, pretty, and RFC 8785 canonical), as the docs of `fingerprint.rs` promise.
#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderValue, Method, header::CONTENT_TYPE};
use idem_key::Fingerprint;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

#[derive(Debug, Arbitrary)]
enum ContentType<'a> {
    None,
    Json,
    JsonCharset,
    ProblemJson,
    Text,
    Raw(&'a [u8]),
}

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    method: &'a [u8],
    path: &'a str,
    content_type: ContentType<'a>,
    body: &'a [u8],
}

const EXACT: u64 = 1 << 53;

/// No number beyond 2^53 in magnitude (hashed byte for byte, by design).
fn canonicalisable(value: &Value) -> bool {
    match value {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u <= EXACT
            } else if let Some(i) = n.as_i64() {
                i.unsigned_abs() <= EXACT
            } else {
                n.as_f64().is_some_and(|d| d.abs() <= EXACT as f64)
            }
        }
        Value::Array(items) => items.iter().all(canonicalisable),
        Value::Object(map) => map.values().all(canonicalisable),
        _ => true,
    }
}

fuzz_target!(|input: Input<'_>| {
    let method = Method::from_bytes(input.method).unwrap_or(Method::POST);
    let mut headers = HeaderMap::new();
    let content_type = match input.content_type {
        ContentType::None => None,
        ContentType::Json => Some(&b"application/json"[..]),
        ContentType::JsonCharset => Some(&b"Application/JSON; charset=utf-8"[..]),
        ContentType::ProblemJson => Some(&b"application/problem+json"[..]),
        ContentType::Text => Some(&b"text/plain"[..]),
        ContentType::Raw(raw) => Some(raw),
    };
    if let Some(value) = content_type.and_then(|c| HeaderValue::from_bytes(c).ok()) {
        headers.insert(CONTENT_TYPE, value);
    }
    let fingerprint = Fingerprint::of(&method, input.path, &headers, input.body);
    assert_eq!(
        fingerprint,
        Fingerprint::of(&method, input.path, &headers, input.body)
    );

    let json_type = matches!(
        input.content_type,
        ContentType::Json | ContentType::JsonCharset | ContentType::ProblemJson
    );
    if !json_type {
        return;
    }
    let Ok(value) = serde_json::from_slice::<Value>(input.body) else {
        return;
    };
    if !canonicalisable(&value) {
        return;
    }
    for respelled in [
        serde_json::to_vec(&value).unwrap(),
        serde_json::to_vec_pretty(&value).unwrap(),
        serde_json_canonicalizer::to_vec(&value).unwrap(),
    ] {
        assert_eq!(
            fingerprint,
            Fingerprint::of(&method, input.path, &headers, &respelled),
            "{:?} and its re-serialisation {:?} differ",
            String::from_utf8_lossy(input.body),
            String::from_utf8_lossy(&respelled),
        );
    }
});
