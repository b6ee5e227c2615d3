//! The databases the outbox and the consumers run on.

use sqlx::Pool;

use crate::storage::EventStorage;

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

/// What seals [`Backend`]: a trait no other crate can name, so none can implement it.
mod sealed {
    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for sqlx::Postgres {}
    #[cfg(feature = "sqlite")]
    impl Sealed for sqlx::Sqlite {}
    #[cfg(feature = "mysql")]
    impl Sealed for sqlx::MySql {}
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
/// [`Error::Migrate`](crate::Error::Migrate) when the database cannot be reached or a
/// migration fails. On PostgreSQL and SQLite nothing of a failed migration is left applied. On
/// MySQL, where each `CREATE TABLE` commits by itself, what the migration created before it
/// failed stays, and its row in `_idem_events_migrations` stays marked unfinished
/// (`success = FALSE`): later calls fail with `MigrateError::Dirty` until that row is deleted,
/// and then complete the migration, whose statements create only what is missing.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), crate::Error> {
    DB::migrate(pool).await
}
