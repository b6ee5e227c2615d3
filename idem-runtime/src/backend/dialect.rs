//! What differs between databases in the statements they share: the contract each backend
//! fulfils so that [`SharedStorage`](super::shared::SharedStorage) runs on it.
//!
//! Where a statement is written, one place per database:
//!
//! - a statement the shared code runs ([`SharedStorage`](super::shared::SharedStorage),
//!   [`Inspection`](super::inspection::Inspection), [`Rekeying`](super::rekeying::Rekeying)) is written in the database's
//!   `impl Dialect`, or here as a default where PostgreSQL and SQLite spell it alike (MySQL,
//!   whose parameters are `?` and whose `key` is a reserved word, writes its own); what the
//!   shared code builds from parts ([`UPDATE_BY_KEY`](Dialect::UPDATE_BY_KEY),
//!   [`KEY_COLUMN`](Dialect::KEY_COLUMN), [`param`](Dialect::param)) is assembled in
//!   `shared.rs`, `inspection.rs` or `rekeying.rs`;
//! - a statement only one database runs (its claim, its lookup, its purge) is a constant of
//!   that database's file, beside the `impl Storage` that runs it;
//! - on PostgreSQL, the external-mode start is a SQL function (`idem_start`) that the
//!   migrations create, so that it takes one round trip; the file's constant (`START`) is the
//!   call.

use std::{future::Future, time::Duration};

use sqlx::{Encode, Type, migrate::Migrator};

use super::rekeying::KeyPart;
use crate::record::Completion;

/// The SQL and the binding in which one database differs from the others in the statements
/// they share. Implemented once per database (`backend/postgres.rs`, `backend/sqlite.rs`,
/// `backend/mysql.rs`); every database that implements it gets
/// [`SharedStorage`](super::shared::SharedStorage), the statements written once for all.
///
/// A database backend supplies, in an `impl Dialect for` its sqlx database type:
///
/// - the three statements whose SQL differs: [`COMPLETE`](Dialect::COMPLETE),
///   [`COMPLETE_STARTED`](Dialect::COMPLETE_STARTED) and [`LAPSE`](Dialect::LAPSE), with the parameters
///   documented on each, bound in that order: the order in which the statements use them, so
///   that a database whose parameters are positional (MySQL's `?`) takes the same binds;
/// - the type its `response_status` column holds ([`Status`](Dialect::Status), from
///   [`status`](Dialect::status)), how a time to live is bound ([`Expiry`](Dialect::Expiry),
///   from [`expiry`](Dialect::expiry)), the completion's last parameter
///   ([`Guard`](Dialect::Guard), from [`completion_guard`](Dialect::completion_guard)), and
///   how the completion runs and tells a claim gone ([`run_completion`](Dialect::run_completion));
/// - its migrations ([`MIGRATOR`](Dialect::MIGRATOR)), and how many rows a statement wrote
///   ([`rows_affected`](Dialect::rows_affected)).
///
/// The shared statements also need sqlx to run statements on the database's connection and to
/// encode and decode a few plain types (text, bytes, `i64`, JSON): the `where` clause of
/// `SharedStorage`'s one implementation lists them, and every sqlx driver provides them. The
/// backend then implements [`Storage`](super::Storage) for what it does its own way (claiming,
/// lookups, external-mode starts, purging, recovery), which seals it, and is added to
/// [`Backend`](super::Backend).
pub(super) trait Dialect: sqlx::Database {
    /// Stores a completed response for a key the transaction holds, writing nothing unless the
    /// claim is still this transaction's (or, where that cannot be told in SQL, no live row is
    /// in the way). Parameters: `$1` method, `$2` path, `$3` fingerprint, `$4`
    /// [`Status`](Dialect::Status), `$5` headers (JSON), `$6` body, `$7` the retention as an
    /// [`Expiry`](Dialect::Expiry), `$8` scope, `$9` key, `$10` the [`Guard`](Dialect::Guard):
    /// the order in which an `UPDATE … SET … WHERE` uses them.
    const COMPLETE: &'static str;

    /// Completes the `started` row owned by `$7`: `$1` [`Status`](Dialect::Status), `$2`
    /// headers (JSON), `$3` body, `$4` an [`Expiry`](Dialect::Expiry) (`NULL` to keep the row's
    /// expiry), `$5` scope, `$6` key, `$7` claim token.
    const COMPLETE_STARTED: &'static str;

    /// Ends the lease of the `started` row owned by `$3` now, keeping its recorded steps: `$1`
    /// scope, `$2` key, `$3` claim token.
    const LAPSE: &'static str;

