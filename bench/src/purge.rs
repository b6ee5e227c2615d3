//! `purge`: how fast the purge task empties a table of expired keys on a database with nothing
//! else to do, against a bare loop of `DELETE` statements emptying the same table (the
//! baseline), and, on a table seeded again, how fast beside live requests and how much it slows
//! them. On PostgreSQL, or on MariaDB with `--backend mysql`: what differs
//! between them is a [`Target`]'s few statements; the measuring is the same.

use std::{
    net::SocketAddr,
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
use sqlx::mysql::MySqlPoolOptions;

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
    /// The database to purge.
    #[arg(long, value_enum, default_value_t = Database::Postgres)]
    backend: Database,
    /// Measures the purge alone only, without the phase beside live requests (on MariaDB, a
    /// million keys take most of an hour beside them).
    #[arg(long)]
    alone_only: bool,
}

/// A database the purge benchmark runs on.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Database {
    /// PostgreSQL at `$DATABASE_URL` (a scratch database is created and dropped).
    Postgres,
    /// MariaDB at `$MYSQL_URL` (a scratch database is created and dropped; the seed reads
    /// MariaDB's Sequence engine, which MySQL lacks).
    Mysql,
}

/// Runs the benchmark and prints its table.
pub async fn run(args: Args) -> Result<(), db::Error> {
    match args.backend {
        Database::Postgres => {
            let scratch = db::Scratch::create(args.concurrency as u32 + 4).await?;
            let store = Store::new(scratch.pool.clone());
            let result = measure(&args, &Postgres(&scratch), &store).await;
            scratch.drop().await?;
            result
        }
        Database::Mysql => {
            let scratch = db::MySqlScratch::create().await?;
            let result = async {
                let pool = MySqlPoolOptions::new()
                    .max_connections(4)
                    .connect(&scratch.url)
                    .await?;
                let store = Store::new(pool.clone());
                let target = MySql {
                    url: &scratch.url,
                    pool: pool.clone(),
                };
                let result = measure(&args, &target, &store).await;
                pool.close().await;
                result
            }
            .await;
            scratch.drop().await?;
            result
        }
    }
}

/// What the benchmark needs of a database; the measuring is the same on each.
trait Target {
    /// The database of the store the purge runs on.
    type Db: idem_runtime::Backend;
    /// The database's name in the table.
    const NAME: &'static str;
    /// Whose CPU time is the database's.
    const SERVER: cpu::Server;
    /// The purge alone's targets on this database, printed beside what the run measured, where
    /// they are not simply the rate.
    const TARGETS: Option<&'static str>;
    /// Empties the table into a new one (`TRUNCATE`), so that each phase starts from the same
    /// fresh table and not from the pages the phase before emptied; inserts `rows` expired
    /// keys, and has the database analyse the table.
    async fn insert_expired(&self, rows: i64) -> Result<(), db::Error>;
    /// How many keys are past their expiry.
    async fn expired(&self) -> Result<i64, db::Error>;
    /// Deletes up to `batch` of the oldest expired keys in one bare statement, as a loop written
    /// by hand would: the baseline of the purge alone.
    async fn delete_bare(&self, batch: u32) -> Result<u64, db::Error>;
    /// Whether any key is past its expiry (cheaper than counting them).
    async fn any_expired(&self) -> Result<bool, db::Error>;
    /// What of the server's configuration bears on the purge's speed, with the table's size.
    async fn describe(&self) -> Result<String, db::Error>;
    /// How many of the purge's statements are running on other connections (a statement cut
    /// off by the end of a window runs on in the server).
    async fn purge_statements(&self) -> Result<i64, db::Error>;
    /// Serves the example over the database with `connections` connections of its own.
    async fn serve(&self, connections: u32) -> Result<SocketAddr, db::Error>;
}

/// PostgreSQL, on the scratch database's pool.
struct Postgres<'a>(&'a db::Scratch);

