//! The one loop of every background task, and what a task gives it.

use std::{fmt::Display, future::Future, time::Duration};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{Backoff, Schedule, TaskHandle};

/// What a successful pass asks of the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// More work is ready: pass again at once.
    Busy,
    /// Nothing more to do for now: wait [`Schedule::idle`].
    Idle,
}

/// What the loop lends a pass: the shutdown token, and a way to end an outage mid-pass.
#[derive(Debug)]
pub struct PassContext<'a> {
    shutdown: &'a CancellationToken,
    recovered: Vec<usize>,
}

impl PassContext<'_> {
    /// The task's token, for a pass the loop does not cut short
    /// ([`Schedule::with_interrupt`]) to race the waits it may cut.
    pub fn shutdown(&self) -> &CancellationToken {
        self.shutdown
    }

    /// Ends outage `outage` (see [`Work::outage`]) now, whatever the pass's result: a consumer
    /// that received a message has its broker back even if the database then fails.
    pub fn recovered(&mut self, outage: usize) {
        self.recovered.push(outage);
    }
}

/// One background task, as the loop of [`run`] drives it: a pass, the wording of its reports,
/// and an optional housekeeping step.
///
/// The loop decides when to report: [`Work::outage_started`] once, when a pass fails after a
/// success (or first of all), [`Work::still_failing`] for each failure after it, and
/// [`Work::outage_ended`] once, at the next success. The defaults log a warning, a debug line
/// and an info line; a task overrides them to say what it is.
pub trait Work: Send + 'static {
    /// Why a pass failed.
    type Error: Display + Send;

    /// Does one pass of the task's work.
    ///
    /// # Errors
    ///
    /// When the pass failed: the loop waits a backoff step and passes again.
    fn pass(
        &mut self,
        cx: &mut PassContext<'_>,
    ) -> impl Future<Output = Result<Next, Self::Error>> + Send;

    /// Which outage `error` belongs to (default `0`): each has a backoff and reports of its
    /// own, as a consumer's broker and database do.
    fn outage(&self, error: &Self::Error) -> usize {
        let _ = error;
        0
    }

    /// The task's housekeeping, every [`Schedule::housekeeping`] (the purge of old rows);
    /// nothing by default. Its errors are the task's to log.
    fn housekeep(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Runs before each wait, idle or backing off (the relay reports its backlog there);
    /// nothing by default.
    fn before_wait(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Reports the failure that starts an outage.
    fn outage_started(&self, error: &Self::Error) {
        tracing::warn!(%error, "a background task cannot go on; it retries with backoff");
    }

    /// Reports a failure within an outage, and the wait before the next attempt.
    fn still_failing(&self, error: &Self::Error, wait: Duration) {
        tracing::debug!(%error, ?wait, "a background task still cannot go on");
    }

    /// Reports the success that ends outage `outage`.
    fn outage_ended(&self, outage: usize) {
        tracing::info!(outage, "a background task goes on again");
    }
}

/// Runs `work` until `shutdown` is cancelled: the housekeeping when it is due, a pass, then
/// the wait the pass asked for ([`Next::Busy`]: none, [`Next::Idle`]: [`Schedule::idle`], a
/// failure: a backoff step). The cancellation is looked at between passes, during the
/// housekeeping and the waits, and during a pass unless the schedule says otherwise.
pub async fn run<W: Work>(mut work: W, schedule: Schedule, shutdown: CancellationToken) {
    let (first, cap) = schedule
        .backoff()
        .unwrap_or((schedule.idle(), schedule.idle()));
    let mut outages: Vec<Backoff> = Vec::new();
    let mut next_housekeeping = Instant::now();
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        // Looked at before every pass, so that a task that never runs out of work does it too.
        if let Some(every) = schedule.housekeeping()
            && Instant::now() >= next_housekeeping
        {
            next_housekeeping = Instant::now() + every;
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = work.housekeep() => {}
            }
        }
        let mut cx = PassContext {
            shutdown: &shutdown,
            recovered: Vec::new(),
        };
        let passed = if schedule.interrupt() {
            tokio::select! {
                () = shutdown.cancelled() => return,
                passed = work.pass(&mut cx) => passed,
            }
        } else {
            work.pass(&mut cx).await
        };
        if shutdown.is_cancelled() {
            return;
        }
        for outage in cx.recovered {
            if outages.get_mut(outage).is_some_and(Backoff::succeeded) {
                work.outage_ended(outage);
            }
        }
        let wait = match passed {
            Ok(next) => {
                for (outage, backoff) in outages.iter_mut().enumerate() {
                    if backoff.succeeded() {
                        work.outage_ended(outage);
                    }
                }
                match next {
                    Next::Busy => None,
                    Next::Idle => Some(schedule.idle()),
                }
            }
            Err(error) => {
                let outage = work.outage(&error);
                if outages.len() <= outage {
                    outages.resize_with(outage + 1, || Backoff::new(first, cap));
                }
                let (backoff, started) = outages[outage].failed();
                let wait = if schedule.backoff().is_some() {
                    backoff
                } else {
                    schedule.idle()
                };
                if started {
                    work.outage_started(&error);
                } else {
                    work.still_failing(&error, wait);
                }
                Some(wait)
            }
        };
        if let Some(wait) = wait {
            work.before_wait().await;
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        } else {
            // A busy task still lets the others of its runtime thread run.
            tokio::task::yield_now().await;
        }
    }
}

/// Spawns [`run`] on the current runtime, stopped by a child token of `shutdown`.
///
/// # Panics
///
/// Outside a tokio runtime.
pub fn spawn<W: Work>(work: W, schedule: Schedule, shutdown: CancellationToken) -> TaskHandle {
    TaskHandle::spawn(&shutdown, move |stop| run(work, schedule, stop))
}
