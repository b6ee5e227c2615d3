//! `scale`: does the claim slow down as the key table grows? On one scratch database per
//! backend (PostgreSQL, MariaDB, SQLite), grown in steps to each of `--keys` (0, 1 and 10
//! million by default): requests to a handler that writes nothing but its key (first
//! executions, then their replays) are timed in the process, each statement of idem's apart
//! (the claim, the completion, the commit); the example's payments are sent over HTTP,
//! closed-loop, first executions and replays; and the table's bytes per key are read, the heap
//! and each index apart. The steps run one after the other on a table that only grows, so a
//! drift of the host over the run is not cancelled out as interleaved rounds would: the 0-key
//! step is measured first and the ratios are against it.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::Path,
    http::{self, StatusCode},
    routing::post,
};
use hdrhistogram::Histogram;
use idem_runtime::{Backend, Store, idempotent};
use sqlx::{MySqlPool, PgPool, SqlitePool, Transaction, mysql::MySqlPoolOptions};
use tower::ServiceExt;

use crate::{
    churn::{self, Database},
    db,
    http::median,
    load::{self, Client, Workload, fresh_key},
    statements,
};

/// Arguments of the scale benchmark.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The databases, in turn.
    #[arg(long, value_enum, num_args = 1.., default_values_t = [Database::Postgres])]
    pub backend: Vec<Database>,
    /// The table's sizes to measure at, in keys, ascending (the table is grown to each).
    #[arg(long, num_args = 1.., default_values_t = [0, 1_000_000, 10_000_000])]
    pub keys: Vec<i64>,
    /// Rounds at each size.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Requests (each a first execution, then its replay) per round.
    #[arg(long, default_value_t = 2000)]
    pub claims: usize,
    /// Seconds of each closed-loop HTTP measurement (first executions, replays).
    #[arg(long, default_value_t = 5)]
    pub http_secs: u64,
    /// Concurrent HTTP clients.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// A run of a few seconds that checks the benchmark works (0 and 10 000 keys, one round of
    /// 100 claims, 1 s of HTTP); its numbers mean nothing.
    #[arg(long)]
    pub smoke: bool,
}

impl Args {
    /// The arguments of `--smoke` on `backend`.
    pub fn smoke(backend: Database) -> Self {
        Self {
            backend: vec![backend],
            keys: vec![0, 10_000],
            rounds: 1,
            claims: 100,
            http_secs: 1,
            concurrency: 4,
            smoke: true,
        }
    }
}

/// What one size measured.
#[derive(Clone, Debug)]
pub struct Step {
    /// Keys in the table when measured (the seeded ones).
    pub keys: i64,
    /// Rows in the table, the benchmark's own included.
    pub rows: i64,
    /// The table and its indexes, in bytes.
    pub bytes: i64,
    /// The heap's and each index's bytes per row, named.
    pub per_key: Vec<(String, f64)>,
    /// In the process: a whole first execution, its claim, its completion, its commit, and a
    /// whole replay: (p50, p99) in ms, medians over the rounds.
    pub timings: [(f64, f64); 5],
    /// Over HTTP through the example, first executions and replays per second.
    pub http: (f64, f64),
}

/// Runs the benchmark and prints its tables.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let args = if args.smoke {
        Args {
            backend: args.backend.clone(),
            ..Args::smoke(Database::Postgres)
        }
    } else {
        args
    };
    for &backend in &args.backend {
        let steps = run_backend(&args, backend).await?;
        print(&args, backend, &steps);
        println!();
    }
    Ok(())
}

