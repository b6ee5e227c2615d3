//! Transactional mode: the key is claimed inside the handler's own transaction, the body
//! borrows that transaction, and the response is stored in the same commit as its writes.

use axum::response::{IntoResponse, Response};
use sqlx::Transaction;

use tokio::time::Instant;

use super::{Limit, StoredScope, outcome::Outcome, request::IdemRequest};
use crate::{
    attribute::Options,
    backend::{Backend, Begun, Undone},
    checkout::{Checkout, Settle},
    context::IdempotencyContext,
    problem::ProblemKind,
    record::{KeyRef, KeyStatus},
    store::{HeldKey, Hold},
};

/// A key held by this request's transaction, for as long as the transaction lives.
///
/// The transaction borrows its connection from a slot the handler's expansion owns (`slot` of
/// [`Claim::acquire`]), which closes the connection unless the claim settles it: whatever cuts
/// the request short (its deadline, its client going away, a panic) leaves nothing behind on a
/// pooled connection.
#[derive(Debug)]
pub struct Claim<'c, DB: Backend> {
    tx: Transaction<'c, DB>,
    /// Settles the slot's connection once the transaction has ended.
    settle: Settle<'c>,
    /// When the request's database work must be done (the store's `database_timeout` from
    /// its start).
    deadline: Instant,
    /// What identifies the claiming transaction to the completion, where the database gives it.
    mark: Option<String>,
    request: IdemRequest<DB>,
    /// `None` for a request without a key where the key is optional: nothing is claimed.
    key: Option<KeyRef>,
    options: Options,
    /// Dropped after `tx` (fields drop in order): the process lets go of the key only once the
    /// database has.
    _held: Option<HeldKey>,
    /// Single-writer databases: this process's turn to write, held as long as the transaction.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// What carries over from one attempt at a claim to the next: the request, and the key this
/// process holds for it while it waits for another process to let go of the key.
#[derive(Debug)]
pub struct Attempt<DB: Backend> {
    request: IdemRequest<DB>,
    held: Option<HeldKey>,
}

impl<DB: Backend> From<IdemRequest<DB>> for Attempt<DB> {
    fn from(request: IdemRequest<DB>) -> Self {
        Self {
            request,
            held: None,
        }
    }
}

/// What [`Claim::acquire`] came to.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "matched and taken apart at once by the handler's expansion; a box would cost an \
              allocation on every request"
)]
pub enum Acquired<'c, DB: Backend> {
    /// The key is this request's: run the handler.
    Claimed(Claim<'c, DB>),
    /// Another process holds the key and this request waits for it (`Prefer: wait`): try
    /// again, with a new connection slot.
    Again(Attempt<DB>),
    /// The answer to send instead of running the handler.
    Answer(Response),
}

