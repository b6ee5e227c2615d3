//! What the example's binaries read from their environment: the database and the broker.

use std::{path::PathBuf, str::FromStr, time::Duration};

use idem_events::{nats::Nats, rabbitmq::RabbitMq, redis::RedisStreams};
use sqlx::{
    MySql, MySqlPool, PgPool, SqlitePool,
    migrate::MigrateDatabase,
    mysql::{MySqlConnectOptions, MySqlPoolOptions},
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
};

use crate::{schema, server};

/// An error to print before exiting.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The database a binary stores in.
#[derive(Debug)]
pub enum Database {
    /// `$DATABASE_URL` names a PostgreSQL database.
    Postgres(PgPool),
    /// `$DATABASE_URL` is `sqlite:<path>`, or unset: the SQLite file `$SQLITE_PATH`.
    Sqlite(SqlitePool),
    /// `$DATABASE_URL` is `mysql://…/<database>`: a MySQL or MariaDB database.
    MySql(MySqlPool),
}

/// Opens `$DATABASE_URL` (PostgreSQL; `mysql://…/<database>`, MySQL or MariaDB, the database
/// created when the server has none of that name; or `sqlite:<path>`), with at most
/// `connections` connections to a server; without it, the SQLite file `$SQLITE_PATH` (default
/// `default_file`), so that nothing needs to be installed. PostgreSQL is connected to with
/// [`idem_runtime::postgres::connect_options`], which a stock PgBouncer accepts.
///
/// # Errors
///
/// When the URL does not parse, a MySQL URL names no database, the database cannot be
/// reached, created or opened, or a pooler in front of PostgreSQL refuses the connection or
/// breaks its statements (with what it means and what to do).
pub async fn database(default_file: &str, connections: u32) -> Result<Database, Error> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("mysql:") => {
            Ok(Database::MySql(mysql(&url, connections).await?))
        }
        Ok(url) if url.starts_with("sqlite:") => {
            let options = SqliteConnectOptions::from_str(&url)
                .map_err(|e| format!("DATABASE_URL is not a SQLite URL: {e}"))?
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30));
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(options)
                .await
                .map_err(|e| format!("cannot open DATABASE_URL: {e}"))?;
            tracing::info!(database = %url, "storing in SQLite");
            Ok(Database::Sqlite(pool))
        }
        Ok(url) => {
            // Without `extra_float_digits`, which a stock PgBouncer refuses.
            let options = idem_runtime::postgres::connect_options(&url)
                .map_err(|e| format!("DATABASE_URL is not a PostgreSQL URL: {e}"))?;
            let pool = PgPoolOptions::new()
                .max_connections(connections)
                .connect_with(options)
                .await
                .map_err(|e| match idem_runtime::postgres::pooler_refusal(&e) {
                    Some(reason) => format!("DATABASE_URL: {reason}"),
                    None => format!("cannot connect to DATABASE_URL: {e}"),
                })?;
            check_pooler(&pool).await?;
            tracing::info!("storing in PostgreSQL (DATABASE_URL)");
            Ok(Database::Postgres(pool))
        }
        Err(_) => {
            let path = PathBuf::from(
                std::env::var("SQLITE_PATH").unwrap_or_else(|_| default_file.to_owned()),
            );
            let pool = schema::connect_sqlite(&path)
                .await
                .map_err(|e| format!("cannot open the SQLite file {}: {e}", path.display()))?;
            tracing::info!(
                path = %path.display(),
                "storing in SQLite (set DATABASE_URL to use PostgreSQL)"
            );
            Ok(Database::Sqlite(pool))
        }
    }
}