/// Measures one database at each size.
pub async fn run_backend(args: &Args, backend: Database) -> Result<Vec<Step>, db::Error> {
    match backend {
        Database::Postgres => {
            let scratch = db::Scratch::named(4, "scale").await?;
            let target = Pg(&scratch);
            let result = measure(args, &target).await;
            scratch.drop().await?;
            result
        }
        Database::Mysql => {
            let scratch = db::MySqlScratch::named("scale").await?;
            let result = async {
                let pool = MySqlPoolOptions::new()
                    .max_connections(4)
                    .connect(&scratch.url)
                    .await?;
                let target = My {
                    url: scratch.url.clone(),
                    pool: pool.clone(),
                };
                let result = measure(args, &target).await;
                pool.close().await;
                result
            }
            .await;
            scratch.drop().await?;
            result
        }
        Database::Sqlite => {
            let dir = std::env::temp_dir().join(format!("idem-bench-scale-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let result = async {
                let path = dir.join("scale.db");
                let pool = idem_examples::schema::connect_sqlite(&path).await?;
                idem_examples::schema::create(&pool).await?;
                let target = Lite { path, pool };
                measure(args, &target).await
            }
            .await;
            std::fs::remove_dir_all(&dir)?;
            result
        }
    }
}

/// What the benchmark needs of a database.
trait Target {
    type Db: Backend;
    /// Adds the seeded keys `from + 1` to `from + n`.
    async fn seed(&self, from: i64, n: i64) -> Result<(), db::Error>;
    /// Has the database clean up and analyse the table (as its routine maintenance would).
    async fn settle(&self) -> Result<(), db::Error>;
    /// Rows, the table's total bytes, and the heap's and each index's bytes.
    async fn sizes(&self) -> Result<(i64, i64, Vec<(String, i64)>), db::Error>;
    /// A store on the database, for the in-process handler.
    fn store(&self) -> Store<Self::Db>;
    /// Serves the example over the database.
    async fn serve(&self) -> Result<SocketAddr, db::Error>;
}

async fn measure<T: Target>(args: &Args, target: &T) -> Result<Vec<Step>, db::Error> {
    let app = Router::new()
        .route("/v1/tenants/{tenant}/payments", post(create::<T::Db>))
        .with_state(target.store());
    let client = Client::new(target.serve().await?);
    let mut seeded = 0;
    let mut steps = Vec::new();
    for &keys in &args.keys {
        if keys > seeded {
            eprintln!("growing the table to {keys} keys...");
            let clock = Instant::now();
            target.seed(seeded, keys - seeded).await?;
            eprintln!("  in {:.0} s", clock.elapsed().as_secs_f64());
            seeded = keys;
        }
        target.settle().await?;
        let (rows, bytes, parts) = target.sizes().await?;
        // Warm the caches, then time.
        time_claims(&app, 200.min(args.claims)).await?;
        let mut rounds: Vec<[(f64, f64); 5]> = Vec::new();
        for round in 1..=args.rounds {
            eprintln!("{keys} keys: round {round}/{}", args.rounds);
            let timed = time_claims(&app, args.claims).await?;
            rounds.push(timed.map(|h| (quantile(&h, 0.5), quantile(&h, 0.99))));
        }
        let timings: [(f64, f64); 5] = std::array::from_fn(|i| {
            (
                median(rounds.iter().map(|r| r[i].0)),
                median(rounds.iter().map(|r| r[i].1)),
            )
        });
        let window = Duration::from_secs(args.http_secs);
        let first = load::run(&client, &Workload::First, args.concurrency, window).await;
        let replay_keys = complete_keys(&client, 200).await?;
        let replay = load::run(
            &client,
            &Workload::Replay(Arc::new(replay_keys)),
            args.concurrency,
            window,
        )
        .await;
        if first.errors > 0 || replay.errors > 0 {
            return Err(format!(
                "unexpected answers over HTTP: {:?} {:?}",
                first.first_error, replay.first_error
            )
            .into());
        }
        steps.push(Step {
            keys,
            rows,
            bytes,
            per_key: parts
                .into_iter()
                .map(|(name, b)| (name, b as f64 / rows.max(1) as f64))
                .collect(),
            timings,
            http: (first.rate(), replay.rate()),
        });
    }
    Ok(steps)
}

/// Completes `n` fresh keys of the example over HTTP, for replays.
async fn complete_keys(client: &Client, n: usize) -> Result<Vec<String>, db::Error> {
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        let key = fresh_key();
        let (status, _) = client.pay(load::Route::Idempotent, Some(&key)).await?;
        if status != reqwest::StatusCode::CREATED {
            return Err(format!("completing a key answered {status}").into());
        }
        keys.push(key);
    }
    Ok(keys)
}

