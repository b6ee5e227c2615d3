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
}

impl Default for Args {
    fn default() -> Self {
        Self {
            concurrency: 32,
            rounds: 5,
            seconds: 3,
            group: 4,
        }
    }
}

/// Runs the benchmark and prints its table.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let scratch = db::Scratch::create(args.concurrency as u32 + 8).await?;
    let result = measure(&args, &scratch).await;
    scratch.drop().await?;
    result
}

async fn measure(args: &Args, scratch: &db::Scratch) -> Result<(), db::Error> {
    let addr = load::serve(Store::new(scratch.pool.clone())).await?;
    let client = Client::new(addr);

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
        "PostgreSQL, {} clients, {} rounds x {} s per scenario, {} cores",
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
    println!(
        "SQL statements added to a first execution: {:.1} (target <= 2); a replay runs {:.1}",
        per_request[1] - per_request[0],
        per_request[2]
    );
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