/// The longest the start waits to find out what a pooler in front of PostgreSQL lets through.
const POOLER_CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// Refuses, at start, a pooler in front of PostgreSQL that the service cannot work through
/// ([`idem_runtime::postgres::check_pooler`]): one in transaction mode that breaks sqlx's
/// prepared statements, or one that shares server connections while the migrations would go
/// through it too (`$MIGRATION_DATABASE_URL` unset).
///
/// # Errors
///
/// With the cause and the remedies, when so; when the check fails or takes over 15 s.
async fn check_pooler(pool: &PgPool) -> Result<(), Error> {
    let checked = tokio::time::timeout(
        POOLER_CHECK_TIMEOUT,
        idem_runtime::postgres::check_pooler(pool),
    )
    .await
    .map_err(|_| {
        format!("DATABASE_URL: PostgreSQL did not answer within {POOLER_CHECK_TIMEOUT:?}")
    })?
    .map_err(|e| format!("DATABASE_URL: {e}"))?;
    if checked == idem_runtime::postgres::Pooling::Shared {
        if std::env::var_os("MIGRATION_DATABASE_URL").is_none() {
            return Err(
                "DATABASE_URL goes through a pooler in transaction mode (two connections \
                        were given one server connection): the migrations need a session of \
                        their own; set MIGRATION_DATABASE_URL to a direct connection to \
                        PostgreSQL for them"
                    .into(),
            );
        }
        tracing::info!(
            "DATABASE_URL goes through a pooler in transaction mode that keeps prepared statements apart"
        );
    }
    Ok(())
}

/// A pool of its own for the migrations on `$MIGRATION_DATABASE_URL` when it is set (a direct
/// connection, where `$DATABASE_URL` goes through a pooler in transaction mode); `None` when
/// they run through the service's pool. Close it once they ran.
///
/// # Errors
///
/// When `$MIGRATION_DATABASE_URL` cannot be connected to.
pub async fn migration_pool<DB: sqlx::Database>() -> Result<Option<sqlx::Pool<DB>>, Error> {
    match std::env::var("MIGRATION_DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            let migrations = sqlx::pool::PoolOptions::<DB>::new()
                .max_connections(2)
                .connect(&url)
                .await
                .map_err(|e| format!("cannot connect to MIGRATION_DATABASE_URL: {e}"))?;
            tracing::info!("migrating through MIGRATION_DATABASE_URL");
            Ok(Some(migrations))
        }
        _ => Ok(None),
    }
}

/// A pool on the MySQL or MariaDB database `url` names, created first if the server has no
/// database of that name (the user must then be allowed to `CREATE DATABASE`).
///
/// # Errors
///
/// When the URL does not parse or names no database, or the server cannot be reached or
/// refuses to create the database.
async fn mysql(url: &str, connections: u32) -> Result<MySqlPool, Error> {
    let options = MySqlConnectOptions::from_str(url)
        .map_err(|e| format!("DATABASE_URL is not a MySQL URL: {e}"))?;
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Err("DATABASE_URL must name a database: mysql://user@host:3306/<database>".into());
    };
    let exists = MySql::database_exists(url)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    if !exists {
        // Another instance starting at the same time may create it first: that is no error.
        if let Err(error) = MySql::create_database(url).await
            && !MySql::database_exists(url).await.unwrap_or(false)
        {
            return Err(format!(
                "the MySQL server has no database {name:?} and cannot create it \
                 (create it with `CREATE DATABASE {name}`): {error}"
            )
            .into());
        }
        tracing::info!(database = %name, "created the MySQL database");
    }
    let pool = MySqlPoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    tracing::info!(database = %name, "storing in MySQL (DATABASE_URL)");
    Ok(pool)
}

/// The broker events go through.
#[derive(Debug, Clone)]
pub enum Broker {
    /// `$EVENTS` unset or `rabbitmq`: RabbitMQ at `$AMQP_URL`.
    RabbitMq(RabbitMq),
    /// `$EVENTS=redis`: Redis at `$REDIS_URL`.
    Redis(RedisStreams),
    /// `$EVENTS=nats`: NATS JetStream at `$NATS_URL`.
    Nats(Nats),
}

/// The most replicas JetStream gives a stream.
const MAX_NATS_REPLICAS: usize = 5;

