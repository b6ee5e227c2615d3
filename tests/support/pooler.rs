//! The PgBouncers of `scripts/pooler up`, as the pooler tests reach them: the URL of one, set
//! by scripts/test's pooler pass, naming a test's own database; and PgBouncer's `KILL` of that
//! database's connections, so that `#[sqlx::test]` can drop it.

use std::process::Command;

use sqlx::PgPool;

/// The URL of the pooler in `$variable` (`POOLER_TRANSACTION_URL`), naming `database` instead
/// of its own.
///
/// # Panics
///
/// When `$variable` is unset or names no database.
pub fn pooler_url(variable: &str, database: &str) -> String {
    let url = std::env::var(variable)
        .unwrap_or_else(|_| panic!("{variable} is set by scripts/test (scripts/pooler up)"));
    let (server, _) = url.rsplit_once('/').expect("a database path");
    format!("{server}/{database}")
}

/// Ends the connections to `database` that the pooler in `$variable` holds, so that the
/// database can be dropped at once: its admin console's `KILL`, then `RESUME` (a killed
/// database makes new clients wait until it is resumed, and the next run's test of the same
/// name gets a database of the same name), through `psql`.
///
/// # Panics
///
/// When `psql` cannot be run or the pooler refuses.
pub fn release_pooled(variable: &str, database: &str) {
    let admin = pooler_url(variable, "pgbouncer");
    let killed = Command::new("psql")
        .args([admin.as_str(), "-Atq"])
        .args([
            "-c",
            &format!("KILL {database}"),
            "-c",
            &format!("RESUME {database}"),
        ])
        .output()
        .expect("run psql");
    assert!(
        killed.status.success(),
        "KILL and RESUME {database} on the pooler: {}",
        String::from_utf8_lossy(&killed.stderr)
    );
}

/// Checks that a refused start or migration left nothing in the database `pool` reaches
/// directly: no table, no advisory lock.
///
/// # Panics
///
/// When something is left, or the database cannot be asked.
pub async fn assert_nothing_left(pool: &PgPool) {
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            .fetch_one(pool)
            .await
            .expect("count tables");
    assert_eq!(tables, 0, "no migration ran");
    let locks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(pool)
    .await
    .expect("count locks");
    assert_eq!(locks, 0, "no advisory lock is left");
}
