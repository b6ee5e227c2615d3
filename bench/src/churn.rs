//! `churn`: does the key table hold its size under constant churn? The example's payments are
//! sent at a steady rate (a stated share of what the service answers at most, measured first)
//! with a short retention, while the purge runs as a spawned task on its default pacing, on a
//! table seeded with millions of keys that do not expire during the run. Every sample (a
//! minute by default) records the table's and each index's size, what the database says of
//! dead rows and of its own cleaning (PostgreSQL's autovacuum, InnoDB's history list, SQLite's
//! freelist), the purge's backlog and the first requests' p50 and p99. After a warm-up of one
//! retention and the run's duration it prints the series and a verdict: the size and the p99
//! at the end against those one retention after the start, and whether the backlog stayed
//! bounded. `--plot` writes the series as an SVG.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, response::Response, routing::post};
use hdrhistogram::Histogram;
use idem_examples::{
    auth::Tenant,
    error::{ApiError, ApiJson},
    payments::{self, AppState, NewTransfer},
    sql::Sql,
};
use idem_runtime::{
    Store, idempotent,
    tasks::{Purge, PurgeOptions},
};
use sqlx::{MySqlPool, PgPool, SqlitePool, Transaction, mysql::MySqlPoolOptions};
use tokio_util::sync::CancellationToken;

use crate::{
    db,
    http::median,
    load::{self, Client, Route, Workload},
};

/// Arguments of the churn benchmark.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The database.
    #[arg(long, value_enum, default_value_t = Database::Postgres)]
    pub backend: Database,
    /// Keys seeded before the run, expiring long after it.
    #[arg(long, default_value_t = 2_000_000)]
    pub seed: i64,
    /// The retention of the payments sent (the warm-up lasts one retention).
    #[arg(long, value_enum, default_value_t = Retention::FiveMinutes)]
    pub retention: Retention,
    /// Minutes measured after the warm-up.
    #[arg(long, default_value_t = 60.0)]
    pub minutes: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 60)]
    pub sample_secs: u64,
    /// The share of the measured capacity (closed-loop requests/s) sent.
    #[arg(long, default_value_t = 0.25)]
    pub share: f64,
    /// A rate to send instead of a share of the capacity, in requests/s.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seconds of the closed-loop capacity measurement.
    #[arg(long, default_value_t = 10)]
    pub capacity_secs: u64,
    /// Seconds between the ends of two purge passes (the purge's own default: 60).
    #[arg(long, default_value_t = 60)]
    pub purge_interval_secs: u64,
    /// On PostgreSQL, resets the key table's autovacuum settings (which idem's migrations set)
    /// to the server's, to measure the table without them.
    #[arg(long)]
    pub stock_autovacuum: bool,
    /// Writes the series as an SVG plot to this file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// A run of under a minute that checks the benchmark works (10 s retention, 20 s measured,
    /// 5 s samples, 10 000 seeded keys); its numbers mean nothing.
    #[arg(long)]
    pub smoke: bool,
}

impl Args {
    /// The arguments of `--smoke` on `backend`.
    pub fn smoke(backend: Database) -> Self {
        Self {
            backend,
            seed: 10_000,
            retention: Retention::TenSeconds,
            minutes: 20.0 / 60.0,
            sample_secs: 5,
            share: 0.25,
            rate: None,
            capacity_secs: 2,
            purge_interval_secs: 5,
            stock_autovacuum: false,
            plot: None,
            smoke: true,
        }
    }
}

/// A database the churn benchmark runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Database {
    /// PostgreSQL at `$DATABASE_URL` (a scratch database is created and dropped).
    Postgres,
    /// MariaDB at `$MYSQL_URL` (a scratch database is created and dropped; the seed reads
    /// MariaDB's Sequence engine).
    Mysql,
    /// A scratch SQLite file in a temporary directory.
    Sqlite,
}

/// The retentions the benchmark's payment routes are compiled with (the `#[idempotent]`
/// attribute takes a literal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Retention {
    /// 10 s, for `--smoke`.
    #[value(name = "10s")]
    TenSeconds,
    /// 1 minute.
    #[value(name = "1m")]
    OneMinute,
    /// 5 minutes.
    #[value(name = "5m")]
    FiveMinutes,
    /// 10 minutes.
    #[value(name = "10m")]
    TenMinutes,
}

impl Retention {
    fn duration(self) -> Duration {
        Duration::from_secs(match self {
            Self::TenSeconds => 10,
            Self::OneMinute => 60,
            Self::FiveMinutes => 300,
            Self::TenMinutes => 600,
        })
    }

