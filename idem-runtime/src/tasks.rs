//! Background tasks: the purge of expired keys and the recovery of abandoned claims.
//!
//! Both run on demand (`Store::purge_expired`, `Store::recover_abandoned`, for a cron job or a
//! test) or in the background (`spawn_purge`, `spawn_recovery`), stopped by a
//! [`CancellationToken`]: cancel the same token that triggers the server's graceful shutdown.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use crate::{record::StoredResponse, replay::CaptureError};

use crate::{
    IdempotencyContext, Steps,
    backend::Backend,
    record::{Abandoned, Completion, fresh_token},
    store::Store,
};

/// How a purge pass paces itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeOptions {
    /// Rows per statement; each statement is its own short transaction. Default 1000.
    pub batch_size: u32,
    /// Pause between statements, leaving the database to live requests. Default 10 ms.
    pub pause: Duration,
}

impl Default for PurgeOptions {
    fn default() -> Self {
        Self {
            batch_size: 1000,
            pause: Duration::from_millis(10),
        }
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

/// What one recovery pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Abandoned claims found (their lease had run out).
    pub found: u64,
    /// Claims released: a retry will run the handler again.
    pub released: u64,
    /// Claims completed with a response from the hook: a retry replays it.
    pub completed: u64,
    /// Claims the hook left for a later pass.
    pub kept: u64,
    /// Age of the oldest claim found.
    pub oldest: Duration,
}

/// A claim whose handler never completed (a crash between the external call and the
/// completion), handed to a [`RecoveryHook`].
pub struct AbandonedClaim<DB: Backend> {
    /// The caller's scope (`""` for global keys).
    pub scope: String,
    /// Method of the request that claimed the key.
    pub method: String,
    /// Path and query of that request.
    pub path: String,
    /// Time since the claim was taken.
    pub age: Duration,
    steps: Steps<DB>,
}

impl<DB: Backend> AbandonedClaim<DB> {
    /// The handler's context: [`IdempotencyContext::derive`] gives the same downstream keys the
    /// handler used, to ask the downstream service whether the side effect happened.
    pub fn context(&self) -> &IdempotencyContext {
        self.steps.context()
    }

    /// The steps the handler recorded ([`Steps::recovery_point`], [`Steps::output`]), and the
    /// means to run more of them on the recovery's behalf: a compensation, or the rest of the
    /// work before [`Recovery::Complete`]. Steps recorded here are kept when the hook answers
    /// [`Recovery::Keep`], so that a retry resumes after them.
    pub fn steps(&self) -> &Steps<DB> {
        &self.steps
    }
}

impl<DB: Backend> std::fmt::Debug for AbandonedClaim<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbandonedClaim")
            .field("scope", &self.scope)
            .field("method", &self.method)
            .field("path", &self.path)
            .field("age", &self.age)
            .field("steps", &self.steps)
            .finish()
    }
}

/// What to do with an abandoned claim.
#[derive(Debug, Clone)]
pub enum Recovery {
    /// Delete the claim, and its recorded steps: the next retry runs the handler from the
    /// start. A hook releases a claim with steps only once it has undone them (compensation
    /// steps through [`AbandonedClaim::steps`]).
    Release,
    /// Complete the key with this response: retries replay it.
    Complete(StoredResponse),
    /// Leave the claim for a later pass (the lease is renewed meanwhile).
    Keep,
}

/// Decides the fate of abandoned claims; registered with [`spawn_recovery`].
///
/// ```
/// use idem_runtime::{Backend, tasks::{AbandonedClaim, Recovery, RecoveryHook}};
///
/// struct AskTheProcessor;
///
/// impl<DB: Backend> RecoveryHook<DB> for AskTheProcessor {
///     async fn recover(&self, claim: AbandonedClaim<DB>) -> Recovery {
///         let _downstream_key = claim.context().derive("charge");
///         // look the charge up downstream with that key; complete or release accordingly
///         Recovery::Release
///     }
/// }
/// ```
pub trait RecoveryHook<DB: Backend>: Send + Sync + 'static {
    /// Decides what happens to `claim`.
    fn recover(&self, claim: AbandonedClaim<DB>) -> impl Future<Output = Recovery> + Send;

    /// Whether the hook is handed claims with recorded steps (multi-step handlers); `true`
    /// unless the hook says otherwise. Claims it is not handed stay as they are: a retry
    /// resumes them, and they expire with their key.
    fn handles_steps(&self) -> bool {
        true
    }
}

/// The default hook: release every abandoned claim without recorded steps, so that retries run
/// the handler again (safe when the handler's downstream calls use derived keys). Claims with
/// recorded steps are left alone, for a retry to resume: only a hook of the application's own
/// knows how to undo or finish a multi-step handler's work.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReleaseAbandoned;

