//! `http`: the layer's cost over real HTTP, scenario by scenario, against the same handler
//! without idempotency (`bare`), in interleaved rounds.

use std::time::Duration;

use idem_runtime::Store;

use crate::{
    db,
    load::{self, Client, Stats, Workload},
    statements,
};

/// Arguments of the HTTP benchmark.
#[derive(clap::Args, Clone)]
pub struct Args {
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Rounds; each runs every scenario once, in turn (A B A B ...).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Seconds per scenario per round.
    #[arg(long, default_value_t = 3)]
    pub seconds: u64,
    /// Clients sharing each key in `contended`.
    #[arg(long, default_value_t = 4)]
    pub group: usize,
    /// The databases to measure, in turn.
    #[arg(long, value_enum, num_args = 1.., default_values_t = [Database::Postgres, Database::Sqlite])]
    pub backend: Vec<Database>,
}

/// A database the benchmark can run against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Database {
    /// PostgreSQL at `$DATABASE_URL` (a scratch database is created and dropped).
    Postgres,
    /// A scratch SQLite file in a temporary directory.
    Sqlite,
}

impl std::fmt::Display for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Postgres => "PostgreSQL",
            Self::Sqlite => "SQLite",
        })
    }
}

impl Default for Args {
    fn default() -> Self {
        Self {
            concurrency: 32,
            rounds: 5,
            seconds: 3,
            group: 4,
            backend: vec![Database::Postgres, Database::Sqlite],
        }
    }
}

/// Runs the benchmark on each database and prints a table for each.
pub async fn run(args: Args) -> Result<(), db::Error> {
    for (index, database) in args.backend.iter().enumerate() {
        if index > 0 {
            println!();
        }
        match database {
            Database::Postgres => {
                let scratch = db::Scratch::create(args.concurrency as u32 + 8).await?;
                let result = match load::serve(Store::new(scratch.pool.clone())).await {
                    Ok(addr) => measure(&args, *database, Client::new(addr)).await,
                    Err(error) => Err(error),
                };
                scratch.drop().await?;
                result?;
            }
            Database::Sqlite => {
                let dir = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
                std::fs::create_dir_all(&dir)?;
                let result = async {
                    let pool = idem_examples::schema::connect_sqlite(&dir.join("bench.db")).await?;
                    idem_examples::schema::create(&pool).await?;
                    let addr = load::serve_sqlite(Store::new(pool)).await?;
                    measure(&args, *database, Client::new(addr)).await
                }
                .await;
                std::fs::remove_dir_all(&dir)?;
                result?;
            }
        }
    }
    Ok(())
}

async fn measure(args: &Args, database: Database, client: Client) -> Result<(), db::Error> {
    eprintln!("completing 1000 keys for the replay scenario...");
    let keys: Vec<String> = (0..1000).map(|_| load::fresh_key()).collect();
    for chunk in keys.chunks(50) {
        let sends: Vec<_> = chunk
            .iter()
            .map(|key| {
                let (client, key) = (client.clone(), key.clone());
                tokio::spawn(async move { client.pay(Some(&key)).await })
            })
            .collect();
        for send in sends {
            let (status, _) = send.await??;
            if status != reqwest::StatusCode::CREATED {
                return Err(format!("seeding a replay key answered {status}").into());
            }
        }
    }
    let workloads = [
        Workload::Bare,
        Workload::First,
        Workload::Replay(keys.into()),
        Workload::Contended(args.group),
        Workload::Mixed(10),
    ];

    eprintln!("counting statements per request...");
    let mut per_request = Vec::new();
    for workload in &workloads {
        let clients = if let Workload::Contended(group) = workload {
            *group
        } else {
            1
        };
        let (stats, statements) = statements::count(load::run(
            &client,
            workload,
            clients,
            Duration::from_millis(500),
        ))
        .await;
        per_request.push(statements as f64 / (stats.ok + stats.conflicts).max(1) as f64);
    }

    eprintln!("warming up...");
    for workload in &workloads {
        load::run(&client, workload, args.concurrency, Duration::from_secs(1)).await;
    }

    let mut runs: Vec<Vec<Stats>> = workloads.iter().map(|_| Vec::new()).collect();
    for round in 1..=args.rounds {
        eprintln!("round {round}/{}", args.rounds);
        for (index, workload) in workloads.iter().enumerate() {
            let stats = load::run(
                &client,
                workload,
                args.concurrency,
                Duration::from_secs(args.seconds),
            )
            .await;
            runs[index].push(stats);
        }
    }

    println!(
        "{database}, {} clients, {} rounds x {} s per scenario, {} cores",
        args.concurrency,
        args.rounds,
        args.seconds,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    println!();
    println!("| scenario | req/s | p50 ms | p99 ms | errors | replays | 409s | SQL/request |");
    println!("|---|---|---|---|---|---|---|---|");
    for ((workload, stats), statements) in workloads.iter().zip(&runs).zip(&per_request) {
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {} | {} | {} | {:.1} |",
            workload.name(),
            median(stats.iter().map(Stats::rate)),
            median(stats.iter().map(|s| s.ms(0.5))),
            median(stats.iter().map(|s| s.ms(0.99))),
            stats.iter().map(|s| s.errors).sum::<u64>(),
            stats.iter().map(|s| s.replays).sum::<u64>(),
            stats.iter().map(|s| s.conflicts).sum::<u64>(),
            statements
        );
    }
    let ratio = |numerator: usize| {
        median(
            runs[numerator]
                .iter()
                .zip(&runs[0])
                .map(|(n, bare)| n.rate() / bare.rate()),
        )
    };
    println!();
    println!(
        "first/bare  {:.2}  (req/s, median of per-round ratios; target >= 0.85)",
        ratio(1)
    );
    println!("replay/bare {:.2}  (target >= 1.0)", ratio(2));
    let note = match database {
        Database::Postgres => "target <= 2",
        Database::Sqlite => "one is a read without the write lock, so that replays never wait",
    };
    println!(
        "SQL statements added to a first execution: {:.1} ({note}); a replay runs {:.1}",
        per_request[1] - per_request[0],
        per_request[2]
    );
    for (workload, stats) in workloads.iter().zip(&runs) {
        if let Some(first) = stats.iter().find_map(|s| s.first_error.as_deref()) {
            println!("first unexpected answer in {}: {first}", workload.name());
        }
    }
    println!(
        "(SQL/request counts the statements sqlx logs; BEGIN is not logged, and every request \
         that touches the database sends one more)"
    );
    Ok(())
}

/// The median of some numbers.
pub fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}
