//! The service behind PgBouncer (Debian's 1.18) in transaction mode, which this PgBouncer
//! cannot carry sqlx's prepared statements through: the service refuses to start and says why,
//! in idem's words on one line (`payments: …`), never sqlx's bare error nor a `Debug` dump.
//! Through a PgBouncer of the stock configuration too (no `ignore_startup_parameters`), which
//! refuses a connection sending a startup parameter it does not know: the service sends none
//! by default (`extra_float_digits` left out), so it meets the same refusal as above; and one
//! that a person adds (`PGOPTIONS`) is explained with the remedy. (Session mode needs no test of
//! its own: scripts/test's pooler pass runs the PostgreSQL behaviour suite through a
//! session-mode PgBouncer.)
//!
//! The tests need the poolers of `POOL_MODE=transaction scripts/pooler up`
//! (`$POOLER_TRANSACTION_URL`) and of `POOL_MODE=transaction POOLER_IGNORE_STARTUP_PARAMETERS=
//! scripts/pooler up` (`$POOLER_STOCK_TRANSACTION_URL`), in front of `$DATABASE_URL`'s server:
//! they are ignored in the suite, and scripts/test's pooler pass runs them against poolers of
//! its own.

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The longest the service may take to refuse a pooler it cannot work through.
const REFUSAL_DEADLINE: Duration = Duration::from_secs(15);

/// What idem says of a pooler in transaction mode that breaks sqlx's prepared statements: the
/// cause and the three remedies.
const TRANSACTION_MODE_REFUSAL: [&str; 5] = [
    "a pooler in transaction mode",
    "prepared statement",
    "session mode",
    "max_prepared_statements",
    "a direct connection",
];

/// Starts the service on the test database `database` through the pooler in `$variable`,
/// with `env` added; waits for it to exit (at most [`REFUSAL_DEADLINE`]) and checks that it
/// exited 1 with one readable line of its own: `payments: …`, no `Debug` form of an error (no
/// `Pooler {`, no `\"`), no log line above it. Returns that line.
async fn refused_start(variable: &str, database: &str, env: &[(&str, &str)]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
        .env("DATABASE_URL", idem_tests::pooler_url(variable, database))
        .env("EVENTS", "off")
        .env("ADDR", idem_tests::reserve_addr())
        .env("GRPC_ADDR", idem_tests::reserve_addr())
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start payments");
    let started = tokio::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child's status") {
            break status;
        }
        if started.elapsed() > REFUSAL_DEADLINE {
            let _ = child.kill();
            panic!("the service still runs after {REFUSAL_DEADLINE:?} behind {variable}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("piped"), &mut stderr)
        .expect("read stderr");
    assert_eq!(status.code(), Some(1), "{stderr}");
    let said = stderr.trim_end();
    assert!(
        said.starts_with("payments: ") && !said.contains('\n'),
        "one line of the service's own: {stderr}"
    );
    for debug in ["Pooler {", "Database(", "\\\"", "Error: "] {
        assert!(!said.contains(debug), "a Debug form ({debug:?}) in: {said}");
    }
    said.to_owned()
}

#[sqlx::test(migrations = false)]
#[ignore = "needs scripts/pooler: run by scripts/test"]
async fn transaction_mode_pgbouncer_1_18_is_refused_at_start_with_the_cause_and_the_remedies(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = connect.get_database().expect("a test database").to_owned();
    let pool = sqlx::PgPool::connect_with(connect).await.expect("connect");
    let said = refused_start("POOLER_TRANSACTION_URL", &name, &[]).await;
    for words in TRANSACTION_MODE_REFUSAL {
        assert!(said.contains(words), "no {words:?} in: {said}");
    }
    // Nothing left behind: no lock, no table of a half-applied migration.
    idem_tests::assert_nothing_left(&pool).await;
    idem_tests::release_pooled("POOLER_TRANSACTION_URL", &name);
}

#[sqlx::test(migrations = false)]
#[ignore = "needs scripts/pooler: run by scripts/test"]
async fn a_stock_transaction_mode_pgbouncer_is_refused_for_its_mode_not_for_a_startup_parameter(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = connect.get_database().expect("a test database").to_owned();
    let pool = sqlx::PgPool::connect_with(connect).await.expect("connect");
    let said = refused_start("POOLER_STOCK_TRANSACTION_URL", &name, &[]).await;
    assert!(
        !said.contains("unsupported startup parameter"),
        "the service sends no startup parameter a stock PgBouncer refuses: {said}"
    );
    for words in TRANSACTION_MODE_REFUSAL {
        assert!(said.contains(words), "no {words:?} in: {said}");
    }
    idem_tests::assert_nothing_left(&pool).await;
    idem_tests::release_pooled("POOLER_STOCK_TRANSACTION_URL", &name);
}

#[sqlx::test(migrations = false)]
#[ignore = "needs scripts/pooler: run by scripts/test"]
async fn a_startup_parameter_a_stock_pgbouncer_refuses_is_explained_with_the_remedy(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = connect.get_database().expect("a test database").to_owned();
    let pool = sqlx::PgPool::connect_with(connect).await.expect("connect");
    // libpq's variable, which sqlx reads too: sent as the startup parameter `options`.
    let env = [("PGOPTIONS", "-c statement_timeout=5000")];
    let said = refused_start("POOLER_STOCK_TRANSACTION_URL", &name, &env).await;
    for words in [
        "DATABASE_URL",
        "PgBouncer",
        "unsupported startup parameter: options",
        "ignore_startup_parameters",
    ] {
        assert!(said.contains(words), "no {words:?} in: {said}");
    }
    assert!(!said.contains(" at line "), "sqlx's bare error: {said}");
    idem_tests::assert_nothing_left(&pool).await;
}
