//! Request fingerprints: what makes two requests with the same key "the same request".

use http::{HeaderMap, Method, header::CONTENT_TYPE};
use sha2::{Digest, Sha256};

/// SHA-256 over the method, the path with its query, and the body of a request.
///
/// A JSON body (a `Content-Type` of `application/json` or `application/*+json` that parses as
/// JSON) is canonicalised with RFC 8785 (JCS) first, so key order, whitespace and number
/// spelling do not make two requests different. Any other body, and a JSON body with a number
/// beyond 2^53 in magnitude (an integer JCS's doubles cannot hold exactly, however it is
/// spelled: `18446744073709551617` and `1e17` alike), is hashed byte for byte.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints a request.
    ///
    /// # Examples
    ///
    /// ```
    /// use http::{HeaderMap, Method, header::CONTENT_TYPE};
    /// use idem_key::Fingerprint;
    ///
    /// let mut headers = HeaderMap::new();
    /// headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
    /// let a = Fingerprint::of(&Method::POST, "/v1/payments", &headers, br#"{"a":1,"b":2}"#);
    /// let b = Fingerprint::of(&Method::POST, "/v1/payments", &headers, b"{ \"b\": 2, \"a\": 1 }");
    /// assert_eq!(a, b);
    /// ```
    pub fn of(method: &Method, path_and_query: &str, headers: &HeaderMap, body: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        // Length prefixes keep the fields apart: no (method, path) pair can alias another.
        for field in [method.as_str().as_bytes(), path_and_query.as_bytes()] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        match canonical_json(headers, body) {
            Some(canonical) => {
                hasher.update(b"json");
                hasher.update(&canonical);
            }
            None => {
                hasher.update(b"data");
                hasher.update(body);
            }
        }
        Self(hasher.finalize().into())
    }

    /// Rebuilds a fingerprint read back from storage.
    ///
    /// # Errors
    ///
    /// Returns `None` unless `bytes` is exactly 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The 32 bytes of the digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "..)")
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(content_type) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = content_type.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json")
            || subtype.len() > 5 && subtype[subtype.len() - 5..].eq_ignore_ascii_case("+json"))
}

fn canonical_json(headers: &HeaderMap, body: &[u8]) -> Option<Vec<u8>> {
    if !is_json(headers) {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    // JCS writes numbers as IEEE doubles; a number beyond 2^53 would lose digits and two
    // different amounts could look the same. Such bodies are compared byte for byte instead.
    if !numbers_fit_f64(&value) {
        return None;
    }
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// Whether every number of `value` is within 2^53 of zero, where a double holds each integer
/// exactly. Integers beyond `u64`/`i64` reach here as doubles (serde_json reads them so), and
/// `1e17` is a double too: their magnitude, not their spelling, decides.
fn numbers_fit_f64(value: &serde_json::Value) -> bool {
    const EXACT: u64 = 1 << 53;
    match value {
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => u <= EXACT,
            (None, Some(i), _) => i.unsigned_abs() <= EXACT,
            (None, None, Some(f)) => f.abs() <= EXACT as f64,
            (None, None, None) => false,
        },
        serde_json::Value::Array(items) => items.iter().all(numbers_fit_f64),
        serde_json::Value::Object(map) => map.values().all(numbers_fit_f64),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_headers(content_type: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, content_type.parse().unwrap());
        headers
    }

    fn fp(path: &str, content_type: &str, body: &str) -> Fingerprint {
        Fingerprint::of(
            &Method::POST,
            path,
            &json_headers(content_type),
            body.as_bytes(),
        )
    }

    #[test]
    fn json_key_order_and_whitespace_do_not_matter() {
        let a = fp(
            "/p",
            "application/json",
            r#"{"amount":1,"nested":{"x":1,"y":[1,2]}}"#,
        );
        let b = fp(
            "/p",
            "application/json; charset=utf-8",
            "{\n \"nested\": {\"y\": [1, 2], \"x\": 1},\n \"amount\": 1\n}",
        );
        let c = fp(
            "/p",
            "application/problem+json",
            r#"{ "amount" : 1, "nested" : {"x":1,"y":[1,2]} }"#,
        );
        assert_eq!(a, b);
        assert_eq!(a, c);
    }

    #[test]
    fn json_values_still_matter() {
        assert_ne!(
            fp("/p", "application/json", r#"{"amount":1}"#),
            fp("/p", "application/json", r#"{"amount":2}"#)
        );
        assert_ne!(
            fp("/p", "application/json", r#"[1,2]"#),
            fp("/p", "application/json", r#"[2,1]"#)
        );
    }

    #[test]
    fn method_path_and_query_matter() {
        let headers = json_headers("application/json");
        let base = Fingerprint::of(&Method::POST, "/p", &headers, b"{}");
        assert_ne!(base, Fingerprint::of(&Method::PATCH, "/p", &headers, b"{}"));
        assert_ne!(base, Fingerprint::of(&Method::POST, "/q", &headers, b"{}"));
        assert_ne!(
            base,
            Fingerprint::of(&Method::POST, "/p?x=1", &headers, b"{}")
        );
    }

    #[test]
    fn large_integers_keep_every_digit() {
        assert_ne!(
            fp("/p", "application/json", r#"{"amount":9007199254740993}"#),
            fp("/p", "application/json", r#"{"amount":9007199254740992}"#)
        );
        assert_eq!(
            fp("/p", "application/json", r#"{"amount":9007199254740992}"#),
            fp(
                "/p",
                "application/json",
                r#"{ "amount" : 9007199254740992 }"#
            ),
            "integers up to 2^53 are still canonicalised"
        );
    }

    #[test]
    fn other_bodies_are_hashed_as_bytes() {
        assert_ne!(
            fp("/p", "text/plain", r#"{"a":1,"b":2}"#),
            fp("/p", "text/plain", r#"{"b":2,"a":1}"#)
        );
        // Invalid JSON under a JSON content type is still fingerprinted, byte for byte.
        assert_ne!(
            fp("/p", "application/json", "{"),
            fp("/p", "application/json", "{ ")
        );
    }
}
