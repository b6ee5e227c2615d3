//! The narrow trait each database backend implements: the whole of idem's SQL lives behind it.

use std::future::Future;

use sqlx::{Pool, Transaction, migrate::MigrateError};

use crate::record::{Completion, KeyRef, Lookup};

mod postgres;

/// A database that can hold idempotency keys in the same transaction as the handler's writes.
///
/// The `#[idempotent]` macro picks the backend from the handler's transaction type
/// (`&mut Transaction<'_, Postgres>` selects [`sqlx::Postgres`]); its output has the same shape
/// for every backend.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a database idem can store keys in",
    label = "the transaction's database must implement `idem_runtime::Backend`",
    note = "idem supports `sqlx::Postgres`"
)]
pub trait Backend: sqlx::Database + Sized {
    /// Human-readable name, for logs.
    const NAME: &'static str;

    /// Begins the transaction a handler runs in (READ COMMITTED where the database has levels).
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_;

    /// Claims `key` inside `conn`'s transaction, in one round trip and without waiting for other
    /// transactions: either this transaction now holds the key, or the live record (if any) is
    /// returned.
    fn claim<'c>(
        conn: &'c mut Self::Connection,
        key: &'c KeyRef,
    ) -> impl Future<Output = Result<Lookup, sqlx::Error>> + Send + 'c;

    /// Stores a completed response for a key this transaction holds, replacing an expired row.
    /// Returns `false` if a live row is in the way (nothing was written).
    fn complete<'c>(
        conn: &'c mut Self::Connection,
        completion: &'c Completion<'c>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// Marks the point that [`Backend::rollback_to_savepoint`] returns to.
    fn savepoint(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Undoes everything since [`Backend::savepoint`], keeping the claim.
    fn rollback_to_savepoint(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Creates or upgrades the key table.
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), MigrateError>> + Send + '_;
}

/// Creates or upgrades idem's tables in the database behind `pool`.
///
/// Safe to call on every start: applied migrations are recorded in their own table
/// (`_idem_migrations`), apart from the application's own `_sqlx_migrations`, and concurrent
/// callers serialise on a lock.
///
/// # Errors
///
/// [`MigrateError`] when the database cannot be reached or a migration fails; nothing of a
/// failed migration is left applied.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), MigrateError> {
    DB::migrate(pool).await
}
