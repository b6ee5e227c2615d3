//! Multi-step handlers: each step's output is recorded on the key as a recovery point, and a
//! retry resumes after the last recorded step.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
};

use axum::response::{IntoResponse, Response};
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    backend::Backend,
    context::IdempotencyContext,
    problem::ProblemKind,
    record::{KeyRef, RecordedStep},
    store::Store,
};

/// The steps of an external-mode handler: take it as a parameter (`steps: Steps<Postgres>`)
/// and run each part of the work through it.
///
/// - [`step`](Self::step) runs a **database step**: its writes and its recovery point commit in
///   one transaction, or neither does.
/// - [`call`](Self::call) runs an **external step** (a call to another service): the call runs,
///   then its result is recorded. It is given a key derived from (scope, key, step name): a
///   crash between the call and the record re-runs the call with the same key, and a downstream
///   service that honours idempotency keys executes it once.
///
/// A step whose output is recorded never runs again for that (scope, key) while the key
/// lives: a retry after a crash, after a 5xx that is not stored, or after the lease ran out
/// gets the recorded output back at once and goes on from there. A step that fails records
/// nothing. The recorded steps go with the key: when it expires, and when a recovery hook
/// answers [`Verdict::Release`](crate::tasks::Verdict::Release) (after undoing them).
/// Compensation (giving a reservation back when a charge is declined) is a step like any
/// other.
///
/// Steps run one at a time, in the order the handler reaches them; a name is used once per
/// handler. Every write of a recovery point checks that this request still owns the key: once
/// the lease ran out and another request took the key over, a step's writes roll back and it
/// fails with [`StepError::Lost`].
///
/// ```no_run
/// use idem_runtime::{StepError, Steps};
/// use sqlx::Postgres;
///
/// # async fn charge(_key: &str, _amount: i64) -> Result<String, StepError> { Ok(String::new()) }
/// async fn place_order(steps: Steps<Postgres>, sku: &str, quantity: i64) -> Result<String, StepError> {
///     // A step's output is recorded (as JSON) and given back on a retry: here, the stock left.
///     let _left: i64 = steps
///         .step("reserve", async |conn| {
///             sqlx::query_scalar("UPDATE stock SET units = units - $2 WHERE sku = $1 RETURNING units")
///                 .bind(sku)
///                 .bind(quantity)
///                 .fetch_one(&mut *conn)
///                 .await
///                 .map_err(StepError::database)
///         })
///         .await?;
///     let charge: String = steps
///         .call("charge", async |key| charge(key, quantity * 1000).await)
///         .await?;
///     Ok(charge)
/// }
/// ```
pub struct Steps<DB: Backend> {
    shared: Arc<Shared<DB>>,
}

struct Shared<DB: Backend> {
    store: Store<DB>,
    key: KeyRef,
    token: i64,
    context: IdempotencyContext,
    /// What is recorded on the key, in order.
    recorded: Mutex<Vec<RecordedStep>>,
    /// The names this handler has reached so far.
    reached: Mutex<HashSet<String>>,
    /// Held while a step runs: steps run one at a time.
    running: tokio::sync::Mutex<()>,
    on_recorded: Mutex<Option<Observer>>,
}

/// What [`Steps::on_recorded`] installs.
type Observer = Arc<dyn Fn(&str) + Send + Sync>;

