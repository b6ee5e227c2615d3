//! Parsing of the `Idempotency-Key` request header.
//!
//! Two spellings are accepted and mean the same key: the RFC 8941 Structured Field String that
//! the IETF HTTPAPI draft *The Idempotency-Key HTTP Header Field*
//! (draft-ietf-httpapi-idempotency-key-header) specifies (`Idempotency-Key: "8e03978e-..."`) and
//! the bare value Stripe's clients send (`Idempotency-Key: 8e03978e-...`). Either way the key is 1 to 255 visible ASCII
//! characters (`!` to `~`).

use std::fmt;

use http::{HeaderMap, HeaderName};

/// The name of the request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters (Stripe's limit).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as sent by the client.
///
/// Its `Debug` and `Display` forms never show the key itself: keys are client secrets of a kind
/// (the IETF HTTPAPI draft warns that a guessable key lets another client read a response), so they are
/// kept out of logs.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates a key given without the Structured Field quotes.
    ///
    /// # Errors
    ///
    /// [`KeyError::Empty`], [`KeyError::TooLong`] or [`KeyError::NotVisibleAscii`] when the key
    /// breaks the rules above.
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: key.len() });
        }
        if let Some(position) = key.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(KeyError::NotVisibleAscii { position });
        }
        Ok(Self(key))
    }

    /// The key as the client sent it, without quotes.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<{} characters>)", self.0.len())
    }
}

/// Why an `Idempotency-Key` header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The header is absent.
    #[error(
        "this endpoint requires an `Idempotency-Key` header; send a unique value (a UUID v4 is a good choice) and reuse it when you retry"
    )]
    Missing,
    /// The header appears more than once.
    #[error("the `Idempotency-Key` header appears {count} times; send it exactly once")]
    Repeated {
        /// How many times it appeared.
        count: usize,
    },
    /// The key is empty (`Idempotency-Key:` or `Idempotency-Key: ""`).
    #[error("the `Idempotency-Key` header is empty; a key has 1 to 255 visible ASCII characters")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error(
        "the idempotency key is {len} bytes long; a key has at most 255 visible ASCII characters"
    )]
    TooLong {
        /// The key's length in bytes (a valid key's characters are one byte each).
        len: usize,
    },
    /// The key holds a space, a control character or a non-ASCII byte.
    #[error(
        "the idempotency key has a character that is not visible ASCII at position {position}; use only `!` to `~` (no spaces)"
    )]
    NotVisibleAscii {
        /// Zero-based byte position of the first offending character.
        position: usize,
    },
    /// The value starts with `"` but is not a valid Structured Field String.
    #[error(
        "the `Idempotency-Key` header starts with `\"` but is not a valid Structured Field String ({reason}); send `\"<key>\"` or the bare key"
    )]
    BadStructuredField {
        /// What the Structured Field parser said.
        reason: String,
    },
    /// The value is a Structured Field String with parameters (`"abc";x=1`).
    #[error("the `Idempotency-Key` header has Structured Field parameters; send only the string")]
    Parameters,
}

/// Reads and validates the `Idempotency-Key` header.
///
/// # Errors
///
/// A [`KeyError`] naming exactly what is wrong: missing, repeated, empty, too long, not visible
/// ASCII, or a malformed Structured Field String.
///
/// # Examples
///
/// ```
/// use http::HeaderMap;
/// use idem_key::parse_key;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("idempotency-key", "\"8e03978e-40d5\"".parse().unwrap());
/// assert_eq!(parse_key(&headers).unwrap().as_str(), "8e03978e-40d5");
///
/// headers.insert("idempotency-key", "8e03978e-40d5".parse().unwrap());
/// assert_eq!(parse_key(&headers).unwrap().as_str(), "8e03978e-40d5");
/// ```
pub fn parse_key(headers: &HeaderMap) -> Result<IdempotencyKey, KeyError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Err(KeyError::Missing);
    };
    let extra = values.count();
    if extra > 0 {
        return Err(KeyError::Repeated { count: extra + 1 });
    }
    parse_value(value.as_bytes())
}

/// Validates one header value, in either spelling.
///
/// # Errors
///
/// As [`parse_key`], except for `Missing` and `Repeated`.
pub fn parse_value(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
    // HTTP allows optional whitespace around a field value; `http` keeps it.
    let raw = raw.trim_ascii();
    if raw.first() == Some(&b'"') {
        let item: sfv::Item =
            sfv::Parser::new(raw)
                .parse_item()
                .map_err(|error| KeyError::BadStructuredField {
                    reason: error.to_string(),
                })?;
        if !item.params.is_empty() {
            return Err(KeyError::Parameters);
        }
        let Some(string) = item.bare_item.as_string() else {
            return Err(KeyError::BadStructuredField {
                reason: "not a string".to_owned(),
            });
        };
        return IdempotencyKey::new(string.as_str());
    }
    match std::str::from_utf8(raw) {
        Ok(text) => IdempotencyKey::new(text),
        Err(error) => Err(KeyError::NotVisibleAscii {
            // The first byte outside `!`..`~`, which may come before the first invalid UTF-8.
            position: raw
                .iter()
                .position(|b| !b.is_ascii_graphic())
                .unwrap_or(error.valid_up_to()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<String, KeyError> {
        parse_value(raw.as_bytes()).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn quoted_and_bare_are_the_same_key() {
        assert_eq!(parse("\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse("abc-123").unwrap(), "abc-123");
        assert_eq!(parse("  abc-123 ").unwrap(), "abc-123");
    }

    #[test]
    fn escapes_in_quoted_form_are_decoded() {
        assert_eq!(parse(r#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
    }

    #[test]
    fn empty_keys_are_refused() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn length_limit_is_255() {
        assert!(parse(&"k".repeat(255)).is_ok());
        assert_eq!(parse(&"k".repeat(256)), Err(KeyError::TooLong { len: 256 }));
        let quoted = format!("\"{}\"", "k".repeat(256));
        assert_eq!(parse(&quoted), Err(KeyError::TooLong { len: 256 }));
    }

    #[test]
    fn spaces_and_non_ascii_are_refused() {
        assert_eq!(parse("a b"), Err(KeyError::NotVisibleAscii { position: 1 }));
        assert_eq!(
            parse("\"a b\""),
            Err(KeyError::NotVisibleAscii { position: 1 })
        );
        assert_eq!(
            parse_value("aé".as_bytes()),
            Err(KeyError::NotVisibleAscii { position: 1 })
        );
        assert_eq!(
            parse("a\tb"),
            Err(KeyError::NotVisibleAscii { position: 1 })
        );
    }

    #[test]
    fn malformed_structured_fields_are_refused() {
        assert!(matches!(
            parse("\"abc"),
            Err(KeyError::BadStructuredField { .. })
        ));
        assert!(matches!(
            parse("\"a\" b"),
            Err(KeyError::BadStructuredField { .. })
        ));
        assert_eq!(parse("\"abc\";v=1"), Err(KeyError::Parameters));
    }

    #[test]
    fn missing_and_repeated_headers() {
        let mut headers = HeaderMap::new();
        assert_eq!(parse_key(&headers), Err(KeyError::Missing));
        headers.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        headers.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
        assert_eq!(parse_key(&headers), Err(KeyError::Repeated { count: 2 }));
    }

    #[test]
    fn debug_form_hides_the_key() {
        let key = IdempotencyKey::new("secret-key").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
    }
}
