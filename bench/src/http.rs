//! `http`: the layer's cost over real HTTP, scenario by scenario, against the same handler
//! without idempotency (`bare`), in interleaved rounds; and what sealing stored answers at rest
//! adds, `first-sealed` and `replay-sealed` against `first` and `replay` in the same rounds.

use std::time::Duration;

use crate::{
    cpu, db, delay,
    load::{self, Client, Route, Stats, Workload},
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
    /// Only these scenarios (`bare` is always run, and `first` or `replay` with a variant of
    /// theirs: the ratios need them), e.g. to profile one. `first-nested` and `replay-nested`
    /// (the routes nested as the sealed ones are, without keys) run only when named here: they
    /// tell what nesting costs apart from what sealing costs.
    #[arg(long, num_args = 1..)]
    pub only: Vec<String>,
    /// How far away PostgreSQL and MySQL are, one way, in microseconds: each value is measured
    /// in turn, through a proxy that holds every byte that long in each direction (0: the
    /// server directly, on loopback). `--db-delay-us 0 250` puts the database 0.5 ms of round
    /// trip away after the loopback figures.
    #[arg(long, num_args = 1.., default_values_t = [0])]
    pub db_delay_us: Vec<u64>,
}

/// A database the benchmark can run against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Database {
    /// PostgreSQL at `$DATABASE_URL` (a scratch database is created and dropped).
    Postgres,
    /// A scratch SQLite file in a temporary directory.
    Sqlite,
    /// MySQL or MariaDB at `$MYSQL_URL` (a scratch database is created and dropped).
    Mysql,
}

impl Database {
    /// Whose CPU time is this database's.
    fn server(self) -> cpu::Server {
        match self {
            Self::Postgres => cpu::Server::Postgres,
            Self::Sqlite => cpu::Server::Sqlite,
            Self::Mysql => cpu::Server::Mysql,
        }
    }
}

impl std::fmt::Display for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Postgres => "PostgreSQL",
            Self::Sqlite => "SQLite",
            Self::Mysql => "MariaDB",
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
            only: Vec::new(),
            db_delay_us: vec![0],
        }
    }
}

/// Runs the benchmark on each database (a server database at each of `--db-delay-us`) and
/// prints a table for each.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let mut first = true;
    for database in &args.backend {
        let delays: &[u64] = if *database == Database::Sqlite {
            &[0]
        } else {
            &args.db_delay_us
        };
        for &delay in delays {
            if !first {
                println!();
            }
            first = false;
            run_one(&args, *database, Duration::from_micros(delay)).await?;
        }
    }
    Ok(())
}

/// `url` as the service reaches it: directly, or `one_way` away through a [`delay`] proxy;
/// says which, with the round trip a `SELECT 1` then takes.
async fn at_distance(
    database: Database,
    url: &str,
    one_way: Duration,
) -> Result<String, db::Error> {
    if one_way.is_zero() {
        return Ok(url.to_owned());
    }
    let default_port = if database == Database::Mysql {
        3306
    } else {
        5432
    };
    let url = delay::delayed(url, one_way, default_port)?;
    let trips = match database {
        Database::Postgres => round_trips::<sqlx::PgConnection>(&url).await?,
        Database::Mysql => round_trips::<sqlx::MySqlConnection>(&url).await?,
        Database::Sqlite => return Ok(url),
    };
    println!(
        "{database} {} µs away each way, through the benchmark's delay proxy: a `SELECT 1` \
         round trip takes {:.3} ms (median of 200).",
        one_way.as_micros(),
        median(trips.into_iter())
    );
    Ok(url)
}

