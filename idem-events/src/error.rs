//! The error of the outbox's and the consumers' own operations.

/// What went wrong in the outbox or in a consumer's records.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database failed or could not be reached.
    #[error("the events' database failed: {0}")]
    Database(#[from] sqlx::Error),
    /// Creating or upgrading the event tables failed; nothing of the failed migration is
    /// applied.
    #[error("migrating idem's event tables failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// An event given to [`enqueue`](crate::enqueue) cannot be published: its topic is empty
    /// or too long, or its payload does not serialize to JSON. Nothing was written.
    #[error("the event cannot be enqueued: {reason}")]
    InvalidEvent {
        /// What is wrong with it.
        reason: String,
    },
}