    /// `POST /v1/payments` of the example, but kept this long.
    fn routes<DB: Sql>(self) -> Router<AppState<DB>> {
        let route = match self {
            Self::TenSeconds => post(pay_10s::<DB>),
            Self::OneMinute => post(pay_1m::<DB>),
            Self::FiveMinutes => post(pay_5m::<DB>),
            Self::TenMinutes => post(pay_10m::<DB>),
        };
        Router::new().route("/v1/payments", route)
    }
}

// The example's `POST /v1/payments` (its work, attributes and answers), with a short retention.

#[idempotent(scope = "tenant", retention = "10s", replay_5xx = false, wait = "10s", state = AppState<DB>)]
async fn pay_10s<DB: Sql>(
    tenant: Tenant,
    tx: &mut Transaction<'_, DB>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Response, ApiError> {
    Ok(payments::record_payment(&tenant, tx, body).await?)
}

#[idempotent(scope = "tenant", retention = "1m", replay_5xx = false, wait = "10s", state = AppState<DB>)]
async fn pay_1m<DB: Sql>(
    tenant: Tenant,
    tx: &mut Transaction<'_, DB>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Response, ApiError> {
    Ok(payments::record_payment(&tenant, tx, body).await?)
}

#[idempotent(scope = "tenant", retention = "5m", replay_5xx = false, wait = "10s", state = AppState<DB>)]
async fn pay_5m<DB: Sql>(
    tenant: Tenant,
    tx: &mut Transaction<'_, DB>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Response, ApiError> {
    Ok(payments::record_payment(&tenant, tx, body).await?)
}

#[idempotent(scope = "tenant", retention = "10m", replay_5xx = false, wait = "10s", state = AppState<DB>)]
async fn pay_10m<DB: Sql>(
    tenant: Tenant,
    tx: &mut Transaction<'_, DB>,
    ApiJson(body): ApiJson<NewTransfer>,
) -> Result<Response, ApiError> {
    Ok(payments::record_payment(&tenant, tx, body).await?)
}

/// One sample of the series.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Seconds since the steady load started.
    pub at: f64,
    /// First requests answered per second over the sample.
    pub rate: f64,
    /// Their p50 and p99, in milliseconds.
    pub p50: f64,
    /// See `p50`.
    pub p99: f64,
    /// Requests answered otherwise than a fresh 201, or failed.
    pub errors: u64,
    /// Keys past their expiry not yet purged.
    pub backlog: i64,
    /// The table and its indexes, in bytes (what the verdict compares).
    pub total: i64,
    /// The database's own measures, named, in a fixed order.
    pub columns: Vec<(String, f64)>,
}

/// What a database says of its key table.
struct Measure {
    total: i64,
    backlog: i64,
    columns: Vec<(String, f64)>,
}

/// What the benchmark needs of a database.
trait Target {
    const NAME: &'static str;
    /// Seeds `keys` completed keys expiring in 30 days.
    async fn seed(&self, keys: i64) -> Result<(), db::Error>;
    /// Serves the example's payments kept `retention` long; spawns the purge with `options`
    /// until `shutdown`.
    async fn serve(
        &self,
        retention: Retention,
        options: PurgeOptions,
        shutdown: &CancellationToken,
    ) -> Result<SocketAddr, db::Error>;
    /// Measures the table now.
    async fn measure(&self) -> Result<Measure, db::Error>;
}

const MIB: f64 = 1_048_576.0;

/// Runs the benchmark and prints its series and verdict.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let args = if args.smoke {
        Args {
            plot: args.plot.clone(),
            ..Args::smoke(args.backend)
        }
    } else {
        args
    };
    run_series(&args).await.map(|_| ())
}

