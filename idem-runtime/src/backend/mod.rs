//! The narrow traits each database backend implements: the whole of idem's SQL lives behind
//! them. A backend supplies its [`Dialect`](dialect::Dialect), which gives it the statements
//! every database shares ([`SharedStorage`], and the operator's, [`Inspection`]), and implements
//! [`Storage`] for the rest.

use std::future::Future;

use sqlx::{Pool, Transaction};

use std::time::Duration;

use crate::record::{Abandoned, KeyRecord, KeyRef, Start, Started};

pub(crate) use inspection::{ClaimCounts, Inspection};
pub(crate) use rekeying::{Locked, LockedRow, Rekeying, Rewrite, SettledRow};
pub(crate) use shared::SharedStorage;

/// What [`Storage::begin_claim`] found.
pub(crate) enum Begun<'c, DB: sqlx::Database> {
    /// The transaction holds the key; the handler may run in it. The mark, where the database
    /// gives one, identifies the claiming transaction to its completion
    /// ([`Completion::mark`](crate::record::Completion::mark)).
    Acquired(Transaction<'c, DB>, Option<String>),
    /// Another transaction holds the key; this one was ended ([`Storage::begin_claim`]).
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        expect(
            dead_code,
            reason = "SQLite's writers queue: a claim there never meets another"
        )
    )]
    Busy,
    /// The key has a live row; the transaction was ended ([`Storage::begin_claim`]).
    Live(KeyRecord),
}

impl<DB: sqlx::Database> std::fmt::Debug for Begun<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Acquired(..) => f.write_str("Acquired"),
            Self::Busy => f.write_str("Busy"),
            Self::Live(record) => f.debug_tuple("Live").field(record).finish(),
        }
    }
}

/// A transactional claim of a key, as [`Storage::begin_claim`] takes it and
/// [`Storage::undo_handler`] takes it again: the key, and the limits of the transaction the
/// handler runs in.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(
    not(all(feature = "postgres", feature = "sqlite")),
    expect(
        dead_code,
        reason = "PostgreSQL alone reads the timeouts, SQLite alone the undo point"
    )
)]
pub(crate) struct ClaimRequest<'a> {
    /// The key.
    pub(crate) key: &'a KeyRef,
    /// How long one statement of the transaction may run, where the database can bound its
    /// statements (`None`: unbounded).
    pub(crate) statement_timeout: Option<Duration>,
    /// How long the transaction may stay idle before the database ends it, where it can.
    pub(crate) idle_timeout: Duration,
    /// Whether the handler's writes may be undone: its 5xx outcomes are stored.
    pub(crate) undo_point: bool,
}

/// What one [`Storage::purge_batch`] deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Purged {
    /// Rows deleted.
    pub(crate) rows: u64,
    /// Where the batch ended, for the next batch to start from, on a database that keeps a
    /// deleted row's index entries for a while (PostgreSQL until a vacuum, MariaDB until its
    /// purge thread gets to them): the latest expiry it deleted, in microseconds since the Unix
    /// epoch. Without it every batch would walk the index past all the rows the batches before
    /// it deleted. `None` where the database has no use for it.
    pub(crate) last: Option<i64>,
}

/// What [`Storage::undo_handler`] came to.
#[derive(Debug)]
pub(crate) enum Undone {
    /// The handler's writes are undone and the transaction holds the key, under this mark
    /// (where the database gives one): its outcome may be stored.
    Kept(Option<String>),
    /// The handler's writes are undone, and another transaction took the key meanwhile (it was
    /// free for an instant): the outcome is not stored.
    #[cfg_attr(
        not(feature = "postgres"),
        expect(dead_code, reason = "only PostgreSQL lets the key go to undo")
    )]
    Taken,
    /// The handler ended the claim's transaction itself (`COMMIT`, `ROLLBACK`): nothing can be
    /// undone or stored.
    Ended,
}

