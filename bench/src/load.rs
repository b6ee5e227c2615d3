//! A closed-loop HTTP load generator: `concurrency` clients send requests back to back over
//! loopback, each latency recorded in a histogram.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;
use idem_runtime::Store;
use sqlx::Postgres;

/// Serves the example's router on a loopback port.
pub async fn serve(store: Store<Postgres>) -> Result<SocketAddr, crate::db::Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, idem_examples::payments::router(store)).await;
    });
    Ok(addr)
}

/// What a load run measured.
#[derive(Debug)]
pub struct Stats {
    /// Requests answered as expected.
    pub ok: u64,
    /// Requests answered otherwise, or failed.
    pub errors: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Latencies, in microseconds.
    pub latency: Histogram<u64>,
}

impl Stats {
    /// Requests per second.
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }

    /// A latency quantile, in milliseconds.
    pub fn ms(&self, quantile: f64) -> f64 {
        self.latency.value_at_quantile(quantile) as f64 / 1000.0
    }
}

/// Sends fresh-key payments from `concurrency` clients until `stop` is set.
pub async fn fresh_payments(addr: SocketAddr, concurrency: usize, stop: Arc<AtomicBool>) -> Stats {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/payments");
    let started = Instant::now();
    let mut workers = Vec::new();
    for worker in 0..concurrency {
        let (client, url, stop) = (client.clone(), url.clone(), Arc::clone(&stop));
        workers.push(tokio::spawn(async move {
            let mut latency = Histogram::<u64>::new(3).expect("histogram");
            let (mut ok, mut errors) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                let key = format!("load-{worker}-{}", NEXT.fetch_add(1, Ordering::Relaxed));
                let sent = Instant::now();
                let reply = client
                    .post(&url)
                    .bearer_auth("bench")
                    .header("idempotency-key", key)
                    .json(
                        &serde_json::json!({"amount": 100, "currency": "usd", "customer": "cus_1"}),
                    )
                    .send()
                    .await;
                let micros = sent.elapsed().as_micros() as u64;
                match reply {
                    Ok(reply) if reply.status() == reqwest::StatusCode::CREATED => {
                        ok += 1;
                        let _ = latency.record(micros.max(1));
                    }
                    _ => errors += 1,
                }
            }
            (latency, ok, errors)
        }));
    }
    let mut stats = Stats {
        ok: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency: Histogram::new(3).expect("histogram"),
    };
    for worker in workers {
        let (latency, ok, errors) = worker.await.expect("worker");
        stats.latency.add(latency).expect("same histogram bounds");
        stats.ok += ok;
        stats.errors += errors;
    }
    stats.elapsed = started.elapsed();
    stats
}