/// The broker `$EVENTS` names (`rabbitmq`, the default; `redis`; `nats`; `off` for none), at
/// `$AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `$REDIS_URL` (default
/// `redis://127.0.0.1:6379`) or `$NATS_URL` (default `nats://127.0.0.1:4222`; a
/// comma-separated list of servers, all used for reconnects). Events go through the exchange
/// or stream `$EVENTS_STREAM` (default `idem.events`); on NATS, the subjects
/// `<$EVENTS_STREAM>.<topic>` of the JetStream stream named after it with its dots made
/// underscores (`idem_events`), created when missing with one replica per server of the
/// cluster, at most 3, or `$NATS_REPLICAS`.
///
/// # Errors
///
/// When `$EVENTS` names no broker, `$REDIS_URL` is not a Redis URL, `$NATS_URL` names no NATS
/// server or `$EVENTS_STREAM` is no NATS subject (with `EVENTS=nats`), or `$NATS_REPLICAS` is
/// not a whole number from 1 to 5.
pub fn broker() -> Result<Option<Broker>, Error> {
    let stream = std::env::var("EVENTS_STREAM").unwrap_or_else(|_| "idem.events".to_owned());
    let events = std::env::var("EVENTS").unwrap_or_default();
    match events.as_str() {
        "" | "rabbitmq" => {
            let url = std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
            Ok(Some(Broker::RabbitMq(RabbitMq::new(&url, &stream))))
        }
        "redis" => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
            Ok(Some(Broker::Redis(RedisStreams::new(&url, &stream)?)))
        }
        "nats" => {
            let url =
                std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
            let mut broker = Nats::new(&url, &stream).map_err(|e| format!("NATS_URL: {e}"))?;
            if let Some(replicas) = nats_replicas(std::env::var("NATS_REPLICAS").ok())? {
                broker = broker.with_replicas(replicas);
            }
            Ok(Some(Broker::Nats(broker)))
        }
        "off" => Ok(None),
        other => Err(format!("EVENTS must be rabbitmq, redis, nats or off, got {other:?}").into()),
    }
}

/// The replicas `$NATS_REPLICAS` (`value`) asks the stream to be created with: none when unset
/// or empty (one per server, at most 3).
///
/// # Errors
///
/// When `value` is not a whole number from 1 to 5 (JetStream's most).
fn nats_replicas(value: Option<String>) -> Result<Option<usize>, Error> {
    let Some(value) = value.filter(|value| !value.is_empty()) else {
        return Ok(None);
    };
    match value.parse::<usize>() {
        Ok(replicas) if (1..=MAX_NATS_REPLICAS).contains(&replicas) => Ok(Some(replicas)),
        _ => Err(format!(
            "NATS_REPLICAS must be a whole number from 1 to {MAX_NATS_REPLICAS} (the stream's \
             replicas), got {value:?}"
        )
        .into()),
    }
}

/// Logs to stderr as `$RUST_LOG` says (default `info`), runs `run`, and turns its error into
/// a line on stderr (`<binary>: <error>`) and a failure exit code.
///
/// lapin logs every message RabbitMQ returns as unroutable (no queue bound to its topic yet),
/// whole, as a warning; the relay reports the same condition once per outage and keeps the
/// event in the outbox, so those lines are filtered out at any level but `error`.
pub async fn main<F>(binary: &str, run: F) -> std::process::ExitCode
where
    F: Future<Output = Result<(), Error>>,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        .add_directive(
            "lapin::returned_messages=error"
                .parse()
                .expect("a valid directive"),
        );
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match run.await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{binary}: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Serves `router` on `listener` until Ctrl-C or SIGTERM, or until `stop` is cancelled (a part
/// of the service that failed), then cancels `stop` (the binary's background tasks) and returns once the open requests are answered. A client gets
/// [`server::HEADER_READ_TIMEOUT`] to send each request's head (see [`server`]).
///
/// # Errors
///
/// None so far: an accept that fails is retried.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    stop: idem_runtime::CancellationToken,
) -> Result<(), Error> {
    server::serve(listener, router, server::HEADER_READ_TIMEOUT, {
        let stop = stop.clone();
        async move {
            // A signal, or a part of the service that failed and stopped it.
            tokio::select! {
                () = shutdown_signal() => {}
                () = stop.cancelled() => {}
            }
            stop.cancel();
        }
    })
    .await;
    stop.cancel();
    Ok(())
}

/// Waits for Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut signal) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            signal.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::nats_replicas;

    #[test]
    fn nats_replicas_takes_one_to_five_and_refuses_anything_else() {
        assert_eq!(nats_replicas(None).expect("unset"), None);
        assert_eq!(nats_replicas(Some(String::new())).expect("empty"), None);
        for n in 1..=5 {
            assert_eq!(nats_replicas(Some(n.to_string())).expect("valid"), Some(n));
        }
        for bad in ["0", "6", "-1", "three", "2.5", " 3"] {
            let error = nats_replicas(Some(bad.to_owned())).expect_err(bad);
            assert!(
                error.to_string().contains("NATS_REPLICAS must be"),
                "{bad}: {error}"
            );
        }
    }
}