impl<'c, DB: Backend> Claim<'c, DB> {
    /// Begins the handler's transaction on a connection put into `slot` and claims the key
    /// in it.
    ///
    /// A duplicate of a request in flight that may wait (the client's `Prefer: wait` and the
    /// handler's `wait`) waits here: for a key this process holds, until it is let go; for a
    /// key another process holds, [`Acquired::Again`] after a pause, holding no connection
    /// meanwhile. Its transaction borrows `slot`, so each attempt needs a slot of its own.
    pub async fn acquire(
        slot: &'c mut Option<Checkout<DB>>,
        attempt: Attempt<DB>,
        scope: &StoredScope,
        options: Options,
    ) -> Acquired<'c, DB> {
        let Attempt { mut request, held } = attempt;
        request.count_fields(options.body_fields);
        if request.is_unprotected() {
            return Self::unprotected(slot, request, options).await;
        }
        let key = match request.key_ref(scope.clone()) {
            Ok(key) => key,
            Err(answer) => return Acquired::Answer(answer),
        };
        let held = match held {
            Some(held) => held,
            None => match Self::hold(&mut request, &key, options).await {
                Ok(held) => held,
                Err(answer) => return Acquired::Answer(answer),
            },
        };
        let deadline = request.store.deadline();
        let mut permit = None;
        if request.store.single_writer() {
            // A finished key is answered without queueing for the single writer.
            match request.store.lookup(&key, deadline).await {
                Ok(Some(record)) if record.status == KeyStatus::Completed => {
                    return Acquired::Answer(request.answer_existing(record, &key, None));
                }
                Ok(_) => {}
                Err(error) => return Acquired::Answer(request.store_failed(&error)),
            }
            // Writers of this process queue here, not inside the database while holding a
            // pooled connection: the pool stays free for replays and 409s.
            permit = match request.store.write_permit(deadline).await {
                Ok(permit) => permit,
                Err(error) => return Acquired::Answer(request.store_failed(&error)),
            };
        }
        // A statement in flight when the handler is stopped ends at twice the handler's timeout
        // at the latest: the handler, not one of its statements, is stopped first, and the
        // rollback does not wait on a statement for ever.
        let statement_timeout = options.timeout.map(|limit| limit * 2);
        // On a single-writer database a duplicate in another process waits for the first
        // inside the database, for its write lock: a request that may wait counts as waiting
        // meanwhile, and its replay says that it waited.
        let waits_in_database =
            request.store.single_writer() && request.wait_allowed(options.wait).is_some();
        let asked = tokio::time::Instant::now();
        let counted = waits_in_database.then(|| request.store.wait_counted());
        let claimed = request
            .store
            .begin_claim(slot, &key, statement_timeout, deadline, options.replay_5xx)
            .await;
        drop(counted);
        match claimed {
            Ok((Begun::Acquired(mut tx, mark), settle)) => {
                held.running();
                if options.replay_5xx {
                    let prepared = request.store.before_handler(&mut tx, deadline).await;
                    if let Err(error) = prepared {
                        return Acquired::Answer(request.failed_to_claim(&error));
                    }
                }
                Acquired::Claimed(Self {
                    tx,
                    settle,
                    deadline,
                    mark,
                    request,
                    key: Some(key),
                    options,
                    _held: Some(held),
                    _permit: permit,
                })
            }
            Ok((Begun::Busy, _)) => match request.may_wait(options.wait) {
                // Another process runs the request: look again after a pause, still holding
                // the key in this process so that its other duplicates wait on this one.
                Some(until) => {
                    drop(permit);
                    request.pause(until).await;
                    Acquired::Again(Attempt {
                        request,
                        held: Some(held),
                    })
                }
                None => Acquired::Answer(request.in_progress(None)),
            },
            Ok((Begun::Live(record), _)) => {
                // Only a duplicate waited: another request under the key gets its 422 as such.
                if waits_in_database
                    && record.status == KeyStatus::Completed
                    && record.fingerprint == request.fingerprint
                {
                    request.waited_since(options.wait, asked);
                }
                Acquired::Answer(request.answer_existing(record, &key, None))
            }
            Err(error) => Acquired::Answer(request.failed_to_claim(&error)),
        }
    }

    /// A request without a key, where the key is optional: the handler's transaction begins
    /// on a connection put into `slot`, and nothing is claimed.
    async fn unprotected(
        slot: &'c mut Option<Checkout<DB>>,
        request: IdemRequest<DB>,
        options: Options,
    ) -> Acquired<'c, DB> {
        let deadline = request.store.deadline();
        let permit = match request.store.write_permit(deadline).await {
            Ok(permit) => permit,
            Err(error) => return Acquired::Answer(request.store_failed(&error)),
        };
        let statement_timeout = options.timeout.map(|limit| limit * 2);
        match request
            .store
            .begin_unprotected(slot, statement_timeout, deadline)
            .await
        {
            Ok((tx, settle)) => Acquired::Claimed(Self {
                tx,
                settle,
                deadline,
                mark: None,
                request,
                key: None,
                options,
                _held: None,
                _permit: permit,
            }),
            Err(error) => Acquired::Answer(request.store_failed(&error)),
        }
    }

    /// Holds the key in this process, waiting for another request of this process to let it
    /// go where this one may wait; otherwise the answer to send (a replay, 409).
    async fn hold(
        request: &mut IdemRequest<DB>,
        key: &KeyRef,
        options: Options,
    ) -> Result<HeldKey, Response> {
        loop {
            let holding = match request.store.hold(key.lock_id, &request.fingerprint) {
                Hold::Taken(held) => return Ok(held),
                // A handler of this process runs with the key: 409 without touching the
                // database, so the answer comes at once even when every pooled connection is
                // busy.
                Hold::Running(holding) => holding,
                // Another request of this process is claiming the key, replaying it, or waiting
                // for it: a finished key is replayed (concurrent replays must not turn each
                // other into 409s).
                Hold::Claiming(holding) => {
                    match request.store.lookup(key, request.store.deadline()).await {
                        Ok(Some(record)) if record.status == KeyStatus::Completed => {
                            return Err(request.answer_existing(record, key, None));
                        }
                        Ok(_) => {}
                        Err(error) => return Err(request.store_failed(&error)),
                    }
                    holding
                }
            };
            // Another request under the key is never made to wait for the first's outcome.
            let until = match holding.same_request {
                true => request.may_wait(options.wait),
                false => None,
            };
            match until {
                Some(until) => request.wait_for(holding, until).await,
                None => return Err(request.in_progress(None)),
            }
        }
    }

    /// The transaction the handler body runs in.
    pub fn transaction(&mut self) -> &mut Transaction<'c, DB> {
        &mut self.tx
    }

    /// The handler's idempotency context; a request without a key gets one of its own, so
    /// that the keys it derives are its own too.
    pub fn context(&self) -> IdempotencyContext {
        IdempotencyContext::of(self.key.as_ref())
    }
    /// How long the handler body may run: until its `timeout`, if it has one, and at the
    /// latest until the request's deadline.
    pub fn limit(&self) -> Limit {
        Limit::earlier_of(self.options.timeout, Some(self.deadline))
    }

    /// Stores the handler's response with the key and commits, or rolls everything back.
    pub async fn complete(self, response: Response) -> Response {
        let Self {
            mut tx,
            mut settle,
            deadline,
            mut mark,
            request,
            key,
            options,
            _held,
            _permit: permit,
        } = self;
        let store = request.store.clone();
        let Some(key) = key else {
            return unprotected_end(tx, &mut settle, &request, deadline, response).await;
        };
        if response.status().is_server_error() {
            // Asked first, while the handler's last statement is the connection's last.
            if lost_a_conflict(&mut tx, &store, deadline, &request).await {
                if let Err(error) = roll_back(tx, &mut settle, &store, deadline).await {
                    tracing::warn!(parent: &request.span, %error, "rollback after a lost conflict failed; the connection was closed");
                }
                tracing::warn!(parent: &request.span, "the handler's transaction lost a conflict with another and was rolled back; its 5xx is answered as a 409");
                return request.conflict_lost("the database rolled the transaction back");
            }
            if !options.replay_5xx {
                // A rollback that fails says the connection is gone: a failover, a server
                // shutting down, a broken network. The handler's 5xx most likely came from
                // that passing fault, and its writes were not committed: the client is told to
                // retry.
                if let Err(error) = roll_back(tx, &mut settle, &store, deadline).await {
                    return request.connection_lost(response.status(), &error);
                }
                return request.end(Outcome::NotStored, response);
            }
            let statement_timeout = options.timeout.map(|limit| limit * 2);
            let undone = store
                .undo_handler(&mut tx, &key, mark.as_deref(), statement_timeout, deadline)
                .await;
            match undone {
                Ok(Undone::Kept(kept)) => mark = kept,
                Ok(Undone::Taken) => {
                    // The key was free for an instant, and a retry took it: the retry's outcome
                    // is the one stored, and this 5xx, whose writes are undone, is only answered.
                    tracing::debug!(parent: &request.span, "a retry took the key while this 5xx was undone; it is answered, not stored");
                    let _ = roll_back(tx, &mut settle, &store, deadline).await;
                    return request.end(Outcome::NotStored, response);
                }
                Ok(Undone::Ended) => {
                    let _ = roll_back(tx, &mut settle, &store, deadline).await;
                    return claim_gone(&request);
                }
                Err(error) => {
                    return write_failed(tx, &mut settle, &request, &error, deadline).await;
                }
            }
        }
        // On any early return below, the transaction is rolled back (or, past the deadline,
        // its connection closed) with the writes and the claim.
        let captured = match request.capture(response).await {
            Ok(captured) => captured,
            Err(problem) => {
                let _ = roll_back(tx, &mut settle, &store, deadline).await;
                return problem;
            }
        };
        let stored = captured.to_stored();
        let completion = request.completion(&key, &stored, mark.as_deref());
        let completed = store
            .complete(&mut tx, &completion, options.retention, deadline)
            .await;
        match completed {
            Ok(true) => {}
            Ok(false) => {
                let _ = roll_back(tx, &mut settle, &store, deadline).await;
                return claim_gone(&request);
            }
            Err(error) if store.aborted_by_a_failed_statement(&error) => {
                // A statement of the handler failed and the handler answered anyway: its
                // answer stands, but nothing can be committed with it.
                tracing::warn!(parent: &request.span, "the handler's transaction was aborted by a failed statement; its answer was not stored");
                let _ = roll_back(tx, &mut settle, &store, deadline).await;
                return request.end(Outcome::NotStored, captured.into_response());
            }
            Err(error) => return write_failed(tx, &mut settle, &request, &error, deadline).await,
        }
        match tokio::time::timeout_at(deadline, tx.commit()).await {
            Ok(Ok(())) => {
                settle.settle();
                // The next writer of a single-writer database goes on now, not after this
                // request's answer is built.
                drop(permit);
            }
            Ok(Err(error)) => return request.commit_failed(&error),
            // The COMMIT was sent and not answered: it may have committed or not.
            Err(_) => return request.commit_unanswered(store.options().database_timeout()),
        }
        request.end(Outcome::Executed, captured.into_response())
    }

    /// The handler body was stopped at `limit` and its future dropped: rolls back its writes
    /// and the claim, and answers 503.
    pub async fn stopped(self, limit: Limit) -> Response {
        let Self {
            tx,
            mut settle,
            deadline,
            request,
            options,
            _held,
            _permit,
            ..
        } = self;
        if limit.is_deadline() {
            // Nothing is waited on past the deadline: dropping the transaction with the
            // connection unsettled closes it, and the server rolls back.
            drop(tx);
            let timeout = request.store.options().database_timeout();
            return request.store_failed(&crate::error::Error::TimedOut { after: timeout });
        }
        // Rolled back here rather than on drop, so that the connection is back in the pool
        // and the key free before the client hears about it.
        let store = request.store.clone();
        if let Err(error) = roll_back(tx, &mut settle, &store, deadline).await {
            tracing::warn!(parent: &request.span, %error, "rollback after a timeout failed; the connection was closed");
        }
        request.timed_out(options.timeout, "its writes were rolled back")
    }
}

