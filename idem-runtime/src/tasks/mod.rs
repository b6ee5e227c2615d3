//! Background tasks: the purge of expired keys ([`Purge`]) and the recovery of abandoned
//! claims ([`Recovery`]).
//!
//! Each is built from the store and its options, and either runs one pass on demand
//! ([`Purge::pass`], [`Recovery::pass`], for a cron job or a test) or is spawned:
//! `spawn(shutdown)` returns a [`TaskHandle`], and the task stops when the
//! [`CancellationToken`](crate::CancellationToken) is cancelled (cancel the one that triggers
//! the server's graceful shutdown) or [`TaskHandle::stop`] is called.
//!
//! ```no_run
//! # async fn demo(store: idem_runtime::Store<sqlx::Postgres>) {
//! use idem_runtime::{CancellationToken, tasks::{Purge, PurgeOptions, Recovery, RecoveryOptions, ReleaseAbandoned}};
//!
//! let shutdown = CancellationToken::new();
//! let purge = Purge::new(store.clone(), PurgeOptions::default()).spawn(shutdown.clone());
//! let recovery =
//!     Recovery::new(store, ReleaseAbandoned, RecoveryOptions::default()).spawn(shutdown.clone());
//! // ... serve until the shutdown, then:
//! shutdown.cancel();
//! purge.await.ok();
//! recovery.await.ok();
//! # }
//! ```

use std::{future::Future, time::Duration};

pub use idem_task::TaskHandle;

pub use crate::{record::StoredResponse, replay::CaptureError};
pub use pacing::Pacing;
pub use purge::{Purge, PurgeOptions, PurgeReport};
pub use recovery::{Recovery, RecoveryOptions, RecoveryReport};

use crate::{backend::Backend, context::IdempotencyContext, steps::Steps};

mod pacing;
mod purge;
mod recovery;

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
    /// work before [`Verdict::Complete`]. Steps recorded here are kept when the hook answers
    /// [`Verdict::Keep`], so that a retry resumes after them.
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

/// What a [`RecoveryHook`] decides for an abandoned claim.
#[derive(Debug, Clone)]
pub enum Verdict {
    /// Delete the claim, and its recorded steps: the next retry runs the handler from the
    /// start. A hook releases a claim with steps only once it has undone them (compensation
    /// steps through [`AbandonedClaim::steps`]).
    Release,
    /// Complete the key with this response: retries replay it.
    Complete(StoredResponse),
    /// Leave the claim for a later pass (its lease is renewed meanwhile).
    Keep,
    /// The hook could not settle the claim (the downstream service did not answer, a
    /// compensation failed): left for a later pass as with [`Verdict::Keep`], with this reason
    /// kept on the claim for the person who looks at it if the recovery gives up on it
    /// ([`RecoveryOptions::max_attempts`], `idem dead`).
    Failed(String),
}

/// Decides the fate of abandoned claims; run by a [`Recovery`].
///
/// ```
/// use idem_runtime::{Backend, tasks::{AbandonedClaim, RecoveryHook, Verdict}};
///
/// struct AskTheProcessor;
///
/// impl<DB: Backend> RecoveryHook<DB> for AskTheProcessor {
///     async fn recover(&self, claim: AbandonedClaim<DB>) -> Verdict {
///         let _downstream_key = claim.context().derive("charge");
///         // look the charge up downstream with that key; complete or release accordingly
///         Verdict::Release
///     }
/// }
/// ```
pub trait RecoveryHook<DB: Backend>: Send + Sync + 'static {
    /// Decides what happens to `claim`.
    fn recover(&self, claim: AbandonedClaim<DB>) -> impl Future<Output = Verdict> + Send;

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
    async fn recover(&self, _claim: AbandonedClaim<DB>) -> Verdict {
        Verdict::Release
    }

    fn handles_steps(&self) -> bool {
        false
    }
}