    /// Deletes the `started` row owned by `$3`: `$1` scope, `$2` key, `$3` claim token. The
    /// default is written for PostgreSQL and SQLite, as are the three below; a database that
    /// spells them otherwise (MySQL's `?` parameters, its reserved word `key`) gives its own.
    const RELEASE: &'static str = "DELETE FROM idem_keys \
         WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3";

    /// [`RELEASE`](Dialect::RELEASE), only of a row without recorded steps.
    const RELEASE_WITHOUT_STEPS: &'static str = "DELETE FROM idem_keys \
         WHERE scope = $1 AND key = $2 AND status = 'started' AND claim_token = $3 \
           AND steps IS NULL";

    /// Records the steps `$1` (JSON) of the `started` row owned by `$4`: `$2` scope, `$3` key.
    const RECORD_STEPS: &'static str = "UPDATE idem_keys SET steps = $1 \
         WHERE scope = $2 AND key = $3 AND status = 'started' AND claim_token = $4";

    /// The `steps` column of the row owned by `$3`: `$1` scope, `$2` key.
    const RECORDED_STEPS: &'static str =
        "SELECT steps FROM idem_keys WHERE scope = $1 AND key = $2 AND claim_token = $3";

    /// How a statement that updates one key's row (`WHERE scope = … AND key = …` and more)
    /// begins: `UPDATE idem_keys`, or a spelling that reaches the row by the primary key only,
    /// where the optimizer could choose another index and lock other keys' rows on its way.
    const UPDATE_BY_KEY: &'static str = "UPDATE idem_keys";

    /// [`UPDATE_BY_KEY`](Dialect::UPDATE_BY_KEY) for a `DELETE`.
    const DELETE_BY_KEY: &'static str = "DELETE FROM idem_keys";

    /// The migrations that create and upgrade the key table (`sqlx::migrate!` of the
    /// backend's directory); recorded in `_idem_migrations`.
    const MIGRATOR: Migrator;

    /// The integer the `response_status` column holds.
    type Status: for<'q> Encode<'q, Self>
        + for<'r> sqlx::Decode<'r, Self>
        + Type<Self>
        + Into<i64>
        + Send;

    /// An HTTP status as [`Status`](Dialect::Status).
    ///
    /// # Errors
    ///
    /// When the column's type cannot hold `status`.
    fn status(status: u16) -> Result<Self::Status, crate::error::Error>;

    /// A time to live as the statements bind it (`None`: keep the row's expiry).
    type Expiry: for<'q> Encode<'q, Self> + Type<Self> + Send;

    /// `retention` as [`Expiry`](Dialect::Expiry).
    fn expiry(retention: Option<Duration>) -> Self::Expiry;

    /// The last parameter of [`COMPLETE`](Dialect::COMPLETE): what makes the write
    /// conditional, or the time it happens.
    type Guard<'a>: Encode<'a, Self> + Type<Self> + Send;

