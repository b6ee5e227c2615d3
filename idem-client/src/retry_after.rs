//! `Retry-After`: seconds, or an HTTP date (RFC 9110, section 10.2.3).

use std::time::{Duration, SystemTime};

#[cfg(feature = "http")]
use http::header::{HeaderMap, RETRY_AFTER};

/// How long the server asks to wait, if it says; a date in the past is no wait.
#[cfg(feature = "http")]
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    parse(headers.get(RETRY_AFTER)?.to_str().ok()?)
}

/// A `Retry-After` value: seconds, or a date (in the past: no wait); `None` for nonsense.
pub(crate) fn parse(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        // Beyond a day is no retry worth waiting for; the budget refuses it either way.
        return Some(Duration::from_secs(seconds.min(86_400)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(
        date.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(all(test, feature = "http"))]
mod tests {
    use http::header::HeaderValue;

    use super::*;

    fn with(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn seconds_and_dates_are_read_and_nonsense_is_ignored() {
        assert_eq!(retry_after(&with("3")), Some(Duration::from_secs(3)));
        assert_eq!(
            retry_after(&with("Wed, 21 Oct 2015 07:28:00 GMT")),
            Some(Duration::ZERO)
        );
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        let wait = retry_after(&with(&later)).unwrap();
        assert!(wait > Duration::from_secs(100) && wait <= Duration::from_secs(120));
        assert_eq!(retry_after(&with("soon")), None);
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }
}
