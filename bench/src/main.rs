//! `cargo run --release -p idem-bench -- <scenario>`: benchmarks of idem against a real
//! PostgreSQL (`$DATABASE_URL`, else the local server), printing ratios against a baseline
//! measured in the same run.

mod db;
mod load;
mod purge;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Benchmarks of the idem idempotency layer")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// Purge throughput on a table of expired keys, and live request latency while it runs.
    Purge(purge::Args),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.scenario {
        Scenario::Purge(args) => purge::run(args).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idem-bench: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}