/// Runs the benchmark; returns the series and the verdict's text.
pub async fn run_series(args: &Args) -> Result<(Vec<Sample>, String), db::Error> {
    match args.backend {
        Database::Postgres => {
            let scratch = db::Scratch::named(4, "churn").await?;
            if args.stock_autovacuum {
                sqlx::raw_sql(
                    "ALTER TABLE idem_keys RESET (autovacuum_vacuum_scale_factor, \
                     autovacuum_vacuum_threshold, autovacuum_analyze_scale_factor)",
                )
                .execute(&scratch.pool)
                .await?;
            }
            let settings: String = sqlx::query_scalar(
                "SELECT format('autovacuum %s, the key table''s settings %s', \
                   current_setting('autovacuum'), coalesce(reloptions::text, '(none)')) \
                 FROM pg_class WHERE oid = 'idem_keys'::regclass",
            )
            .fetch_one(&scratch.pool)
            .await?;
            eprintln!("PostgreSQL: {settings}");
            println!("PostgreSQL: {settings}");
            let target = Postgres::new(&scratch);
            let result = churn(args, &target).await;
            target.stop.cancel();
            scratch.drop().await?;
            result
        }
        Database::Mysql => {
            let scratch = db::MySqlScratch::named("churn").await?;
            let result = async {
                let pool = MySqlPoolOptions::new()
                    .max_connections(4)
                    .connect(&scratch.url)
                    .await?;
                let target = MySql {
                    url: scratch.url.clone(),
                    pool: pool.clone(),
                };
                let result = churn(args, &target).await;
                pool.close().await;
                result
            }
            .await;
            scratch.drop().await?;
            result
        }
        Database::Sqlite => {
            let dir = std::env::temp_dir().join(format!("idem-bench-churn-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let result = async {
                let path = dir.join("churn.db");
                let pool = idem_examples::schema::connect_sqlite(&path).await?;
                idem_examples::schema::create(&pool).await?;
                let target = Sqlite { path, pool };
                churn(args, &target).await
            }
            .await;
            std::fs::remove_dir_all(&dir)?;
            result
        }
    }
}

/// The latencies of the first requests since the last sample.
struct Window {
    latency: Histogram<u64>,
    ok: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Window {
    fn new() -> Self {
        Self {
            latency: Histogram::new(3).expect("histogram"),
            ok: 0,
            errors: 0,
            first_error: None,
        }
    }
}

async fn churn<T: Target>(args: &Args, target: &T) -> Result<(Vec<Sample>, String), db::Error> {
    let retention = args.retention.duration();
    eprintln!("seeding {} keys...", args.seed);
    let seeding = Instant::now();
    target.seed(args.seed).await?;
    eprintln!("seeded in {:.0} s", seeding.elapsed().as_secs_f64());
    let shutdown = CancellationToken::new();
    let options =
        PurgeOptions::default().with_interval(Duration::from_secs(args.purge_interval_secs));
    let result = async {
        let client = Client::new(target.serve(args.retention, options, &shutdown).await?);
        // What the service answers at most, closed-loop: the rate is a share of it.
        let capacity = load::run(
            &client,
            &Workload::First,
            16,
            Duration::from_secs(args.capacity_secs),
        )
        .await;
        if capacity.ok == 0 {
            return Err(format!(
                "no request succeeded while measuring the capacity: {:?}",
                capacity.first_error
            )
            .into());
        }
        let rate = args.rate.unwrap_or(capacity.rate() * args.share);
        let share = rate / capacity.rate();
        let header = format!(
            "{} churn: {} keys seeded (expiring after the run), payments kept {} s, sent at \
             {rate:.0} req/s ({:.0}% of the {:.0} req/s 16 closed-loop clients got), the purge \
             spawned on its default pacing every {} s; warm-up {} s, then {:.0} min measured, a \
             sample every {} s",
            T::NAME,
            args.seed,
            retention.as_secs(),
            share * 100.0,
            capacity.rate(),
            args.purge_interval_secs,
            retention.as_secs(),
            args.minutes,
            args.sample_secs,
        );
        eprintln!("{header}");
        let window = Arc::new(Mutex::new(Window::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let driver = tokio::spawn(drive(
            client.clone(),
            rate,
            Arc::clone(&stop),
            Arc::clone(&window),
        ));
        let started = Instant::now();
        let total = retention + Duration::from_secs_f64(args.minutes * 60.0);
        let mut series = Vec::new();
        let mut ticker = tokio::time::interval_at(
            tokio::time::Instant::now() + Duration::from_secs(args.sample_secs),
            Duration::from_secs(args.sample_secs),
        );
        let mut last = Instant::now();
        let mut first_error = None;
        let sampled = async {
            while started.elapsed() < total {
                ticker.tick().await;
                let taken = std::mem::replace(&mut *window.lock().expect("window"), Window::new());
                let secs = last.elapsed().as_secs_f64();
                last = Instant::now();
                let measure = target.measure().await?;
                if first_error.is_none() {
                    first_error = taken.first_error;
                }
                let sample = Sample {
                    at: started.elapsed().as_secs_f64(),
                    rate: taken.ok as f64 / secs,
                    p50: taken.latency.value_at_quantile(0.5) as f64 / 1000.0,
                    p99: taken.latency.value_at_quantile(0.99) as f64 / 1000.0,
                    errors: taken.errors,
                    backlog: measure.backlog,
                    total: measure.total,
                    columns: measure.columns,
                };
                eprintln!("{}", row(&sample));
                series.push(sample);
            }
            Ok::<_, db::Error>(())
        }
        .await;
        stop.store(true, Ordering::Relaxed);
        let _ = driver.await;
        sampled?;
        println!("{header}");
        println!();
        print_series(&series);
        let verdict = verdict(&series, retention, rate, options);
        println!();
        println!("{verdict}");
        if let Some(error) = first_error {
            println!("first unexpected answer: {error}");
        }
        if let Some(path) = &args.plot {
            plot(path, T::NAME, &series, retention)?;
            println!("plot written to {}", path.display());
        }
        Ok((series, verdict))
    }
    .await;
    shutdown.cancel();
    result
}

/// Sends first requests at `rate` per second, open-loop (a request is sent on time whether or
/// not the ones before it were answered, up to 512 in flight), until `stop`.
async fn drive(client: Client, rate: f64, stop: Arc<AtomicBool>, window: Arc<Mutex<Window>>) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1.0)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(512));
    let mut sends = tokio::task::JoinSet::new();
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            break;
        };
        let (client, window) = (client.clone(), Arc::clone(&window));
        sends.spawn(async move {
            let sent = Instant::now();
            let reply = client
                .pay(Route::Idempotent, Some(&load::fresh_key()))
                .await;
            let micros = (sent.elapsed().as_micros() as u64).max(1);
            drop(permit);
            let mut window = window.lock().expect("window");
            match reply {
                Ok((status, false)) if status == reqwest::StatusCode::CREATED => {
                    window.ok += 1;
                    let _ = window.latency.record(micros);
                }
                other => {
                    window.errors += 1;
                    if window.first_error.is_none() {
                        window.first_error = Some(format!("{other:?}"));
                    }
                }
            }
        });
        while sends.try_join_next().is_some() {}
    }
    while sends.join_next().await.is_some() {}
}

