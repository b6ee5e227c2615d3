//! A closed-loop HTTP load generator: `concurrency` clients send requests back to back over
//! loopback for a fixed time, each latency recorded in a histogram.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, routing::post};
use hdrhistogram::Histogram;
use idem_examples::{
    payments::{self, AppState},
    sql::Sql,
};
use idem_runtime::{Store, StoreOptions, seal::EncryptionKeys};
use reqwest::StatusCode;
use sqlx::{MySql, Pool, Postgres, Sqlite, mysql::MySqlPoolOptions, postgres::PgPoolOptions};

use crate::cpu;

/// Where the example's routes are served a second time, by a store that seals its answers
/// ([`sealed_store`]): `POST /sealed/v1/payments` is `POST /v1/payments` with encryption keys.
pub const SEALED: &str = "/sealed";

/// Where the example's routes are served a third time, nested as under [`SEALED`] but by a
/// store without keys: what nesting alone costs, told apart from what sealing costs.
pub const NESTED: &str = "/nested";

/// The key the sealed routes' store seals with, as `IDEM_ENCRYPTION_KEYS` writes it: fixed (the
/// bytes 0 to 31), so that every run seals alike. A benchmark's key, never a secret.
const SEALING_KEY: &str = "bench:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// A store over `pool` that seals every answer it stores with [`SEALING_KEY`], its options
/// otherwise the defaults that `Store::new` gives the unsealed routes.
pub fn sealed_store<DB: Sql>(pool: Pool<DB>) -> Store<DB> {
    let keys = EncryptionKeys::parse(SEALING_KEY).expect("the benchmark's key is well formed");
    Store::new(pool).with_options(StoreOptions::default().with_encryption_keys(keys))
}

/// The example's routes over `pool` with `extra` beside them, all served by a store without
/// keys; the example's routes again under [`SEALED`], served by [`sealed_store`] over the same
/// pool; and under [`NESTED`], by another store without keys over the same pool. The layer fingerprints the request's original URI, so a nested route keeps keys
/// of its own: a key used on `/v1/payments` and on `/sealed/v1/payments` is a mismatch, not a
/// replay.
fn with_sealed<DB: Sql>(extra: Router<AppState<DB>>, pool: Pool<DB>) -> Router {
    let sealed = payments::routes::<DB>().with_state(AppState::new(sealed_store(pool.clone())));
    let nested = payments::routes::<DB>().with_state(AppState::new(Store::new(pool.clone())));
    payments::routes::<DB>()
        .merge(extra)
        .with_state(AppState::new(Store::new(pool)))
        .nest(SEALED, sealed)
        .nest(NESTED, nested)
}

/// Serves the example's router over PostgreSQL at `url` on a loopback port, plus
/// `POST /bare/payments` (the same payment handler and business writes in a transaction, without
/// idempotency), `POST /peer/payments` (the same work in the peer design, [`crate::peer`]) and
/// the example's routes again under [`SEALED`], by a store that seals its answers.
/// The service runs on a runtime of its own, with its own pool, so that its CPU time can be told
/// apart from the load generator's ([`crate::cpu`]).
pub async fn serve(url: String, connections: u32) -> Result<SocketAddr, crate::db::Error> {
    serve_apart(move || async move {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .min_connections(connections)
            .connect(&url)
            .await?;
        let extra = Router::new()
            .route(
                "/bare/payments",
                post(payments::create_payment_bare::<Postgres>),
            )
            .route(
                "/peer/payments",
                post(crate::peer::postgres::create_payment),
            );
        Ok(with_sealed(extra, pool))
    })
    .await
}

/// As [`serve`], over MySQL (MariaDB) at `url`.
pub async fn serve_mysql(url: String, connections: u32) -> Result<SocketAddr, crate::db::Error> {
    serve_apart(move || async move {
        let pool = MySqlPoolOptions::new()
            .max_connections(connections)
            .min_connections(connections)
            .connect(&url)
            .await?;
        let extra = Router::new()
            .route(
                "/bare/payments",
                post(payments::create_payment_bare::<MySql>),
            )
            .route("/peer/payments", post(crate::peer::mysql::create_payment));
        Ok(with_sealed(extra, pool))
    })
    .await
}

/// As [`serve`], over the SQLite file at `path` (no peer route: the peer design is
/// PostgreSQL's).
pub async fn serve_sqlite(path: PathBuf) -> Result<SocketAddr, crate::db::Error> {
    serve_apart(move || async move {
        let pool = idem_examples::schema::connect_sqlite(&path).await?;
        let extra = Router::new().route(
            "/bare/payments",
            post(payments::create_payment_bare::<Sqlite>),
        );
        Ok(with_sealed(extra, pool))
    })
    .await
}