mod dialect;
mod inspection;
mod rekeying;
mod shared;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// A database that can hold idempotency keys in the same transaction as the handler's writes:
/// `sqlx::Postgres` (feature `postgres`), `sqlx::Sqlite` (feature `sqlite`) or `sqlx::MySql`
/// (feature `mysql`, MySQL and MariaDB).
///
/// The `#[idempotent]` macro picks the backend from the handler's transaction type
/// (`&mut Transaction<'_, Postgres>` selects `sqlx::Postgres`); its output has the same shape
/// for every backend. Use it as a bound to write code generic over the database
/// (`Store<DB: Backend>`); it is sealed: idem implements it, applications do not.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a database idem can store keys in",
    label = "the transaction's database must be one idem supports",
    note = "idem supports `sqlx::Postgres` (feature `postgres`), `sqlx::Sqlite` (feature `sqlite`) and `sqlx::MySql` (feature `mysql`) of the sqlx that `idem-runtime` depends on (0.9); a different sqlx version in your Cargo.toml gives this error too"
)]
#[allow(private_bounds)]
pub trait Backend: Storage + sealed::Sealed {}

#[cfg(feature = "postgres")]
impl Backend for sqlx::Postgres {}
#[cfg(feature = "sqlite")]
impl Backend for sqlx::Sqlite {}
#[cfg(feature = "mysql")]
impl Backend for sqlx::MySql {}

/// What seals [`Backend`]: a trait no other crate can name, so none can implement it. Every
/// database with idem's [`Storage`] has it, and only those: the crate-private `Storage` is
/// implemented here alone.
mod sealed {
    pub trait Sealed {}
    impl<DB: super::Storage> Sealed for DB {}
}

/// The SQL of one database: everything idem runs, behind one narrow trait. Private: an
/// application reaches it only through [`Store`](crate::store::Store), the handlers and the tasks, and
/// a `DB: Backend` bound does not let it call these.
///
/// What every database does alike is its supertrait [`SharedStorage`], which a database gets
/// from its [`Dialect`](dialect::Dialect); what each does its own way is here, implemented in
/// the backend's module.
pub(crate) trait Storage: SharedStorage + Inspection + Rekeying {
    /// Whether the database admits one writing transaction at a time (SQLite). Writers of a
    /// process then queue in the process, not in the database while holding a connection.
    const SINGLE_WRITER: bool = false;

    /// Begins the transaction a handler runs in on `conn` (READ COMMITTED where the database
    /// has levels) and claims the request's key in it, without waiting for other transactions:
    /// either this transaction now holds the key, or another does, or the key has a live row
    /// (returned).
    ///
    /// With a `statement_timeout`, a database that can bound its statements does so for this
    /// transaction: a handler stopped in the middle of a statement then cannot hold its
    /// connection and its key for longer than the statement may run. A database that can end
    /// a transaction left idle ends this one after `idle_timeout`: a server that never hears
    /// its client go (a partition) frees the key by itself.
    ///
    /// When the key is not acquired, the transaction has been dropped: every answer has been
    /// read and its `ROLLBACK` is queued on the connection, sent as it goes back to the pool
    /// (sqlx's test of a returned connection), so that a replay does not wait for it. Until
    /// then it may hold the key's advisory lock (PostgreSQL) or a shared lock on its row
    /// (MySQL), which another claim of the key answers 409 for that instant. SQLite, whose
    /// `BEGIN IMMEDIATE` took the database's write lock, rolls back before returning: every
    /// other writer would wait on that lock.
    ///
    /// `undo_point`: the handler's 5xx outcomes are stored, so its writes may be undone
    /// ([`undo_handler`](Storage::undo_handler)). A database that can take the point they are
    /// undone to with the claim, in the same call, does so here (SQLite), and its
    /// [`before_handler`](Storage::before_handler) does nothing.
    fn begin_claim<'c>(
        conn: &'c mut Self::Connection,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Begun<'c, Self>, crate::error::Error>> + Send;

    /// Prepares the transaction of a handler whose 5xx outcomes are stored for
    /// [`undo_handler`](Storage::undo_handler), before the handler runs; nothing where undoing
    /// needs no preparation (PostgreSQL) or [`begin_claim`](Storage::begin_claim) prepared it
    /// (SQLite).
    fn before_handler(
        _conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + '_ {
        async { Ok(()) }
    }

