//! `purge`: how fast the purge task empties a table of expired keys on a database with nothing
//! else to do, and, on a table seeded again, how fast beside live requests and how much it
//! slows them.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use idem_runtime::{
    Store,
    tasks::{Pacing, PurgeOptions},
};

use crate::{
    cpu, db,
    http::median,
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
    /// A fixed pause between purge statements, in milliseconds; without it, the purge's
    /// default adaptive pacing.
    #[arg(long)]
    pause_ms: Option<u64>,
    /// Concurrent live clients.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Seconds of each window of live load, alone or beside the purge (they alternate).
    #[arg(long, default_value_t = 3)]
    window_secs: u64,
}

/// Runs the benchmark and prints its table.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let scratch = db::Scratch::create(args.concurrency as u32 + 4).await?;
    let result = measure(&args, &scratch).await;
    scratch.drop().await?;
    result
}

/// Inserts `rows` expired keys, and has PostgreSQL analyse the table.
async fn seed(pool: &sqlx::PgPool, rows: i64) -> Result<(), db::Error> {
    eprintln!("seeding {rows} expired keys...");
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
    .bind(rows)
    .execute(pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE idem_keys")
        .execute(pool)
        .await?;
    Ok(())
}

async fn measure(args: &Args, scratch: &db::Scratch) -> Result<(), db::Error> {
    let pool = &scratch.pool;
    let store = Store::new(pool.clone());
    let pacing = args.pause_ms.map_or(Pacing::Adaptive, |ms| {
        Pacing::Fixed(Duration::from_millis(ms))
    });
    let options = PurgeOptions::default()
        .with_batch_size(args.batch)
        .with_pacing(pacing);

    // The purge alone: nothing else runs on the database.
    seed(pool, args.rows).await?;
    eprintln!("purging alone...");
    let started = cpu::Sample::now();
    let report = store.purge_expired(options).await?;
    let cpu_alone = cpu::Sample::now().since(started);
    let pacing_name = match pacing {
        Pacing::Fixed(pause) => format!("{} ms pauses", pause.as_millis()),
        _ => "adaptive pacing".to_owned(),
    };
    println!(
        "purge of {} expired keys alone, batches of {}, {pacing_name}",
        args.rows, args.batch
    );
    println!(
        "  cleared in       {:>11.2}s ({:.2}s of pauses)",
        report.elapsed.as_secs_f64(),
        report.paused.as_secs_f64()
    );
    println!(
        "  rate             {:>10.0} rows/s",
        report.rows as f64 / report.elapsed.as_secs_f64()
    );
    println!(
        "  purge CPU        {:>8.1} µs/row of PostgreSQL",
        cpu_alone.postgres.as_secs_f64() * 1e6 / report.rows.max(1) as f64
    );
    println!();

    // Beside live requests, on a table seeded again.
    seed(pool, args.rows).await?;
    let connections = args.concurrency as u32 + 4;
    let client = load::Client::new(load::serve(scratch.url.clone(), connections).await?);
    let window = Duration::from_secs(args.window_secs);

    eprintln!("warming up...");
    load::run(&client, &Workload::First, args.concurrency, window).await;

    // Windows of live load alone and of live load beside the purge, in turn, until the purge
    // is done. Each round's two windows make a pair, and the live requests' change is the
    // median of the pairs' ratios; which window comes first alternates, so that a drift of the
    // host over the run favours neither side.
    let seeded = expired(pool).await?;
    let mut pairs = Vec::new();
    let mut purging = Duration::ZERO;
    let mut round = 0;
    while expired(pool).await? > 0 {
        round += 1;
        eprintln!(
            "round {round}: {} s alone and {} s beside the purge",
            args.window_secs, args.window_secs
        );
        let (alone, beside) = if round % 2 == 1 {
            let alone = alone(&client, args, window).await;
            (
                alone,
                beside(&client, &store, options, args, window, pool).await?,
            )
        } else {
            let beside = beside(&client, &store, options, args, window, pool).await?;
            (alone(&client, args, window).await, beside)
        };
        purging += beside.purging;
        pairs.push((alone, beside));
    }
    let purged = (seeded - expired(pool).await?) as u64;
    println!(
        "purge of {} expired keys beside live requests, batches of {}, {pacing_name}, {} live \
         clients, {} rounds of {} s alone and {} s beside the purge",
        args.rows, args.batch, args.concurrency, round, args.window_secs, args.window_secs
    );
    println!("  rows purged      {purged:>12}");
    println!(
        "  cleared in       {:>11.2}s of windows beside live requests",
        purging.as_secs_f64()
    );
    println!(
        "  rate             {:>10.0} rows/s",
        purged as f64 / purging.as_secs_f64()
    );
    // PostgreSQL's CPU beside the purge, less what the live requests answered meanwhile cost
    // at the rate of their round's window alone: what the purge itself cost.
    let purge_cpu: f64 = pairs
        .iter()
        .map(|(alone, beside)| {
            let live = alone
                .cpu
                .per_request(
                    alone.live.ok + alone.live.errors,
                    crate::cpu::Server::Postgres,
                )
                .1;
            let requests = beside.live.ok + beside.live.errors;
            beside.cpu.postgres.as_secs_f64() * 1e6 - live * requests as f64
        })
        .sum();
    println!(
        "  purge CPU        {:>8.1} µs/row of PostgreSQL, {:.2} of {} cores while it ran",
        purge_cpu / purged.max(1) as f64,
        purge_cpu / 1e6 / purging.as_secs_f64(),
        std::thread::available_parallelism().map_or(1, usize::from),
    );
    println!();
    println!(
        "  live requests    {:>10} {:>10} {:>10} {:>8}",
        "req/s", "p50 ms", "p99 ms", "errors"
    );
    let mut all_alone = load::Stats::empty();
    let mut all_beside = load::Stats::empty();
    for (alone, beside) in &pairs {
        all_alone.add(&alone.live);
        all_beside.add(&beside.live);
    }
    for (name, stats) in [("alone", &all_alone), ("beside the purge", &all_beside)] {
        println!(
            "  {name:<16} {:>10.0} {:>10.2} {:>10.2} {:>8}",
            stats.rate(),
            stats.ms(0.5),
            stats.ms(0.99),
            stats.errors
        );
    }
    // A last purge window cut short by the end of the purge is too few requests for a p99.
    let ratio = |measure: &dyn Fn(&load::Stats) -> f64| {
        median(
            pairs
                .iter()
                .filter(|(_, beside)| beside.purging >= window / 2)
                .map(|(alone, beside)| measure(&beside.live) / measure(&alone.live)),
        )
    };
    println!(
        "  beside/alone     {:>10.2} {:>10.2} {:>10.2}   (median of the rounds' ratios)",
        ratio(&|s| s.rate()),
        ratio(&|s| s.ms(0.5)),
        ratio(&|s| s.ms(0.99))
    );
    Ok(())
}

/// What one window measured.
struct Window {
    /// The live requests.
    live: load::Stats,
    /// The CPU the window took.
    cpu: cpu::Sample,
    /// How long the purge ran in it: none in a window alone; beside it, the whole window, or
    /// less when the purge finished.
    purging: Duration,
}

/// A window of live load alone.
async fn alone(client: &load::Client, args: &Args, window: Duration) -> Window {
    let started = cpu::Sample::now();
    let live = load::run(client, &Workload::First, args.concurrency, window).await;
    Window {
        live,
        cpu: cpu::Sample::now().since(started),
        purging: Duration::ZERO,
    }
}

/// A window of live load beside the purge.
async fn beside(
    client: &load::Client,
    store: &Store<sqlx::Postgres>,
    options: PurgeOptions,
    args: &Args,
    window: Duration,
    pool: &sqlx::PgPool,
) -> Result<Window, db::Error> {
    let started = cpu::Sample::now();
    let stop = Arc::new(AtomicBool::new(false));
    let live = load::run_until(
        client,
        &Workload::First,
        args.concurrency,
        Arc::clone(&stop),
    );
    let purge = async {
        let clock = std::time::Instant::now();
        // The window's end cuts the pass short between or inside its statements, as a
        // server's shutdown cuts a spawned purge; each statement is its own transaction.
        let outcome = tokio::time::timeout(window, store.purge_expired(options)).await;
        let took = clock.elapsed();
        stop.store(true, Ordering::Relaxed);
        (outcome, took)
    };
    let (live, (outcome, purging)) = tokio::join!(live, purge);
    if let Ok(report) = outcome {
        report?;
    }
    // A statement cut off mid-way still runs to its end in PostgreSQL: wait for it, so that its
    // rows and CPU count in this window and not in the next.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND state = 'active' \
               AND pid <> pg_backend_pid() AND query LIKE 'WITH purged AS%'",
        )
        .fetch_one(pool)
        .await?;
        if running == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a purge statement cut off at the window's end was still running 30 s later"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Window {
        live,
        cpu: cpu::Sample::now().since(started),
        purging,
    })
}

/// How many keys are past their expiry.
async fn expired(pool: &sqlx::PgPool) -> Result<i64, db::Error> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE expires_at <= now()")
            .fetch_one(pool)
            .await?,
    )
}
