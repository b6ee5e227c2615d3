//! Every answer the layer gives itself, as methods of the request it answers: a replay, a 409,
//! a 422, a problem for a store that failed or a handler that overran, each recorded on the
//! request's span with how the request ended ([`Outcome`](super::outcome::Outcome)).

use std::time::Duration;

use axum::response::{IntoResponse, Response};

use super::{
    outcome::{Call, Outcome, end},
    request::IdemRequest,
};
use crate::{
    attribute::attribute_duration,
    backend::Backend,
    problem::{DEFAULT_PROBLEM_TYPE_BASE, Problem, ProblemKind, Rebasable},
    record::{KeyRecord, KeyRef, KeyStatus},
    replay,
};

impl<DB: Backend> IdemRequest<DB> {
    /// Logs what a connection pooler that breaks sqlx's prepared statements is doing, and
    /// what to do about it, when `error` is one it causes: once per process, since under load
    /// every request would say it. Each failure is still logged where it happens.
    pub(super) fn explain_store_error(&self, error: &crate::error::Error) {
        if let crate::error::Error::Database(database) = error {
            self.explain_database_error(database);
        }
    }

    /// [`explain_store_error`](Self::explain_store_error) for sqlx's error.
    pub(super) fn explain_database_error(&self, error: &sqlx::Error) {
        #[cfg(feature = "postgres")]
        if let Some(reason) = crate::pooler::pooler_refusal(error) {
            static EXPLAINED: std::sync::Once = std::sync::Once::new();
            EXPLAINED.call_once(|| tracing::error!(parent: &self.span, "{reason}"));
        }
        #[cfg(not(feature = "postgres"))]
        let _ = error;
    }

    /// A problem of `kind`, its `type` under the store's [`StoreOptions::problem_type_base`].
    ///
    /// [`StoreOptions::problem_type_base`]: crate::store::StoreOptions::problem_type_base
    ///
    /// A 503 tells the client when to retry: `Retry-After` is the store's
    /// [`StoreOptions::retry_after`](crate::store::StoreOptions::retry_after).
    pub(super) fn problem(&self, kind: ProblemKind, detail: impl Into<String>) -> Problem {
        let problem = kind.problem_under(self.store.options().problem_type_base(), detail);
        if kind.status() == http::StatusCode::SERVICE_UNAVAILABLE {
            problem.with_retry_after(self.retry_after_secs())
        } else {
            problem
        }
    }

    /// The store's `retry_after` in whole seconds, at least one.
    fn retry_after_secs(&self) -> u64 {
        let after = self.store.options().retry_after();
        after.as_secs_f64().ceil().max(1.0) as u64
    }

