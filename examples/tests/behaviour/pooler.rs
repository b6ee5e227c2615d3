//! The service behind PgBouncer (Debian's 1.18) in transaction mode, which this PgBouncer
//! cannot carry sqlx's prepared statements through: the service refuses to start and says why.
//! (Session mode needs no test of its own: scripts/test's pooler pass runs the PostgreSQL
//! behaviour suite through a session-mode PgBouncer.)
//!
//! The test needs the pooler of `POOL_MODE=transaction scripts/pooler up`
//! (`$POOLER_TRANSACTION_URL`, in front of `$DATABASE_URL`'s server): it is ignored in the
//! suite, and scripts/test's pooler pass runs it against a pooler of its own.

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The longest the service may take to refuse a pooler it cannot work through.
const REFUSAL_DEADLINE: Duration = Duration::from_secs(15);

#[sqlx::test(migrations = false)]
#[ignore = "needs scripts/pooler: run by scripts/test"]
async fn transaction_mode_pgbouncer_1_18_is_refused_at_start_with_the_cause_and_the_remedies(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = connect.get_database().expect("a test database").to_owned();
    let pool = sqlx::PgPool::connect_with(connect).await.expect("connect");
    let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
        .env(
            "DATABASE_URL",
            idem_tests::pooler_url("POOLER_TRANSACTION_URL", &name),
        )
        .env("EVENTS", "off")
        .env("ADDR", idem_tests::reserve_addr())
        .env("GRPC_ADDR", idem_tests::reserve_addr())
        .env("RUST_LOG", "warn")
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
            panic!(
                "the service still runs after {REFUSAL_DEADLINE:?} behind a transaction-mode pooler"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("piped"), &mut stderr)
        .expect("read stderr");
    assert_eq!(status.code(), Some(1), "{stderr}");
    for said in [
        "a pooler in transaction mode",
        "prepared statement",
        "session mode",
        "max_prepared_statements",
        "a direct connection",
    ] {
        assert!(stderr.contains(said), "no {said:?} in: {stderr}");
    }
    // Nothing left behind: no lock, no table of a half-applied migration.
    idem_tests::assert_nothing_left(&pool).await;
    idem_tests::release_pooled("POOLER_TRANSACTION_URL", &name);
}