fn row(sample: &Sample) -> String {
    let mut line = format!(
        "| {:.1} | {:.0} | {:.2} | {:.2} | {} | {} | {:.1} |",
        sample.at / 60.0,
        sample.rate,
        sample.p50,
        sample.p99,
        sample.errors,
        sample.backlog,
        sample.total as f64 / MIB,
    );
    for (_, value) in &sample.columns {
        if value.fract() == 0.0 {
            line.push_str(&format!(" {value:.0} |"));
        } else {
            line.push_str(&format!(" {value:.1} |"));
        }
    }
    line
}

fn print_series(series: &[Sample]) {
    let Some(first) = series.first() else {
        println!("(no samples)");
        return;
    };
    let mut header =
        "| min | req/s | p50 ms | p99 ms | errors | backlog | table+indexes MiB |".to_owned();
    let mut rule = "|---|---|---|---|---|---|---|".to_owned();
    for (name, _) in &first.columns {
        header.push_str(&format!(" {name} |"));
        rule.push_str("---|");
    }
    println!("{header}");
    println!("{rule}");
    for sample in series {
        println!("{}", row(sample));
    }
}

/// The sample one retention after the start, the last one, and the targets between them.
fn verdict(series: &[Sample], retention: Duration, rate: f64, options: PurgeOptions) -> String {
    let warm = retention.as_secs_f64();
    let Some(reference) = series.iter().find(|s| s.at >= warm) else {
        return "verdict: no sample after the warm-up".to_owned();
    };
    let end = series.last().expect("a sample after the warm-up");
    let size = end.total as f64 / reference.total.max(1) as f64;
    let p99 = end.p99 / reference.p99.max(f64::MIN_POSITIVE);
    // Steadier than one sample each: the median p99 of the first and the last five samples
    // after the warm-up.
    let after: Vec<&Sample> = series.iter().filter(|s| s.at >= warm).collect();
    let five = after.len().min(5);
    let p99_first5 = median(after[..five].iter().map(|s| s.p99));
    let p99_last5 = median(after[after.len() - five..].iter().map(|s| s.p99));
    // Bounded: the backlog never exceeded what arrives over two purge intervals plus the
    // length of a sample, the most a purge that keeps up leaves behind when it is sampled.
    let bound = (rate * (2 * options.interval().as_secs() + 60) as f64) as i64;
    let backlog_max = after.iter().map(|s| s.backlog).max().unwrap_or(0);
    let half = after.len() / 2;
    let backlog_first_half = after[..half].iter().map(|s| s.backlog).max().unwrap_or(0);
    let backlog_second_half = after[half..].iter().map(|s| s.backlog).max().unwrap_or(0);
    let ok = |pass: bool| if pass { "met" } else { "NOT met" };
    format!(
        "verdict, the last sample ({:.1} min) against the one a retention after the start ({:.1} min):\n  \
         size   {:.1} MiB -> {:.1} MiB: {size:.3}x (target <= 1.25: {})\n  \
         p99    {:.2} ms -> {:.2} ms: {p99:.2}x (target <= 1.2: {}); median of the first and last five samples {p99_first5:.2} -> {p99_last5:.2} ms, {:.2}x\n  \
         backlog at most {backlog_max} (first half {backlog_first_half}, second half {backlog_second_half}; bound {bound}, two purge intervals and a minute of arrivals: {})",
        end.at / 60.0,
        reference.at / 60.0,
        reference.total as f64 / MIB,
        end.total as f64 / MIB,
        ok(size <= 1.25),
        reference.p99,
        end.p99,
        ok(p99 <= 1.2),
        p99_last5 / p99_first5.max(f64::MIN_POSITIVE),
        if backlog_max <= bound {
            "bounded"
        } else {
            "NOT bounded"
        },
    )
}