impl Target for Postgres<'_> {
    type Db = sqlx::Postgres;
    const NAME: &'static str = "PostgreSQL";
    const SERVER: cpu::Server = cpu::Server::Postgres;
    const TARGETS: Option<&'static str> = None;

    async fn insert_expired(&self, rows: i64) -> Result<(), db::Error> {
        let pool = &self.0.pool;
        sqlx::raw_sql("TRUNCATE idem_keys").execute(pool).await?;
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

    async fn expired(&self) -> Result<i64, db::Error> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM idem_keys WHERE expires_at <= now()")
                .fetch_one(&self.0.pool)
                .await?,
        )
    }

    async fn delete_bare(&self, batch: u32) -> Result<u64, db::Error> {
        Ok(sqlx::query(
            "DELETE FROM idem_keys WHERE ctid = ANY (ARRAY ( \
               SELECT ctid FROM idem_keys WHERE expires_at <= now() \
               ORDER BY expires_at LIMIT $1))",
        )
        .bind(i64::from(batch))
        .execute(&self.0.pool)
        .await?
        .rows_affected())
    }

    async fn any_expired(&self) -> Result<bool, db::Error> {
        Ok(
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM idem_keys WHERE expires_at <= now())")
                .fetch_one(&self.0.pool)
                .await?,
        )
    }

    async fn describe(&self) -> Result<String, db::Error> {
        let (buffers, table): (String, i64) = sqlx::query_as(
            "SELECT current_setting('shared_buffers'), pg_total_relation_size('idem_keys')",
        )
        .fetch_one(&self.0.pool)
        .await?;
        Ok(format!(
            "shared_buffers {buffers}, table and indexes {} MiB",
            table >> 20
        ))
    }

    async fn purge_statements(&self) -> Result<i64, db::Error> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND state = 'active' \
               AND pid <> pg_backend_pid() AND query LIKE 'WITH purged AS%'",
        )
        .fetch_one(&self.0.pool)
        .await?)
    }

    async fn serve(&self, connections: u32) -> Result<SocketAddr, db::Error> {
        load::serve(self.0.url.clone(), connections).await
    }
}

/// MariaDB (the seed reads its Sequence engine), on a pool of the benchmark's own.
struct MySql<'a> {
    url: &'a str,
    pool: sqlx::MySqlPool,
}