fn print(args: &Args, backend: Database, steps: &[Step]) {
    let name = match backend {
        Database::Postgres => "PostgreSQL",
        Database::Mysql => "MariaDB",
        Database::Sqlite => "SQLite",
    };
    println!(
        "{name}: in the process (no socket), {} fresh keys per round, medians of {} rounds' \
         p50/p99 in ms; over HTTP through the example, {} closed-loop clients, {} s each",
        args.claims, args.rounds, args.concurrency, args.http_secs
    );
    println!();
    println!(
        "| keys | MiB | first p50 | first p99 | claim p50 | claim p99 | completion p50 | \
         completion p99 | commit p50 | commit p99 | replay p50 | replay p99 | HTTP first req/s | \
         HTTP replay req/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for step in steps {
        // A statement the database's driver does not log (SQLite's commit) shows as "-".
        let ms = |value: f64| {
            if value > 0.0 {
                format!("{value:.3}")
            } else {
                "-".to_owned()
            }
        };
        let cells: Vec<String> = step
            .timings
            .iter()
            .flat_map(|(p50, p99)| [ms(*p50), ms(*p99)])
            .collect();
        println!(
            "| {} | {:.0} | {} | {:.0} | {:.0} |",
            step.keys,
            step.bytes as f64 / 1_048_576.0,
            cells.join(" | "),
            step.http.0,
            step.http.1
        );
    }
    println!();
    if let Some(last) = steps.last() {
        let mut header = "| keys | rows |".to_owned();
        let mut rule = "|---|---|".to_owned();
        for (part, _) in &last.per_key {
            header.push_str(&format!(" {part} B/key |"));
            rule.push_str("---|");
        }
        println!("{header}");
        println!("{rule}");
        for step in steps {
            let mut line = format!("| {} | {} |", step.keys, step.rows);
            for (_, bytes) in &step.per_key {
                if step.rows > 0 {
                    line.push_str(&format!(" {bytes:.0} |"));
                } else {
                    line.push_str(" - |");
                }
            }
            println!("{line}");
        }
    }
    if let (Some(empty), Some(_)) = (steps.first(), steps.get(1)) {
        println!();
        for step in &steps[1..] {
            let ratio = step.timings[0].1 / empty.timings[0].1.max(f64::MIN_POSITIVE);
            println!(
                "{name}: first execution p99 at {} keys / at {} keys: {ratio:.2} (target <= 1.2 \
                 at 10 million){}",
                step.keys,
                empty.keys,
                if step.keys >= 10_000_000 && ratio > 1.2 {
                    ": NOT met"
                } else {
                    ""
                }
            );
        }
    }
}

