//! External mode: a `started` row committed before the handler runs, exclusive for a lease,
//! completed afterwards; dropped before completion (a panic, a cancelled request), it releases
//! the key.

use axum::response::Response;

use super::{Limit, StoredScope, outcome::Outcome, request::IdemRequest};
use crate::{
    attribute::Options,
    backend::Backend,
    context::IdempotencyContext,
    record::{KeyRef, KeyStatus, RecordedStep, Start, Started, fresh_token},
    steps::Steps,
    store::Hold,
};

/// External mode: a `started` row committed before the handler runs, owned by a token and
/// exclusive for a lease. The side effect is outside the database, so nothing can make it
/// atomic with the stored response; a retry after the lease takes the key over, and the
/// handler's [`IdempotencyContext::derive`] keys make the downstream call happen once.
#[derive(Debug)]
pub struct ExternalClaim<DB: Backend> {
    request: IdemRequest<DB>,
    /// `None` for a request without a key where the key is optional: nothing is claimed.
    key: Option<KeyRef>,
    options: Options,
    token: i64,
    /// Steps an earlier attempt recorded, until the handler takes its [`Steps`].
    resumed: Vec<RecordedStep>,
    steps: Option<Steps<DB>>,
    /// Until completion, dropping the claim (a panic, a cancelled request) releases the key.
    armed: bool,
}

impl<DB: Backend> ExternalClaim<DB> {
    /// Commits a `started` claim with a lease.
    ///
    /// # Errors
    ///
    /// The response to send instead of running the handler, as for [`Claim::acquire`]; a 409
    /// carries the lease's remaining time in `Retry-After`.
    pub async fn acquire(
        mut request: IdemRequest<DB>,
        scope: StoredScope,
        options: Options,
    ) -> Result<Self, Response> {
        request.count_fields(options.body_fields);
        if request.is_unprotected() {
            return Ok(Self {
                request,
                key: None,
                options,
                token: 0,
                resumed: Vec::new(),
                steps: None,
                armed: false,
            });
        }
        let key = request.key_ref(scope)?;
        // Armed before the claim is sent: if this request is cancelled while the claim is in
        // flight, dropping it releases whatever was committed under its token.
        let mut claim = Self {
            request,
            key: Some(key.clone()),
            options,
            token: fresh_token(),
            resumed: Vec::new(),
            steps: None,
            armed: true,
        };
        // A duplicate that may wait keeps looking until the key is free or finished; while it
        // waits, it holds the key in this process, so that its duplicates here wait on it
        // rather than each looking at the database.
        let mut poller = None;
        loop {
            let deadline = claim.request.store.deadline();
            let outcome = {
                let start = Start {
                    row: claim.request.row_of(&key),
                    lease: options.lease,
                    retention: options.retention,
                    token: claim.token,
                };
                match claim.request.store.write_permit(deadline).await {
                    Ok(_permit) => claim.request.store.start(&start, deadline).await,
                    Err(error) => Err(error),
                }
            };
            let in_flight = match &outcome {
                Ok(Started::Busy) => true,
                Ok(Started::Found { record, .. }) => {
                    record.status == KeyStatus::Started
                        && record.fingerprint == claim.request.fingerprint
                }
                _ => false,
            };
            if in_flight && let Some(until) = claim.request.may_wait(options.wait) {
                if poller.is_none() {
                    let fingerprint = claim.request.fingerprint;
                    match claim.request.store.hold(key.lock_id, &fingerprint) {
                        Hold::Taken(held) => poller = Some(held),
                        Hold::Running(holding) | Hold::Claiming(holding) => {
                            claim.request.wait_for(holding, until).await;
                            continue;
                        }
                    }
                }
                claim.request.pause(until).await;
                continue;
            }
            drop(poller);
            return claim.settle_start(&key, outcome).await;
        }
    }

    /// The answer to what the claim's `start` found.
    async fn settle_start(
        mut self,
        key: &KeyRef,
        outcome: Result<Started, crate::error::Error>,
    ) -> Result<Self, Response> {
        if !matches!(outcome, Ok(Started::Acquired { .. })) {
            self.armed = false;
        }
        match outcome {
            Ok(Started::Acquired { taken_over }) => {
                if taken_over {
                    metrics::counter!("idem_takeovers_total").increment(1);
                    tracing::info!(parent: &self.request.span, "took over an abandoned or expired claim");
                    // A lapsed claim of this same request keeps what its steps recorded.
                    let deadline = self.request.store.deadline();
                    match self
                        .request
                        .store
                        .recorded_steps(key, self.token, deadline)
                        .await
                    {
                        Ok(steps) => self.resumed = steps,
                        // Its steps are sealed with a key the service is not given: resuming
                        // without them would run them again. The claim stays, its lease ended,
                        // for the recovery to park.
                        Err(crate::error::Error::Unopened(unopened)) => {
                            // Its lease ended now, not when this claim is dropped: the recovery
                            // parks it at its next round.
                            let released = self.give_up().await;
                            self.armed = false;
                            if let Err(error) = released {
                                tracing::warn!(parent: &self.request.span, %error, "ending the lease of a claim whose steps cannot be opened failed; it ends by itself");
                            }
                            return Err(self.request.answer_unreadable(&unopened));
                        }
                        Err(error) => return Err(self.request.store_failed(&error)),
                    }
                }
                Ok(self)
            }
            Ok(Started::Found { record, lease_left }) => {
                Err(self.request.answer_existing(record, key, lease_left))
            }
            Ok(Started::Busy) => Err(self.request.in_progress(None)),
            Err(error) => Err(self.request.store_failed(&error)),
        }
    }