/// 200 `SELECT 1` round trips on a connection to `url`, in milliseconds.
async fn round_trips<C>(url: &str) -> Result<Vec<f64>, db::Error>
where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
{
    let mut connection = C::connect(url).await?;
    let mut trips = Vec::with_capacity(200);
    for _ in 0..200 {
        let start = std::time::Instant::now();
        sqlx::raw_sql("SELECT 1").execute(&mut connection).await?;
        trips.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(trips)
}

async fn run_one(args: &Args, database: Database, one_way: Duration) -> Result<(), db::Error> {
    match database {
        Database::Postgres => {
            let scratch = db::Scratch::create(2).await?;
            let connections = args.concurrency as u32 + 8;
            let result = match at_distance(database, &scratch.url, one_way).await {
                Ok(url) => match load::serve(url, connections).await {
                    Ok(addr) => measure(args, database, Client::new(addr)).await,
                    Err(error) => Err(error),
                },
                Err(error) => Err(error),
            };
            scratch.drop().await?;
            result
        }
        Database::Sqlite => {
            let dir = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let result = async {
                let path = dir.join("bench.db");
                let pool = idem_examples::schema::connect_sqlite(&path).await?;
                idem_examples::schema::create(&pool).await?;
                pool.close().await;
                let addr = load::serve_sqlite(path).await?;
                measure(args, database, Client::new(addr)).await
            }
            .await;
            std::fs::remove_dir_all(&dir)?;
            result
        }
        Database::Mysql => {
            let scratch = db::MySqlScratch::create().await?;
            let connections = args.concurrency as u32 + 8;
            let result = match at_distance(database, &scratch.url, one_way).await {
                Ok(url) => match load::serve_mysql(url, connections).await {
                    Ok(addr) => measure(args, database, Client::new(addr)).await,
                    Err(error) => Err(error),
                },
                Err(error) => Err(error),
            };
            scratch.drop().await?;
            result
        }
    }
}

/// What one scenario measured in one round.
struct Run {
    stats: Stats,
    cpu: cpu::Sample,
    database: Database,
}

impl Run {
    /// Service and database CPU per answered request, in microseconds.
    fn cpu_per_request(&self) -> (f64, f64) {
        self.cpu
            .per_request(self.stats.ok + self.stats.conflicts, self.database.server())
    }
}

/// Runs `workload` as [`load::run`] does, with the CPU time it cost.
async fn timed(
    client: &Client,
    database: Database,
    workload: &Workload,
    concurrency: usize,
    seconds: u64,
) -> Run {
    let before = cpu::Sample::now();
    let stats = load::run(client, workload, concurrency, Duration::from_secs(seconds)).await;
    Run {
        stats,
        cpu: cpu::Sample::now().since(before),
        database,
    }
}

/// Completes 1000 fresh keys through `route`, for a replay scenario to send again.
async fn seed_replay_keys(client: &Client, route: Route) -> Result<Vec<String>, db::Error> {
    eprintln!(
        "completing 1000 keys on {} for a replay scenario...",
        route.path()
    );
    let keys: Vec<String> = (0..1000).map(|_| load::fresh_key()).collect();
    for chunk in keys.chunks(50) {
        let sends: Vec<_> = chunk
            .iter()
            .map(|key| {
                let (client, key) = (client.clone(), key.clone());
                tokio::spawn(async move { client.pay(route, Some(&key)).await })
            })
            .collect();
        for send in sends {
            let (status, _) = send.await??;
            if status != reqwest::StatusCode::CREATED {
                return Err(format!("seeding a replay key answered {status}").into());
            }
        }
    }
    Ok(keys)
}

/// The scenarios measured against each other, each family's plain one first: a sealed
/// scenario and a nested one (the example's routes nested as the sealed ones are, by a store
/// without keys) against the scenario they vary.
const FAMILIES: [[&str; 3]; 2] = [
    ["first", "first-nested", "first-sealed"],
    ["replay", "replay-nested", "replay-sealed"],
];

/// The comparisons printed, numerator first, where both ran: sealing against no keys; and,
/// when the nested scenarios run, nesting alone and sealing alone.
const COMPARED: [(&str, &str); 6] = [
    ("first-sealed", "first"),
    ("replay-sealed", "replay"),
    ("first-nested", "first"),
    ("replay-nested", "replay"),
    ("first-sealed", "first-nested"),
    ("replay-sealed", "replay-nested"),
];

/// Whether the scenario `name` runs. Without `--only`, all but the nested ones, which only
/// tell the nesting's share of what sealing costs. With `--only`, those named, `bare`, and the
/// plain scenario of a family one of whose others is named.
fn selected(only: &[String], name: &str) -> bool {
    let named = |name: &str| only.iter().any(|o| o == name);
    if only.is_empty() {
        return !name.ends_with("-nested");
    }
    name == "bare"
        || named(name)
        || FAMILIES
            .iter()
            .any(|family| family[0] == name && family.iter().any(|&member| named(member)))
}

/// The order the scenarios run in, in round `round` (from 1): as listed, except that in even
/// rounds each family runs in the reverse order, so that none of its scenarios always meets the
/// database as another left it (a key table one scenario's worth larger, a checkpoint under
/// way).
fn round_order(workloads: &[Workload], round: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..workloads.len()).collect();
    if round.is_multiple_of(2) {
        for family in FAMILIES {
            let slots: Vec<usize> = (0..order.len())
                .filter(|&slot| family.contains(&workloads[order[slot]].name()))
                .collect();
            let members: Vec<usize> = slots.iter().map(|&slot| order[slot]).collect();
            for (&slot, &member) in slots.iter().zip(members.iter().rev()) {
                order[slot] = member;
            }
        }
    }
    order
}

