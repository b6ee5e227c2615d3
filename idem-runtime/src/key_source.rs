//! Where a handler takes its idempotency key from ([`KeySource`]): the `Idempotency-Key` header
//! by default, another header (a webhook's delivery id), a string field of the JSON body named
//! by a JSON Pointer, or a string field of a tonic request message (AIP-155's `request_id`).
//! Whatever the source, the key has the syntax and limits of the `Idempotency-Key` header, and a
//! missing or malformed key is refused before the key is claimed.

use idem_key::{IdempotencyKey, KeyError};

/// Where a handler's idempotency key comes from, as its attribute says (`key_header`,
/// `key_pointer`, `key_field`; [`KeySource::Standard`] without them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// The `Idempotency-Key` header, or a tonic call's `idempotency-key` metadata.
    Standard,
    /// Another request header, named in lowercase (`webhook-id`, `x-github-delivery`).
    Header(&'static str),
    /// A string field of the JSON request body, named by a JSON Pointer (`/id`, RFC 6901).
    BodyField(&'static str),
    /// A string field of a tonic request message (`request_id`, as Google's AIP-155 names it).
    MessageField(&'static str),
}

impl KeySource {
    /// Where the key is, in a few words for an API's users: "the `webhook-id` header".
    pub fn describe(&self) -> String {
        match self {
            Self::Standard => "the `Idempotency-Key` header".to_owned(),
            Self::Header(name) => format!("the `{name}` header"),
            Self::BodyField(pointer) => format!("the body's `{pointer}` field"),
            Self::MessageField(field) => format!("the request message's `{field}` field"),
        }
    }

    /// The key of an HTTP request with these `headers` and `body`.
    ///
    /// # Errors
    ///
    /// [`Refused`] says whether the key is missing and, in the words of this source, what is
    /// wrong with it.
    pub(crate) fn take_http(
        &self,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> Result<IdempotencyKey, Refused> {
        match self {
            Self::Standard => idem_key::parse_key(headers).map_err(|error| Refused {
                missing: error == KeyError::Missing,
                detail: error.to_string(),
            }),
            Self::Header(name) => take_header(headers, name),
            Self::BodyField(pointer) => take_body_field(body, pointer),
            Self::MessageField(field) => Err(Refused {
                missing: true,
                detail: format!(
                    "the key is the request message's `{field}` field, which only a gRPC call has"
                ),
            }),
        }
    }

    /// The key of a tonic call whose message field (for [`KeySource::MessageField`]) holds
    /// `field`; the `idempotency-key` metadata otherwise, among `headers`.
    ///
    /// # Errors
    ///
    /// As [`take_http`](Self::take_http).
    #[cfg(feature = "grpc")]
    pub(crate) fn take_grpc(
        &self,
        headers: &http::HeaderMap,
        field: Option<&str>,
    ) -> Result<IdempotencyKey, Refused> {
        match self {
            Self::MessageField(name) => {
                let value = field.filter(|value| !value.is_empty()).ok_or_else(|| Refused {
                    missing: true,
                    detail: format!(
                        "this method requires the request's `{name}` field, its idempotency key: \
                         set it to a unique value (a UUID v4 is a good choice) and keep it when \
                         you retry"
                    ),
                })?;
                IdempotencyKey::new(value).map_err(|error| Refused {
                    missing: false,
                    detail: format!("the request's `{name}` field is not a valid key: {error}"),
                })
            }
            _ => idem_key::parse_key(headers).map_err(|error| Refused {
                missing: error == KeyError::Missing,
                detail: grpc_metadata_detail(&error),
            }),
        }
    }
}

/// Why a request's key was refused: it is missing, or its value breaks the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refused {
    /// No key at all: the request may run unprotected where the key is optional.
    pub(crate) missing: bool,
    /// What is wrong, for the client.
    pub(crate) detail: String,
}

/// The key in the header `name`: sent once, in either spelling the `Idempotency-Key` header
/// accepts.
fn take_header(headers: &http::HeaderMap, name: &str) -> Result<IdempotencyKey, Refused> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Err(Refused {
            missing: true,
            detail: format!(
                "this endpoint requires a `{name}` header, the request's idempotency key; send \
                 the same value when you retry"
            ),
        });
    };
    let extra = values.count();
    if extra > 0 {
        return Err(Refused {
            missing: false,
            detail: format!(
                "the `{name}` header appears {} times; send it exactly once",
                extra + 1
            ),
        });
    }
    idem_key::parse_value(value.as_bytes()).map_err(|error| Refused {
        missing: false,
        detail: format!("the `{name}` header is not a valid key: {error}"),
    })
}