impl Target for MySql<'_> {
    type Db = sqlx::MySql;
    const NAME: &'static str = "MariaDB";
    const SERVER: cpu::Server = cpu::Server::Mysql;
    /// On the server's default configuration (a 128 MiB pool, direct I/O) the purge reads its
    /// pages from the disk as the bare loop does, so it is held to the loop there; where the
    /// table's pages are in memory, to a rate.
    const TARGETS: Option<&'static str> = Some(
        "on the server's default configuration (pages read from the disk): at least the bare \
         loop (1.0x; 1.07x measured); with the table's pages in memory: 50,000 rows/s \
         (102,025 measured)",
    );

    /// The same rows as on PostgreSQL, from MariaDB's Sequence engine, in primary key order
    /// (InnoDB then appends to each page instead of splitting pages all over the table).
    async fn insert_expired(&self, rows: i64) -> Result<(), db::Error> {
        // The deletes of a phase before are still being cleaned up by InnoDB's purge thread,
        // which would slow the next phase: it starts when they are.
        let deadline = std::time::Instant::now() + Duration::from_secs(600);
        loop {
            let history: String = sqlx::query_scalar(
                "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
                 WHERE VARIABLE_NAME = 'INNODB_HISTORY_LIST_LENGTH'",
            )
            .fetch_one(&self.pool)
            .await?;
            if history.parse::<u64>().is_ok_and(|length| length < 1000) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "InnoDB's history list was still {history} long after 10 minutes"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "TRUNCATE idem_keys; \
             INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, \
               response_status, response_headers, response_body, created_at, expires_at) \
             SELECT CONCAT('tenant_', seq % 1000), CONCAT('key-', seq), 'POST', '/v1/payments', \
               UNHEX(SHA2(seq, 256)), 'completed', 201, \
               '[[\"content-type\",\"application/json\"]]', REPEAT('x', 120), \
               UTC_TIMESTAMP(6) - INTERVAL 2 DAY, \
               UTC_TIMESTAMP(6) - INTERVAL 1 DAY + INTERVAL (seq % 3600) SECOND \
             FROM seq_1_to_{rows} ORDER BY 1, 2; \
             ANALYZE TABLE idem_keys"
        )))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn expired(&self) -> Result<i64, db::Error> {
        Ok(sqlx::query_scalar(
            "SELECT COUNT(*) FROM idem_keys WHERE expires_at <= UTC_TIMESTAMP(6)",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    async fn delete_bare(&self, batch: u32) -> Result<u64, db::Error> {
        Ok(sqlx::query(
            "DELETE FROM idem_keys WHERE expires_at <= UTC_TIMESTAMP(6) \
             ORDER BY expires_at LIMIT ?",
        )
        .bind(batch)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    async fn any_expired(&self) -> Result<bool, db::Error> {
        let any: i64 = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM idem_keys WHERE expires_at <= UTC_TIMESTAMP(6))",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(any != 0)
    }

    async fn describe(&self) -> Result<String, db::Error> {
        let (pool, table): (u64, i64) = sqlx::query_as(
            "SELECT @@innodb_buffer_pool_size, \
               CAST(DATA_LENGTH + INDEX_LENGTH AS SIGNED) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_keys'",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(format!(
            "innodb_buffer_pool_size {} MiB, table and indexes {} MiB",
            pool >> 20,
            table >> 20
        ))
    }

    /// The purge's delete, or its locking read and deletes by key; and a cut-off transaction's rollback, which
    /// the server runs when it finds the connection closed (`Killed`, with no statement).
    async fn purge_statements(&self) -> Result<i64, db::Error> {
        Ok(sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE DB = DATABASE() AND ID <> CONNECTION_ID() AND COMMAND <> 'Sleep' \
               AND (COMMAND = 'Killed' OR INFO LIKE 'DELETE idem_keys FROM%' \
                 OR INFO LIKE 'SET STATEMENT innodb_lock_wait_timeout = 0 FOR DELETE%' \
                 OR INFO LIKE 'SELECT scope, `key` FROM idem_keys%')",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    async fn serve(&self, connections: u32) -> Result<SocketAddr, db::Error> {
        load::serve_mysql(self.url.to_owned(), connections).await
    }
}

/// Inserts `rows` expired keys into `target`'s table.
async fn seed<T: Target>(target: &T, rows: i64) -> Result<(), db::Error> {
    eprintln!("seeding {rows} expired keys...");
    target.insert_expired(rows).await
}

async fn measure<T: Target>(
    args: &Args,
    target: &T,
    store: &Store<T::Db>,
) -> Result<(), db::Error> {
    let pacing = args.pause_ms.map_or(Pacing::Adaptive, |ms| {
        Pacing::Fixed(Duration::from_millis(ms))
    });
    let options = PurgeOptions::default()
        .with_batch_size(args.batch)
        .with_pacing(pacing);

    // The purge alone: nothing else runs on the database.
    seed(target, args.rows).await?;
    let server = target.describe().await?;
    eprintln!("deleting alone in a bare loop...");
    let clock = std::time::Instant::now();
    let mut bare_rows = 0;
    loop {
        let rows = target.delete_bare(args.batch).await?;
        bare_rows += rows;
        if rows < u64::from(args.batch) {
            break;
        }
    }
    let bare = bare_rows as f64 / clock.elapsed().as_secs_f64();
    seed(target, args.rows).await?;
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
    println!("  {} ({server})", T::NAME);
    println!(
        "  cleared in       {:>11.2}s ({:.2}s of pauses)",
        report.elapsed.as_secs_f64(),
        report.paused.as_secs_f64()
    );
    let rate = report.rows as f64 / report.elapsed.as_secs_f64();
    println!(
        "  rate             {rate:>10.0} rows/s, {:.2}x of a bare loop of DELETE statements \
         ({bare:.0} rows/s, {:.2}s)",
        rate / bare,
        bare_rows as f64 / bare
    );
    println!(
        "  purge CPU        {:>8.1} µs/row of {}",
        cpu_alone.of(T::SERVER).as_secs_f64() * 1e6 / report.rows.max(1) as f64,
        T::NAME
    );
    if let Some(targets) = T::TARGETS {
        println!("  targets          {targets}");
        println!(
            "                   here: {:.2}x of the bare loop, {rate:.0} rows/s",
            rate / bare
        );
    }
    println!();
    if args.alone_only {
        return Ok(());
    }

    // Beside live requests, on a table seeded again.
    seed(target, args.rows).await?;
    let connections = args.concurrency as u32 + 4;
    let client = load::Client::new(target.serve(connections).await?);
    let window = Duration::from_secs(args.window_secs);

    eprintln!("warming up...");
    load::run(&client, &Workload::First, args.concurrency, window).await;

    // Windows of live load alone and of live load beside the purge, in turn, until the purge
    // is done. Each round's two windows make a pair, and the live requests' change is the
    // median of the pairs' ratios; which window comes first alternates, so that a drift of the
    // host over the run favours neither side.
    let seeded = target.expired().await?;
    let mut pairs = Vec::new();
    let mut purging = Duration::ZERO;
    let mut round = 0;
    while target.any_expired().await? {
        round += 1;
        eprintln!(
            "round {round}: {} s alone and {} s beside the purge",
            args.window_secs, args.window_secs
        );
        let (alone, beside) = if round % 2 == 1 {
            let alone = alone(&client, args, window).await;
            (
                alone,
                beside(&client, target, store, options, args, window).await?,
            )
        } else {
            let beside = beside(&client, target, store, options, args, window).await?;
            (alone(&client, args, window).await, beside)
        };
        purging += beside.purging;
        pairs.push((alone, beside));
    }
    let purged = (seeded - target.expired().await?) as u64;
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
    // The database's CPU beside the purge, less what the live requests answered meanwhile cost
    // at the rate of their round's window alone: what the purge itself cost.
    let purge_cpu: f64 = pairs
        .iter()
        .map(|(alone, beside)| {
            let live = alone
                .cpu
                .per_request(alone.live.ok + alone.live.errors, T::SERVER)
                .1;
            let requests = beside.live.ok + beside.live.errors;
            beside.cpu.of(T::SERVER).as_secs_f64() * 1e6 - live * requests as f64
        })
        .sum();
    println!(
        "  purge CPU        {:>8.1} µs/row of {}, {:.2} of {} cores while it ran",
        purge_cpu / purged.max(1) as f64,
        T::NAME,
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
    for (name, stats) in [("alone", &all_alone), ("beside the purge", &all_beside)] {
        if let Some(first) = &stats.first_error {
            println!("  first unexpected answer {name}: {first}");
        }
    }
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
async fn beside<T: Target>(
    client: &load::Client,
    target: &T,
    store: &Store<T::Db>,
    options: PurgeOptions,
    args: &Args,
    window: Duration,
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
        // server's shutdown cuts a spawned purge; each batch is its own transaction (on
        // PostgreSQL one statement, on MariaDB a locking read and its deletes), and a batch
        // cut off is rolled back: its CPU counts in the window, its rows do not.
        let outcome = tokio::time::timeout(window, store.purge_expired(options)).await;
        let took = clock.elapsed();
        stop.store(true, Ordering::Relaxed);
        (outcome, took)
    };
    let (live, (outcome, purging)) = tokio::join!(live, purge);
    if let Ok(report) = outcome {
        report?;
    }
    // A statement cut off mid-way still runs to its end in the server: wait for it, so that its
    // rows and CPU count in this window and not in the next.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while target.purge_statements().await? > 0 {
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