/// Writes the size and the p99 over time as an SVG.
fn plot(path: &Path, name: &str, series: &[Sample], retention: Duration) -> Result<(), db::Error> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(250);
    let minutes = series.last().map_or(1.0, |s| s.at / 60.0).max(0.1);
    let size_max = series
        .iter()
        .map(|s| s.total as f64 / MIB)
        .fold(0.0, f64::max)
        * 1.1;
    let p99_max = series.iter().map(|s| s.p99).fold(0.0, f64::max) * 1.1;
    let warm = retention.as_secs_f64() / 60.0;
    for (area, title, max, unit, value) in [
        (
            &top,
            format!("{name}: key table and indexes"),
            size_max,
            "MiB",
            (|s: &Sample| s.total as f64 / MIB) as fn(&Sample) -> f64,
        ),
        (
            &bottom,
            format!("{name}: first requests' p99"),
            p99_max,
            "ms",
            (|s: &Sample| s.p99) as fn(&Sample) -> f64,
        ),
    ] {
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..minutes, 0.0..max.max(0.001))?;
        chart
            .configure_mesh()
            .x_desc("minutes")
            .y_desc(unit)
            .draw()?;
        chart.draw_series(LineSeries::new(
            series.iter().map(|s| (s.at / 60.0, value(s))),
            &BLUE,
        ))?;
        chart.draw_series(LineSeries::new([(warm, 0.0), (warm, max)], RED.mix(0.5)))?;
    }
    root.present()?;
    Ok(())
}

/// Inserts the completed keys `from + 1` to `from + n` (`seed-0000000001`, ...), expiring in 30
/// days and a millisecond apart (as keys written over time do: the `expires_at` index
/// deduplicates equal values, which would understate its size), in statements of a million rows, in primary key order.
pub async fn seed_postgres(pool: &PgPool, from: i64, n: i64) -> Result<(), db::Error> {
    let chunk = 1_000_000_i64;
    let mut seeded = 0;
    while seeded < n {
        let rows = chunk.min(n - seeded);
        sqlx::query(
            "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
               response_status, response_headers, response_body, created_at, expires_at) \
             SELECT 'seed_' || lpad((g / 100000)::text, 5, '0'), \
               'seed-' || lpad(g::text, 10, '0'), 'POST', '/v1/payments', \
               sha256(g::text::bytea), 'completed', 201, \
               '[[\"content-type\",\"application/json\"],[\"location\",\"/v1/payments/pay_0\"]]'::jsonb, \
               convert_to(repeat('x', 120), 'UTF8'), now() - interval '1 hour', \
               now() + interval '30 days' + make_interval(secs => g / 1000.0) \
             FROM generate_series($1 + 1, $1 + $2) g",
        )
        .bind(from + seeded)
        .bind(rows)
        .execute(pool)
        .await?;
        seeded += rows;
        eprintln!("seeded {} keys", from + seeded);
    }
    Ok(())
}

