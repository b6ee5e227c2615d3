//! The one way idem bounds database work in time, in both of its crates: a request's work by the
//! deadline of the whole request, a background task's statement by a deadline of its own.

use std::{future::Future, time::Duration};

use tokio::time::Instant;

/// When database work must be done, and the limit it was set from (which a timeout reports).
///
/// ```
/// use std::time::Duration;
/// use idem_task::Deadline;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let deadline = Deadline::after(Duration::from_millis(10));
/// let never = std::future::pending::<Result<(), String>>();
/// let outcome = deadline
///     .bound(never, |after| format!("no answer within {after:?}"))
///     .await;
/// assert_eq!(outcome, Err("no answer within 10ms".to_owned()));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    at: Instant,
    limit: Duration,
}

impl Deadline {
    /// `limit` from now.
    pub fn after(limit: Duration) -> Self {
        Self::new(Instant::now() + limit, limit)
    }

    /// At `at`, set from `limit` (reported when it passes).
    pub fn new(at: Instant, limit: Duration) -> Self {
        Self { at, limit }
    }

    /// When the work must be done.
    pub fn at(self) -> Instant {
        self.at
    }

    /// The limit the deadline was set from.
    pub fn limit(self) -> Duration {
        self.limit
    }

    /// Awaits `work` until the deadline; once it passes, `timed_out(limit)` instead, and `work`
    /// has been dropped, with whatever it held: a transaction it had open is rolled back when
    /// its connection is closed or returned.
    ///
    /// # Errors
    ///
    /// `work`'s error, or `timed_out(limit)` when the deadline passed first.
    pub async fn bound<T, E>(
        self,
        work: impl Future<Output = Result<T, E>>,
        timed_out: impl FnOnce(Duration) -> E,
    ) -> Result<T, E> {
        match tokio::time::timeout_at(self.at, work).await {
            Ok(done) => done,
            Err(_) => Err(timed_out(self.limit)),
        }
    }
}