/// The key in the JSON body's string field at `pointer`.
fn take_body_field(body: &[u8], pointer: &str) -> Result<IdempotencyKey, Refused> {
    let missing = |why: &str| Refused {
        missing: true,
        detail: format!(
            "this endpoint takes its idempotency key from the JSON body's `{pointer}` field, \
             and {why}; send the same value when you retry"
        ),
    };
    let Ok(document) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Err(missing("the body is not JSON"));
    };
    match document.pointer(pointer) {
        None | Some(serde_json::Value::Null) => Err(missing("the body has no such field")),
        Some(serde_json::Value::String(value)) => {
            IdempotencyKey::new(value.as_str()).map_err(|error| Refused {
                missing: false,
                detail: format!("the body's `{pointer}` field is not a valid key: {error}"),
            })
        }
        Some(_) => Err(Refused {
            missing: false,
            detail: format!(
                "the body's `{pointer}` field is not a string; a key is a string of 1 to 255 \
                 visible ASCII characters"
            ),
        }),
    }
}

/// What is wrong with a call's `idempotency-key` metadata, in the words of gRPC metadata.
#[cfg(feature = "grpc")]
fn grpc_metadata_detail(error: &KeyError) -> String {
    match error {
        KeyError::Missing => "this method requires `idempotency-key` metadata; send a unique \
                              value (a UUID v4 is a good choice) and reuse it when you retry"
            .to_owned(),
        KeyError::Repeated { count } => {
            format!("the `idempotency-key` metadata appears {count} times; send it exactly once")
        }
        other => format!("the `idempotency-key` metadata is not a valid key: {other}"),
    }
}

/// Where an Axum handler's key comes from, named by a type in its signature
/// ([`Input`](crate::signature::Input)'s third parameter): the key is read while the request is
/// extracted, before the handler's last extractor runs.
pub trait KeyFrom {
    /// Where the key is, and whether a request without one runs, unprotected, instead of
    /// being refused (400).
    fn rule() -> (KeySource, bool);
}

/// The `Idempotency-Key` header, required: the default.
#[derive(Debug)]
pub enum StandardKey {}

impl KeyFrom for StandardKey {
    fn rule() -> (KeySource, bool) {
        (KeySource::Standard, false)
    }
}

/// The key source `#[idempotent]` registered under `ID` for a handler with `key_header`,
/// `key_pointer` or `key_optional` (a [`KeySpec`] in the handler's body): a number in the
/// type, so that the handler needs no item beside it and may be an associated function.
#[derive(Debug)]
pub enum KeyAt<const ID: u64> {}

impl<const ID: u64> KeyFrom for KeyAt<ID> {
    fn rule() -> (KeySource, bool) {
        let found = specs().get(&ID).copied();
        found.expect("#[idempotent] registers the key source its handler's signature names")
    }
}

/// What the macro registers for a handler's key source; not an API.
#[doc(hidden)]
#[derive(Debug)]
pub struct KeySpec {
    /// The number the handler's `KeyAt` names.
    pub id: u64,
    /// Where the key is.
    pub source: KeySource,
    /// Whether it is optional.
    pub optional: bool,
}

inventory::collect!(KeySpec);

