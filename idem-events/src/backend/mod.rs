//! The databases the outbox and the consumers run on ([`Backend`], [`migrate`]), and their SQL
//! behind narrow traits: a backend supplies its [`Dialect`](dialect::Dialect), which gives it
//! the statements every database shares ([`SharedEventStorage`]), and implements
//! [`EventStorage`] for the rest.

use std::{future::Future, time::Duration};

use sqlx::{Pool, Transaction, pool::PoolConnection};

use crate::message::Message;

mod dialect;
mod shared;

pub(crate) use shared::SharedEventStorage;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// Events of one topic that a relay holds (no other relay publishes that topic meanwhile),
/// oldest first.
pub(crate) struct Batch<DB: EventStorage> {
    /// The topic.
    pub topic: String,
    /// The events, in the order to publish them.
    pub messages: Vec<Message>,
    /// Their rows.
    pub(crate) rows: Vec<i64>,
    /// What holds the topic: a transaction with its row locked, or a lease.
    pub(crate) held: DB::Held,
}

impl<DB: EventStorage> Batch<DB> {
    /// The batch of `topic` from its rows `(id, event id, payload)`, in order.
    pub(crate) fn new(topic: String, rows: Vec<(i64, String, String)>, held: DB::Held) -> Self {
        let mut ids = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        for (id, event_id, payload) in rows {
            ids.push(id);
            messages.push(Message::new(event_id, topic.clone(), payload));
        }
        Self {
            topic,
            messages,
            rows: ids,
            held,
        }
    }
}

/// What a relay's pass asks [`EventStorage::take_batch`] for.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(
    not(feature = "sqlite"),
    expect(
        dead_code,
        reason = "SQLite alone holds a topic with a lease, under the relay's name"
    )
)]
pub(crate) struct Wanted<'a> {
    /// The relay's name, under which it holds the topic where a lease does (SQLite).
    pub(crate) relay: &'a str,
    /// The topic of the relay's last batch: the topics after it come first, so that every
    /// topic gets its turn.
    pub(crate) after: Option<&'a str>,
    /// Topics not to take.
    pub(crate) skip: &'a [String],
    /// The most events.
    pub(crate) limit: i64,
    /// How long a lease on the topic lasts (SQLite) if the relay stops without letting go.
    pub(crate) lease: Duration,
}

/// The outbox's and the consumers' statements of one database. Private: applications reach
/// them only through the relay, the consumers and [`enqueue`](crate::outbox::enqueue).
///
/// What every database does alike is its supertrait [`SharedEventStorage`], which a database
/// gets from its [`Dialect`](dialect::Dialect); what each does its own way (how a relay holds a
/// topic) is here, implemented in the backend's module.
pub(crate) trait EventStorage: SharedEventStorage {
    /// What holds a topic while its batch is published, and all that letting go of it needs.
    type Held: Send;

    /// Begins a transaction on `conn` that is going to write: a plain `BEGIN`, written once
    /// here for every database; SQLite's takes its write lock at once (`BEGIN IMMEDIATE`), so
    /// that a transaction that reads first cannot fail to upgrade its lock later.
    fn begin_write(
        conn: PoolConnection<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, crate::error::Error>> + Send {
        async { Ok(Transaction::begin(conn, None).await?) }
    }

    /// Takes a topic with waiting events that no other relay holds and is not in
    /// [`skip`](Wanted::skip), and up to [`limit`](Wanted::limit) of its events, in order. The
    /// topics after [`after`](Wanted::after) come first, so that every topic gets its turn.
    /// `None` when there is no such topic; nothing is written then. Whether any event waits is
    /// read first, on every database: an idle relay takes no lock.
    fn take_batch<'p>(
        pool: &'p Pool<Self>,
        wanted: Wanted<'p>,
    ) -> impl Future<Output = Result<Option<Batch<Self>>, crate::error::Error>> + Send + 'p {
        async move {
            if !Self::any_waiting(pool).await? {
                return Ok(None);
            }
            Self::hold_batch(pool, wanted).await
        }
    }

    /// [`take_batch`](EventStorage::take_batch) once events wait: holds a topic, and reads its
    /// batch.
    fn hold_batch<'p>(
        pool: &'p Pool<Self>,
        wanted: Wanted<'p>,
    ) -> impl Future<Output = Result<Option<Batch<Self>>, crate::error::Error>> + Send + 'p;

    /// Marks a batch's events published and lets go of its topic.
    fn mark_published(
        batch: Batch<Self>,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send;

    /// Lets go of a batch's topic, its events still waiting.
    fn abandon(batch: Batch<Self>) -> impl Future<Output = Result<(), crate::error::Error>> + Send;
}

/// A duration in whole milliseconds, as statements bind it (saturating).
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// An attempt count as the database holds it (absent: none).
fn count(attempts: Option<i64>) -> u32 {
    attempts.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// A database that can hold the outbox and the consumers' records: `sqlx::Postgres` (feature
/// `postgres`), `sqlx::Sqlite` (feature `sqlite`) or `sqlx::MySql` (feature `mysql`: MySQL 8 or
/// MariaDB 10.11).
///
/// Use it as a bound to write code generic over the database. It is sealed: idem implements
/// it, applications do not, and the statements behind it are not reachable through it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a database idem-events can keep an outbox in",
    label = "the transaction's database must be one idem-events supports",
    note = "idem-events supports `sqlx::Postgres` (feature `postgres`), `sqlx::Sqlite` (feature `sqlite`) and `sqlx::MySql` (feature `mysql`) of the sqlx that `idem-events` depends on (0.9); a different sqlx version in your Cargo.toml gives this error too"
)]
#[allow(private_bounds)]
pub trait Backend: EventStorage + sealed::Sealed {}

#[cfg(feature = "postgres")]
impl Backend for sqlx::Postgres {}
#[cfg(feature = "sqlite")]
impl Backend for sqlx::Sqlite {}
#[cfg(feature = "mysql")]
impl Backend for sqlx::MySql {}

/// What seals [`Backend`]: a trait no other crate can name, so none can implement it. Every
/// database with the crate's [`EventStorage`] has it, and only those: the crate-private
/// `EventStorage` is implemented here alone.
mod sealed {
    pub trait Sealed {}
    impl<DB: super::EventStorage> Sealed for DB {}
}

/// Creates or upgrades the outbox's and the consumers' tables in the database behind `pool`.
///
/// Safe to call on every start: applied migrations are recorded in their own table
/// (`_idem_events_migrations`), apart from the application's `_sqlx_migrations` and from the
/// key table's (`idem_runtime::migrate`); on PostgreSQL and MySQL concurrent callers serialise
/// on an advisory lock. A database whose event tables an earlier release of idem created (when
/// they came with the key table) is adopted as it is.
///
/// # Errors
///
/// [`Error::Migrate`](crate::error::Error::Migrate) when the database cannot be reached or a
/// migration fails. On PostgreSQL and SQLite nothing of a failed migration is left applied. On
/// MySQL, where each `CREATE TABLE` commits by itself, what the migration created before it
/// failed stays, and its row in `_idem_events_migrations` stays marked unfinished
/// (`success = FALSE`): later calls fail with `MigrateError::Dirty` until that row is deleted,
/// and then complete the migration, whose statements create only what is missing.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), crate::error::Error> {
    DB::migrate(pool).await
}
