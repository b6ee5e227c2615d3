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
        Self::of_fields(method, path_and_query, headers, body, BodyFields::All)
    }

    /// Fingerprints a request whose JSON body counts only in part: only the fields `fields`
    /// names, or all but those (see [`BodyFields`]). The method and the path with its query
    /// always count; a body that is not JSON (or holds a number beyond 2^53) counts whole, byte
    /// for byte, as in [`Fingerprint::of`]. [`BodyFields::All`] is [`Fingerprint::of`].
    ///
    /// # Examples
    ///
    /// ```
    /// use http::{HeaderMap, Method, header::CONTENT_TYPE};
    /// use idem_key::{BodyFields, Fingerprint};
    ///
    /// let mut headers = HeaderMap::new();
    /// headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
    /// let fields = BodyFields::Except(&["/sent_at"]);
    /// let of = |body: &[u8]| Fingerprint::of_fields(&Method::POST, "/v1/payments", &headers, body, fields);
    /// assert_eq!(of(br#"{"amount":5,"sent_at":"10:00"}"#), of(br#"{"amount":5,"sent_at":"10:01"}"#));
    /// assert_ne!(of(br#"{"amount":5,"sent_at":"10:00"}"#), of(br#"{"amount":6,"sent_at":"10:00"}"#));
    /// ```
    pub fn of_fields(
        method: &Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: &[u8],
        fields: BodyFields,
    ) -> Self {
        let mut hasher = Sha256::new();
        // Length prefixes keep the fields apart: no (method, path) pair can alias another.
        for field in [method.as_str().as_bytes(), path_and_query.as_bytes()] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        match json_body(headers, body).and_then(|value| fields.canonical(value)) {
            // Each selection has its own tag, so that no two selections (nor the whole body)
            // can give the same input for different bodies.
            Some(canonical) => {
                hasher.update(fields.tag());
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

/// The body as JSON, when its `Content-Type` says it is and it parses. JCS writes numbers as
/// IEEE doubles; a number beyond 2^53 would lose digits and two different amounts could look
/// the same, so a part to hash that holds one is compared byte for byte instead ([`canonical`]).
fn json_body(headers: &HeaderMap, body: &[u8]) -> Option<serde_json::Value> {
    if !is_json(headers) {
        return None;
    }
    serde_json::from_slice(body).ok()
}

/// `value` canonicalised (RFC 8785), unless it holds a number JCS cannot write exactly (see
/// [`json_body`]): only what is hashed is checked, so a large number in a field left out does
/// not make the body count whole.
fn canonical(value: &serde_json::Value) -> Option<Vec<u8>> {
    if !numbers_fit_f64(value) {
        return None;
    }
    serde_json_canonicalizer::to_vec(value).ok()
}

/// Which parts of a JSON request body count in its [`Fingerprint`]: the whole body (the
/// default), only the fields named, or all but them. Fields are named by JSON Pointer (RFC 6901:
/// `/amount`, `/payer/id`, `/items/0`, `~1` for a `/` and `~0` for a `~` in a name).
///
/// For clients that put something in the body that changes from one retry to the next (a
/// timestamp, a trace id): the fields that count still make a retry with other values of them
/// another request (422).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BodyFields {
    /// The whole body.
    #[default]
    All,
    /// Only these fields. A field the body lacks counts as absent, which differs from `null`.
    Only(&'static [&'static str]),
    /// All but these fields. A field named in an array is counted as `null`, so that the
    /// elements after it keep their places.
    Except(&'static [&'static str]),
}

impl BodyFields {
    /// What the hash takes before the canonical JSON.
    fn tag(self) -> &'static [u8] {
        match self {
            Self::All => b"json",
            Self::Only(_) => b"json-only",
            Self::Except(_) => b"json-except",
        }
    }

    /// The part of `value` that counts, canonicalised (RFC 8785).
    fn canonical(self, mut value: serde_json::Value) -> Option<Vec<u8>> {
        match self {
            Self::All => canonical(&value),
            Self::Only(pointers) => {
                // `[pointer, value]` for a field present, `[pointer]` for one absent.
                let picked: Vec<serde_json::Value> = pointers
                    .iter()
                    .map(|pointer| match value.pointer(pointer) {
                        Some(found) => serde_json::json!([pointer, found]),
                        None => serde_json::json!([pointer]),
                    })
                    .collect();
                canonical(&serde_json::Value::Array(picked))
            }
            Self::Except(pointers) => {
                for pointer in pointers {
                    remove(&mut value, pointer);
                }
                canonical(&value)
            }
        }
    }
}