/// Every registered key source by its number. Two sources under one number (the macro's
/// 64-bit hash of the source colliding) would be a bug of the macro: refused loudly.
fn specs() -> &'static std::collections::HashMap<u64, (KeySource, bool)> {
    static SPECS: std::sync::OnceLock<std::collections::HashMap<u64, (KeySource, bool)>> =
        std::sync::OnceLock::new();
    SPECS.get_or_init(|| {
        let mut specs = std::collections::HashMap::new();
        for spec in inventory::iter::<KeySpec> {
            let rule = (spec.source, spec.optional);
            let known = *specs.entry(spec.id).or_insert(rule);
            assert_eq!(
                known, rule,
                "two key sources share the number {:#x}: rename one handler's argument",
                spec.id
            );
        }
        specs
    })
}

#[cfg(feature = "grpc")]
/// A tonic request message's field that can hold its key: a `string` (`String`, empty when
/// unset, as proto3 has it) or an `optional string` (`Option<String>`).
#[diagnostic::on_unimplemented(
    message = "`key_field` names a field of type `{Self}`, which cannot hold an idempotency key",
    label = "the key field must be a `string` (or `optional string`) field of the request message",
    note = "AIP-155 declares it as `string request_id = N;`"
)]
pub trait KeyField {
    /// The key the field holds; `None` when it is unset or empty.
    fn key_field(&self) -> Option<&str>;
}

#[cfg(feature = "grpc")]
impl KeyField for String {
    fn key_field(&self) -> Option<&str> {
        (!self.is_empty()).then_some(self.as_str())
    }
}

#[cfg(feature = "grpc")]
impl KeyField for Option<String> {
    fn key_field(&self) -> Option<&str> {
        self.as_deref().filter(|value| !value.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, http::HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn a_named_header_gives_the_key_and_the_standard_header_is_not_read() {
        let source = KeySource::Header("webhook-id");
        let both = headers(&[("webhook-id", "msg_1"), ("idempotency-key", "other")]);
        assert_eq!(source.take_http(&both, b"").unwrap().as_str(), "msg_1");
        let refused = source
            .take_http(&headers(&[("idempotency-key", "k")]), b"")
            .unwrap_err();
        assert!(refused.missing);
        assert!(
            refused.detail.contains("`webhook-id` header"),
            "{refused:?}"
        );
    }

    #[test]
    fn a_named_header_sent_twice_or_malformed_is_refused_but_not_missing() {
        let source = KeySource::Header("webhook-id");
        let twice = headers(&[("webhook-id", "a"), ("webhook-id", "b")]);
        assert!(!source.take_http(&twice, b"").unwrap_err().missing);
        let spaced = headers(&[("webhook-id", "a b")]);
        let refused = source.take_http(&spaced, b"").unwrap_err();
        assert!(!refused.missing);
        assert!(refused.detail.contains("not visible ASCII"), "{refused:?}");
    }

    #[test]
    fn a_body_field_gives_the_key_when_it_is_a_valid_string() {
        let source = KeySource::BodyField("/data/request_id");
        let body = br#"{"data": {"request_id": "r-1"}}"#;
        assert_eq!(
            source.take_http(&headers(&[]), body).unwrap().as_str(),
            "r-1"
        );
        for (body, missing) in [
            (&br#"{"data": {}}"#[..], true),
            (br#"{"data": {"request_id": null}}"#, true),
            (b"not json", true),
            (br#"{"data": {"request_id": 7}}"#, false),
            (br#"{"data": {"request_id": ""}}"#, false),
        ] {
            let refused = source.take_http(&headers(&[]), body).unwrap_err();
            assert_eq!(refused.missing, missing, "{refused:?}");
            assert!(refused.detail.contains("`/data/request_id`"), "{refused:?}");
        }
    }

    #[cfg(feature = "grpc")]
    #[test]
    fn a_message_field_gives_the_key_and_an_empty_one_is_missing() {
        let source = KeySource::MessageField("request_id");
        let none = headers(&[("idempotency-key", "ignored")]);
        assert_eq!(
            source.take_grpc(&none, Some("r-1")).unwrap().as_str(),
            "r-1"
        );
        assert!(source.take_grpc(&none, Some("")).unwrap_err().missing);
        assert!(source.take_grpc(&none, None).unwrap_err().missing);
        assert!(!source.take_grpc(&none, Some("a b")).unwrap_err().missing);
    }
}