    /// The [`Guard`](Dialect::Guard) of the completion `c`.
    fn completion_guard<'a>(c: &Completion<'a>) -> Self::Guard<'a>;

    /// Runs `completion` ([`COMPLETE`](Dialect::COMPLETE), its parameters bound) in the claim's
    /// transaction open on `conn`: whether it wrote the key's row. `false` also when the claim's
    /// transaction is no longer the one open on `conn` (the handler ended it itself), where the
    /// statement's own `WHERE` cannot tell: nothing was written then.
    ///
    /// # Errors
    ///
    /// When the database fails.
    fn run_completion<'q>(
        conn: &'q mut Self::Connection,
        completion: sqlx::query::Query<'q, Self, Self::Arguments>,
    ) -> impl Future<Output = Result<bool, crate::error::Error>> + Send + 'q;

    /// How many rows a statement wrote (sqlx gives each database's result type its own
    /// `rows_affected`, and no trait for it).
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// The current time as an SQL expression of the type the table's times have.
    const NOW: &'static str;

    /// An hour from now, as [`NOW`](Dialect::NOW) is spelled.
    const IN_AN_HOUR: &'static str;

    /// The current time in Unix milliseconds, as an SQL expression: the
    /// [`Inspection`](super::inspection::Inspection) statements report ages and time left in it.
    const NOW_MS: &'static str;

    /// `column`, a time, in Unix milliseconds.
    fn ms(column: &str) -> String;

    /// The `key` column as a statement names it (a reserved word on MySQL).
    const KEY_COLUMN: &'static str = "key";

    /// `scope` and `key` selected as text, under those names.
    const SCOPE_AND_KEY: &'static str = "scope, key";

    /// The type a `CAST` turns an integer into to read it as a 64-bit signed integer.
    const BIGINT: &'static str = "BIGINT";

    /// The type a `CAST` turns JSON into to read it as text.
    const TEXT: &'static str = "TEXT";

    /// The placeholder of the `n`th parameter, from 1.
    fn param(n: usize) -> String {
        format!("${n}")
    }

    /// Where a claim being written by another transaction at this instant must not be waited
    /// for by an operator's release (MySQL, whose transactional claims are uncommitted rows):
    /// a statement that locks the key's row without waiting and reads its `status` (`$1`
    /// scope, `$2` key; `parked` for a parked claim), skipping a row another transaction holds. `None` where a row an
    /// operator can see is never held for long (PostgreSQL, SQLite): the release deletes
    /// directly.
    const LOCK_UNHELD_ROW: Option<&'static str> = None;

    /// Deletes at most `$2` completed keys of the scope `$1`, expired or not: one batch of an
    /// erasure ([`Store::forget`](crate::store::Store::forget)), so that a scope of millions of
    /// keys is deleted in short statements rather than one long transaction. Never a `started`
    /// row (a claim in flight, a parked one): the status is checked again on the row deleted, as
    /// a row the subquery chose may have become a claim since (a retry taking an expired key).
    /// The default, for PostgreSQL and SQLite, picks the batch by the primary key `(scope, key)`
    /// in a subquery (neither has `DELETE … LIMIT`); MySQL gives its own.
    const FORGET_BATCH: &'static str = "DELETE FROM idem_keys WHERE scope = $1 \
           AND status = 'completed' AND key IN ( \
           SELECT key FROM idem_keys WHERE scope = $1 AND status = 'completed' LIMIT $2)";

    /// The rows after a key, `(scope, key)` in the primary key's order, as a condition the
    /// database reads as a range of that key (a row value on PostgreSQL and SQLite), with
    /// the parameters it binds, in order ([`AFTER_KEY_BINDS`](Dialect::AFTER_KEY_BINDS)): the
    /// rekey's pages ([`Store::rekey`](crate::store::Store::rekey)).
    const AFTER_KEY: &'static str = "(scope, key) > ($1, $2)";

    /// What [`AFTER_KEY`](Dialect::AFTER_KEY)'s parameters are, in order.
    const AFTER_KEY_BINDS: &'static [KeyPart] = &[KeyPart::Scope, KeyPart::Key];

    /// How a read that locks the row it finds ends, skipping a row another transaction holds
    /// rather than waiting for it; empty where a transaction of idem's own already excludes
    /// every writer ([`BEGIN_OWN`](Dialect::BEGIN_OWN) on SQLite).
    const LOCK_SKIPPING: &'static str = " FOR UPDATE SKIP LOCKED";

    /// How a transaction of idem's own begins (an operator's row rewrite): at the claims'
    /// isolation level, READ COMMITTED, on PostgreSQL and MySQL (whatever the server's default),
    /// holding the write lock from its start on SQLite.
    const BEGIN_OWN: &'static str;

    /// Checks, before the migrations take their lock, that the connection can carry them
    /// (PostgreSQL: not through a pooler in transaction mode); by default, nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Pooler`](crate::error::Error::Pooler) with what to use instead; a database error.
    fn before_migrate(
        pool: &sqlx::Pool<Self>,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + '_ {
        let _ = pool;
        async { Ok(()) }
    }

    /// Silences, on `conn`, the notices the migrations raise on every start (PostgreSQL:
    /// `relation "_idem_migrations" already exists, skipping`, which sqlx logs at `INFO`), for
    /// [`restore_notices`](Dialect::restore_notices) to undo with what it returns; by
    /// default, nothing.
    ///
    /// # Errors
    ///
    /// A database error.
    fn quiet_notices(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<Option<String>, crate::error::Error>> + Send + '_ {
        let _ = conn;
        async { Ok(None) }
    }

    /// Gives `conn` back the notices [`quiet_notices`](Dialect::quiet_notices) silenced
    /// (`previous`, what it returned).
    ///
    /// # Errors
    ///
    /// A database error: the connection is then not to be used again.
    fn restore_notices(
        conn: &mut Self::Connection,
        previous: Option<String>,
    ) -> impl Future<Output = Result<(), crate::error::Error>> + Send + '_ {
        let _ = (conn, previous);
        async { Ok(()) }
    }
}
