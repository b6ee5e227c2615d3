//! `cargo run --bin payments`: the payments API of `CONTRACT.md` §3.
//!
//! Listens on `$ADDR` (default `127.0.0.1:3000`), stores everything in `$DATABASE_URL`
//! (PostgreSQL), creating its tables on start, and sends refunds to the processor at
//! `$PROCESSOR_URL` (default `http://127.0.0.1:3001`). The purge and recovery tasks run in the
//! background and stop with the server.

use std::process::ExitCode;

use std::time::Duration;

use idem_examples::{
    payments::{self, AppState},
    refunds::ProcessorClient,
    schema,
};
use idem_runtime::{
    CancellationToken, Store,
    tasks::{self, PurgeOptions, ReleaseAbandoned},
};
use sqlx::postgres::PgPoolOptions;
use tracing_subscriber::EnvFilter;

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

async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let url = std::env::var("DATABASE_URL").map_err(|_| {
        "DATABASE_URL is not set; point it at PostgreSQL, e.g. \
         DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres"
    })?;
    let pool = PgPoolOptions::new()
        .max_connections(32)
        .connect(&url)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
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
    // claims lease for 5 s; abandoned ones are released so that a retry runs again (the
    // processor deduplicates through the derived key).
    let purge = tasks::spawn_purge(
        store.clone(),
        Duration::from_secs(60),
        PurgeOptions::default(),
        stop.clone(),
    );
    let recovery = tasks::spawn_recovery(
        store.clone(),
        ReleaseAbandoned,
        Duration::from_secs(10),
        stop.clone(),
    );
    let state = AppState {
        store,
        processor: ProcessorClient::new(processor_url),
    };
    tracing::info!(addr = %listener.local_addr()?, "payments service listening");
    axum::serve(listener, payments::routes().with_state(state))
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