/// As [`seed_postgres`], on MariaDB (its Sequence engine), in statements of 500 000 rows.
pub async fn seed_mysql(pool: &MySqlPool, from: i64, n: i64) -> Result<(), db::Error> {
    let chunk = 500_000_i64;
    let mut seeded = 0;
    while seeded < n {
        let rows = chunk.min(n - seeded);
        // In primary key order across chunks: InnoDB appends instead of splitting pages.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, \
               response_status, response_headers, response_body, created_at, expires_at) \
             SELECT CONCAT('seed_', LPAD(seq DIV 100000, 5, '0')), \
               CONCAT('seed-', LPAD(seq, 10, '0')), 'POST', '/v1/payments', \
               UNHEX(SHA2(seq, 256)), 'completed', 201, \
               '[[\"content-type\",\"application/json\"],[\"location\",\"/v1/payments/pay_0\"]]', \
               REPEAT('x', 120), UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, \
               UTC_TIMESTAMP(6) + INTERVAL 30 DAY + INTERVAL seq * 1000 MICROSECOND \
             FROM seq_{}_to_{} ORDER BY 1, 2",
            from + seeded + 1,
            from + seeded + rows
        )))
        .execute(pool)
        .await?;
        seeded += rows;
        eprintln!("seeded {} keys", from + seeded);
    }
    Ok(())
}

/// As [`seed_postgres`], on SQLite (times in Unix milliseconds), in one statement.
pub async fn seed_sqlite(pool: &SqlitePool, from: i64, n: i64) -> Result<(), db::Error> {
    if n <= 0 {
        return Ok(());
    }
    sqlx::query(
        "WITH RECURSIVE g(n) AS (SELECT ?1 + 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?1 + ?2) \
         INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
           response_status, response_headers, response_body, created_at, expires_at) \
         SELECT printf('seed_%05d', n / 100000), printf('seed-%010d', n), 'POST', \
           '/v1/payments', randomblob(32), 'completed', 201, \
           '[[\"content-type\",\"application/json\"],[\"location\",\"/v1/payments/pay_0\"]]', \
           zeroblob(120), (unixepoch() - 3600) * 1000, (unixepoch() + 30 * 86400) * 1000 + n FROM g",
    )
    .bind(from)
    .bind(n)
    .execute(pool)
    .await?;
    eprintln!("seeded {} keys", from + n);
    Ok(())
}

/// PostgreSQL, with a poller of `pg_stat_progress_vacuum` that times each (auto)vacuum of the
/// table to the second.
struct Postgres<'a> {
    scratch: &'a db::Scratch,
    vacuums: Arc<Mutex<Vec<f64>>>,
    stop: CancellationToken,
}

impl<'a> Postgres<'a> {
    fn new(scratch: &'a db::Scratch) -> Self {
        let vacuums = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        tokio::spawn(poll_vacuums(
            scratch.pool.clone(),
            Arc::clone(&vacuums),
            stop.clone(),
        ));
        Self {
            scratch,
            vacuums,
            stop,
        }
    }
}

/// Every second, which vacuums of `idem_keys` run; pushes each one's duration when it ends.
async fn poll_vacuums(pool: PgPool, done: Arc<Mutex<Vec<f64>>>, stop: CancellationToken) {
    let mut running: std::collections::HashMap<i32, f64> = std::collections::HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.is_cancelled() {
        tick.tick().await;
        let Ok(now): Result<Vec<(i32, f64)>, _> = sqlx::query_as(
            "SELECT p.pid, extract(epoch FROM clock_timestamp() - a.xact_start)::float8 \
             FROM pg_stat_progress_vacuum p JOIN pg_stat_activity a USING (pid) \
             WHERE p.datid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND p.relid = to_regclass('idem_keys') AND a.xact_start IS NOT NULL",
        )
        .fetch_all(&pool)
        .await
        else {
            continue;
        };
        let ended: Vec<i32> = running
            .keys()
            .filter(|pid| !now.iter().any(|(p, _)| p == *pid))
            .copied()
            .collect();
        for pid in ended {
            if let Some(took) = running.remove(&pid) {
                done.lock().expect("vacuums").push(took);
            }
        }
        for (pid, took) in now {
            running.insert(pid, took);
        }
    }
}

