//! What the handler answered, made ready to store: its response read within
//! [`max_response_body`](crate::store::StoreOptions::max_response_body) ([`Captured`]), and the
//! completion that writes it on the key's row ([`Completion`]).

use axum::response::{IntoResponse, Response};

use super::{outcome::Outcome, request::IdemRequest};
use crate::{
    backend::Backend,
    problem::ProblemKind,
    record::{Completion, KeyRef, StoredResponse},
    replay::{CaptureError, Captured},
};

impl<DB: Backend> IdemRequest<DB> {
    /// Reads the handler's response for storage.
    pub(super) async fn capture(&self, response: Response) -> Result<Captured, Response> {
        let limit = self.store.options().max_response_body();
        match Captured::read(response, limit).await {
            Ok(captured) => Ok(captured),
            Err(error @ CaptureError::TooLarge { .. }) => Err(self.end(
                Outcome::Failed,
                self.problem(
                    ProblemKind::ResponseTooLarge,
                    format!("{error}; the handler's outcome was not stored"),
                )
                .into_response(),
            )),
            Err(CaptureError::Body(error)) => {
                tracing::error!(parent: &self.span, %error, "response body failed");
                Err(self.end(
                    Outcome::Failed,
                    crate::problem::Problem::new(
                        http::StatusCode::INTERNAL_SERVER_ERROR,
                        "Response body failed",
                    )
                    .with_detail("the handler's response body failed; its outcome was not stored")
                    .into_response(),
                ))
            }
        }
    }

    /// The completion that stores `stored` under `key` for this request, in the claim marked
    /// `mark` where the database gives one.
    pub(super) fn completion<'a>(
        &'a self,
        key: &'a KeyRef,
        stored: &'a StoredResponse,
        mark: Option<&'a str>,
    ) -> Completion<'a> {
        Completion {
            row: self.row_of(key),
            response: stored,
            mark,
        }
    }
}