/// Ends a request that ran without a key: its writes are committed with nothing stored, or
/// rolled back after a 5xx, and the handler's response is answered as it is.
async fn unprotected_end<DB: Backend>(
    tx: Transaction<'_, DB>,
    settle: &mut Settle<'_>,
    request: &IdemRequest<DB>,
    deadline: Instant,
    response: Response,
) -> Response {
    if response.status().is_server_error() {
        if let Err(error) = roll_back(tx, settle, &request.store, deadline).await {
            return request.connection_lost(response.status(), &error);
        }
        return request.end(Outcome::Unprotected, response);
    }
    match tokio::time::timeout_at(deadline, tx.commit()).await {
        Ok(Ok(())) => settle.settle(),
        Ok(Err(error)) => return request.commit_failed(&error),
        Err(_) => return request.commit_unanswered(request.store.options().database_timeout()),
    }
    request.end(Outcome::Unprotected, response)
}

/// The answer when the handler ended the claim's transaction itself: its outcome is not stored.
fn claim_gone<DB: Backend>(request: &IdemRequest<DB>) -> Response {
    request.end(
        Outcome::Failed,
        request
            .problem(
                ProblemKind::CommitRefused,
                "the key's claim was gone at completion (did the handler run COMMIT or ROLLBACK \
                 itself?); the outcome was not stored",
            )
            .into_response(),
    )
}