impl<DB: Backend> Clone for Steps<DB> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Steps<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steps")
            .field("recovery_point", &self.recovery_point())
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Steps<DB> {
    pub(crate) fn new(
        store: Store<DB>,
        key: KeyRef,
        token: i64,
        recorded: Vec<RecordedStep>,
    ) -> Self {
        let context = IdempotencyContext::new(&key.scope, &key.key);
        Self {
            shared: Arc::new(Shared {
                store,
                key,
                token,
                context,
                recorded: Mutex::new(recorded),
                reached: Mutex::new(HashSet::new()),
                running: tokio::sync::Mutex::new(()),
                on_recorded: Mutex::new(None),
            }),
        }
    }

    /// Runs a database step: `work` gets a connection inside a transaction that idem begins;
    /// its writes and the step's recovery point commit together. If the step was recorded by
    /// an earlier attempt, its recorded output is returned and `work` does not run.
    ///
    /// `work` must not end the transaction itself (`COMMIT`, `ROLLBACK`). On SQLite the step
    /// holds the process's turn to write (and SQLite's write lock) while `work` runs: `work`
    /// must not wait for anything that writes through the same store, such as a request to an
    /// idempotent route of the same process.
    ///
    /// # Errors
    ///
    /// What `work` returns, with its writes rolled back and nothing recorded; or a
    /// [`StepError`] (converted into `E`) when the name is used twice, a step is already
    /// running, the output does not (de)serialize, the key was taken over
    /// ([`StepError::Lost`], the writes rolled back), or the database failed.
    pub async fn step<T, E, F>(&self, name: &str, work: F) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<StepError>,
        F: AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
    {
        let _running = self.begin(name)?;
        if let Some(output) = self.recorded_output(name)? {
            return Ok(output);
        }
        let shared = &*self.shared;
        let store = &shared.store;
        let deadline = store.deadline();
        let _permit = store
            .write_permit(deadline)
            .await
            .map_err(|e| StepError::store(name, e))?;
        let mut conn = store
            .checkout(deadline)
            .await
            .map_err(|e| StepError::store(name, e))?;
        // The whole step, its work included, until the deadline: its connection goes back to
        // the pool only once its transaction has ended.
        let mut settled = false;
        let ran = tokio::time::timeout_at(deadline, async {
            let mut tx = store
                .begin_write(&mut conn)
                .await
                .map_err(|e| StepError::store(name, e))?;
            let done: Result<(T, Vec<RecordedStep>), E> = async {
                let output = work(&mut *tx).await?;
                let steps = self.with_output(name, &output)?;
                let owned = store
                    .record_steps_in(&mut tx, &shared.key, shared.token, &steps)
                    .await
                    .map_err(|e| StepError::store(name, e))?;
                if !owned {
                    return Err(StepError::Lost { step: name.into() }.into());
                }
                Ok((output, steps))
            }
            .await;
            match done {
                Ok(done) => {
                    tx.commit()
                        .await
                        .map_err(|e| StepError::store(name, e.into()))?;
                    settled = true;
                    Ok(done)
                }
                Err(error) => {
                    settled = tx.rollback().await.is_ok();
                    Err(error)
                }
            }
        })
        .await;
        if settled {
            conn.settle();
        }
        let timeout = store.options().database_timeout();
        let (output, steps) = ran.unwrap_or_else(|_| {
            Err(StepError::store(name, crate::error::Error::TimedOut { after: timeout }).into())
        })?;
        self.recorded(name, steps);
        Ok(output)
    }

    /// Runs an external step: `call` gets the key derived for this step
    /// ([`IdempotencyContext::derive`] of its name) to send downstream as its idempotency key;
    /// its result is recorded once it returns. If the step was recorded by an earlier attempt,
    /// its recorded output is returned and `call` does not run.
    ///
    /// # Errors
    ///
    /// What `call` returns, with nothing recorded (a retry calls again, with the same key); or
    /// a [`StepError`] (converted into `E`) as for [`step`](Self::step). After
    /// [`StepError::Lost`] or a database failure the call did happen: the request that took
    /// the key over, or a retry, calls again with the same key.
    pub async fn call<T, E, F>(&self, name: &str, call: F) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<StepError>,
        F: AsyncFnOnce(&str) -> Result<T, E>,
    {
        let _running = self.begin(name)?;
        if let Some(output) = self.recorded_output(name)? {
            return Ok(output);
        }
        let shared = &*self.shared;
        let output = call(&shared.context.derive(name)).await?;
        let steps = self.with_output(name, &output)?;
        let owned = shared
            .store
            .record_steps(&shared.key, shared.token, &steps)
            .await
            .map_err(|e| StepError::store(name, e))?;
        if !owned {
            return Err(StepError::Lost { step: name.into() }.into());
        }
        self.recorded(name, steps);
        Ok(output)
    }

    /// The output `name` recorded, by this attempt or an earlier one; `None` if it has not
    /// been recorded.
    ///
    /// # Errors
    ///
    /// [`StepError::Output`] when the recorded output is not a `T`.
    pub fn output<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, StepError> {
        self.recorded_output(name)
    }

    /// The last recorded step, where a retry resumes: `None` before the first.
    pub fn recovery_point(&self) -> Option<String> {
        let recorded = lock(&self.shared.recorded);
        recorded.last().map(|step| step.step.clone())
    }

    /// Every recorded step, in order.
    pub fn recorded_steps(&self) -> Vec<RecordedStep> {
        lock(&self.shared.recorded).clone()
    }

    /// The handler's context, whose [`derive`](IdempotencyContext::derive) gives the keys
    /// external steps are called with.
    pub fn context(&self) -> &IdempotencyContext {
        &self.shared.context
    }

    /// Calls `observer` with a step's name each time a step is recorded by this attempt (not
    /// when a recorded step is skipped); for instrumentation and fault injection.
    pub fn on_recorded(&self, observer: impl Fn(&str) + Send + Sync + 'static) {
        *lock(&self.shared.on_recorded) = Some(Arc::new(observer));
    }

    /// Checks `name` and takes the turn to run.
    fn begin(&self, name: &str) -> Result<tokio::sync::MutexGuard<'_, ()>, StepError> {
        let running = self
            .shared
            .running
            .try_lock()
            .map_err(|_| StepError::Overlap { step: name.into() })?;
        if !lock(&self.shared.reached).insert(name.to_owned()) {
            return Err(StepError::Duplicate { step: name.into() });
        }
        Ok(running)
    }

    fn recorded_output<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, StepError> {
        let recorded = lock(&self.shared.recorded);
        recorded
            .iter()
            .find(|step| step.step == name)
            .map(|step| {
                T::deserialize(&step.output).map_err(|source| StepError::Output {
                    step: name.into(),
                    source,
                })
            })
            .transpose()
    }

    /// The recorded steps with `name`'s output added.
    fn with_output<T: Serialize>(
        &self,
        name: &str,
        output: &T,
    ) -> Result<Vec<RecordedStep>, StepError> {
        let output = serde_json::to_value(output).map_err(|source| StepError::Output {
            step: name.into(),
            source,
        })?;
        let mut steps = lock(&self.shared.recorded).clone();
        steps.push(RecordedStep {
            step: name.to_owned(),
            output,
        });
        Ok(steps)
    }

    fn recorded(&self, name: &str, steps: Vec<RecordedStep>) {
        *lock(&self.shared.recorded) = steps;
        tracing::debug!(step = name, "recorded a step");
        let observer = lock(&self.shared.on_recorded).clone();
        if let Some(observer) = observer {
            observer(name);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why a step could not run or be recorded.
///
/// As a response ([`IntoResponse`]) it is a problem: 409 [`ProblemKind::InProgress`] for
/// [`Lost`](Self::Lost) (another request holds the key now), 503
/// [`ProblemKind::StoreUnavailable`] for [`Store`](Self::Store), 500
/// [`ProblemKind::StepFailed`] for the others, which are mistakes in the handler. Convert it
/// into your handler's error type with `From`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The name was used by an earlier step of this handler.
    #[error("the step name {step:?} is used twice in this handler; each step needs its own name")]
    Duplicate {
        /// The step.
        step: String,
    },
    /// A step was started while another was running (steps run one at a time).
    #[error("step {step:?} was started while another step was running; steps run one at a time")]
    Overlap {
        /// The step.
        step: String,
    },
    /// The step's output could not be recorded as JSON, or the recorded output is not of the
    /// type the handler asks for (the handler changed between attempts).
    #[error("the output of step {step:?} could not be recorded or read back: {source}")]
    Output {
        /// The step.
        step: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// The lease ran out and another request took the key over before the step was recorded;
    /// a database step's writes were rolled back.
    #[error(
        "the key was taken over by another request while step {step:?} ran (the lease ran out); the step was not recorded"
    )]
    Lost {
        /// The step.
        step: String,
    },
    /// The database failed while the step was begun or recorded.
    #[error("recording step {step:?} failed: {source}")]
    Store {
        /// The step.
        step: String,
        /// The database error.
        source: crate::error::Error,
    },
    /// The step's own database work failed (see [`StepError::database`]).
    #[error("the database work of a step failed: {0}")]
    Database(#[source] sqlx::Error),
}

impl StepError {
    /// Wraps a failure of a database step's own statements, for steps whose work returns
    /// `StepError` (`.map_err(StepError::database)`); answered as 503.
    pub fn database(error: sqlx::Error) -> Self {
        Self::Database(error)
    }

    fn store(step: &str, source: crate::error::Error) -> Self {
        Self::Store {
            step: step.into(),
            source,
        }
    }

    /// The kind of problem this error is answered with.
    pub fn kind(&self) -> ProblemKind {
        match self {
            Self::Lost { .. } => ProblemKind::InProgress,
            Self::Store { .. } | Self::Database(_) => ProblemKind::StoreUnavailable,
            Self::Duplicate { .. } | Self::Overlap { .. } | Self::Output { .. } => {
                ProblemKind::StepFailed
            }
        }
    }
}

impl IntoResponse for StepError {
    fn into_response(self) -> Response {
        match &self {
            Self::Lost { .. } | Self::Store { .. } | Self::Database(_) => {
                tracing::warn!(error = %self, "a step failed");
            }
            _ => tracing::error!(error = %self, "a step failed"),
        }
        let (kind, detail) = (self.kind(), self.to_string());
        let mut response = kind.with_detail(detail.clone()).into_response();
        // The request flow gives it the store's problem type base.
        response
            .extensions_mut()
            .insert(crate::problem::Rebasable { kind, detail });
        response
    }
}

/// A step that failed, as the status a tonic method answers with (`?` on
/// [`Steps::step`] in a method that returns `Result<_, Status>`): `ABORTED` when
/// another call took the key over, `UNAVAILABLE` when the store failed (both retried, nothing of
/// the step kept), `INTERNAL` for a mistake of the method's own (a step name used twice, an
/// output that cannot be recorded). None of them is stored unless the method has
/// `replay_5xx = true`.
#[cfg(feature = "grpc")]
impl From<StepError> for tonic::Status {
    fn from(error: StepError) -> Self {
        let message = error.to_string();
        // Both are retried, after a second as idem's own `ABORTED` and `UNAVAILABLE` say.
        let second = std::time::Duration::from_secs(1);
        match error.kind() {
            ProblemKind::InProgress => {
                tracing::warn!(%message, "a step failed");
                crate::grpc::retry_later(tonic::Code::Aborted, message, second)
            }
            ProblemKind::StoreUnavailable => {
                tracing::warn!(%message, "a step failed");
                crate::grpc::retry_later(tonic::Code::Unavailable, message, second)
            }
            _ => {
                tracing::error!(%message, "a step failed");
                tonic::Status::internal(message)
            }
        }
    }
}

#[cfg(all(test, feature = "grpc"))]
mod tests {
    use super::*;

    #[test]
    fn a_step_error_is_the_status_a_retry_reads_right() {
        let lost = StepError::Lost {
            step: "charge".into(),
        };
        let lost = tonic::Status::from(lost);
        assert_eq!(lost.code(), tonic::Code::Aborted);
        assert_eq!(
            lost.metadata()
                .get("grpc-retry-pushback-ms")
                .map(|v| v.to_str().unwrap()),
            Some("1000")
        );
        let twice = StepError::Duplicate {
            step: "charge".into(),
        };
        assert_eq!(tonic::Status::from(twice).code(), tonic::Code::Internal);
    }
}
