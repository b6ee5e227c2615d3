//! `scale`: does the claim slow down as the key table grows? Requests to a handler that writes
//! nothing but its key (first executions, then their replays) are timed on a table that starts
//! empty and on one with millions of keys, in interleaved rounds.

use std::time::{Duration, Instant};

use axum::{
    Router,
    body::Body,
    extract::Path,
    http::{self, StatusCode},
    routing::post,
};
use hdrhistogram::Histogram;
use idem_runtime::{Store, idempotent};
use sqlx::{PgPool, Postgres, Transaction};
use tower::ServiceExt;

use crate::{db, http::median, load::fresh_key};

/// Arguments of the scale benchmark.
#[derive(clap::Args)]
pub struct Args {
    /// Keys in the large table.
    #[arg(long, default_value_t = 10_000_000)]
    keys: i64,
    /// Rounds; each times both tables in turn.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Requests (each a first execution, then its replay) per table per round.
    #[arg(long, default_value_t = 2000)]
    claims: usize,
}

/// Runs the benchmark and prints its table.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let empty = db::Scratch::named(4, "empty").await?;
    let large = match db::Scratch::named(4, "large").await {
        Ok(large) => large,
        Err(error) => {
            empty.drop().await?;
            return Err(error);
        }
    };
    let result = measure(&args, &empty.pool, &large.pool).await;
    empty.drop().await?;
    large.drop().await?;
    result
}

async fn measure(args: &Args, empty: &PgPool, large: &PgPool) -> Result<(), db::Error> {
    let chunk = 1_000_000_i64;
    let mut seeded = 0;
    while seeded < args.keys {
        let n = chunk.min(args.keys - seeded);
        sqlx::query(
            "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
               response_status, response_headers, response_body, expires_at) \
             SELECT 'tenant_' || (g % 10000), md5(g::text), 'POST', '/v1/payments', \
               sha256(g::text::bytea), 'completed', 201, '[]'::jsonb, '\\x00'::bytea, \
               now() + interval '1 day' \
             FROM generate_series($1 + 1, $1 + $2) g",
        )
        .bind(seeded)
        .bind(n)
        .execute(large)
        .await?;
        seeded += n;
        eprintln!("seeded {seeded} keys");
    }
    sqlx::raw_sql("VACUUM ANALYZE idem_keys")
        .execute(large)
        .await?;
    sqlx::raw_sql("VACUUM ANALYZE idem_keys")
        .execute(empty)
        .await?;
    let size: String =
        sqlx::query_scalar("SELECT pg_size_pretty(pg_total_relation_size('idem_keys'))")
            .fetch_one(large)
            .await?;

    // Warm both, then alternate.
    time_claims(empty, 200).await?;
    time_claims(large, 200).await?;
    let mut rounds: [Vec<(f64, f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for round in 1..=args.rounds {
        eprintln!("round {round}/{}", args.rounds);
        for (index, pool) in [empty, large].into_iter().enumerate() {
            // Each pass adds its keys to both tables alike (`--claims` per round, a few
            // thousand against the large table's millions).
            sqlx::raw_sql("VACUUM ANALYZE idem_keys")
                .execute(pool)
                .await?;
            let (first, replay) = time_claims(pool, args.claims).await?;
            rounds[index].push((
                quantile(&first, 0.5),
                quantile(&first, 0.99),
                quantile(&replay, 0.5),
                quantile(&replay, 0.99),
            ));
        }
    }
    println!(
        "request latency in the process (no socket), {} fresh keys per table per round, {} rounds",
        args.claims, args.rounds
    );
    println!();
    println!("| table | first execution p50 ms | p99 ms | replay p50 ms | p99 ms |");
    println!("|---|---|---|---|---|");
    let labels = [
        "starting empty".to_owned(),
        format!("{} keys ({size})", args.keys),
    ];
    let medians: Vec<[f64; 4]> = rounds
        .iter()
        .map(|r| {
            [
                median(r.iter().map(|x| x.0)),
                median(r.iter().map(|x| x.1)),
                median(r.iter().map(|x| x.2)),
                median(r.iter().map(|x| x.3)),
            ]
        })
        .collect();
    for (label, m) in labels.iter().zip(&medians) {
        println!(
            "| {label} | {:.3} | {:.3} | {:.3} | {:.3} |",
            m[0], m[1], m[2], m[3]
        );
    }
    let ratio = median(
        rounds[1]
            .iter()
            .zip(&rounds[0])
            .map(|(large, empty)| large.0 / empty.0),
    );
    println!();
    println!(
        "first execution p50 large/empty {ratio:.2} (median of per-round ratios; target <= 1.2)"
    );
    Ok(())
}

/// Sends `n` requests with fresh keys one after another through an idempotent handler that
/// writes nothing (so that the time is the key's: `BEGIN`, the claim, the completion and the
/// `COMMIT`), then retries each once (a replay: the claim finds the completed row); returns the
/// first executions' and the replays' latencies. The requests go through the router in the
/// process, without a socket.
async fn time_claims(
    pool: &PgPool,
    n: usize,
) -> Result<(Histogram<u64>, Histogram<u64>), db::Error> {
    let mut first = Histogram::<u64>::new(3)?;
    let mut replay = Histogram::<u64>::new(3)?;
    let app = Router::new()
        .route("/v1/tenants/{tenant}/payments", post(create))
        .with_state(Store::<Postgres>::new(pool.clone()));
    let mut keys = Vec::with_capacity(n);
    for i in 0..n {
        let request = Request {
            tenant: format!("tenant_{}", i % 10_000),
            key: fresh_key(),
        };
        let started = Instant::now();
        let status = request.send(&app).await?;
        record(&mut first, started.elapsed());
        if status != StatusCode::CREATED {
            return Err(format!("a first execution answered {status}").into());
        }
        keys.push(request);
    }
    for request in &keys {
        let started = Instant::now();
        let status = request.send(&app).await?;
        record(&mut replay, started.elapsed());
        if status != StatusCode::CREATED {
            return Err(format!("a replay answered {status}").into());
        }
    }
    Ok((first, replay))
}

/// The benchmark's handler: claims the key and completes it, nothing else.
#[idempotent(scope = "tenant", retention = "24h")]
async fn create(Path(tenant): Path<String>, tx: &mut Transaction<'_, Postgres>) -> StatusCode {
    let _ = (&tenant, tx);
    StatusCode::CREATED
}

/// One request of the benchmark.
struct Request {
    tenant: String,
    key: String,
}

impl Request {
    async fn send(&self, app: &Router) -> Result<StatusCode, db::Error> {
        let request = http::Request::post(format!("/v1/tenants/{}/payments", self.tenant))
            .header("idempotency-key", &self.key)
            .body(Body::empty())?;
        let response = app.clone().oneshot(request).await?;
        Ok(response.status())
    }
}

fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    let _ = histogram.record((elapsed.as_micros() as u64).max(1));
}

fn quantile(histogram: &Histogram<u64>, q: f64) -> f64 {
    histogram.value_at_quantile(q) as f64 / 1000.0
}
