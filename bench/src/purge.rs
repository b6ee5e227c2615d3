//! `purge`: how fast the purge task empties a table of expired keys, and how much it slows the
//! live requests that run beside it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use idem_runtime::{Store, tasks::PurgeOptions};

use crate::{
    cpu, db,
    load::{self, Workload},
};

/// Arguments of the purge benchmark.
#[derive(clap::Args)]
pub struct Args {
    /// Expired keys to seed.
    #[arg(long, default_value_t = 1_000_000)]
    rows: i64,
    /// Rows per purge statement.
    #[arg(long, default_value_t = 1000)]
    batch: u32,
    /// Pause between purge statements, in milliseconds.
    #[arg(long, default_value_t = 10)]
    pause_ms: u64,
    /// Concurrent live clients.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Seconds of live load measured before the purge, as the baseline.
    #[arg(long, default_value_t = 10)]
    baseline_secs: u64,
}

/// Runs the benchmark and prints its table.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let scratch = db::Scratch::create(args.concurrency as u32 + 4).await?;
    let result = measure(&args, &scratch).await;
    scratch.drop().await?;
    result
}

async fn measure(args: &Args, scratch: &db::Scratch) -> Result<(), db::Error> {
    let pool = &scratch.pool;
    eprintln!("seeding {} expired keys...", args.rows);
    sqlx::query(
        "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, response_status, \
           response_headers, response_body, created_at, expires_at) \
         SELECT 'tenant_' || (g % 1000), 'key-' || g, 'POST', '/v1/payments', \
           sha256(g::text::bytea), 'completed', 201, \
           '[[\"content-type\",\"application/json\"]]'::jsonb, \
           convert_to(repeat('x', 120), 'UTF8'), now() - interval '2 days', \
           now() - interval '1 day' + make_interval(secs => g % 3600) \
         FROM generate_series(1, $1) g",
    )
    .bind(args.rows)
    .execute(pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE idem_keys")
        .execute(pool)
        .await?;

    let store = Store::new(pool.clone());
    let connections = args.concurrency as u32 + 4;
    let client = load::Client::new(load::serve(scratch.url.clone(), connections).await?);

    eprintln!("baseline: {} s of live load...", args.baseline_secs);
    let started = cpu::Sample::now();
    let baseline = load::run(
        &client,
        &Workload::First,
        args.concurrency,
        Duration::from_secs(args.baseline_secs),
    )
    .await;
    let baseline_cpu = cpu::Sample::now().since(started);

    eprintln!("purging while the same load runs...");
    let started = cpu::Sample::now();
    let stop = Arc::new(AtomicBool::new(false));
    let during = load::run_until(
        &client,
        &Workload::First,
        args.concurrency,
        Arc::clone(&stop),
    );
    let purge = async {
        let report = store
            .purge_expired(
                PurgeOptions::default()
                    .with_batch_size(args.batch)
                    .with_pause(Duration::from_millis(args.pause_ms)),
            )
            .await;
        stop.store(true, Ordering::Relaxed);
        report
    };
    let (during, report) = tokio::join!(during, purge);
    let during_cpu = cpu::Sample::now().since(started);
    let report = report?;

    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE expires_at <= now()")
        .fetch_one(pool)
        .await?;
    println!(
        "purge of {} expired keys, batches of {}, {} ms pauses, {} live clients",
        args.rows, args.batch, args.pause_ms, args.concurrency
    );
    println!("  rows purged      {:>12}", report.rows);
    println!("  statements       {:>12}", report.batches);
    println!("  duration         {:>11.2}s", report.elapsed.as_secs_f64());
    println!(
        "  rate             {:>10.0} rows/s",
        report.rows as f64 / report.elapsed.as_secs_f64()
    );
    println!("  expired left     {:>12}", left);
    // PostgreSQL's CPU during the purge, less what the live requests answered meanwhile cost
    // at the baseline's rate: what the purge itself cost.
    let live_pg = baseline_cpu
        .per_request(baseline.ok + baseline.errors, crate::cpu::Server::Postgres)
        .1;
    let total_pg = during_cpu.postgres.as_secs_f64() * 1e6;
    let purge_pg = total_pg - live_pg * (during.ok + during.errors) as f64;
    println!(
        "  purge CPU        {:>8.1} µs/row of PostgreSQL, {:.2} of {} cores while it ran",
        purge_pg / report.rows.max(1) as f64,
        purge_pg / 1e6 / during.elapsed.as_secs_f64(),
        std::thread::available_parallelism().map_or(1, usize::from),
    );
    println!();
    println!(
        "  live requests    {:>10} {:>10} {:>10} {:>8}",
        "req/s", "p50 ms", "p99 ms", "errors"
    );
    for (name, stats) in [("before purge", &baseline), ("during purge", &during)] {
        println!(
            "  {name:<16} {:>10.0} {:>10.2} {:>10.2} {:>8}",
            stats.rate(),
            stats.ms(0.5),
            stats.ms(0.99),
            stats.errors
        );
    }
    println!(
        "  during/before    {:>10.2} {:>10.2} {:>10.2}",
        during.rate() / baseline.rate(),
        during.ms(0.5) / baseline.ms(0.5),
        during.ms(0.99) / baseline.ms(0.99)
    );
    Ok(())
}