/// Sends `n` requests with fresh keys one after another through an idempotent handler that
/// writes nothing (so that the time is the key's: `BEGIN`, the claim, the completion and the
/// `COMMIT`), then retries each once (a replay: the claim finds the completed row); returns
/// histograms of the first executions, their claims, completions and commits, and the replays.
/// The requests go through the router in the process, without a socket.
async fn time_claims(app: &Router, n: usize) -> Result<[Histogram<u64>; 5], db::Error> {
    let mut histograms: [Histogram<u64>; 5] = std::array::from_fn(|_| Histogram::new(3).unwrap());
    let mut keys = Vec::with_capacity(n);
    for i in 0..n {
        let request = Request {
            tenant: format!("tenant_{}", i % 10_000),
            key: fresh_key(),
        };
        let started = Instant::now();
        let (status, statements) = statements::time(request.send(app)).await;
        record(&mut histograms[0], started.elapsed().as_secs_f64());
        let status = status?;
        if status != StatusCode::CREATED {
            return Err(format!("a first execution answered {status}").into());
        }
        let idem: Vec<f64> = statements
            .iter()
            .filter(|(text, _)| text.contains("idem_"))
            .map(|(_, secs)| *secs)
            .collect();
        if let Some(claim) = idem.first() {
            record(&mut histograms[1], *claim);
        }
        if idem.len() >= 2 {
            record(&mut histograms[2], idem[idem.len() - 1]);
        }
        if let Some((_, commit)) = statements
            .iter()
            .find(|(text, _)| text.trim_start().to_ascii_uppercase().starts_with("COMMIT"))
        {
            record(&mut histograms[3], *commit);
        }
        keys.push(request);
    }
    for request in &keys {
        let started = Instant::now();
        let status = request.send(app).await?;
        record(&mut histograms[4], started.elapsed().as_secs_f64());
        if status != StatusCode::CREATED {
            return Err(format!("a replay answered {status}").into());
        }
    }
    Ok(histograms)
}

/// The benchmark's handler: claims the key and completes it, nothing else.
#[idempotent(scope = "tenant", retention = "24h", state = Store<DB>)]
async fn create<DB: Backend>(
    Path(tenant): Path<String>,
    tx: &mut Transaction<'_, DB>,
) -> StatusCode {
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

fn record(histogram: &mut Histogram<u64>, seconds: f64) {
    let _ = histogram.record(((seconds * 1e6) as u64).max(1));
}

fn quantile(histogram: &Histogram<u64>, q: f64) -> f64 {
    if histogram.is_empty() {
        return 0.0;
    }
    histogram.value_at_quantile(q) as f64 / 1000.0
}

/// PostgreSQL, on the scratch database.
struct Pg<'a>(&'a db::Scratch);

impl Target for Pg<'_> {
    type Db = sqlx::Postgres;

    async fn seed(&self, from: i64, n: i64) -> Result<(), db::Error> {
        churn::seed_postgres(&self.0.pool, from, n).await
    }

    async fn settle(&self) -> Result<(), db::Error> {
        sqlx::raw_sql("VACUUM ANALYZE idem_keys")
            .execute(&self.0.pool)
            .await?;
        Ok(())
    }

    async fn sizes(&self) -> Result<(i64, i64, Vec<(String, i64)>), db::Error> {
        pg_sizes(&self.0.pool).await
    }

    fn store(&self) -> Store<sqlx::Postgres> {
        Store::new(self.0.pool.clone())
    }

    async fn serve(&self) -> Result<SocketAddr, db::Error> {
        load::serve(self.0.url.clone(), 24).await
    }
}

async fn pg_sizes(pool: &PgPool) -> Result<(i64, i64, Vec<(String, i64)>), db::Error> {
    let (rows, total, heap): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM idem_keys), pg_total_relation_size('idem_keys'), \
           pg_table_size('idem_keys')",
    )
    .fetch_one(pool)
    .await?;
    let mut parts = vec![("heap".to_owned(), heap)];
    let indexes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT indexrelname::text, pg_relation_size(indexrelid) FROM pg_stat_user_indexes \
         WHERE relname = 'idem_keys' ORDER BY indexrelname",
    )
    .fetch_all(pool)
    .await?;
    parts.extend(indexes);
    Ok((rows, total, parts))
}

/// MariaDB, on the scratch database.
struct My {
    url: String,
    pool: MySqlPool,
}

impl Target for My {
    type Db = sqlx::MySql;

    async fn seed(&self, from: i64, n: i64) -> Result<(), db::Error> {
        churn::seed_mysql(&self.pool, from, n).await
    }

