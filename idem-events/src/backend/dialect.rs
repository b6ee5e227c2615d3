//! What differs between databases in the outbox's and the consumers' shared statements: the
//! contract each backend fulfils so that [`SharedEventStorage`](super::shared::SharedEventStorage)
//! runs on it.

use sqlx::migrate::Migrator;

/// [`Dialect::CLEAR_FAILURES`] where placeholders are numbered (`$1`): PostgreSQL and SQLite
/// share it.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(super) const NUMBERED_CLEAR_FAILURES: &str =
    "DELETE FROM idem_consumer_failures WHERE consumer = $1 AND message_id = $2";

/// The distinct topics of the waiting events, one index probe per topic (a loose index scan of
/// `idem_outbox_pending`) rather than a read of every waiting event: the `waiting (topic)`
/// table that PostgreSQL's and SQLite's `KNOW_TOPICS` insert from, each with its own `INSERT`,
/// for `concat!` to join to it.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! with_waiting_topics {
    () => {
        "WITH RECURSIVE waiting (topic) AS ( \
           SELECT (SELECT topic FROM idem_outbox WHERE published_at IS NULL ORDER BY topic LIMIT 1) \
           UNION ALL \
           SELECT (SELECT o.topic FROM idem_outbox o \
                   WHERE o.published_at IS NULL AND o.topic > w.topic ORDER BY o.topic LIMIT 1) \
           FROM waiting w WHERE w.topic IS NOT NULL) "
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(super) use with_waiting_topics;

/// The SQL in which one database differs from the others in the statements they share: those
/// statements bind alike everywhere (text, an `i64` count of milliseconds for a retention, a
/// limit), read attempts as a 64-bit integer, and let the database compute the time. Implemented
/// once per database (`backend/postgres.rs`, `backend/sqlite.rs`, `backend/mysql.rs`); every
/// database that implements it gets [`SharedEventStorage`](super::shared::SharedEventStorage),
/// the statements written once for all.
///
/// A new database backend supplies, in an `impl Dialect for` its sqlx database, each
/// statement below with the parameters documented on it, in that order (a database whose
/// placeholders are bound in order of appearance, as MySQL's `?`, reads them from a derived
/// table where its SQL needs another order), its migrations, and how many rows a statement
/// wrote ([`rows_affected`](Dialect::rows_affected)). The
/// shared statements also need sqlx to run statements on the database's connection and pool and
/// to encode and decode text and `i64`: the `where` clause of `SharedEventStorage`'s one
/// implementation lists them, and every sqlx driver provides them. The backend then implements
/// [`EventStorage`](super::EventStorage) for what it does its own way (how a relay holds a topic
/// and publishes its batch), which seals it, and is added to
/// [`Backend`](crate::backend::Backend).
pub(super) trait Dialect: sqlx::Database {
    /// The migrations that create and upgrade the event tables (`sqlx::migrate!` of the
    /// backend's directory); recorded in `_idem_events_migrations`.
    const MIGRATOR: Migrator;

    /// Adds an event to the outbox, created now: `$1` event id, `$2` topic, `$3` payload.
    const ENQUEUE: &'static str;

    /// One row: how many events wait to be published (`i64`), and the age of the oldest in
    /// milliseconds (`i64`, `NULL` when none waits).
    const WAITING: &'static str;

    /// Deletes up to `$2` events published more than `$1` milliseconds ago.
    const PURGE_PUBLISHED: &'static str;

    /// Records that consumer `$1` processed message `$2`, now; touches no row (and writes
    /// nothing) when it was recorded before.
    const RECORD_PROCESSED: &'static str;

    /// The failure count (`i64`) of consumer `$1` on message `$2`; no row when it has none.
    const ATTEMPTS: &'static str;

    /// Sets the last error of consumer `$1` on message `$2` to `$3`, failed now, returning the
    /// count (`i64`); no row when no failure is counted. (Returning nothing where
    /// [`FAILURE_RETURNS_COUNT`](Dialect::FAILURE_RETURNS_COUNT) is `false`.)
    const NOTE_FAILURE: &'static str;

    /// Counts one more failure of consumer `$1` on message `$2` with error `$3`, failed now
    /// (the first makes the row), returning the count (`i64`). (Returning nothing where
    /// [`FAILURE_RETURNS_COUNT`](Dialect::FAILURE_RETURNS_COUNT) is `false`.)
    const COUNT_FAILURE: &'static str;

    /// Whether [`NOTE_FAILURE`](Dialect::NOTE_FAILURE) and
    /// [`COUNT_FAILURE`](Dialect::COUNT_FAILURE) return the count themselves (`RETURNING`, on
    /// PostgreSQL and SQLite). Where they cannot (MySQL has no `RETURNING`), each runs in a
    /// transaction of its own followed by [`ATTEMPTS`](Dialect::ATTEMPTS), which reads the
    /// count it left while the row is still locked.
    const FAILURE_RETURNS_COUNT: bool;

    /// Forgets the failures of consumer `$1` on message `$2` (on the databases with numbered
    /// placeholders, `NUMBERED_CLEAR_FAILURES`).
    const CLEAR_FAILURES: &'static str;

    /// Deletes up to `$3` messages that consumer `$1` processed more than `$2` milliseconds
    /// ago.
    const PURGE_CONSUMED: &'static str;

    /// Deletes up to `$3` failure counts of consumer `$1` last failed more than `$2`
    /// milliseconds ago.
    const PURGE_FAILURES: &'static str;

    /// How many rows a statement wrote (sqlx gives each database's result type its own
    /// `rows_affected`, and no trait for it).
    fn rows_affected(done: &Self::QueryResult) -> u64;
}