/// Serves the router `make` builds (over a pool it opens), as [`serve`] serves the example's,
/// on a runtime of its own; returns the address once it listens.
pub async fn serve_router<F, Fut>(make: F) -> Result<SocketAddr, crate::db::Error>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<axum::Router, crate::db::Error>>,
{
    serve_apart(make).await
}

/// Builds the router with `make` and serves it, both on a runtime of its own whose threads are
/// named [`cpu::SERVER_THREADS`]; returns the address once it listens.
async fn serve_apart<F, Fut>(make: F) -> Result<SocketAddr, crate::db::Error>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<axum::Router, crate::db::Error>>,
{
    let (ready, listening) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(cpu::SERVER_THREADS.to_owned())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .thread_name(cpu::SERVER_THREADS)
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = ready.send(Err(error.into()));
                    return;
                }
            };
            runtime.block_on(async move {
                let bound = async {
                    let app = make().await?;
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    Ok::<_, crate::db::Error>((app, listener))
                }
                .await;
                match bound {
                    Ok((app, listener)) => {
                        let _ = ready.send(listener.local_addr().map_err(Into::into));
                        let _ = axum::serve(listener, app).await;
                    }
                    Err(error) => {
                        let _ = ready.send(Err(error));
                    }
                }
            });
        })?;
    listening.await?
}

/// What the clients send.
#[derive(Clone, Debug)]
pub enum Workload {
    /// `POST /bare/payments`, no key.
    Bare,
    /// `POST /v1/payments`, a fresh key every time.
    First,
    /// `POST /peer/payments`, a fresh key every time.
    Peer,
    /// `POST /v1/payments` with keys that are already completed.
    Replay(Arc<Vec<String>>),
    /// `POST /sealed/v1/payments`, a fresh key every time: `First` with answers sealed.
    FirstSealed,
    /// `POST /sealed/v1/payments` with keys completed there: `Replay` with answers sealed.
    ReplaySealed(Arc<Vec<String>>),
    /// `POST /nested/v1/payments`, a fresh key every time: `FirstSealed` without keys.
    FirstNested,
    /// `POST /nested/v1/payments` with keys completed there: `ReplaySealed` without keys.
    ReplayNested(Arc<Vec<String>>),
    /// Groups of `n` clients send the same sequence of keys at the same time.
    Contended(usize),
    /// Fresh keys, except every `n`-th request, which retries the client's previous key.
    Mixed(u64),
}

impl Workload {
    /// The scenario's name in the tables.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::First => "first",
            Self::Peer => "peer",
            Self::Replay(_) => "replay",
            Self::FirstSealed => "first-sealed",
            Self::ReplaySealed(_) => "replay-sealed",
            Self::FirstNested => "first-nested",
            Self::ReplayNested(_) => "replay-nested",
            Self::Contended(_) => "contended",
            Self::Mixed(_) => "mixed",
        }
    }
}

/// What a load run measured.
#[derive(Debug)]
pub struct Stats {
    /// Requests answered as the workload expects.
    pub ok: u64,
    /// Requests answered otherwise, or failed.
    pub errors: u64,
    /// 201s that were replays.
    pub replays: u64,
    /// 409s (expected in `contended` only).
    pub conflicts: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Latencies, in microseconds.
    pub latency: Histogram<u64>,
    /// What the first unexpected answer was.
    pub first_error: Option<String>,
}

impl Stats {
    /// No request yet.
    pub fn empty() -> Self {
        Self {
            ok: 0,
            errors: 0,
            replays: 0,
            conflicts: 0,
            elapsed: Duration::ZERO,
            latency: Histogram::new(3).expect("histogram"),
            first_error: None,
        }
    }

    /// Adds `other`'s requests, latencies and time to these.
    pub fn add(&mut self, other: &Self) {
        self.ok += other.ok;
        self.errors += other.errors;
        self.replays += other.replays;
        self.conflicts += other.conflicts;
        self.elapsed += other.elapsed;
        self.latency
            .add(&other.latency)
            .expect("same histogram bounds");
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
    }

    /// Answered requests per second.
    pub fn rate(&self) -> f64 {
        (self.ok + self.conflicts) as f64 / self.elapsed.as_secs_f64()
    }

    /// A latency quantile, in milliseconds.
    pub fn ms(&self, quantile: f64) -> f64 {
        self.latency.value_at_quantile(quantile) as f64 / 1000.0
    }
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

/// A key no request has used.
pub fn fresh_key() -> String {
    format!(
        "k{}-{}",
        std::process::id(),
        NEXT_KEY.fetch_add(1, Ordering::Relaxed)
    )
}

/// Where a payment goes.
#[derive(Clone, Copy, Debug)]
pub enum Route {
    /// `POST /v1/payments`, idem's.
    Idempotent,
    /// `POST /bare/payments`, without idempotency.
    Bare,
    /// `POST /peer/payments`, the peer design.
    Peer,
    /// `POST /sealed/v1/payments`, idem's with answers sealed.
    Sealed,
    /// `POST /nested/v1/payments`, idem's nested as `Sealed` is, without keys.
    Nested,
}

impl Route {
    /// The path a payment is posted to.
    pub fn path(self) -> &'static str {
        match self {
            Self::Idempotent => "/v1/payments",
            Self::Bare => "/bare/payments",
            Self::Peer => "/peer/payments",
            Self::Sealed => "/sealed/v1/payments",
            Self::Nested => "/nested/v1/payments",
        }
    }
}

