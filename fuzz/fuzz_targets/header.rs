//! Arbitrary bytes → `Idempotency-Key` header values → `parse_key`.
//!
//! The input is split on NUL, which no header value can hold, into any number of header values.
//! Besides "no panic", every answer is checked against the grammar of `header.rs`'s docs: a key
//! is accepted exactly when there is one header whose value, less surrounding spaces and tabs,
//! is a bare key or one RFC 8941 sf-string (no parameters) whose content is a key; a key is 1 to
//! 255 visible ASCII characters.
#![no_main]

use http::{HeaderMap, HeaderValue};
use idem_key::{IDEMPOTENCY_KEY, parse_key, parse_value};
use libfuzzer_sys::fuzz_target;

fn is_key(key: &[u8]) -> bool {
    (1..=255).contains(&key.len()) && key.iter().all(|b| (b'!'..=b'~').contains(b))
}

fn trim_ows(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

/// The key the docs say one header value holds, if any.
fn model(value: &[u8]) -> Option<Vec<u8>> {
    let value = trim_ows(value);
    let Some(quoted) = value.strip_prefix(b"\"") else {
        return is_key(value).then(|| value.to_vec());
    };
    let mut content = Vec::new();
    let mut rest = quoted.iter();
    loop {
        match rest.next()? {
            b'"' => break,
            b'\\' => match rest.next()? {
                &escaped @ (b'"' | b'\\') => content.push(escaped),
                _ => return None,
            },
            &byte @ 0x20..=0x7e => content.push(byte),
            _ => return None,
        }
    }
    (rest.as_slice().is_empty() && is_key(&content)).then_some(content)
}

fuzz_target!(|data: &[u8]| {
    // Any bytes at all through the one-value entry point: no panic, and the grammar for the
    // bytes a header value can hold (no control characters but tab).
    let direct = parse_value(data);
    if HeaderValue::from_bytes(data).is_ok() {
        assert_eq!(
            direct.as_ref().ok().map(|k| k.as_str().as_bytes().to_vec()),
            model(data),
            "parse_value disagrees with the grammar on {data:?}: {direct:?}"
        );
    }

    let mut headers = HeaderMap::new();
    let mut values = Vec::new();
    if !data.is_empty() {
        for part in data.split(|&b| b == 0) {
            if let Ok(value) = HeaderValue::from_bytes(part) {
                headers.append(IDEMPOTENCY_KEY, value);
                values.push(part);
            }
        }
    }
    let got = parse_key(&headers);
    let expected = match values[..] {
        [one] => model(one),
        _ => None,
    };
    assert_eq!(
        got.as_ref().ok().map(|k| k.as_str().as_bytes().to_vec()),
        expected,
        "parse_key disagrees with the grammar on {values:?}: {got:?}"
    );
    if let Ok(key) = got {
        // The sf-string spelling of an accepted key is the same key.
        let mut quoted = vec![b'"'];
        for &b in key.as_str().as_bytes() {
            if b == b'"' || b == b'\\' {
                quoted.push(b'\\');
            }
            quoted.push(b);
        }
        quoted.push(b'"');
        assert_eq!(parse_value(&quoted).as_ref(), Ok(&key));
    }
});
