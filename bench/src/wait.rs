//! What a duplicate that waits costs the database, next to a client that takes the 409 and
//! retries: while a first payment runs (the example's `cus_slower`, 5 s), `waiters` duplicates
//! of it are sent, and the SQL statements the services run meanwhile are counted.
//!
//! - `wait, same instance`: `Prefer: wait=10` to the instance running the first payment; the
//!   duplicates wait on the process's watch of the key.
//! - `wait, other instance`: `Prefer: wait=10` to a second instance on the same database; one
//!   of its waiters looks at the key again and again (25 ms growing to 500 ms) for all of them.
//! - `409 and retry`: idem's client with its default policy (no `Prefer`), which retries each
//!   409 after its `Retry-After` (1 s) or its backoff, whichever is longer; to the same instance
//!   (which answers a duplicate of a key it runs without the database), and to the other.

use std::time::{Duration, Instant};

use idem_client::{IdempotentRetry, RetryPolicy};

use crate::{db, load, statements};

/// The benchmark's settings.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Duplicates sent while the first payment runs.
    #[arg(long, default_value_t = 50)]
    pub waiters: usize,
}

const SLOWER: &str = r#"{"amount": 100, "currency": "usd", "customer": "cus_slower"}"#;

/// Runs the three modes, one after the other, and prints statements per second per waiter.
///
/// # Errors
///
/// When the database cannot be reached or a request fails.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let scratch = db::Scratch::create(2).await?;
    let connections = 10;
    let first = load::serve(scratch.url.clone(), connections).await?;
    let other = load::serve(scratch.url.clone(), connections).await?;
    let (first, other) = (format!("http://{first}"), format!("http://{other}"));

    println!(
        "{} duplicates of one payment that runs 5 s (cus_slower), PostgreSQL, pools of {connections}",
        args.waiters
    );
    println!(
        "| mode | statements during the first payment | per waiter per second | waiters answered \
         with the payment | their p50 |"
    );
    println!("|---|---|---|---|---|");
    let (_, alone) = statements::count(pay(&first, &load::fresh_key(), None)).await;
    println!("| the first payment alone | {alone} | | | |");
    for mode in [Mode::Same, Mode::Other, Mode::Retry, Mode::RetryOther] {
        let key = load::fresh_key();
        let outcome = statements::count(async {
            let running = tokio::spawn(pay_owned(first.clone(), key.clone(), None));
            // Let the first claim the key before its duplicates arrive.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let started = Instant::now();
            let duplicates: Vec<_> = (0..args.waiters)
                .map(|_| {
                    let (base, key) = match mode {
                        Mode::Same | Mode::Retry => (first.clone(), key.clone()),
                        Mode::Other | Mode::RetryOther => (other.clone(), key.clone()),
                    };
                    tokio::spawn(async move {
                        let begun = Instant::now();
                        let answer = match mode {
                            Mode::Retry | Mode::RetryOther => retry(&base, &key).await,
                            Mode::Same | Mode::Other => pay(&base, &key, Some("wait=10")).await,
                        };
                        (answer, begun.elapsed())
                    })
                })
                .collect();
            let mut answered = 0;
            let mut latencies = Vec::new();
            for duplicate in duplicates {
                let (answer, took) = duplicate.await?;
                if answer? == 201 {
                    answered += 1;
                }
                latencies.push(took);
            }
            let window = started.elapsed();
            running.await??;
            latencies.sort();
            Ok::<_, db::Error>((answered, window, latencies[latencies.len() / 2]))
        })
        .await;
        let (result, counted) = outcome;
        let (answered, window, p50) = result?;
        let extra = counted.saturating_sub(alone);
        let per = extra as f64 / args.waiters as f64 / window.as_secs_f64();
        println!(
            "| {} | {counted} | {per:.2} | {answered} of {} | {:.0} ms |",
            mode.name(),
            args.waiters,
            p50.as_secs_f64() * 1000.0
        );
    }
    scratch.drop().await
}

#[derive(Clone, Copy)]
enum Mode {
    Same,
    Other,
    Retry,
    RetryOther,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Same => "wait, same instance",
            Self::Other => "wait, other instance",
            Self::Retry => "409 and retry (idem-client), same instance",
            Self::RetryOther => "409 and retry (idem-client), other instance",
        }
    }
}

/// A slow payment under `key`, with `Prefer` if given; its status.
async fn pay(base: &str, key: &str, prefer: Option<&str>) -> Result<u16, db::Error> {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/v1/payments"))
        .bearer_auth("bench")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(SLOWER);
    if let Some(prefer) = prefer {
        request = request.header("prefer", prefer);
    }
    Ok(request.send().await?.status().as_u16())
}

async fn pay_owned(
    base: String,
    key: String,
    prefer: Option<&'static str>,
) -> Result<u16, db::Error> {
    pay(&base, &key, prefer).await
}

/// The same payment through idem's client, which retries a 409.
async fn retry(base: &str, key: &str) -> Result<u16, db::Error> {
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotentRetry::new(
            RetryPolicy::default().with_max_attempts(30),
        ))
        .build();
    let answer = client
        .post(format!("{base}/v1/payments"))
        .bearer_auth("bench")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(SLOWER)
        .send()
        .await?;
    Ok(answer.status().as_u16())
}
