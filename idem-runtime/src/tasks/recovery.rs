//! The recovery of abandoned claims: its options, its report, its task.

use std::{sync::Arc, time::Duration};

use idem_task::{Next, PassContext, Schedule, TaskHandle, Work};
use tokio_util::sync::CancellationToken;

use super::{AbandonedClaim, RecoveryHook, Verdict};
use crate::{
    backend::Backend,
    record::{Abandoned, Completion, RowOf, fresh_token},
    steps::Steps,
    store::Store,
};

/// How a spawned [`Recovery`] works: how often it looks for abandoned claims, how many it
/// takes per pass, and after how many rounds it gives up on one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecoveryOptions {
    interval: Duration,
    limit: u32,
    max_attempts: u32,
}

impl Default for RecoveryOptions {
    /// A pass every 10 s, of at most 100 claims; a claim parked after 20 rounds.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            limit: 100,
            max_attempts: 20,
        }
    }
}

impl RecoveryOptions {
    /// Sets [`RecoveryOptions::interval`].
    #[must_use]
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Sets [`RecoveryOptions::limit`] (at least 1).
    #[must_use]
    pub fn with_limit(mut self, limit: u32) -> Self {
        self.limit = limit.max(1);
        self
    }

    /// Sets [`RecoveryOptions::max_attempts`] (at least 1).
    #[must_use]
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// How many rounds the hook gets at one claim: once it has answered [`Verdict::Keep`] or
    /// [`Verdict::Failed`] that many times, the claim is parked. A parked claim waits for a
    /// person: no retry takes it over (a retry is answered 500, problem type `claimparked`)
    /// and no pass hands it to the hook again, until an operator resumes it (`idem resume`, or
    /// [`Store::resume_parked`]) or abandons it (`idem abandon`, [`Store::abandon_parked`]).
    /// The count goes on across passes and processes (it is kept on the key's row), and
    /// starts again when the claim is resumed. Default 20: with the 60 s the recovery holds a
    /// claim while its hook decides, about twenty minutes of trying.
    ///
    /// [`Verdict::Keep`]: super::Verdict::Keep
    /// [`Verdict::Failed`]: super::Verdict::Failed
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The wait between the end of one pass and the next. Default 10 s.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The most claims one pass hands to the hook. Default 100.
    pub fn limit(&self) -> u32 {
        self.limit
    }
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
    /// Claims the hook left for a later pass ([`Verdict::Keep`], [`Verdict::Failed`]), parked
    /// ones not counted.
    ///
    /// [`Verdict::Keep`]: super::Verdict::Keep
    /// [`Verdict::Failed`]: super::Verdict::Failed
    pub kept: u64,
    /// Claims parked by this pass: the hook did not settle them in
    /// [`RecoveryOptions::max_attempts`] rounds.
    pub parked: u64,
    /// Age of the oldest claim found.
    pub oldest: Duration,
}

/// The recovery of abandoned claims as a background task: [`Store::recover_abandoned`] with
/// its hook at once, then every [`RecoveryOptions::interval`].
pub struct Recovery<DB: Backend, H> {
    store: Store<DB>,
    hook: Arc<H>,
    options: RecoveryOptions,
}

impl<DB: Backend, H> std::fmt::Debug for Recovery<DB, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recovery")
            .field("store", &self.store)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, H: RecoveryHook<DB>> Recovery<DB, H> {
    /// The recovery of `store`'s abandoned claims, decided by `hook`.
    pub fn new(store: Store<DB>, hook: H, options: RecoveryOptions) -> Self {
        Self {
            store,
            hook: Arc::new(hook),
            options,
        }
    }

    /// Runs one pass now (a cron job, a test): [`Store::recover_abandoned`] with the hook and
    /// [`RecoveryOptions::limit`].
    ///
    /// # Errors
    ///
    /// As [`Store::recover_abandoned`].
    pub async fn pass(&self) -> Result<RecoveryReport, crate::error::Error> {
        let report = self
            .store
            .recover_abandoned(&*self.hook, &self.options)
            .await?;
        // Counts, not this pass's events: an alert on them fires while any claim waits for a
        // person (or for nobody), and resolves when the last one is dealt with.
        let counts = self.store.claim_counts().await?;
        metrics::gauge!("idem_parked_claims").set(counts.parked as f64);
        metrics::gauge!("idem_claims_past_lease").set(counts.past_lease as f64);
        Ok(report)
    }

    /// Runs a pass now and then every [`RecoveryOptions::interval`] until `shutdown` is
    /// cancelled, which stops it between passes or cuts a pass short. A failed pass is retried
    /// after the same wait; a run of failures gives one warning.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(self, shutdown: CancellationToken) -> TaskHandle {
        // Exported from the start, at zero: an alert on the increase of a series that appears
        // only with its first event (the first recovery, the first takeover) would never fire.
        for result in ["released", "completed", "kept", "parked"] {
            metrics::counter!("idem_recovered_total", "result" => result).increment(0);
        }
        metrics::counter!("idem_takeovers_total").increment(0);
        let schedule = Schedule::new(self.options.interval);
        idem_task::spawn(self, schedule, shutdown)
    }
}

impl<DB: Backend, H: RecoveryHook<DB>> Work for Recovery<DB, H> {
    type Error = crate::error::Error;

