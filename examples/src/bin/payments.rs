//! `cargo run --bin payments`: the payments API of `CONTRACT.md` §3.
//!
//! Listens on `$ADDR` (default `127.0.0.1:3000`) and stores everything in `$DATABASE_URL`
//! (PostgreSQL), creating its tables on start.

use std::process::ExitCode;

use idem_examples::{payments, schema};
use idem_runtime::Store;
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
    tracing::info!(addr = %listener.local_addr()?, "payments service listening");
    axum::serve(listener, payments::router(Store::new(pool)))
        .with_graceful_shutdown(shutdown())
        .await?;
    Ok(())
}

async fn shutdown() {
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