/// The answer when undoing or completing the handler's transaction failed with `error`,
/// after rolling it back (unless the database did not answer in time: then its connection is
/// closed). A transaction that lost a conflict with another is a 409 to retry: a Galera node
/// reports it at the first statement after another node's commit aborted the transaction.
async fn write_failed<DB: Backend>(
    tx: Transaction<'_, DB>,
    settle: &mut Settle<'_>,
    request: &IdemRequest<DB>,
    error: &crate::error::Error,
    deadline: Instant,
) -> Response {
    if !error.is_timed_out() {
        let _ = roll_back(tx, settle, &request.store, deadline).await;
    }
    match error {
        crate::error::Error::Database(sqlx::Error::Database(refusal)) if error.is_conflict() => {
            tracing::warn!(parent: &request.span, %error, "the handler's transaction lost a conflict with another before it completed; nothing was stored");
            request.conflict_lost(refusal.message())
        }
        _ => request.store_failed(error),
    }
}

/// Whether the handler's transaction lost a conflict and was rolled back by the database (see
/// `Storage::lost_a_conflict`); a question that fails or times out counts as no (logged).
async fn lost_a_conflict<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    store: &crate::store::Store<DB>,
    deadline: Instant,
    request: &IdemRequest<DB>,
) -> bool {
    match store.lost_a_conflict(tx, deadline).await {
        Ok(lost) => lost,
        Err(error) => {
            tracing::warn!(parent: &request.span, %error, "could not ask the database whether the handler's transaction lost a conflict; its 5xx is answered as it is");
            false
        }
    }
}

/// Makes sure the transaction is open (see `Storage::ensure_open`), until `deadline`.
async fn reopened<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    store: &crate::store::Store<DB>,
    deadline: Instant,
) -> Result<(), crate::error::Error> {
    store.ensure_open(tx, deadline).await
}

/// Rolls `tx` back until `deadline`, and settles its connection if that worked; otherwise the
/// connection is closed when its slot is dropped.
async fn roll_back<DB: Backend>(
    mut tx: Transaction<'_, DB>,
    settle: &mut Settle<'_>,
    store: &crate::store::Store<DB>,
    deadline: Instant,
) -> Result<(), crate::error::Error> {
    reopened(&mut tx, store, deadline).await?;
    store
        .bounded(deadline, async { Ok(tx.rollback().await?) })
        .await?;
    settle.settle();
    Ok(())
}