    /// The handler's idempotency context; a request without a key gets one of its own, so
    /// that the keys it derives are its own too.
    pub fn context(&self) -> IdempotencyContext {
        IdempotencyContext::of(self.key.as_ref())
    }
    /// How long the handler body may run: until its `timeout`, if it has one. The handler
    /// holds no transaction, so the store's database deadline does not bound it.
    pub fn limit(&self) -> Limit {
        Limit::earlier_of(self.options.timeout, None)
    }

    /// The handler's steps, with what earlier attempts recorded. (`#[idempotent]` refuses
    /// `key_optional` on a handler in steps: a request without a key has nowhere to record
    /// them.)
    pub fn steps(&mut self) -> Steps<DB> {
        self.steps
            .get_or_insert_with(|| {
                Steps::new(
                    self.request.store.clone(),
                    self.key
                        .clone()
                        .expect("a handler in steps always has a key"),
                    self.token,
                    std::mem::take(&mut self.resumed),
                )
            })
            .clone()
    }

    /// Lets go of the key: deletes the claim, or ends its lease where steps are recorded on it
    /// (the row decides: a step whose commit went unanswered may be recorded), so that a retry
    /// resumes after them.
    fn give_up(&self) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'static {
        let (store, key, token) = (self.request.store.clone(), self.key.clone(), self.token);
        async move {
            match key {
                Some(key) => store.give_up(&key, token).await,
                None => Ok(true),
            }
        }
    }

    /// Stores the handler's response (or releases the key after a 5xx that is not replayed).
    ///
    /// The claim stays armed until the database has the outcome: a request cancelled before
    /// that releases its key when the claim is dropped.
    pub async fn complete(mut self, response: Response) -> Response {
        let response = self.request.rebase(response);
        let Some(key) = self.key.clone() else {
            return self.request.end(Outcome::Unprotected, response);
        };
        if response.status().is_server_error() && !self.options.replay_5xx {
            let released = self.give_up().await;
            self.armed = false;
            if let Err(error) = released {
                tracing::error!(parent: &self.request.span, %error, "releasing the key after a 5xx failed; it frees itself when the lease ends");
            }
            return self.request.end(Outcome::NotStored, response);
        }
        let captured = match self.request.capture(response).await {
            Ok(captured) => captured,
            Err(problem) => {
                let _ = self.give_up().await;
                self.armed = false;
                return problem;
            }
        };
        let stored = captured.to_stored();
        let finished = {
            let completion = self.request.completion(&key, &stored, None);
            let retention = Some(self.options.retention);
            self.request
                .store
                .complete_started(&completion, self.token, retention)
                .await
        };
        self.armed = false;
        match finished {
            Ok(true) => self
                .request
                .end(Outcome::Executed, captured.into_response()),
            Ok(false) => {
                // The lease ran out and another request took the key over; it will store its
                // own outcome. This client still gets what the handler answered.
                tracing::warn!(parent: &self.request.span, "the claim's lease ran out before completion; the outcome was not stored");
                self.request
                    .end(Outcome::NotStored, captured.into_response())
            }
            Err(error) => {
                self.request.explain_store_error(&error);
                tracing::error!(parent: &self.request.span, %error, "storing the outcome failed");
                self.request
                    .end(Outcome::NotStored, captured.into_response())
            }
        }
    }
}

impl<DB: Backend> Drop for ExternalClaim<DB> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // The handler panicked or its request was cancelled: it is not running any more, so
        // the key can be released at once (the derived downstream keys keep a retry safe).
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let give_up = self.give_up();
        runtime.spawn(async move {
            if let Err(error) = give_up.await {
                tracing::warn!(%error, "releasing an interrupted claim failed; it frees itself when the lease ends");
            }
        });
    }
}

impl<DB: Backend> ExternalClaim<DB> {
    /// The handler body ran past its `timeout` and its future was dropped: releases the
    /// claim under its token, as a cancelled request does, and answers 503.
    ///
    /// The claim stays armed until the release returns: if this request is cancelled
    /// meanwhile, dropping the claim releases it.
    pub async fn stopped(mut self, _limit: Limit) -> Response {
        if self.key.is_none() {
            return self.request.timed_out(
                self.options.timeout,
                "it ran without a key: nothing was stored",
            );
        }
        let released = self.give_up().await;
        self.armed = false;
        if let Err(error) = released {
            tracing::error!(parent: &self.request.span, %error, "releasing the key after a timeout failed; it frees itself when the lease ends");
        }
        self.request
            .timed_out(self.options.timeout, "the key was released")
    }
}