/// Takes the field at `pointer` out of `value`: an object's member is removed, an array's
/// element becomes `null` (the elements after it keep their indices). Nothing when the body has
/// no such field.
fn remove(value: &mut serde_json::Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let name = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(serde_json::Value::Object(members)) => {
            members.remove(&name);
        }
        Some(serde_json::Value::Array(items)) => {
            // An index as RFC 6901 (and `Value::pointer`) reads one: digits, no leading zero.
            let is_index = !name.is_empty()
                && name.bytes().all(|b| b.is_ascii_digit())
                && (name == "0" || !name.starts_with('0'));
            let index = is_index.then(|| name.parse::<usize>().ok()).flatten();
            if let Some(item) = index.and_then(|i| items.get_mut(i)) {
                *item = serde_json::Value::Null;
            }
        }
        _ => {}
    }
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

    fn with(fields: BodyFields, body: &str) -> Fingerprint {
        Fingerprint::of_fields(
            &Method::POST,
            "/v1/payments",
            &json_headers("application/json"),
            body.as_bytes(),
            fields,
        )
    }

    #[test]
    fn only_the_named_fields_count() {
        let only = BodyFields::Only(&["/amount", "/payer/id"]);
        let first = with(
            only,
            r#"{"amount":5,"payer":{"id":"p1","name":"A"},"note":"x"}"#,
        );
        assert_eq!(
            first,
            with(
                only,
                r#"{"note":"y","payer":{"name":"B","id":"p1"},"amount":5}"#
            )
        );
        assert_ne!(first, with(only, r#"{"amount":6,"payer":{"id":"p1"}}"#));
        assert_ne!(first, with(only, r#"{"amount":5,"payer":{"id":"p2"}}"#));
    }

    #[test]
    fn an_absent_field_differs_from_a_null_one() {
        let only = BodyFields::Only(&["/amount"]);
        assert_ne!(with(only, r#"{}"#), with(only, r#"{"amount":null}"#));
        let except = BodyFields::Except(&["/sent_at"]);
        assert_ne!(with(except, r#"{"a":1}"#), with(except, r#"{"a":null}"#));
    }

    #[test]
    fn all_but_the_named_fields_count() {
        let except = BodyFields::Except(&["/sent_at", "/trace/id", "/a~1b"]);
        let first = with(
            except,
            r#"{"amount":5,"sent_at":1,"trace":{"id":"t1","hop":2},"a/b":"x"}"#,
        );
        assert_eq!(
            first,
            with(
                except,
                r#"{"amount":5,"sent_at":2,"trace":{"id":"t2","hop":2},"a/b":"y"}"#
            )
        );
        assert_eq!(first, with(except, r#"{"amount":5,"trace":{"hop":2}}"#));
        assert_ne!(
            first,
            with(
                except,
                r#"{"amount":6,"sent_at":1,"trace":{"id":"t1","hop":2}}"#
            )
        );
        assert_ne!(
            first,
            with(except, r#"{"amount":5,"trace":{"id":"t1","hop":3}}"#)
        );
    }

    #[test]
    fn a_field_named_in_an_array_keeps_the_places_of_the_others() {
        let except = BodyFields::Except(&["/items/0"]);
        assert_eq!(
            with(except, r#"{"items":["a","b"]}"#),
            with(except, r#"{"items":["z","b"]}"#)
        );
        assert_ne!(
            with(except, r#"{"items":["a","b"]}"#),
            with(except, r#"{"items":["b"]}"#)
        );
    }

    #[test]
    fn each_selection_fingerprints_apart_from_the_whole_body() {
        // The whole body `[["/a",1]]` is what `Only(["/a"])` canonicalises `{"a":1}` to; the
        // tags keep them apart.
        assert_ne!(
            with(BodyFields::Only(&["/a"]), r#"{"a":1}"#),
            with(BodyFields::All, r#"[["/a",1]]"#)
        );
        assert_ne!(
            with(BodyFields::Except(&["/b"]), r#"{"a":1}"#),
            with(BodyFields::All, r#"{"a":1}"#)
        );
        assert_eq!(
            with(BodyFields::All, r#"{"a":1}"#),
            fp("/v1/payments", "application/json", r#"{"a":1}"#)
        );
    }

    #[test]
    fn a_body_that_is_not_json_counts_whole_whatever_the_selection() {
        let only = BodyFields::Only(&["/amount"]);
        let text = |body: &str| {
            Fingerprint::of_fields(
                &Method::POST,
                "/v1/payments",
                &json_headers("text/plain"),
                body.as_bytes(),
                only,
            )
        };
        assert_ne!(text(r#"{"amount":5,"a":1}"#), text(r#"{"amount":5,"a":2}"#));
    }

    #[test]
    fn a_large_number_in_a_field_left_out_does_not_make_the_body_count_whole() {
        let except = BodyFields::Except(&["/sent_at_ns"]);
        assert_eq!(
            with(except, r#"{"amount":5,"sent_at_ns":1733310000000000001}"#),
            with(
                except,
                r#"{ "sent_at_ns":1733310000000000999, "amount": 5 }"#
            )
        );
        let only = BodyFields::Only(&["/amount"]);
        assert_eq!(
            with(only, r#"{"amount":5,"trace":18446744073709551615}"#),
            with(only, r#"{"amount":5,"trace":1}"#)
        );
        // One that counts still makes the body count byte for byte.
        assert_ne!(
            with(only, r#"{"amount":18446744073709551615}"#),
            with(only, r#"{ "amount":18446744073709551615}"#)
        );
    }

    #[test]
    fn an_array_index_is_read_as_rfc_6901_reads_it() {
        let except = BodyFields::Except(&["/items/01"]);
        assert_ne!(
            with(except, r#"{"items":["a","b"]}"#),
            with(except, r#"{"items":["a","c"]}"#),
            "`01` is no index: nothing is left out"
        );
    }
}