    /// The handler's `response`, with a problem of the layer that was made without the
    /// store's settings (a `StepError`) given the store's problem type base. Status and
    /// headers stay; only the body's `type` changes.
    pub(super) fn rebase(&self, response: Response) -> Response {
        let base = self.store.options().problem_type_base();
        let Some(marked) = response.extensions().get::<Rebasable>().cloned() else {
            return response;
        };
        // A layer's 409 or 503 says when to retry, as the flow's own do.
        let mut response = response;
        let status = response.status();
        if (status == http::StatusCode::CONFLICT || status == http::StatusCode::SERVICE_UNAVAILABLE)
            && !response.headers().contains_key(http::header::RETRY_AFTER)
        {
            response.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from(self.retry_after_secs()),
            );
        }
        if base == DEFAULT_PROBLEM_TYPE_BASE {
            return response;
        }
        let (mut parts, _) = response.into_parts();
        let (_, body) = marked
            .kind
            .problem_under(base, marked.detail)
            .into_response()
            .into_parts();
        parts.headers.remove(http::header::CONTENT_LENGTH);
        Response::from_parts(parts, body)
    }

    pub(super) fn end(&self, outcome: Outcome, response: Response) -> Response {
        let mut response = response;
        if let Some(waiting) = &self.waiting {
            metrics::histogram!(
                "idem_wait_duration_seconds",
                "route" => self.route.to_string(),
                "outcome" => outcome.as_str(),
            )
            .record(waiting.since.elapsed());
            if outcome == Outcome::Replayed {
                response.headers_mut().insert(
                    http::HeaderName::from_static("preference-applied"),
                    crate::prefer::applied(waiting.seconds),
                );
            }
        }
        end(&self.span, &self.route, self.call(), outcome, response)
    }

    /// Whether this is an HTTP request or a gRPC call (stored under the method `GRPC`).
    fn call(&self) -> Call {
        #[cfg(feature = "grpc")]
        if self.method.as_str() == crate::stored_grpc::GRPC_METHOD {
            return Call::Grpc;
        }
        Call::Http
    }

    pub(super) fn store_failed(&self, error: &crate::error::Error) -> Response {
        if let Some(hint) = error.setup_hint() {
            tracing::error!(parent: &self.span, %error, "{hint}");
            return self.end(
                Outcome::Failed,
                self.problem(
                    ProblemKind::StoreNotSetUp,
                    "the service's idempotency store is not set up (its key table is missing: \
                     the service must run `idem_runtime::migrate` on its database); nothing ran \
                     and nothing was stored, and no retry succeeds until the service is fixed",
                )
                .into_response(),
            );
        }
        let detail = if matches!(error, crate::error::Error::ReadOnly) {
            tracing::warn!(parent: &self.span, %error, "the idempotency store's database takes no writes; answered 503 to retry");
            "the database is read-only (a standby, or a primary a failover demoted); nothing was \
             run, retry with the same key"
        } else if let crate::error::Error::TimedOut { after } = error {
            tracing::error!(parent: &self.span, %error, "the idempotency store's database did not answer in time; the request's work was abandoned and its connection closed");
            return self.end(
                Outcome::Failed,
                self.problem(
                    ProblemKind::StoreUnavailable,
                    format!(
                        "the database did not answer within {}; nothing was committed, retry with the same key",
                        attribute_duration(*after)
                    ),
                )
                .into_response(),
            );
        } else {
            self.explain_store_error(error);
            tracing::error!(parent: &self.span, %error, "idempotency store failed");
            "the idempotency store failed; nothing was stored, retry with the same key"
        };
        self.end(
            Outcome::Failed,
            self.problem(ProblemKind::StoreUnavailable, detail)
                .into_response(),
        )
    }

    /// 503 with `Retry-After` for a handler's 5xx (`status`) whose transaction could not be
    /// rolled back (`error`): its connection broke or its server went away, likely what the
    /// handler met too. Nothing of the transaction was committed, and a retry runs it again.
    pub(super) fn connection_lost(
        &self,
        status: http::StatusCode,
        error: &crate::error::Error,
    ) -> Response {
        tracing::warn!(parent: &self.span, %error, %status, "the handler answered a 5xx and its transaction could not be rolled back: its connection is gone; answered 503 to retry");
        self.end(
            Outcome::Failed,
            self.problem(
                ProblemKind::StoreUnavailable,
                format!(
                    "the handler failed ({status}) and its connection to the database was lost; \
                     nothing was committed, retry with the same key"
                ),
            )
            .into_response(),
        )
    }

    /// The COMMIT was sent and not answered by the request's deadline: it may have committed
    /// or not, and the connection is being closed.
    pub(super) fn commit_unanswered(&self, timeout: Duration) -> Response {
        let limit = attribute_duration(timeout);
        tracing::error!(parent: &self.span, timeout = %limit, "the database did not answer the handler's COMMIT in time; its outcome is unknown");
        self.end(
            Outcome::Failed,
            self.problem(
                ProblemKind::OutcomeUnknown,
                format!("the database did not answer the commit within {limit}; retry with the same key to get the stored outcome, or to run the request if it was not committed"),
            )
            .into_response(),
        )
    }

    /// The database refused the COMMIT (a deferred constraint), or refused it because the
    /// transaction lost a conflict with another (a serialization failure, a deadlock: SQLSTATE
    /// class 40, as a multi-primary cluster answers a duplicate that committed first at another
    /// node), or the connection broke or the server went away during it (a failover: see
    /// [`is_transient`](crate::transient::is_transient)) and the outcome is unknown. A primary stopped
    /// while a synchronous standby confirms the COMMIT answers it `57P01` although the
    /// transaction committed locally: only a retry can tell.
    pub(super) fn commit_failed(&self, error: &sqlx::Error) -> Response {
        if let sqlx::Error::Database(refusal) = error
            && crate::error::is_conflict_code(refusal.code().as_deref())
        {
            tracing::warn!(parent: &self.span, %error, "the handler's commit lost a conflict with another transaction; nothing was stored");
            return self.conflict_lost(refusal.message());
        }
        self.explain_database_error(error);
        tracing::error!(parent: &self.span, %error, "committing the handler's transaction failed");
        let problem = match error {
            sqlx::Error::Database(refusal) if !crate::transient::is_transient(error) => self.problem(
                ProblemKind::CommitRefused,
                format!(
                    "the database refused to commit the handler's writes ({}); nothing was stored, retry with the same key",
                    refusal.message()
                ),
            ),
            _ => self.problem(
                ProblemKind::OutcomeUnknown,
                "the connection failed while committing; retry with the same key to get the stored outcome, or to run the request if it was not committed",
            ),
        };
        self.end(Outcome::Failed, problem.into_response())
    }

    /// 409 with `Retry-After`: the handler's transaction lost a conflict with another
    /// transaction (the database said `why`) and was rolled back whole, so nothing of the
    /// request was committed. On a multi-primary cluster that is how the duplicate that did not
    /// commit first ends; its retry replays the other's outcome.
    pub(super) fn conflict_lost(&self, why: &str) -> Response {
        let seconds = self.retry_after_secs();
        self.end(
            Outcome::Conflict,
            self.problem(
                ProblemKind::InProgress,
                format!(
                    "the handler's writes conflicted with another transaction's and were not committed ({why}); nothing was stored, retry with the same key after {seconds}s"
                ),
            )
            .with_retry_after(seconds)
            .into_response(),
        )
    }

    /// The answer when beginning the claim or preparing the handler's transaction failed with
    /// `error`: a 409 to retry when the transaction lost a conflict with another (on a Galera
    /// cluster, another node's commit of the key), otherwise the store's failure.
    pub(super) fn failed_to_claim(&self, error: &crate::error::Error) -> Response {
        match error {
            crate::error::Error::Database(sqlx::Error::Database(refusal))
                if error.is_conflict() =>
            {
                tracing::warn!(parent: &self.span, %error, "the claim's transaction lost a conflict with another; nothing was stored");
                self.conflict_lost(refusal.message())
            }
            _ => self.store_failed(error),
        }
    }

    /// 409: the key is held by another request, for about `retry_after`.
    pub(super) fn in_progress(&self, retry_after: Option<Duration>) -> Response {
        let seconds = match retry_after {
            Some(after) => after.as_secs_f64().ceil().max(1.0) as u64,
            None => self.retry_after_secs(),
        };
        self.end(
            Outcome::Conflict,
            self.problem(ProblemKind::InProgress, format!(
                    "a request with this idempotency key is being processed; retry after {seconds}s to get its outcome"
                ))
                .with_retry_after(seconds)
                .into_response(),
        )
    }

    /// The answer to a request whose key has a live row: 422, a replay, or 409.
    pub(super) fn answer_existing(
        &self,
        record: KeyRecord,
        key: &KeyRef,
        lease_left: Option<Duration>,
    ) -> Response {
        if record.fingerprint != self.fingerprint {
            return self.end(
                Outcome::Mismatch,
                self.problem(ProblemKind::KeyReused, format!(
                        "this idempotency key was already used for a different request ({} {}); use a new key for a new request",
                        record.method, record.path
                    ))
                    .into_response(),
            );
        }
        match (record.status, record.response) {
            (KeyStatus::Completed, Some(stored)) => match self.store.opened(stored, key) {
                Ok(stored) => self.end(Outcome::Replayed, replay::replay(stored)),
                Err(unopened) => self.answer_unreadable(&unopened),
            },
            (KeyStatus::Started, _) => self.in_progress(lease_left),
            (KeyStatus::Parked, _) => self.end(
                Outcome::Parked,
                self.problem(
                    ProblemKind::ClaimParked,
                    "the first request with this idempotency key was interrupted, and the \
                     recovery could not settle it: whether its work happened is unknown until an \
                     operator looks (`idem dead`), so it is not run again; retrying gets this \
                     answer until the operator resumes or abandons the claim",
                )
                .into_response(),
            ),
            (KeyStatus::Completed, None) => self.store_failed(&crate::error::Error::corrupt(
                "a completed idempotency key has no stored response",
            )),
        }
    }

    /// 500: the key's stored answer is sealed and does not open; nothing runs or is stored.
    /// The log names the key id it needs and the route, never the key.
    pub(super) fn answer_unreadable(&self, unopened: &crate::seal::Unopened) -> Response {
        tracing::error!(parent: &self.span, route = %self.route, sealed_with = unopened.key_id(), %unopened, "a stored answer cannot be opened: give the service the encryption key it was sealed with");
        self.end(
            Outcome::Failed,
            self.problem(
                ProblemKind::AnswerUnreadable,
                format!(
                    "this key's answer is stored sealed with the encryption key `{}`, and the \
                     service cannot open it; the request is not run again",
                    unopened.key_id()
                ),
            )
            .into_response(),
        )
    }

    /// 503: the handler ran past its `timeout` and was stopped.
    pub(super) fn timed_out(&self, timeout: Option<Duration>, undone: &str) -> Response {
        let limit = timeout.map_or_else(|| "its timeout".to_owned(), attribute_duration);
        tracing::warn!(parent: &self.span, timeout = %limit, "the handler ran past its timeout and was stopped");
        self.end(
            Outcome::TimedOut,
            self.problem(ProblemKind::HandlerTimedOut, format!(
                    "the handler took longer than {limit} and was stopped; {undone} and nothing was stored, retry with the same key"
                ))
                .into_response(),
        )
    }
}