impl Target for Postgres<'_> {
    const NAME: &'static str = "PostgreSQL";

    async fn seed(&self, keys: i64) -> Result<(), db::Error> {
        seed_postgres(&self.scratch.pool, 0, keys).await?;
        sqlx::raw_sql("VACUUM ANALYZE idem_keys")
            .execute(&self.scratch.pool)
            .await?;
        Ok(())
    }

    async fn serve(
        &self,
        retention: Retention,
        options: PurgeOptions,
        shutdown: &CancellationToken,
    ) -> Result<SocketAddr, db::Error> {
        let purge_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&self.scratch.url)
            .await?;
        let _ = Purge::new(Store::new(purge_pool), options).spawn(shutdown.clone());
        let url = self.scratch.url.clone();
        load::serve_router(move || async move {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(24)
                .min_connections(24)
                .connect(&url)
                .await?;
            Ok(retention
                .routes::<sqlx::Postgres>()
                .with_state(AppState::new(Store::new(pool))))
        })
        .await
    }

    async fn measure(&self) -> Result<Measure, db::Error> {
        let pool = &self.scratch.pool;
        let (heap, live, dead, autovacuums, autoanalyzes): (i64, i64, i64, i64, i64) =
            sqlx::query_as(
                "SELECT pg_table_size('idem_keys'), n_live_tup, n_dead_tup, autovacuum_count, \
                   autoanalyze_count FROM pg_stat_user_tables WHERE relname = 'idem_keys'",
            )
            .fetch_one(pool)
            .await?;
        let indexes: Vec<(String, i64)> = sqlx::query_as(
            "SELECT indexrelname::text, pg_relation_size(indexrelid) FROM pg_stat_user_indexes \
             WHERE relname = 'idem_keys' ORDER BY indexrelname",
        )
        .fetch_all(pool)
        .await?;
        let backlog: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE expires_at <= now()")
                .fetch_one(pool)
                .await?;
        let vacuum_secs = self
            .vacuums
            .lock()
            .expect("vacuums")
            .drain(..)
            .fold(0.0, |sum, took| sum + took);
        let mut columns = vec![("heap MiB".to_owned(), heap as f64 / MIB)];
        let mut total = heap;
        for (name, bytes) in indexes {
            total += bytes;
            let short = name
                .trim_start_matches("idem_keys_")
                .trim_end_matches("_idx");
            columns.push((format!("{short} MiB"), bytes as f64 / MIB));
        }
        columns.extend([
            ("live".to_owned(), live as f64),
            ("dead".to_owned(), dead as f64),
            ("autovacuums".to_owned(), autovacuums as f64),
            ("vacuum s".to_owned(), vacuum_secs),
            ("autoanalyzes".to_owned(), autoanalyzes as f64),
        ]);
        Ok(Measure {
            total,
            backlog,
            columns,
        })
    }
}

/// MariaDB: sizes from `information_schema` and InnoDB's persistent statistics (refreshed by
/// an `ANALYZE TABLE` before each sample), the tablespace file's size, and the server's history
/// list (undo not yet purged, server-wide).
struct MySql {
    url: String,
    pool: MySqlPool,
}

impl Target for MySql {
    const NAME: &'static str = "MariaDB";

    async fn seed(&self, keys: i64) -> Result<(), db::Error> {
        seed_mysql(&self.pool, 0, keys).await?;
        sqlx::raw_sql("ANALYZE TABLE idem_keys")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn serve(
        &self,
        retention: Retention,
        options: PurgeOptions,
        shutdown: &CancellationToken,
    ) -> Result<SocketAddr, db::Error> {
        let purge_pool = MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&self.url)
            .await?;
        let _ = Purge::new(Store::new(purge_pool), options).spawn(shutdown.clone());
        let url = self.url.clone();
        load::serve_router(move || async move {
            let pool = MySqlPoolOptions::new()
                .max_connections(24)
                .min_connections(24)
                .connect(&url)
                .await?;
            Ok(retention
                .routes::<sqlx::MySql>()
                .with_state(AppState::new(Store::new(pool))))
        })
        .await
    }

