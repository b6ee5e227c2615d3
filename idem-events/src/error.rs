//! The error of the outbox's and the consumers' own operations.

/// What went wrong in the outbox or in a consumer's records.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database failed or could not be reached.
    #[error("the events' database failed: {0}")]
    Database(#[from] sqlx::Error),
    /// The database did not answer within the relay's or consumer's `database_timeout`
    /// ([`RelayOptions::database_timeout`](crate::relay::RelayOptions::database_timeout),
    /// [`ConsumerOptions::database_timeout`](crate::consumer::ConsumerOptions::database_timeout)): the
    /// operation was abandoned, and is tried again.
    #[error("the events' database did not answer within {after:?}")]
    TimedOut {
        /// The timeout that passed.
        after: std::time::Duration,
    },
    /// Creating or upgrading the event tables failed; nothing of the failed migration is
    /// applied, but on MySQL (see [`migrate`](crate::backend::migrate)).
    #[error("migrating idem's event tables failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// An event given to [`enqueue`](crate::outbox::enqueue) cannot be published: its topic is empty
    /// or too long, or its payload does not serialize to JSON. Nothing was written.
    #[error("the event cannot be enqueued: {reason}")]
    InvalidEvent {
        /// What is wrong with it.
        reason: String,
    },
}

/// Awaits `work` for at most `timeout` ([`idem_task::Deadline`], as the runtime bounds its
/// own): [`Error::TimedOut`] if it is not done by then, in which case `work` has been dropped (a
/// transaction it held is rolled back).
pub(crate) async fn bounded<T>(
    timeout: std::time::Duration,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    idem_task::Deadline::after(timeout)
        .bound(work, |after| Error::TimedOut { after })
        .await
}
