//! How the loop paces a task: the idle wait, the backoff, the housekeeping.

use std::time::Duration;

/// The pace of a task's loop; [`Schedule::new`] takes the idle wait, the rest is optional.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    idle: Duration,
    backoff: Option<(Duration, Duration)>,
    housekeeping: Option<Duration>,
    interrupt: bool,
}

impl Schedule {
    /// A loop that waits `idle` after a pass that had nothing more to do ([`Next::Idle`]), and
    /// as long after a failed pass; no housekeeping; a cancellation cuts a pass short.
    ///
    /// [`Next::Idle`]: crate::Next::Idle
    pub fn new(idle: Duration) -> Self {
        Self {
            idle,
            backoff: None,
            housekeeping: None,
            interrupt: true,
        }
    }

    /// Failed passes wait a [`Backoff`](crate::Backoff) step instead: about `first`, doubling
    /// up to `cap`, with jitter.
    #[must_use]
    pub fn with_backoff(mut self, first: Duration, cap: Duration) -> Self {
        self.backoff = Some((first, cap));
        self
    }

    /// Runs [`Work::housekeep`](crate::Work::housekeep) before the first pass and then at
    /// most every `every`, looked at before each pass (so that a task that always has work does
    /// it too).
    #[must_use]
    pub fn with_housekeeping(mut self, every: Duration) -> Self {
        self.housekeeping = Some(every);
        self
    }

    /// Whether a cancellation cuts a pass short (`true`, the default) or lets it finish: a pass
    /// that must not stop half-way (a consumer settling its message) races the waits it may cut
    /// against [`PassContext::shutdown`](crate::PassContext::shutdown) itself.
    #[must_use]
    pub fn with_interrupt(mut self, interrupt: bool) -> Self {
        self.interrupt = interrupt;
        self
    }

    /// The wait after an idle pass.
    pub fn idle(&self) -> Duration {
        self.idle
    }

    /// The first and the longest wait after failed passes; `None`: they wait
    /// [`Schedule::idle`].
    pub fn backoff(&self) -> Option<(Duration, Duration)> {
        self.backoff
    }

    /// How often the housekeeping runs, if it does.
    pub fn housekeeping(&self) -> Option<Duration> {
        self.housekeeping
    }

    /// Whether a cancellation cuts a pass short.
    pub fn interrupt(&self) -> bool {
        self.interrupt
    }
}
