//! Which database errors are faults that pass (a connection that broke, a server shutting down
//! or failing over), as opposed to the database refusing a statement.

/// MySQL and MariaDB: the server runs with `--read-only` (a replica, or a primary demoted by a
/// failover). Its SQLSTATE is the catch-all `HY000`, so it is told by its number.
#[cfg(feature = "mysql")]
const ER_OPTION_PREVENTS_STATEMENT: u16 = 1290;

/// Whether `error` is a fault that passes rather than a refusal of the statement: the
/// connection could not be made or broke, or the server is shutting down, starting, in
/// recovery, or refused a write because it became a read-only standby in a failover. Retried
/// a moment later (on a new connection) the same work can succeed, so a request that met it
/// is answered 503 with `Retry-After`, never 500.
///
/// It is true for:
///
/// - an I/O or TLS error, a pool that timed out or was closed, a crashed connection worker;
/// - SQLSTATE class `08` (connection exception: MySQL's server shutdown 1053 and a Galera node
///   that left the cluster, 1047, answer `08S01`), `57P01`-`57P03` (PostgreSQL's
///   administrator, crash or startup shutdown), `53300` (too many connections), `25006` (a
///   read-only transaction, as a standby answers a write) and `70100` (MariaDB's connection
///   killed, 1927);
/// - MySQL and MariaDB's `--read-only` refusal (1290);
/// - SQLite's busy and locked errors (a writer held the database past the busy timeout).
///
/// A transaction that lost a conflict with another (SQLSTATE class `40`) is not counted here:
/// idem answers it 409.
#[must_use]
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(error) => {
            is_transient_code(error.code().as_deref()) || is_transient_refusal(error.as_ref())
        }
        _ => false,
    }
}

/// Whether a SQLSTATE names a fault that passes (see [`is_transient`]).
fn is_transient_code(code: Option<&str>) -> bool {
    code.is_some_and(|code| {
        code.starts_with("08")
            || matches!(
                code,
                "57P01" | "57P02" | "57P03" | "53300" | "25006" | "70100"
            )
    })
}

/// Whether a backend's own error, which its SQLSTATE does not tell, is a fault that passes.
#[allow(unused_variables)]
fn is_transient_refusal(error: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "mysql")]
    if let Some(error) = error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return error.number() == ER_OPTION_PREVENTS_STATEMENT;
    }
    #[cfg(feature = "sqlite")]
    if error
        .try_downcast_ref::<sqlx::sqlite::SqliteError>()
        .is_some()
    {
        // The extended result code; its low byte is the primary one.
        return error
            .code()
            .and_then(|code| code.parse::<u32>().ok())
            .is_some_and(|code| matches!(code & 0xff, SQLITE_BUSY | SQLITE_LOCKED));
    }
    false
}

/// SQLite's primary result codes for a database another connection holds.
#[cfg(feature = "sqlite")]
const SQLITE_BUSY: u32 = 5;
#[cfg(feature = "sqlite")]
const SQLITE_LOCKED: u32 = 6;

#[cfg(test)]
mod tests {
    use super::{is_transient, is_transient_code};

    #[test]
    fn connection_shutdown_and_read_only_codes_are_transient_and_refusals_are_not() {
        for code in [
            "08000", "08006", "08S01", "08004", "57P01", "57P02", "57P03", "53300", "25006",
            "70100",
        ] {
            assert!(is_transient_code(Some(code)), "{code}");
        }
        // A unique violation, a lost conflict (answered 409), a syntax error, a statement
        // timeout, an aborted transaction, no code at all.
        for code in ["23505", "40001", "40P01", "42601", "57014", "25P02"] {
            assert!(!is_transient_code(Some(code)), "{code}");
        }
        assert!(!is_transient_code(None));
    }

    #[test]
    fn a_broken_connection_or_an_exhausted_pool_is_transient_and_a_missing_row_is_not() {
        let broken = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(is_transient(&sqlx::Error::Io(broken)));
        assert!(is_transient(&sqlx::Error::PoolTimedOut));
        assert!(!is_transient(&sqlx::Error::RowNotFound));
        assert!(!is_transient(&sqlx::Error::ColumnNotFound("id".into())));
    }
}
