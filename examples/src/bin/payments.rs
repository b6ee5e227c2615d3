//! `cargo run --bin payments`: the payments API the README describes.
//!
//! Listens on `$ADDR` (default `127.0.0.1:3000`). Stores everything in `$DATABASE_URL`
//! (PostgreSQL, or `sqlite:<path>`); without it, in the SQLite file `$SQLITE_PATH` (default
//! `payments.db`), so that nothing needs to be installed. Creates its tables on start, sends
//! refunds and order charges to the processor at `$PROCESSOR_URL` (default
//! `http://127.0.0.1:3001`), and runs the purge and recovery tasks until it stops. With
//! `$CRASH_AFTER` set to a step of `POST /v1/orders` (`reserve`, `charge`, `ship`, or
//! `charge-call`), it aborts right after that step, for crash tests. `$RECOVERY_EVERY` sets the
//! seconds between passes of the recovery task (default 10; `0` turns it off, for all but one
//! of several instances sharing a database).

use std::{path::PathBuf, process::ExitCode, str::FromStr, time::Duration};

use axum::Router;
use idem_examples::{
    orders::SettleAbandoned,
    payments::{self, AppState},
    refunds::ProcessorClient,
    schema,
    sql::Sql,
};
use idem_runtime::{
    CancellationToken, Store,
    tasks::{self, PurgeOptions},
};
use sqlx::{
    Pool, Postgres, Sqlite,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
};
use tracing_subscriber::EnvFilter;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("payments: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Error> {
    match std::env::var("DATABASE_URL") {
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
            serve(pool, payments::routes::<Sqlite>()).await
        }
        Ok(url) => {
            let pool = PgPoolOptions::new()
                .max_connections(32)
                .connect(&url)
                .await
                .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
            tracing::info!("storing in PostgreSQL (DATABASE_URL)");
            serve(pool, payments::routes::<Postgres>()).await
        }
        Err(_) => {
            let path = PathBuf::from(
                std::env::var("SQLITE_PATH").unwrap_or_else(|_| "payments.db".to_owned()),
            );
            let pool = schema::connect_sqlite(&path)
                .await
                .map_err(|e| format!("cannot open the SQLite file {}: {e}", path.display()))?;
            tracing::info!(
                path = %path.display(),
                "storing in SQLite (set DATABASE_URL to use PostgreSQL)"
            );
            serve(pool, payments::routes::<Sqlite>()).await
        }
    }
}

async fn serve<DB: Sql>(pool: Pool<DB>, routes: Router<AppState<DB>>) -> Result<(), Error> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    schema::create(&pool)
        .await
        .map_err(|e| format!("cannot create the tables: {e}"))?;
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let processor_url =
        std::env::var("PROCESSOR_URL").unwrap_or_else(|_| "http://127.0.0.1:3001".to_owned());
    let store = Store::new(pool);
    let stop = CancellationToken::new();
    // Keys expire per route (24 h, 7 d); sweeping every minute keeps the table small. Refund
    // and order claims lease for 5 s; abandoned refunds are released so that a retry runs again
    // (the processor deduplicates through the derived key), abandoned orders are finished or
    // have their stock given back.
    let purge = tasks::spawn_purge(
        store.clone(),
        Duration::from_secs(60),
        PurgeOptions::default(),
        stop.clone(),
    );
    let processor = ProcessorClient::new(processor_url);
    // Where several instances share a database, one running the recovery is enough.
    let recovery = match recovery_every()? {
        Some(every) => tasks::spawn_recovery(
            store.clone(),
            SettleAbandoned::new(processor.clone()),
            every,
            stop.clone(),
        ),
        None => {
            tracing::info!("recovery task off (RECOVERY_EVERY=0)");
            tokio::spawn(async {})
        }
    };
    let state = AppState {
        store,
        processor,
        crash_after: std::env::var("CRASH_AFTER")
            .ok()
            .filter(|step| !step.is_empty()),
    };
    tracing::info!(addr = %listener.local_addr()?, "payments service listening");
    axum::serve(listener, routes.with_state(state))
        .with_graceful_shutdown({
            let stop = stop.clone();
            async move {
                signal().await;
                stop.cancel();
            }
        })
        .await?;
    stop.cancel();
    let _ = tokio::join!(purge, recovery);
    Ok(())
}

/// `$RECOVERY_EVERY`: seconds between passes of the recovery task (default 10); `0` turns it
/// off.
fn recovery_every() -> Result<Option<Duration>, Error> {
    let Ok(value) = std::env::var("RECOVERY_EVERY") else {
        return Ok(Some(Duration::from_secs(10)));
    };
    let secs: u64 = value.parse().map_err(|_| {
        format!("RECOVERY_EVERY must be a whole number of seconds (0: off), got {value:?}")
    })?;
    Ok((secs > 0).then(|| Duration::from_secs(secs)))
}

async fn signal() {
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
