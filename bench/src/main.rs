//! `cargo run --release -p idem-bench [-- <benchmark>]`: benchmarks of idem against a real
//! PostgreSQL (`$DATABASE_URL`, else the local server), printing ratios against a baseline
//! measured in the same run. Without a benchmark name it runs `http`.

mod churn;
mod claim;
mod cpu;
mod db;
mod delay;
mod grpc;
mod http;
mod load;
mod peer;
mod purge;
mod relay;
mod scale;
mod statements;
mod wait;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Benchmarks of the idem idempotency layer")]
struct Cli {
    #[command(subcommand)]
    scenario: Option<Scenario>,
}

#[derive(Subcommand)]
enum Scenario {
    /// Requests/s, p50, p99 and SQL statements per request of bare, first, replay, contended and
    /// mixed traffic over HTTP, in interleaved rounds, with the ratios to bare; and first
    /// executions and replays with answers sealed at rest, with their ratios to the unsealed.
    Http(http::Args),
    /// What each way of claiming a key costs PostgreSQL, without HTTP: transactions/s and CPU.
    Claim(claim::Args),
    /// Whether the key table holds its size under constant churn: the example's payments at a
    /// steady rate with a short retention and the purge running, sampled every minute, on
    /// PostgreSQL, MariaDB or SQLite.
    Churn(churn::Args),
    /// Claim, completion and request latency, HTTP req/s and bytes per key as the key table
    /// grows (0, 1 and 10 million keys by default), on PostgreSQL, MariaDB or SQLite.
    Scale(scale::Args),
    /// Purge throughput on a table of expired keys, and live request latency while it runs, on
    /// PostgreSQL or (`--backend mysql`) MariaDB.
    Purge(purge::Args),
    /// What duplicates that wait (`Prefer: wait`) cost the database, next to 409-and-retry.
    Wait(wait::Args),
    /// Calls/s, p50, p99 and CPU per call of a tonic method over gRPC: bare, first and replay.
    Grpc(grpc::Args),
    /// Events/s from a full outbox to the broker's acknowledgement, and commit-to-consume
    /// latency, on RabbitMQ, Redis and NATS JetStream.
    Relay(relay::Args),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    statements::install();
    let cli = Cli::parse();
    let result = match cli
        .scenario
        .unwrap_or(Scenario::Http(http::Args::default()))
    {
        Scenario::Http(args) => http::run(args).await,
        Scenario::Claim(args) => claim::run(args).await,
        Scenario::Scale(args) => scale::run(args).await,
        Scenario::Churn(args) => churn::run(args).await,
        Scenario::Purge(args) => purge::run(args).await,
        Scenario::Wait(args) => wait::run(args).await,
        Scenario::Relay(args) => relay::run(args).await,
        Scenario::Grpc(args) => grpc::run(args).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idem-bench: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}