    async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, crate::error::Error> {
        Recovery::pass(self).await.map(|_| Next::Idle)
    }

    fn outage_started(&self, error: &crate::error::Error) {
        match error.setup_hint() {
            Some(hint) => tracing::error!(
                %error,
                "recovering idempotency claims failed: {hint}; retrying later"
            ),
            None => tracing::warn!(%error, "recovering idempotency claims failed; retrying later"),
        }
    }

    fn still_failing(&self, error: &crate::error::Error, wait: Duration) {
        tracing::debug!(%error, ?wait, "recovering idempotency claims still fails");
    }

    fn outage_ended(&self, _outage: usize) {
        tracing::info!("recovering idempotency claims works again");
    }
}

/// How long the recovery holds a claim while its hook decides.
const RECOVERY_LEASE: Duration = Duration::from_secs(60);

impl<DB: Backend> Store<DB> {
    /// Finds claims whose lease ran out and hands each to `hook`, up to
    /// [`RecoveryOptions::limit`] per pass; parks a claim the hook did not settle in
    /// [`RecoveryOptions::max_attempts`] rounds.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::error::Error::Database) or [`Error::TimedOut`](crate::error::Error::TimedOut)
    /// while finding or settling claims, or
    /// [`Error::CorruptRow`](crate::error::Error::CorruptRow) for a claim idem did not write; claims
    /// not settled stay reclaimed until the recovery lease (60 s) runs out, then are found
    /// again.
    pub async fn recover_abandoned<H: RecoveryHook<DB>>(
        &self,
        hook: &H,
        options: &RecoveryOptions,
    ) -> Result<RecoveryReport, crate::error::Error> {
        let limit = options.limit;
        let token = fresh_token();
        let claims = {
            let deadline = self.deadline();
            let _permit = self.write_permit(deadline).await?;
            self.on_connection(deadline, async |conn| {
                DB::reclaim_abandoned(
                    conn,
                    i64::from(limit.max(1)),
                    RECOVERY_LEASE,
                    token,
                    hook.handles_steps(),
                )
                .await
            })
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
            attempts,
        } in claims
        {
            report.oldest = report.oldest.max(age);
            let steps = match self.opened_steps(steps, &key) {
                Ok(steps) => steps,
                Err(unopened) => {
                    // Neither settled nor run again: parked for a person at once (kept past its
                    // expiry, its retries answered 500), until the key is given back and the
                    // claim resumed.
                    tracing::error!(scope = %key.scope, key_id = %key.log_id(), %method, %path, sealed_with = unopened.key_id(), %unopened, "an abandoned claim's recorded steps cannot be opened: parked; give the service the encryption key they were sealed with, then resume it");
                    let reason = unopened.to_string();
                    if self
                        .unsettled_round(&key, token, Some(&reason), true)
                        .await?
                    {
                        report.parked += 1;
                    }
                    continue;
                }
            };
            let claim = AbandonedClaim {
                scope: key.scope.clone(),
                method: method.clone(),
                path: path.clone(),
                age,
                steps: Steps::new(self.clone(), key.clone(), token, steps),
            };
            match hook.recover(claim).await {
                Verdict::Release => {
                    // A claim taken over meanwhile is no longer the recovery's to release.
                    if self.release(&key, token).await? {
                        report.released += 1;
                        metrics::counter!("idem_recovered_total", "result" => "released")
                            .increment(1);
                    }
                }
                Verdict::Complete(response) => {
                    let completion = Completion {
                        row: RowOf {
                            key: &key,
                            method: &method,
                            path: &path,
                            fingerprint: &fingerprint,
                        },
                        response: &response,
                        mark: None,
                    };
                    // The row keeps the expiry its claim was given.
                    if self.complete_started(&completion, token, None).await? {
                        report.completed += 1;
                        metrics::counter!("idem_recovered_total", "result" => "completed")
                            .increment(1);
                    }
                }
                verdict @ (Verdict::Keep | Verdict::Failed(_)) => {
                    let reason = match &verdict {
                        Verdict::Failed(reason) => Some(reason.as_str()),
                        _ => None,
                    };
                    let park = attempts >= u64::from(options.max_attempts);
                    let owned = if park || reason.is_some() {
                        self.unsettled_round(&key, token, reason, park).await?
                    } else {
                        true
                    };
                    if park && owned {
                        report.parked += 1;
                        metrics::counter!("idem_recovered_total", "result" => "parked")
                            .increment(1);
                        tracing::error!(
                            scope = %key.scope,
                            method = %method,
                            path = %path,
                            attempts,
                            reason = reason.unwrap_or("kept"),
                            "the recovery gave up on an abandoned claim: parked until an \
                             operator resumes or abandons it (idem dead)"
                        );
                    } else if !park {
                        report.kept += 1;
                        metrics::counter!("idem_recovered_total", "result" => "kept").increment(1);
                    }
                }
            }
        }
        if report.found > 0 {
            tracing::warn!(
                found = report.found,
                released = report.released,
                completed = report.completed,
                kept = report.kept,
                parked = report.parked,
                oldest_secs = report.oldest.as_secs(),
                "recovered abandoned idempotency claims"
            );
        }
        Ok(report)
    }
}
