//! How long a failing task waits before it tries again.

use std::{
    hash::{BuildHasher, Hasher},
    time::Duration,
};

/// A capped exponential backoff with jitter, and whether the trouble was already reported:
/// an outage gives one warning when it starts and one line when it ends, not one per attempt.
#[derive(Debug)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    next: Duration,
    failing: bool,
}

impl Backoff {
    /// A backoff whose first wait is about `first`, doubling with each failure up to `cap`.
    pub fn new(first: Duration, cap: Duration) -> Self {
        Self {
            first,
            cap,
            next: first,
            failing: false,
        }
    }

    /// Counts a failure; returns how long to wait, and whether this failure starts an outage
    /// (the one to report).
    pub fn failed(&mut self) -> (Duration, bool) {
        let started = !self.failing;
        self.failing = true;
        let base = self.next;
        self.next = (self.next * 2).min(self.cap);
        // Half the delay fixed, half random: relays and consumers that lost the same broker
        // do not all come back at the same instant.
        let half = base / 2;
        let nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).max(1);
        let jitter = Duration::from_nanos(random() % nanos);
        (half + jitter, started)
    }

    /// Counts a success; returns whether it ends an outage (the one to report).
    pub fn succeeded(&mut self) -> bool {
        self.next = self.first;
        std::mem::take(&mut self.failing)
    }
}

/// A random number from the standard library's randomly keyed hasher: enough for a jitter.
fn random() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos().into()),
    );
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_reported_once_and_its_waits_grow_to_the_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let (first, started) = backoff.failed();
        assert!(started);
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
        let mut last = first;
        for _ in 0..10 {
            let (wait, started) = backoff.failed();
            assert!(!started, "only the first failure starts an outage");
            assert!(wait <= Duration::from_secs(1), "{wait:?} is over the cap");
            last = wait;
        }
        assert!(
            last >= Duration::from_millis(500),
            "the waits reached the cap"
        );
        assert!(backoff.succeeded(), "the first success ends the outage");
        assert!(!backoff.succeeded());
        assert!(
            backoff.failed().0 <= Duration::from_millis(100),
            "the waits start over"
        );
    }
}