impl<DB: Backend> RecoveryHook<DB> for ReleaseAbandoned {
    async fn recover(&self, _claim: AbandonedClaim<DB>) -> Recovery {
        Recovery::Release
    }

    fn handles_steps(&self) -> bool {
        false
    }
}

/// How long the recovery holds a claim while its hook decides.
const RECOVERY_LEASE: Duration = Duration::from_secs(60);

impl<DB: Backend> Store<DB> {
    /// Deletes every key past its expiry, in batches, each in its own short statement that
    /// skips rows live requests hold, pausing between batches. Reports through `tracing`.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) on the first database error; the batches
    /// before it stay deleted.
    pub async fn purge_expired(&self, options: PurgeOptions) -> Result<PurgeReport, crate::Error> {
        let started = Instant::now();
        let batch = i64::from(options.batch_size.max(1));
        let mut report = PurgeReport::default();
        loop {
            let rows = {
                let _permit = self.write_permit().await;
                DB::purge_batch(self.pool(), batch).await?
            };
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

    /// Finds claims whose lease ran out and hands each to `hook`, up to `limit` per pass.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) while finding or settling claims, or
    /// [`Error::CorruptRow`](crate::Error::CorruptRow) for a claim idem did not write; claims
    /// not settled stay reclaimed until the recovery lease (60 s) runs out, then are found
    /// again.
    pub async fn recover_abandoned<H: RecoveryHook<DB>>(
        &self,
        hook: &H,
        limit: u32,
    ) -> Result<RecoveryReport, crate::Error> {
        let token = fresh_token();
        let claims = {
            let _permit = self.write_permit().await;
            DB::reclaim_abandoned(
                self.pool(),
                i64::from(limit.max(1)),
                RECOVERY_LEASE,
                token,
                hook.handles_steps(),
            )
            .await?
        };
        let mut report = RecoveryReport {
            found: claims.len() as u64,
            ..RecoveryReport::default()
        };
        for Abandoned {
            key,
            method,
            path,
            fingerprint,
            age,
            steps,
        } in claims
        {
            report.oldest = report.oldest.max(age);
            let claim = AbandonedClaim {
                scope: key.scope.clone(),
                method: method.clone(),
                path: path.clone(),
                age,
                steps: Steps::new(self.clone(), key.clone(), token, steps),
            };
            match hook.recover(claim).await {
                Recovery::Release => {
                    // A claim taken over meanwhile is no longer the recovery's to release.
                    if self.release(&key, token).await? {
                        report.released += 1;
                        metrics::counter!("idem_recovered_total", "result" => "released")
                            .increment(1);
                    }
                }
                Recovery::Complete(response) => {
                    let completion = Completion {
                        key: &key,
                        method: &method,
                        path: &path,
                        fingerprint: &fingerprint,
                        response: &response,
                        mark: None,
                    };
                    // The row keeps the expiry its claim was given.
                    if self.finish(&completion, token, None).await? {
                        report.completed += 1;
                        metrics::counter!("idem_recovered_total", "result" => "completed")
                            .increment(1);
                    }
                }
                Recovery::Keep => {
                    report.kept += 1;
                    metrics::counter!("idem_recovered_total", "result" => "kept").increment(1);
                }
            }
        }
        if report.found > 0 {
            tracing::warn!(
                found = report.found,
                released = report.released,
                completed = report.completed,
                kept = report.kept,
                oldest_secs = report.oldest.as_secs(),
                "recovered abandoned idempotency claims"
            );
        }
        Ok(report)
    }
}

/// Runs [`Store::purge_expired`] now and then every `every`, until `shutdown` is cancelled.
pub fn spawn_purge<DB: Backend>(
    store: Store<DB>,
    every: Duration,
    options: PurgeOptions,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    periodically(every, shutdown, move || {
        let store = store.clone();
        async move {
            if let Err(error) = store.purge_expired(options).await {
                tracing::warn!(%error, "purging idempotency keys failed; retrying later");
            }
        }
    })
}

/// Runs [`Store::recover_abandoned`] now and then every `every`, until `shutdown` is
/// cancelled.
pub fn spawn_recovery<DB: Backend, H: RecoveryHook<DB>>(
    store: Store<DB>,
    hook: H,
    every: Duration,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let hook = std::sync::Arc::new(hook);
    periodically(every, shutdown, move || {
        let (store, hook) = (store.clone(), std::sync::Arc::clone(&hook));
        async move {
            if let Err(error) = store.recover_abandoned(&*hook, 100).await {
                tracing::warn!(%error, "recovering idempotency claims failed; retrying later");
            }
        }
    })
}

/// Runs `pass` now and then every `every`; a cancellation stops it between passes or cuts a
/// pass short (each statement of a pass is its own transaction, so nothing is half-done).
fn periodically<F, Fut>(every: Duration, shutdown: CancellationToken, mut pass: F) -> JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = pass() => {}
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(every) => {}
            }
        }
    })
}