    async fn settle(&self) -> Result<(), db::Error> {
        sqlx::raw_sql("ANALYZE TABLE idem_keys")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn sizes(&self) -> Result<(i64, i64, Vec<(String, i64)>), db::Error> {
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_keys")
            .fetch_one(&self.pool)
            .await?;
        let (data, index): (i64, i64) = sqlx::query_as(
            "SELECT CAST(DATA_LENGTH AS SIGNED), CAST(INDEX_LENGTH AS SIGNED) \
             FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_keys'",
        )
        .fetch_one(&self.pool)
        .await?;
        // The clustered index (PRIMARY) holds the rows: InnoDB's "data".
        let parts: Vec<(String, i64)> = sqlx::query_as(
            "SELECT CAST(index_name AS CHAR), CAST(stat_value * @@innodb_page_size AS SIGNED) \
             FROM mysql.innodb_index_stats \
             WHERE database_name = DATABASE() AND table_name = 'idem_keys' \
               AND stat_name = 'size' ORDER BY index_name",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok((rows, data + index, parts))
    }

    fn store(&self) -> Store<sqlx::MySql> {
        Store::new(self.pool.clone())
    }

    async fn serve(&self) -> Result<SocketAddr, db::Error> {
        load::serve_mysql(self.url.clone(), 24).await
    }
}

/// SQLite, on the scratch file.
struct Lite {
    path: std::path::PathBuf,
    pool: SqlitePool,
}

impl Target for Lite {
    type Db = sqlx::Sqlite;

    async fn seed(&self, from: i64, n: i64) -> Result<(), db::Error> {
        churn::seed_sqlite(&self.pool, from, n).await
    }

    async fn settle(&self) -> Result<(), db::Error> {
        sqlx::raw_sql("ANALYZE idem_keys; PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn sizes(&self) -> Result<(i64, i64, Vec<(String, i64)>), db::Error> {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_keys")
            .fetch_one(&self.pool)
            .await?;
        // The dbstat table, where the SQLite build has it; else the file as a whole.
        let parts: Result<Vec<(String, i64)>, _> = sqlx::query_as(
            "SELECT name, CAST(sum(pgsize) AS INTEGER) FROM dbstat \
             WHERE name = 'idem_keys' OR name LIKE 'sqlite_autoindex_idem_keys%' \
               OR name LIKE 'idem_keys_%' GROUP BY name ORDER BY name",
        )
        .fetch_all(&self.pool)
        .await;
        match parts {
            Ok(parts) if !parts.is_empty() => {
                let total = parts.iter().map(|(_, b)| b).sum();
                Ok((rows, total, parts))
            }
            _ => {
                let file = std::fs::metadata(&self.path).map_or(0, |m| m.len()) as i64;
                Ok((rows, file, vec![("file".to_owned(), file)]))
            }
        }
    }

    fn store(&self) -> Store<sqlx::Sqlite> {
        Store::new(self.pool.clone())
    }

    async fn serve(&self) -> Result<SocketAddr, db::Error> {
        load::serve_sqlite(self.path.clone()).await
    }
}

#[cfg(test)]
mod tests {
    //! The scale benchmark in its smoke mode on each database: it grows the table, times the
    //! requests and reads the sizes. `scripts/test` runs these with the suite, so that the
    //! benchmark keeps building and running; the numbers are not checked.

    use super::*;

    async fn smoke(backend: Database) {
        statements::install();
        let args = Args::smoke(backend);
        let steps = run_backend(&args, backend).await.unwrap();
        assert_eq!(steps.len(), 2);
        assert!(steps[1].rows >= 10_000, "{steps:?}");
        assert!(
            steps
                .iter()
                .all(|s| s.bytes > 0 && s.http.0 > 0.0 && s.http.1 > 0.0)
        );
        assert!(
            steps.iter().all(|s| s.timings[1].1 > 0.0),
            "no claim timed: {steps:?}"
        );
        print(&args, backend, &steps);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scale_smoke_on_postgres() {
        smoke(Database::Postgres).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scale_smoke_on_mysql() {
        smoke(Database::Mysql).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scale_smoke_on_sqlite() {
        smoke(Database::Sqlite).await;
    }
}
