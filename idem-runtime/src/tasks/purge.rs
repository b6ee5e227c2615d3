//! The purge of expired keys: its options, its report, its task.

use std::time::{Duration, Instant};

use idem_task::{Next, PassContext, Schedule, TaskHandle, Work};
use tokio_util::sync::CancellationToken;

use crate::{backend::Backend, store::Store};

/// How a purge paces itself: rows per statement, the pause between statements, and how often
/// a spawned [`Purge`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeOptions {
    batch_size: u32,
    pause: Duration,
    interval: Duration,
}

impl Default for PurgeOptions {
    /// 1000 rows per statement, 10 ms between statements, a pass every 60 s.
    fn default() -> Self {
        Self {
            batch_size: 1000,
            pause: Duration::from_millis(10),
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

    /// Sets [`PurgeOptions::pause`].
    #[must_use]
    pub fn with_pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
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

    /// Pause between statements, leaving the database to live requests. Default 10 ms.
    pub fn pause(&self) -> Duration {
        self.pause
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
    pub async fn pass(&self) -> Result<PurgeReport, crate::Error> {
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
    type Error = crate::Error;

    async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, crate::Error> {
        Purge::pass(self).await.map(|_| Next::Idle)
    }

    fn outage_started(&self, error: &crate::Error) {
        match error.setup_hint() {
            Some(hint) => {
                tracing::error!(%error, "purging idempotency keys failed: {hint}; retrying later");
            }
            None => tracing::warn!(%error, "purging idempotency keys failed; retrying later"),
        }
    }

    fn still_failing(&self, error: &crate::Error, wait: Duration) {
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
    /// [`Error::Database`](crate::Error::Database) on the first database error, or
    /// [`Error::TimedOut`](crate::Error::TimedOut) when a batch is not done within the store's
    /// [`database_timeout`](crate::StoreOptions::database_timeout); the batches before it stay
    /// deleted.
    pub async fn purge_expired(&self, options: PurgeOptions) -> Result<PurgeReport, crate::Error> {
        let started = Instant::now();
        let batch = i64::from(options.batch_size.max(1));
        let mut report = PurgeReport::default();
        let mut from = None;
        loop {
            let purged = {
                let deadline = self.deadline();
                let _permit = self.write_permit(deadline).await?;
                self.on_connection(deadline, async |conn| {
                    DB::purge_batch(conn, batch, from).await
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
            tokio::time::sleep(options.pause).await;
        }
        report.elapsed = started.elapsed();
        tracing::info!(
            rows = report.rows,
            batches = report.batches,
            elapsed_ms = report.elapsed.as_millis() as u64,
            "purged expired idempotency keys"
        );
        Ok(report)
    }
}
