//! `cargo run --bin pay -- --amount 4200 --currency usd --customer cus_123 [--key-file F]`:
//! one payment, posted to `$PAYMENTS_URL` (default `http://127.0.0.1:3000`) as the tenant
//! `$TENANT` (default `tenant_1`) through idem's client, which retries safely.
//!
//! Prints the payment and whether the answer was a replay, and exits 0 on success; otherwise
//! prints the problem's title and detail and exits 1 (2 when no answer came at all). With
//! `--key-file`, the payment's key is read from the file if it exists (an earlier run that did
//! not get a final answer), written there before the first attempt, and removed after a final
//! answer: run the same command again after a crash, and the payment is made once.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use idem_client::{
    Action, FileKeyStore, IdempotentRetry, RetryPolicy, reqwest_middleware::ClientBuilder,
};

/// One payment, retried safely.
#[derive(Debug, Parser)]
#[command(name = "pay")]
struct Args {
    /// The amount, in minor units (4200 is 42.00).
    #[arg(long)]
    amount: i64,
    /// The currency (three letters).
    #[arg(long)]
    currency: String,
    /// The customer to charge (`cus_declined` is declined: 402).
    #[arg(long)]
    customer: String,
    /// Keep the payment's key in this file until the payment has a final answer.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Give up after this many seconds of retries.
    #[arg(long, default_value_t = 30)]
    budget_secs: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let base = std::env::var("PAYMENTS_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".into());
    let tenant = std::env::var("TENANT").unwrap_or_else(|_| "tenant_1".into());
    let mut retry =
        IdempotentRetry::new(RetryPolicy::default().budget(Duration::from_secs(args.budget_secs)));
    if let Some(path) = &args.key_file {
        retry = retry.with_store(FileKeyStore::new(path));
    }
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(retry)
        .build();
    let mut request = client
        .post(format!("{}/v1/payments", base.trim_end_matches('/')))
        .bearer_auth(&tenant)
        .json(&serde_json::json!({
            "amount": args.amount,
            "currency": args.currency,
            "customer": args.customer,
        }));
    if args.key_file.is_some() {
        request = request.with_extension(Action("pay".into()));
    }
    let answer = match request.send().await {
        Ok(answer) => answer,
        Err(error) => {
            eprintln!("pay: no answer: {error}");
            return ExitCode::from(2);
        }
    };
    let replayed = idem_client::replayed(&answer);
    match idem_client::check(answer).await {
        Ok(answer) => match answer.json::<serde_json::Value>().await {
            Ok(payment) => {
                println!("{payment}");
                println!("replayed: {replayed}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("pay: the answer is not JSON: {error}");
                ExitCode::FAILURE
            }
        },
        Err(idem_client::Error::Problem { status, problem }) => {
            eprintln!(
                "pay: {status} {}: {}",
                problem.title.as_deref().unwrap_or("error"),
                problem.detail.as_deref().unwrap_or("no detail")
            );
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("pay: {error}");
            ExitCode::FAILURE
        }
    }
}
