//! `cargo run --bin processor`: the simulated card processor the README describes, on
//! `$PROCESSOR_ADDR` (default `127.0.0.1:3001`).

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().init();
    let addr = std::env::var("PROCESSOR_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".to_owned());
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("processor: cannot listen on {addr}: {error}");
            return ExitCode::FAILURE;
        }
    };
    tracing::info!(%addr, "processor listening");
    match axum::serve(listener, idem_examples::processor::router()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("processor: {error}");
            ExitCode::FAILURE
        }
    }
}