    async fn measure(&self) -> Result<Measure, db::Error> {
        let pool = &self.pool;
        sqlx::raw_sql("ANALYZE TABLE idem_keys")
            .execute(pool)
            .await?;
        let (data, index, free, rows): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT CAST(DATA_LENGTH AS SIGNED), CAST(INDEX_LENGTH AS SIGNED), \
               CAST(DATA_FREE AS SIGNED), CAST(TABLE_ROWS AS SIGNED) \
             FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_keys'",
        )
        .fetch_one(pool)
        .await?;
        let indexes: Vec<(String, i64)> = sqlx::query_as(
            "SELECT CAST(index_name AS CHAR), CAST(stat_value * @@innodb_page_size AS SIGNED) \
             FROM mysql.innodb_index_stats \
             WHERE database_name = DATABASE() AND table_name = 'idem_keys' \
               AND stat_name = 'size' ORDER BY index_name",
        )
        .fetch_all(pool)
        .await?;
        let file: Option<i64> = sqlx::query_scalar(
            "SELECT CAST(FILE_SIZE AS SIGNED) FROM information_schema.INNODB_SYS_TABLESPACES \
             WHERE NAME = CONCAT(DATABASE(), '/idem_keys')",
        )
        .fetch_optional(pool)
        .await?;
        let history: String = sqlx::query_scalar(
            "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
             WHERE VARIABLE_NAME = 'INNODB_HISTORY_LIST_LENGTH'",
        )
        .fetch_one(pool)
        .await?;
        let backlog: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM idem_keys WHERE expires_at <= UTC_TIMESTAMP(6)",
        )
        .fetch_one(pool)
        .await?;
        let mut columns = Vec::new();
        for (name, bytes) in indexes {
            let short = name
                .trim_start_matches("idem_keys_")
                .trim_end_matches("_idx");
            columns.push((format!("{short} MiB"), bytes as f64 / MIB));
        }
        columns.extend([
            ("data MiB".to_owned(), data as f64 / MIB),
            ("indexes MiB".to_owned(), index as f64 / MIB),
            ("free MiB".to_owned(), free as f64 / MIB),
            ("file MiB".to_owned(), file.unwrap_or(0) as f64 / MIB),
            ("rows (est.)".to_owned(), rows as f64),
            ("history".to_owned(), history.parse().unwrap_or(f64::NAN)),
        ]);
        Ok(Measure {
            total: data + index,
            backlog,
            columns,
        })
    }
}

/// SQLite: the file's pages and its freelist.
struct Sqlite {
    path: PathBuf,
    pool: SqlitePool,
}

impl Target for Sqlite {
    const NAME: &'static str = "SQLite";

    async fn seed(&self, keys: i64) -> Result<(), db::Error> {
        seed_sqlite(&self.pool, 0, keys).await
    }

    async fn serve(
        &self,
        retention: Retention,
        options: PurgeOptions,
        shutdown: &CancellationToken,
    ) -> Result<SocketAddr, db::Error> {
        let _ = Purge::new(Store::new(self.pool.clone()), options).spawn(shutdown.clone());
        let path = self.path.clone();
        load::serve_router(move || async move {
            let pool = idem_examples::schema::connect_sqlite(&path).await?;
            Ok(retention
                .routes::<sqlx::Sqlite>()
                .with_state(AppState::new(Store::new(pool))))
        })
        .await
    }

    async fn measure(&self) -> Result<Measure, db::Error> {
        let pool = &self.pool;
        let (pages, free, page_size): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT page_count FROM pragma_page_count), \
               (SELECT freelist_count FROM pragma_freelist_count), \
               (SELECT page_size FROM pragma_page_size)",
        )
        .fetch_one(pool)
        .await?;
        let backlog: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idem_keys WHERE expires_at <= unixepoch('subsec') * 1000",
        )
        .fetch_one(pool)
        .await?;
        let file = std::fs::metadata(&self.path).map_or(0, |m| m.len()) as f64;
        Ok(Measure {
            total: (pages - free) * page_size,
            backlog,
            columns: vec![
                ("file MiB".to_owned(), file / MIB),
                ("pages".to_owned(), pages as f64),
                ("freelist".to_owned(), free as f64),
            ],
        })
    }
}

#[cfg(test)]
mod tests {
    //! The churn benchmark in its smoke mode on each database: it runs, samples, and says a
    //! verdict. `scripts/test` runs these with the suite, so that the benchmark keeps building
    //! and running; the numbers are not checked.

    use super::*;

    async fn smoke(backend: Database) {
        let (series, verdict) = run_series(&Args::smoke(backend)).await.unwrap();
        assert!(series.len() >= 3, "{} samples", series.len());
        assert!(series.iter().all(|s| s.total > 0), "{series:?}");
        assert!(series.iter().any(|s| s.rate > 0.0), "{series:?}");
        assert!(verdict.starts_with("verdict, "), "{verdict}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn churn_smoke_on_postgres() {
        smoke(Database::Postgres).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn churn_smoke_on_mysql() {
        smoke(Database::Mysql).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn churn_smoke_on_sqlite() {
        smoke(Database::Sqlite).await;
    }
}
