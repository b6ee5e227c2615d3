//! What a service owner reads as a service starts on a database it has started on before:
//! idem's migrations, run again, log nothing of the tables already there (PostgreSQL answers
//! `CREATE TABLE IF NOT EXISTS` on a table that exists with a notice, which sqlx logs at
//! `INFO`: `relation "_idem_migrations" already exists, skipping`), and leave the connection's
//! `client_min_messages` as it was.

use idem_tests::CapturedLog;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn postgres_migrating_again_logs_no_notice_and_leaves_the_connections_setting(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // One connection: the migrations' and the checks' below.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect)
        .await
        .expect("connect");
    idem_runtime::migrate(&pool)
        .await
        .expect("the first start's migrations");

    let log = CapturedLog::default();
    let guard = tracing::subscriber::set_default(log.subscriber());
    idem_runtime::migrate(&pool)
        .await
        .expect("the next start's migrations");
    let after_migrate = log.text();
    // The same statement outside the migrations is heard: the log would have caught it.
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS _idem_migrations (version BIGINT PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("a notice of the table");
    drop(guard);

    assert!(
        !after_migrate.contains("already exists"),
        "the migrations' notices: {after_migrate}"
    );
    assert!(
        log.text()
            .contains("relation \"_idem_migrations\" already exists, skipping"),
        "the log hears a notice: {}",
        log.text()
    );
    let setting: String = sqlx::query_scalar("SHOW client_min_messages")
        .fetch_one(&pool)
        .await
        .expect("the setting");
    assert_eq!(setting, "notice", "the connection's setting, restored");
}