/// One client's view of the server.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    /// A client of the server at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: format!("http://{addr}"),
        }
    }

    /// Sends one payment to `route`, with `key` if given.
    pub async fn pay(
        &self,
        route: Route,
        key: Option<&str>,
    ) -> Result<(StatusCode, bool), reqwest::Error> {
        let mut request = self
            .http
            .post(format!("{}{}", self.base, route.path()))
            .bearer_auth("bench")
            .header("content-type", "application/json")
            .body(r#"{"amount": 100, "currency": "usd", "customer": "cus_1"}"#);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let reply = request.send().await?;
        let replayed = reply.headers().contains_key("idempotent-replayed");
        let status = reply.status();
        let _ = reply.bytes().await?;
        Ok((status, replayed))
    }
}

/// Runs `workload` from `concurrency` clients for `duration`.
pub async fn run(
    client: &Client,
    workload: &Workload,
    concurrency: usize,
    duration: Duration,
) -> Stats {
    let stop = Arc::new(AtomicBool::new(false));
    let running = run_until(client, workload, concurrency, Arc::clone(&stop));
    let timer = async {
        tokio::time::sleep(duration).await;
        stop.store(true, Ordering::Relaxed);
    };
    let (stats, ()) = tokio::join!(running, timer);
    stats
}

/// Runs `workload` from `concurrency` clients until `stop` is set.
pub async fn run_until(
    client: &Client,
    workload: &Workload,
    concurrency: usize,
    stop: Arc<AtomicBool>,
) -> Stats {
    let started = Instant::now();
    let base: Arc<str> = fresh_key().into();
    let mut workers = Vec::new();
    for worker in 0..concurrency {
        let (client, workload, stop) = (client.clone(), workload.clone(), Arc::clone(&stop));
        let base = Arc::clone(&base);
        workers.push(tokio::spawn(async move {
            work(client, workload, worker, &base, stop).await
        }));
    }
    let mut stats = Stats::empty();
    for worker in workers {
        stats.add(&worker.await.expect("worker"));
    }
    stats.elapsed = started.elapsed();
    stats
}

async fn work(
    client: Client,
    workload: Workload,
    worker: usize,
    base: &str,
    stop: Arc<AtomicBool>,
) -> Stats {
    let mut stats = Stats::empty();
    let mut previous: Option<String> = None;
    let mut i: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let key = match &workload {
            Workload::Bare => None,
            Workload::First | Workload::Peer | Workload::FirstSealed | Workload::FirstNested => {
                Some(fresh_key())
            }
            Workload::Replay(keys)
            | Workload::ReplaySealed(keys)
            | Workload::ReplayNested(keys) => {
                Some(keys[(worker * 7919 + i as usize) % keys.len()].clone())
            }
            Workload::Contended(group) => Some(format!("{base}-g{}-{i}", worker / group)),
            Workload::Mixed(every) => match (&previous, i.is_multiple_of(*every)) {
                (Some(previous), true) => Some(previous.clone()),
                _ => Some(fresh_key()),
            },
        };
        let sent = Instant::now();
        let route = match workload {
            Workload::Bare => Route::Bare,
            Workload::Peer => Route::Peer,
            Workload::FirstSealed | Workload::ReplaySealed(_) => Route::Sealed,
            Workload::FirstNested | Workload::ReplayNested(_) => Route::Nested,
            _ => Route::Idempotent,
        };
        let reply = client.pay(route, key.as_deref()).await;
        let micros = (sent.elapsed().as_micros() as u64).max(1);
        let expected = match (&workload, &reply) {
            (_, Err(_)) => false,
            (
                Workload::Bare
                | Workload::First
                | Workload::Peer
                | Workload::FirstSealed
                | Workload::FirstNested,
                Ok((status, replayed)),
            ) => *status == StatusCode::CREATED && !replayed,
            (
                Workload::Replay(_) | Workload::ReplaySealed(_) | Workload::ReplayNested(_),
                Ok((status, replayed)),
            ) => *status == StatusCode::CREATED && *replayed,
            (Workload::Mixed(_), Ok((status, _))) => *status == StatusCode::CREATED,
            (Workload::Contended(_), Ok((status, _))) => {
                *status == StatusCode::CREATED || *status == StatusCode::CONFLICT
            }
        };
        if !expected {
            stats.errors += 1;
            if stats.first_error.is_none() {
                stats.first_error = Some(match &reply {
                    Ok((status, replayed)) => format!("{status} (replayed: {replayed})"),
                    Err(error) => error.to_string(),
                });
            }
            continue;
        }
        let _ = stats.latency.record(micros);
        match reply {
            Ok((StatusCode::CONFLICT, _)) => stats.conflicts += 1,
            Ok((_, replayed)) => {
                stats.ok += 1;
                stats.replays += u64::from(replayed);
            }
            Err(_) => {}
        }
        if let Workload::Contended(_) = workload {
            // Workers of a group drift apart; keep them on the same keys.
            tokio::task::yield_now().await;
        }
        previous = key;
    }
    stats
}

