//! The purge of expired keys: its options, its report, its task.

use std::time::{Duration, Instant};

use idem_task::{Next, PassContext, Schedule, TaskHandle, Work};
use tokio_util::sync::CancellationToken;

use super::pacing::{Batch, Pacer, Pacing};
use crate::{backend::Backend, store::Store};

/// How a purge paces itself: rows per statement, the pauses between statements, and how often
/// a spawned [`Purge`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeOptions {
    batch_size: u32,
    pacing: Pacing,
    interval: Duration,
}

impl Default for PurgeOptions {
    /// 1000 rows per statement, [`Pacing::Adaptive`], a pass every 60 s.
    fn default() -> Self {
        Self {
            batch_size: 1000,
            pacing: Pacing::Adaptive,
            interval: Duration::from_secs(60),
        }
    }
}

impl PurgeOptions {
    /// Sets [`PurgeOptions::batch_size`] (at least 1).
    #[must_use]
    pub fn with_batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Sets [`PurgeOptions::pacing`].
    #[must_use]
    pub fn with_pacing(mut self, pacing: Pacing) -> Self {
        self.pacing = pacing;
        self
    }

    /// A fixed pause between statements: [`Pacing::Fixed`].
    #[must_use]
    pub fn with_pause(self, pause: Duration) -> Self {
        self.with_pacing(Pacing::Fixed(pause))
    }

    /// Sets [`PurgeOptions::interval`].
    #[must_use]
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Rows per statement; each statement is its own short transaction. Default 1000.
    pub fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// How the pauses between statements, which leave the database to live requests, are
    /// chosen. Default [`Pacing::Adaptive`].
    pub fn pacing(&self) -> Pacing {
        self.pacing
    }

    /// The wait between the end of one pass of a spawned [`Purge`] and the next. Default 60 s.
    pub fn interval(&self) -> Duration {
        self.interval
    }
}

/// What one purge pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Rows deleted.
    pub rows: u64,
    /// Statements run (each deletes at most the batch size, in its own short transaction).
    pub batches: u64,
    /// Time the pass took.
    pub elapsed: Duration,
    /// Of that time, the pauses between statements.
    pub paused: Duration,
}

/// The purge of expired keys as a background task: [`Store::purge_expired`] at once, then
/// every [`PurgeOptions::interval`].
#[derive(Debug)]
pub struct Purge<DB: Backend> {
    store: Store<DB>,
    options: PurgeOptions,
}

// By hand: a derive would require `DB: Clone`, which no database type is.
impl<DB: Backend> Clone for Purge<DB> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            options: self.options,
        }
    }
}

impl<DB: Backend> Purge<DB> {
    /// The purge of `store`'s expired keys.
    pub fn new(store: Store<DB>, options: PurgeOptions) -> Self {
        Self { store, options }
    }

    /// Runs one pass now (a cron job, a test): [`Store::purge_expired`].
    ///
    /// # Errors
    ///
    /// As [`Store::purge_expired`].
    pub async fn pass(&self) -> Result<PurgeReport, crate::error::Error> {
        let report = self.store.purge_expired(self.options).await?;
        // When the last pass that deleted every expired key ended: a purge that stops keeping
        // up (passes that never end, or fail) or stops running leaves it behind the clock.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |since| since.as_secs_f64());
        metrics::gauge!("idem_purge_last_success_timestamp_seconds").set(now);
        Ok(report)
    }

    /// Runs a pass now and then every [`PurgeOptions::interval`] until `shutdown` is cancelled,
    /// which stops it between passes or cuts a pass short (each statement is its own
    /// transaction, so nothing is half-done). A failed pass is retried after the same wait; a
    /// run of failures gives one warning.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(self, shutdown: CancellationToken) -> TaskHandle {
        // Exported from the start, at zero, so that an alert on its increase can fire.
        metrics::counter!("idem_purge_deleted_total").increment(0);
        let schedule = Schedule::new(self.options.interval);
        idem_task::spawn(self, schedule, shutdown)
    }
}

impl<DB: Backend> Work for Purge<DB> {
    type Error = crate::error::Error;

    async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, crate::error::Error> {
        Purge::pass(self).await.map(|_| Next::Idle)
    }

    fn outage_started(&self, error: &crate::error::Error) {
        match error.setup_hint() {
            Some(hint) => {
                tracing::error!(%error, "purging idempotency keys failed: {hint}; retrying later");
            }
            None => tracing::warn!(%error, "purging idempotency keys failed; retrying later"),
        }
    }

    fn still_failing(&self, error: &crate::error::Error, wait: Duration) {
        tracing::debug!(%error, ?wait, "purging idempotency keys still fails");
    }

    fn outage_ended(&self, _outage: usize) {
        tracing::info!("purging idempotency keys works again");
    }
}

impl<DB: Backend> Store<DB> {
    /// Deletes every key past its expiry, in batches, oldest first, each in its own short
    /// statement that skips rows live requests hold, pausing between batches. A skipped row is
    /// left to the next pass. Reports through `tracing`.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::error::Error::Database) on the first database error, or
    /// [`Error::TimedOut`](crate::error::Error::TimedOut) when a batch is not done within the store's
    /// [`database_timeout`](crate::store::StoreOptions::database_timeout); the batches before it stay
    /// deleted.
    pub async fn purge_expired(
        &self,
        options: PurgeOptions,
    ) -> Result<PurgeReport, crate::error::Error> {
        let started = Instant::now();
        let batch = i64::from(options.batch_size.max(1));
        let mut report = PurgeReport::default();
        let mut from = None;
        let mut pacer = Pacer::default();
        let adaptive = options.pacing == Pacing::Adaptive;
        let mut refused_activity = false;
        loop {
            let (purged, took, others_active) = {
                let deadline = self.deadline();
                let _permit = self.write_permit(deadline).await?;
                self.on_connection(deadline, async |conn| {
                    let began = Instant::now();
                    let purged = DB::purge_batch(conn, batch, from).await?;
                    let took = began.elapsed();
                    // Sampled only when the pause depends on it, and only if more is to come.
                    let others = if adaptive && purged.rows == batch as u64 {
                        // A database that refuses the question (a managed server hiding its
                        // sessions) leaves the pacing to the statements' times.
                        match DB::others_active(conn).await {
                            Ok(others) => others,
                            Err(error) => {
                                if !refused_activity {
                                    tracing::warn!(%error, "the database does not say what else runs on it; the purge paces itself by its statements' times");
                                    refused_activity = true;
                                }
                                None
                            }
                        }
                    } else {
                        None
                    };
                    Ok::<_, crate::error::Error>((purged, took, others))
                })
                .await?
            };
            let rows = purged.rows;
            from = purged.last.or(from);
            report.rows += rows;
            metrics::counter!("idem_purge_deleted_total").increment(rows);
            report.batches += 1;
            if rows < batch as u64 {
                break;
            }
            // Let live requests through between batches.
            let pause = match options.pacing {
                Pacing::Fixed(pause) => pause,
                Pacing::Adaptive => pacer.next(Batch {
                    took,
                    rows,
                    full: true,
                    others_active,
                }),
            };
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
                report.paused += pause;
            }
        }
        report.elapsed = started.elapsed();
        tracing::info!(
            rows = report.rows,
            batches = report.batches,
            elapsed_ms = report.elapsed.as_millis() as u64,
            paused_ms = report.paused.as_millis() as u64,
            "purged expired idempotency keys"
        );
        Ok(report)
    }
}
