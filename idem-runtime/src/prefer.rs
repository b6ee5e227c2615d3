//! The `Prefer` request header (RFC 7240), as far as idem reads it: the `wait` preference, a
//! client's "I'd rather wait this many seconds than be told to come back".

use std::time::Duration;

use http::HeaderMap;

/// The `wait` preference among `headers`' `Prefer` fields: its first occurrence, in whole
/// seconds. Preferences idem does not know, and a `wait` whose value is not a number of
/// seconds, are ignored, as RFC 7240 asks of a server.
pub(crate) fn wait(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get_all(http::header::HeaderName::from_static("prefer"))
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .find_map(|preference| {
            // `token [ BWS "=" BWS word ] *( OWS ";" [ OWS parameter ] )`
            let head = preference.split(';').next().unwrap_or_default();
            let (name, value) = head.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            let value = value.trim().trim_matches('"');
            Some(value.parse::<u64>().ok().map(Duration::from_secs))
        })
        .flatten()
}

/// The `Preference-Applied` value of a wait of `seconds`.
pub(crate) fn applied(seconds: u64) -> http::HeaderValue {
    http::HeaderValue::from_str(&format!("wait={seconds}")).expect("digits are a header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(values: &[&str]) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append("prefer", value.parse().expect("a header value"));
        }
        wait(&headers)
    }

    #[test]
    fn the_wait_preference_is_read_among_others_in_any_case() {
        assert_eq!(prefer(&["wait=10"]), Some(Duration::from_secs(10)));
        assert_eq!(
            prefer(&["respond-async, wait=5"]),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            prefer(&["WAIT = 7 ; foo=bar"]),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            prefer(&["return=minimal", "wait=\"3\""]),
            Some(Duration::from_secs(3))
        );
        assert_eq!(prefer(&["wait=0"]), Some(Duration::ZERO));
    }

    #[test]
    fn the_first_wait_counts_and_bad_values_are_ignored() {
        assert_eq!(prefer(&["wait=2, wait=9"]), Some(Duration::from_secs(2)));
        assert_eq!(prefer(&[]), None);
        assert_eq!(prefer(&["respond-async"]), None);
        assert_eq!(prefer(&["wait"]), None);
        assert_eq!(prefer(&["wait=soon"]), None);
        assert_eq!(prefer(&["wait=-1"]), None);
        assert_eq!(prefer(&["waiting=5"]), None);
    }
}
