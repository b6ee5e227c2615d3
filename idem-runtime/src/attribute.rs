//! What the attribute says: its arguments as the macro parsed them, and durations written in its
//! syntax. A leaf: the request flow, the published policy and the errors read it.

use std::time::Duration;

/// The attribute's arguments, as the macro parsed them.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// How long a completed key is kept and replayed.
    pub retention: Duration,
    /// Whether a 5xx outcome is stored and replayed (its writes undone) or rolled back.
    pub replay_5xx: bool,
    /// External mode: how long a claim is exclusive before a retry may take it over.
    pub lease: Duration,
    /// How long the handler body may run before it is stopped (`None`: unbounded).
    pub timeout: Option<Duration>,
    /// The most a duplicate may wait for the first request's outcome (`None`: 409 at once).
    pub wait: Option<Duration>,
    /// Which fields of a JSON body count in the fingerprint.
    pub body_fields: idem_key::BodyFields,
}

/// A duration in the attribute's syntax: `"1h30m"`, `"45s"`.
pub(crate) fn attribute_duration(duration: Duration) -> String {
    let mut left = duration.as_secs();
    if left == 0 {
        return format!("{}ms", duration.as_millis());
    }
    let mut text = String::new();
    for (unit, secs) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if left >= secs {
            text.push_str(&format!("{}{unit}", left / secs));
            left %= secs;
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn timeouts_are_written_in_the_attribute_syntax() {
        let text = |secs| attribute_duration(Duration::from_secs(secs));
        assert_eq!(text(1), "1s");
        assert_eq!(text(90), "1m30s");
        assert_eq!(text(3600), "1h");
        assert_eq!(text(86_401), "1d1s");
        assert_eq!(attribute_duration(Duration::from_millis(250)), "250ms");
    }
}