async fn measure(args: &Args, database: Database, client: Client) -> Result<(), db::Error> {
    let keys = seed_replay_keys(&client, Route::Idempotent).await?;
    let sealed_keys = seed_replay_keys(&client, Route::Sealed).await?;
    let nested_keys = if selected(&args.only, "replay-nested") {
        seed_replay_keys(&client, Route::Nested).await?
    } else {
        Vec::new()
    };
    let mut workloads = vec![Workload::Bare];
    if database != Database::Sqlite {
        workloads.push(Workload::Peer);
    }
    workloads.extend([
        Workload::First,
        Workload::FirstNested,
        Workload::FirstSealed,
        Workload::Replay(keys.into()),
        Workload::ReplayNested(nested_keys.into()),
        Workload::ReplaySealed(sealed_keys.into()),
        Workload::Contended(args.group),
        Workload::Mixed(10),
    ]);
    workloads.retain(|w| selected(&args.only, w.name()));
    let index = |name: &str| workloads.iter().position(|w| w.name() == name);

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

    let mut runs: Vec<Vec<Run>> = workloads.iter().map(|_| Vec::new()).collect();
    for round in 1..=args.rounds {
        eprintln!("round {round}/{}", args.rounds);
        for index in round_order(&workloads, round) {
            runs[index].push(
                timed(
                    &client,
                    database,
                    &workloads[index],
                    args.concurrency,
                    args.seconds,
                )
                .await,
            );
        }
    }

    // One client: the latency a single user sees, without queueing.
    let alone: Vec<usize> = ["bare", "peer", "first"]
        .iter()
        .filter_map(|name| index(name))
        .collect();
    let mut single: Vec<Vec<Run>> = alone.iter().map(|_| Vec::new()).collect();
    for round in 1..=args.rounds {
        eprintln!("one client, round {round}/{}", args.rounds);
        for (slot, &workload) in alone.iter().enumerate() {
            single[slot]
                .push(timed(&client, database, &workloads[workload], 1, args.seconds).await);
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
    println!(
        "| scenario | req/s | p50 ms | p99 ms | service µs/req | {} µs/req | errors | replays | 409s | SQL/request |",
        database
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for ((workload, runs), statements) in workloads.iter().zip(&runs).zip(&per_request) {
        let (service, db) = cpu_medians(runs);
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {service:.0} | {db:.0} | {} | {} | {} | {:.1} |",
            workload.name(),
            median(runs.iter().map(|r| r.stats.rate())),
            median(runs.iter().map(|r| r.stats.ms(0.5))),
            median(runs.iter().map(|r| r.stats.ms(0.99))),
            runs.iter().map(|r| r.stats.errors).sum::<u64>(),
            runs.iter().map(|r| r.stats.replays).sum::<u64>(),
            runs.iter().map(|r| r.stats.conflicts).sum::<u64>(),
            statements
        );
    }
    let ratio = |numerator: usize, denominator: usize| {
        median(
            runs[numerator]
                .iter()
                .zip(&runs[denominator])
                .map(|(n, d)| n.stats.rate() / d.stats.rate()),
        )
    };
    let bare = 0;
    println!();
    println!("req/s ratios, median of per-round ratios:");
    if let Some(first) = index("first") {
        println!("first/bare  {:.2}", ratio(first, bare));
    }
    if let Some(peer) = index("peer") {
        println!("peer/bare   {:.2}", ratio(peer, bare));
        if let Some(first) = index("first") {
            println!("first/peer  {:.2}", ratio(first, peer));
        }
    }
    if let Some(replay) = index("replay") {
        println!("replay/bare {:.2}", ratio(replay, bare));
    }
    for (varied, plain) in COMPARED {
        if let (Some(v), Some(p)) = (index(varied), index(plain)) {
            print_cost((varied, &runs[v]), (plain, &runs[p]), database);
        }
    }
    let (bare_service, bare_db) = cpu_medians(&runs[bare]);
    let added = |runs: &[Run]| {
        let (service, db) = cpu_medians(runs);
        (service - bare_service, db - bare_db)
    };
    if let Some(first) = index("first") {
        let (service, db) = added(&runs[first]);
        println!("CPU added per first execution: service {service:.0} µs, {database} {db:.0} µs");
        println!(
            "SQL statements added to a first execution: {:.1}",
            per_request[first] - per_request[bare]
        );
    }
    if let Some(peer) = index("peer") {
        let (service, db) = added(&runs[peer]);
        println!("CPU added per peer execution:  service {service:.0} µs, {database} {db:.0} µs");
    }
    if let Some(replay) = index("replay") {
        println!("SQL statements of a replay: {:.1}", per_request[replay]);
    }
    println!();
    println!(
        "one client at a time ({} rounds x {} s):",
        args.rounds, args.seconds
    );
    println!("| scenario | req/s | p50 ms | p99 ms | service µs/req | {database} µs/req |");
    println!("|---|---|---|---|---|---|");
    for (slot, &workload) in alone.iter().enumerate() {
        let runs = &single[slot];
        let (service, db) = cpu_medians(runs);
        println!(
            "| {} | {:.0} | {:.3} | {:.3} | {service:.0} | {db:.0} |",
            workloads[workload].name(),
            median(runs.iter().map(|r| r.stats.rate())),
            median(runs.iter().map(|r| r.stats.ms(0.5))),
            median(runs.iter().map(|r| r.stats.ms(0.99))),
        );
    }
    for (workload, runs) in workloads.iter().zip(&runs) {
        if let Some(first) = runs.iter().find_map(|r| r.stats.first_error.as_deref()) {
            println!("first unexpected answer in {}: {first}", workload.name());
        }
    }
    println!(
        "(SQL/request counts the statements sqlx logs; BEGIN is not logged, and every request \
         that touches the database sends one more. CPU, from /proc: the service's own threads, \
         and every process named postgres, the MySQL server's threads or, for SQLite, the \
         connections' threads; the load \
         generator is not counted)"
    );
    Ok(())
}

/// What a scenario costs against the one it varies, from their runs in the same rounds: the
/// throughput ratio (median of the per-round ratios, and their range, which shows the noise)
/// and the CPU per request it adds (median of the per-round differences).
fn print_cost((name, runs): (&str, &[Run]), (plain, twins): (&str, &[Run]), database: Database) {
    let ratios: Vec<f64> = runs
        .iter()
        .zip(twins)
        .map(|(s, p)| s.stats.rate() / p.stats.rate())
        .collect();
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let added =
        |part: fn(&Run) -> f64| median(runs.iter().zip(twins).map(|(s, p)| part(s) - part(p)));
    let service = added(|r| r.cpu_per_request().0);
    let db = added(|r| r.cpu_per_request().1);
    let (plain_service, plain_db) = cpu_medians(twins);
    println!(
        "{name}/{plain} {:.3} (rounds {lowest:.3} to {highest:.3}); CPU added per request: \
         service {service:+.1} µs ({:+.1}%), {database} {db:+.1} µs ({:+.1}%)",
        median(ratios.iter().copied()),
        100.0 * service / plain_service,
        100.0 * db / plain_db,
    );
}

/// The median CPU per request of some runs: (service, database).
fn cpu_medians(runs: &[Run]) -> (f64, f64) {
    (
        median(runs.iter().map(|r| r.cpu_per_request().0)),
        median(runs.iter().map(|r| r.cpu_per_request().1)),
    )
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn names(only: &[&str]) -> Vec<&'static str> {
        let only: Vec<String> = only.iter().map(|&o| o.to_owned()).collect();
        all()
            .iter()
            .map(Workload::name)
            .filter(|name| selected(&only, name))
            .collect()
    }

    fn all() -> Vec<Workload> {
        let keys = Arc::new(Vec::new());
        vec![
            Workload::Bare,
            Workload::First,
            Workload::FirstNested,
            Workload::FirstSealed,
            Workload::Replay(Arc::clone(&keys)),
            Workload::ReplayNested(Arc::clone(&keys)),
            Workload::ReplaySealed(keys),
            Workload::Mixed(10),
        ]
    }

    #[test]
    fn the_nested_scenarios_run_only_when_named() {
        assert_eq!(
            names(&[]),
            [
                "bare",
                "first",
                "first-sealed",
                "replay",
                "replay-sealed",
                "mixed"
            ]
        );
        assert_eq!(
            names(&["replay-nested", "replay-sealed"]),
            ["bare", "replay", "replay-nested", "replay-sealed"]
        );
        assert_eq!(names(&["first-sealed"]), ["bare", "first", "first-sealed"]);
    }

    #[test]
    fn even_rounds_run_each_family_backwards() {
        let workloads = all();
        let named = |round| {
            round_order(&workloads, round)
                .into_iter()
                .map(|i| workloads[i].name())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            named(1),
            workloads.iter().map(Workload::name).collect::<Vec<_>>()
        );
        assert_eq!(
            named(2),
            [
                "bare",
                "first-sealed",
                "first-nested",
                "first",
                "replay-sealed",
                "replay-nested",
                "replay",
                "mixed"
            ]
        );
    }
}
