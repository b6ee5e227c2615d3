//! Opening a SQLite file as idem expects it: the public `idem_runtime::sqlite` (documented
//! there).

use std::{path::Path, time::Duration};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

/// How long a connection waits for another's write lock before SQLite answers "busy".
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections in the pool [`connect`] opens: readers run beside the one writer.
const MAX_CONNECTIONS: u32 = 8;

/// The options [`connect`] uses, to adjust before connecting: the file at `path`, created if
/// missing; write-ahead logging (readers do not block the writer, nor it them);
/// `synchronous = NORMAL` (durable at every checkpoint, and a crash of the process loses
/// nothing committed); a busy timeout of 30 s; foreign keys enforced.
pub fn connect_options(path: impl AsRef<Path>) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(BUSY_TIMEOUT)
        .foreign_keys(true)
}

/// Opens (or creates) the SQLite file at `path` with [`connect_options`], in a pool of eight
/// connections. Run [`migrate`](crate::backend::migrate) on it before serving.
///
/// # Errors
///
/// The file cannot be opened or created (its directory is missing, or not writable), or it is
/// not a SQLite database.
pub async fn connect(path: impl AsRef<Path>) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(MAX_CONNECTIONS)
        .connect_with(connect_options(path))
        .await
}