    /// Undoes a handler's writes for a 5xx outcome that is stored, keeping the key or taking it
    /// again in a fresh transaction on `conn` (as [`begin_claim`](Storage::begin_claim) takes
    /// `request`). `mark` is the claim's ([`Begun::Acquired`]).
    fn undo_handler<'c>(
        conn: &'c mut Self::Connection,
        request: ClaimRequest<'c>,
        mark: Option<&'c str>,
    ) -> impl Future<Output = Result<Undone, crate::error::Error>> + Send + 'c;

    /// Reads the live row of `key`, without taking any lock.
    fn lookup<'c>(
        conn: &'c mut Self::Connection,
        key: &'c KeyRef,
    ) -> impl Future<Output = Result<Option<KeyRecord>, crate::error::Error>> + Send + 'c;

    /// Makes sure a transaction is open on `conn` before idem rolls back the handler's: a
    /// handler that ended the transaction itself (`COMMIT`, `ROLLBACK`) would otherwise make
    /// that rollback fail where the database refuses a `ROLLBACK` outside a transaction
    /// (SQLite), and sqlx, which counts transactions on its side, would then count the pooled
    /// connection as inside one for good.
    fn ensure_open(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + '_;

    /// Takes an external-mode claim in a statement of its own: a committed `started` row with a
    /// lease, replacing an expired row or an abandoned claim whose lease ran out.
    fn start<'c>(
        conn: &'c mut Self::Connection,
        start: &'c Start<'c>,
    ) -> impl Future<Output = Result<Started, crate::error::Error>> + Send + 'c;

    /// Begins the transaction of a handler whose request has no key (`key_optional`): as a
    /// claim's would begin (its isolation level, and where the database has them its statement
    /// and idle timeouts), claiming nothing. By default [`begin_write`](Self::begin_write).
    fn begin_handler(
        conn: &mut Self::Connection,
        statement_timeout: Option<Duration>,
        idle_timeout: Duration,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, crate::error::Error>> + Send {
        let _ = (statement_timeout, idle_timeout);
        Self::begin_write(conn)
    }

    /// Begins a transaction on `conn` that is going to write: a plain `BEGIN`, written once
    /// here for every database; SQLite's takes its write lock at once (`BEGIN IMMEDIATE`), so
    /// that a transaction that reads first cannot fail to upgrade its lock later.
    fn begin_write(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, crate::error::Error>> + Send {
        async { Ok(Transaction::begin(conn, None).await?) }
    }

    /// Deletes up to `limit` rows past their expiry, oldest first, skipping rows that live
    /// requests hold; `from` is where the previous batch of the same pass ended
    /// ([`Purged::last`]), `None` for the first.
    fn purge_batch(
        conn: &mut Self::Connection,
        limit: i64,
        from: Option<i64>,
    ) -> impl Future<Output = Result<Purged, crate::error::Error>> + Send + '_;

    /// Reclaims up to `limit` `started` rows whose lease ran out: renews their lease by `lease`
    /// under `token`, so that no retry takes them over while the recovery decides. Rows with
    /// recorded steps only `with_steps`.
    fn reclaim_abandoned(
        conn: &mut Self::Connection,
        limit: i64,
        lease: Duration,
        token: i64,
        with_steps: bool,
    ) -> impl Future<Output = Result<Vec<Abandoned>, crate::error::Error>> + Send + '_;

    /// How many other sessions are running a statement on the database now, as far as the
    /// database user may see: the signal of an adaptive purge
    /// ([`Pacing::Adaptive`](crate::tasks::Pacing::Adaptive)). `None` where the database has
    /// no such list (SQLite).
    fn others_active(
        _conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<Option<u64>, crate::error::Error>> + Send + '_ {
        async { Ok(None) }
    }

    /// Whether `error` says the transaction was aborted by an earlier failed statement.
    fn is_transaction_aborted(error: &crate::error::Error) -> bool;

    /// Run first when a handler answered 5xx: whether the last statement it ran on `conn` was
    /// refused because its transaction lost a conflict with another and the database rolled the
    /// transaction back whole (MySQL's deadlock error, which is also how a Galera node aborts a
    /// local transaction whose rows another node's transaction committed first). Nothing of the
    /// request was committed then, and the 5xx is the handler's report of it: the answer is a
    /// 409 to retry. `false` where a database does not end a transaction by itself
    /// (PostgreSQL, SQLite).
    fn lost_a_conflict(
        _conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + '_ {
        async { Ok(false) }
    }
}

/// Creates or upgrades idem's tables in the database behind `pool`.
///
/// Safe to call on every start: applied migrations are recorded in their own table
/// (`_idem_migrations`), apart from the application's own `_sqlx_migrations`; on PostgreSQL
/// concurrent callers serialise on an advisory lock.
///
/// # Errors
///
/// [`Error::Migrate`](crate::error::Error::Migrate) when the database cannot be reached or a
/// migration fails; nothing of a failed migration is left applied.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), crate::error::Error> {
    DB::migrate(pool).await
}
