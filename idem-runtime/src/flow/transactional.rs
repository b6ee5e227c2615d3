//! Transactional mode: the key is claimed inside the handler's own transaction, the body
//! borrows that transaction, and the response is stored in the same commit as its writes.

use axum::response::{IntoResponse, Response};
use sqlx::Transaction;

use super::{Options, Scope, extract::IdemRequest, outcome::Outcome};
use crate::{
    backend::{Backend, Begun},
    context::IdempotencyContext,
    problem::ProblemKind,
    record::{KeyRef, KeyStatus},
    store::{HeldKey, Hold},
};

/// A key held by this request's transaction, for as long as the transaction lives.
#[derive(Debug)]
pub struct Claim<DB: Backend> {
    tx: Transaction<'static, DB>,
    /// What identifies the claiming transaction to the completion, where the database gives it.
    mark: Option<String>,
    request: IdemRequest<DB>,
    key: KeyRef,
    options: Options,
    /// Dropped after `tx` (fields drop in order): the process lets go of the key only once the
    /// database has.
    _held: HeldKey,
    /// Single-writer databases: this process's turn to write, held as long as the transaction.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<DB: Backend> Claim<DB> {
    /// Begins the handler's transaction and claims the key in it.
    ///
    /// # Errors
    ///
    /// The response to send instead of running the handler: the replay of a stored response,
    /// 409 while another request holds the key, 422 when the key was used for another request,
    /// or a problem when the store fails.
    pub async fn acquire(
        request: IdemRequest<DB>,
        scope: Scope,
        options: Options,
    ) -> Result<Self, Response> {
        let key = request.key_ref(scope)?;
        let held = match request.store.hold(key.lock_id) {
            Hold::Taken(held) => held,
            // A handler of this process runs with the key: 409 without touching the database,
            // so the answer comes at once even when every pooled connection is busy.
            Hold::Running => return Err(request.in_progress(None)),
            // Another request of this process is claiming the key or replaying it: a finished
            // key is replayed (concurrent replays must not turn each other into 409s).
            Hold::Claiming => {
                return match request.store.lookup(&key).await {
                    Ok(Some(record)) if record.status == KeyStatus::Completed => {
                        Err(request.answer_existing(record, None))
                    }
                    Ok(_) => Err(request.in_progress(None)),
                    Err(error) => Err(request.store_failed(&error)),
                };
            }
        };
        let mut permit = None;
        if DB::SINGLE_WRITER {
            // A finished key is answered without queueing for the single writer.
            match request.store.lookup(&key).await {
                Ok(Some(record)) if record.status == KeyStatus::Completed => {
                    return Err(request.answer_existing(record, None));
                }
                Ok(_) => {}
                Err(error) => return Err(request.store_failed(&error)),
            }
            // Writers of this process queue here, not inside the database while holding a
            // pooled connection: the pool stays free for replays and 409s.
            permit = request.store.write_permit().await;
        }
        // A statement in flight when the handler is stopped ends at twice the handler's timeout
        // at the latest: the handler, not one of its statements, is stopped first, and the
        // rollback does not wait on a statement for ever.
        let statement_timeout = options.timeout.map(|limit| limit * 2);
        match request.store.begin_claim(&key, statement_timeout).await {
            Ok(Begun::Acquired(mut tx, mark)) => {
                held.running();
                if options.replay_5xx {
                    DB::savepoint(&mut tx)
                        .await
                        .map_err(|e| request.store_failed(&e))?;
                }
                Ok(Self {
                    tx,
                    mark,
                    request,
                    key,
                    options,
                    _held: held,
                    _permit: permit,
                })
            }
            Ok(Begun::Busy) => Err(request.in_progress(None)),
            Ok(Begun::Live(record)) => Err(request.answer_existing(record, None)),
            Err(error) => Err(request.store_failed(&error)),
        }
    }

    /// The transaction the handler body runs in.
    pub fn transaction(&mut self) -> &mut Transaction<'static, DB> {
        &mut self.tx
    }

    /// The handler's idempotency context.
    pub fn context(&self) -> IdempotencyContext {
        IdempotencyContext::new(&self.key.scope, &self.key.key)
    }

    /// Stores the handler's response with the key and commits, or rolls everything back.
    pub async fn complete(self, response: Response) -> Response {
        let Self {
            mut tx,
            mark,
            request,
            key,
            options,
            _held,
            _permit,
        } = self;
        if response.status().is_server_error() {
            if let Err(error) = DB::ensure_open(&mut tx).await {
                tracing::warn!(parent: &request.span, %error, "reopening a transaction the handler ended failed");
            }
            if !options.replay_5xx {
                if let Err(error) = tx.rollback().await {
                    tracing::warn!(parent: &request.span, %error, "rollback after a 5xx failed");
                }
                return request.finish(Outcome::NotStored, response);
            }
            if let Err(error) = DB::rollback_to_savepoint(&mut tx).await {
                return request.store_failed(&error);
            }
        }
        // On any early return below, dropping `tx` rolls back the writes and the claim.
        let captured = match request.capture(response).await {
            Ok(captured) => captured,
            Err(problem) => return problem,
        };
        let stored = captured.to_stored();
        let completion = request.completion(&key, &stored, mark.as_deref());
        match DB::complete(&mut tx, &completion, options.retention).await {
            Ok(true) => {}
            Ok(false) => {
                return request.finish(
                    Outcome::Failed,
                    request.problem(ProblemKind::CommitRefused, "the key's claim was gone at completion (did the handler run COMMIT or ROLLBACK itself?); the outcome was not stored")
                        .into_response(),
                );
            }
            Err(error) if DB::is_transaction_aborted(&error) => {
                // A statement of the handler failed and the handler answered anyway: its
                // answer stands, but nothing can be committed with it.
                tracing::warn!(parent: &request.span, "the handler's transaction was aborted by a failed statement; its answer was not stored");
                return request.finish(Outcome::NotStored, captured.into_response());
            }
            Err(error) => return request.store_failed(&error),
        }
        if let Err(error) = tx.commit().await {
            return request.commit_failed(&error);
        }
        request.finish(Outcome::Executed, captured.into_response())
    }
}

impl<DB: Backend> Claim<DB> {
    /// The handler body ran past its `timeout` and its future was dropped: rolls back its
    /// writes and the claim, and answers 503.
    pub async fn timed_out(self) -> Response {
        let Self {
            tx,
            request,
            options,
            _held,
            _permit,
            ..
        } = self;
        // Rolled back here rather than on drop, so that the connection is back in the pool
        // and the key free before the client hears about it.
        let mut tx = tx;
        if let Err(error) = DB::ensure_open(&mut tx).await {
            tracing::warn!(parent: &request.span, %error, "reopening a transaction the handler ended failed");
        }
        if let Err(error) = tx.rollback().await {
            tracing::warn!(parent: &request.span, %error, "rollback after a timeout failed");
        }
        request.timed_out(options.timeout, "its writes were rolled back")
    }
}