#[cfg(test)]
mod tests {
    //! A brief run of the sealed scenarios on each database, as `idem-bench http` serves them:
    //! the nested routes answer and replay, their store seals what it stores, the unsealed
    //! routes' store beside it over the same pool does not, and a key keeps to the route it was
    //! first used on. The benchmark's own smoke test: `scripts/test` runs it with the suite.

    use super::*;

    /// How long each scenario runs: long enough for some requests, short enough for the suite.
    const BRIEFLY: Duration = Duration::from_millis(300);

    /// Stores one answer through the unsealed route and twenty through [`SEALED`], then runs
    /// the sealed scenarios briefly against the server at `addr`: none may answer otherwise than
    /// expected.
    async fn run_sealed_scenarios(addr: SocketAddr) {
        let client = Client::new(addr);
        let plain = fresh_key();
        assert_eq!(
            client.pay(Route::Idempotent, Some(&plain)).await.unwrap(),
            (StatusCode::CREATED, false)
        );
        let mut keys = Vec::new();
        for _ in 0..20 {
            let key = fresh_key();
            assert_eq!(
                client.pay(Route::Sealed, Some(&key)).await.unwrap(),
                (StatusCode::CREATED, false),
                "a first execution through {SEALED}"
            );
            keys.push(key);
        }
        // The fingerprint holds the whole path: a sealed route's key is not the plain route's.
        let (status, _) = client.pay(Route::Idempotent, Some(&keys[0])).await.unwrap();
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);

        let first = run(&client, &Workload::FirstSealed, 4, BRIEFLY).await;
        assert_eq!(first.errors, 0, "{:?}", first.first_error);
        assert!(first.ok > 0 && first.replays == 0, "{first:?}");
        let replay = run(&client, &Workload::ReplaySealed(keys.into()), 4, BRIEFLY).await;
        assert_eq!(replay.errors, 0, "{:?}", replay.first_error);
        assert!(replay.ok > 0 && replay.replays == replay.ok, "{replay:?}");
    }

    /// Each stored row, given as (path, response headers as text), is sealed if and only if it
    /// was stored through [`SEALED`].
    fn check_sealing(rows: &[(String, String)]) {
        assert!(rows.len() > 21, "{} rows", rows.len());
        for (path, headers) in rows {
            assert_eq!(
                headers.contains(idem_runtime::seal::SEALED_WITH),
                path.starts_with(&format!("{SEALED}/")),
                "{path}: {headers}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sealed_scenarios_on_sqlite() {
        let dir = std::env::temp_dir().join(format!("idem-bench-smoke-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bench.db");
        let pool = idem_examples::schema::connect_sqlite(&path).await.unwrap();
        idem_examples::schema::create(&pool).await.unwrap();
        run_sealed_scenarios(serve_sqlite(path).await.unwrap()).await;
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT path, response_headers FROM idem_keys")
                .fetch_all(&pool)
                .await
                .unwrap();
        check_sealing(&rows);
        pool.close().await;
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sealed_scenarios_on_postgres() {
        let scratch = crate::db::Scratch::named(2, "smoke").await.unwrap();
        run_sealed_scenarios(serve(scratch.url.clone(), 8).await.unwrap()).await;
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT path, response_headers::text FROM idem_keys")
                .fetch_all(&scratch.pool)
                .await
                .unwrap();
        check_sealing(&rows);
        scratch.drop().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sealed_scenarios_on_mysql() {
        let scratch = crate::db::MySqlScratch::create().await.unwrap();
        run_sealed_scenarios(serve_mysql(scratch.url.clone(), 8).await.unwrap()).await;
        let pool = sqlx::MySqlPool::connect(&scratch.url).await.unwrap();
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT path, CAST(response_headers AS CHAR) FROM idem_keys")
                .fetch_all(&pool)
                .await
                .unwrap();
        check_sealing(&rows);
        pool.close().await;
        scratch.drop().await.unwrap();
    }
}
