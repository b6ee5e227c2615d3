//! The retries' clock, shared by the HTTP middleware and the gRPC caller: which attempt this
//! is, how long to wait before the next, and whether the budget allows it.

use std::time::Duration;

use tokio::time::Instant;

use crate::RetryPolicy;

/// Which attempt of a logical request (or call) this is, when it started and how long was
/// waited before it, by the clock the time budget is checked against.
///
/// The HTTP middleware sets it as a request extension before each attempt, for a middleware
/// after it (logging, tracing) to read; the gRPC caller sets it in each attempt's
/// `tonic::Request` extensions, for the closure that sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first attempt, 2 for the first retry, and so on.
    pub number: u32,
    /// When the attempt started (Tokio's clock, which a paused test runtime controls): never
    /// later than the policy's budget after the first.
    pub started: Instant,
    /// The wait asked before this attempt (zero for the first): the policy's backoff, or the
    /// server's own (`Retry-After`, `grpc-retry-pushback-ms`) if longer.
    pub waited: Duration,
}

/// The attempts of one logical request under a [`RetryPolicy`].
#[derive(Debug)]
pub(crate) struct Schedule<'a> {
    policy: &'a RetryPolicy,
    first: Instant,
    current: Attempt,
}

impl<'a> Schedule<'a> {
    /// The first attempt starts now.
    pub(crate) fn start(policy: &'a RetryPolicy) -> Self {
        let now = Instant::now();
        Self {
            policy,
            first: now,
            current: Attempt {
                number: 1,
                started: now,
                waited: Duration::ZERO,
            },
        }
    }

    /// The attempt about to be made.
    pub(crate) fn attempt(&self) -> Attempt {
        self.current
    }

    /// The wait before another attempt, after one whose outcome is worth another and whose
    /// server asked to wait `asked`; `None` when there is no other: the attempts are used up,
    /// or the wait would end past the budget.
    pub(crate) fn next_wait(&self, asked: Option<Duration>) -> Option<Duration> {
        if self.current.number >= self.policy.max_attempts() {
            return None;
        }
        let wait = self
            .policy
            .delay(self.current.number)
            .max(asked.unwrap_or_default());
        let ends = self.first.elapsed().checked_add(wait)?;
        (ends <= self.policy.budget()).then_some(wait)
    }

    /// Waits `wait` (from [`Schedule::next_wait`]) and moves on to the next attempt; `false`
    /// when the timer woke past the budget: no attempt starts then.
    pub(crate) async fn wait(&mut self, wait: Duration) -> bool {
        tokio::time::sleep(wait).await;
        // One reading of the clock both decides and dates the attempt.
        let now = Instant::now();
        if now.duration_since(self.first) > self.policy.budget() {
            return false;
        }
        self.current = Attempt {
            number: self.current.number + 1,
            started: now,
            waited: wait,
        };
        true
    }
}
