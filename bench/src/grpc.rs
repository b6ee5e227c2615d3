//! `grpc`: the layer's cost on a tonic method over real gRPC (HTTP/2 on loopback), against the
//! same method without idempotency (`bare`: the same payment's writes in a transaction of its
//! own), in interleaved rounds: a first call with a new key (`first`) and a call with a key
//! already completed (`replay`), with the CPU each answer took in the service and in
//! PostgreSQL.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use hdrhistogram::Histogram;
use idem_examples::{
    auth::Tenant,
    grpc::{
        PaymentsApi,
        proto::{
            CreatePaymentRequest, GetPaymentRequest, Payment,
            payments_client::PaymentsClient,
            payments_server::{Payments, PaymentsServer},
        },
    },
    payments::{self, AppState, NewTransfer},
};
use idem_runtime::{Store, grpc::FromMetadata};
use sqlx::{Postgres, postgres::PgPoolOptions};
use tonic::{Request, Response, Status, transport::Channel};

use crate::{cpu, db, load::fresh_key};

/// Arguments of the gRPC benchmark.
#[derive(clap::Args, Clone)]
pub struct Args {
    /// Concurrent clients, each on an HTTP/2 connection of its own.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Rounds; each runs every scenario once, in turn.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Seconds per scenario per round.
    #[arg(long, default_value_t = 3)]
    pub seconds: u64,
}

/// The scenarios, in the order each round runs them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Bare,
    First,
    Replay,
}

impl Scenario {
    const ALL: [Self; 3] = [Self::Bare, Self::First, Self::Replay];

    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::First => "first",
            Self::Replay => "replay",
        }
    }
}

/// `CreatePayment` without idempotency: the same writes, in a transaction of its own.
struct Bare {
    store: Store<Postgres>,
}

#[tonic::async_trait]
impl Payments for Bare {
    async fn create_payment(
        &self,
        request: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let tenant = Tenant::from_metadata(request.metadata(), request.extensions())?;
        let message = request.into_inner();
        let internal = |error: sqlx::Error| Status::internal(error.to_string());
        let mut tx = self.store.pool().begin().await.map_err(internal)?;
        let body = NewTransfer {
            amount: message.amount,
            currency: message.currency,
            customer: message.customer,
        };
        let transfer = payments::record_payment_in(&tenant, &mut tx, body)
            .await
            .map_err(|error| Status::internal(error.to_string()))?;
        tx.commit().await.map_err(internal)?;
        Ok(Response::new(Payment {
            id: transfer.id,
            amount: transfer.amount,
            currency: transfer.currency,
            customer: transfer.customer,
            status: transfer.status,
        }))
    }

    async fn get_payment(
        &self,
        _: Request<GetPaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        Err(Status::unimplemented(
            "the benchmark's bare service only creates",
        ))
    }
}

/// Runs the benchmark on a scratch PostgreSQL database and prints its table.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let scratch = db::Scratch::create(2).await?;
    let result = measure(&args, &scratch.url).await;
    scratch.drop().await?;
    result
}

async fn measure(args: &Args, url: &str) -> Result<(), db::Error> {
    let connections = args.concurrency as u32 + 8;
    let (bare, idempotent) = serve(url.to_owned(), connections).await?;
    let bare = clients(bare, args.concurrency).await?;
    let idempotent = clients(idempotent, args.concurrency).await?;
    eprintln!("completing a key per client for the replay scenario...");
    let mut replay_keys = Vec::new();
    for client in &idempotent {
        let key = fresh_key();
        call(client, Some(&key)).await?;
        replay_keys.push(key);
    }
    let replay_keys: Arc<[String]> = replay_keys.into();
    let plan = |scenario: Scenario| match scenario {
        Scenario::Bare => (&bare, None),
        Scenario::First => (&idempotent, None),
        Scenario::Replay => (&idempotent, Some(Arc::clone(&replay_keys))),
    };
    eprintln!("warming up...");
    for scenario in Scenario::ALL {
        let (clients, keys) = plan(scenario);
        load(clients, scenario, keys, Duration::from_secs(1)).await?;
    }
    let mut totals: Vec<Totals> = Scenario::ALL.iter().map(|_| Totals::new()).collect();
    for round in 1..=args.rounds {
        eprintln!("round {round}/{}", args.rounds);
        for (index, scenario) in Scenario::ALL.into_iter().enumerate() {
            let (clients, keys) = plan(scenario);
            let before = cpu::Sample::now();
            let measured = load(clients, scenario, keys, Duration::from_secs(args.seconds)).await?;
            totals[index].add(&measured, cpu::Sample::now().since(before));
        }
    }
    print(args, &totals);
    Ok(())
}

/// Both services over PostgreSQL at `url`, each on a loopback port, on a runtime of their own
/// whose threads are the service's ([`cpu::SERVER_THREADS`]): (bare, idempotent).
async fn serve(url: String, connections: u32) -> Result<(SocketAddr, SocketAddr), db::Error> {
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
                    let _ = ready.send(Err(db::Error::from(error)));
                    return;
                }
            };
            runtime.block_on(async move {
                let bound = async {
                    let pool = PgPoolOptions::new()
                        .max_connections(connections)
                        .min_connections(connections)
                        .connect(&url)
                        .await?;
                    let store = Store::new(pool);
                    let bare = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    let idempotent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    Ok::<_, db::Error>((store, bare, idempotent))
                }
                .await;
                let (store, bare, idempotent) = match bound {
                    Ok(bound) => bound,
                    Err(error) => {
                        let _ = ready.send(Err(error));
                        return;
                    }
                };
                let addrs = bare
                    .local_addr()
                    .and_then(|bare_addr| Ok((bare_addr, idempotent.local_addr()?)));
                let _ = ready.send(addrs.map_err(Into::into));
                let bare_server = tonic::transport::Server::builder()
                    .add_service(PaymentsServer::new(Bare {
                        store: store.clone(),
                    }))
                    .serve_with_incoming(tonic::transport::server::TcpIncoming::from(bare));
                let idempotent_server = tonic::transport::Server::builder()
                    .add_service(PaymentsApi::new(AppState::new(store)).server())
                    .serve_with_incoming(tonic::transport::server::TcpIncoming::from(idempotent));
                let _ = tokio::join!(bare_server, idempotent_server);
            });
        })?;
    listening.await?
}

async fn clients(
    addr: SocketAddr,
    count: usize,
) -> Result<Vec<PaymentsClient<Channel>>, db::Error> {
    let mut clients = Vec::with_capacity(count);
    for _ in 0..count {
        let channel = Channel::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        clients.push(PaymentsClient::new(channel));
    }
    Ok(clients)
}

/// One `CreatePayment`, with `key` as its `idempotency-key` if given.
async fn call(client: &PaymentsClient<Channel>, key: Option<&str>) -> Result<bool, db::Error> {
    let mut request = Request::new(CreatePaymentRequest {
        amount: 4200,
        currency: "usd".to_owned(),
        customer: "cus_bench".to_owned(),
        metadata: Default::default(),
    });
    request
        .metadata_mut()
        .insert("authorization", "Bearer bench".parse()?);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse()?);
    }
    let response = client.clone().create_payment(request).await?;
    Ok(response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true"))
}

/// What one run of a scenario measured.
struct Measured {
    calls: u64,
    replays: u64,
    elapsed: Duration,
    latency: Histogram<u64>,
}

/// Every client calls in a loop for `length`: `bare` and `first` with no key or a new one,
/// `replay` with its own completed key.
async fn load(
    clients: &[PaymentsClient<Channel>],
    scenario: Scenario,
    keys: Option<Arc<[String]>>,
    length: Duration,
) -> Result<Measured, db::Error> {
    let start = tokio::time::Instant::now();
    let until = start + length;
    let tasks: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(index, client)| {
            let (client, keys) = (client.clone(), keys.clone());
            tokio::spawn(async move {
                let mut latency = Histogram::<u64>::new(3).expect("histogram");
                let (mut calls, mut replays) = (0, 0);
                while tokio::time::Instant::now() < until {
                    let key = match (&keys, scenario) {
                        (Some(keys), _) => Some(keys[index % keys.len()].clone()),
                        (None, Scenario::First) => Some(fresh_key()),
                        (None, _) => None,
                    };
                    let sent = std::time::Instant::now();
                    let replayed = call(&client, key.as_deref()).await?;
                    latency.record(sent.elapsed().as_micros() as u64)?;
                    calls += 1;
                    replays += u64::from(replayed);
                }
                Ok::<_, db::Error>((calls, replays, latency))
            })
        })
        .collect();
    let mut measured = Measured {
        calls: 0,
        replays: 0,
        elapsed: Duration::ZERO,
        latency: Histogram::new(3).expect("histogram"),
    };
    for task in tasks {
        let (calls, replays, latency) = task.await??;
        measured.calls += calls;
        measured.replays += replays;
        measured.latency.add(&latency)?;
    }
    measured.elapsed = start.elapsed();
    if scenario == Scenario::Replay && measured.replays != measured.calls {
        return Err(format!(
            "replay: {} of {} calls were not replays",
            measured.calls - measured.replays,
            measured.calls
        )
        .into());
    }
    if scenario != Scenario::Replay && measured.replays != 0 {
        return Err(format!(
            "{}: {} calls were replays",
            scenario.name(),
            measured.replays
        )
        .into());
    }
    Ok(measured)
}

/// A scenario's runs, summed over the rounds.
struct Totals {
    calls: u64,
    elapsed: Duration,
    latency: Histogram<u64>,
    cpu: cpu::Sample,
}

impl Totals {
    fn new() -> Self {
        Self {
            calls: 0,
            elapsed: Duration::ZERO,
            latency: Histogram::new(3).expect("histogram"),
            cpu: cpu::Sample::default(),
        }
    }

    fn add(&mut self, measured: &Measured, cpu: cpu::Sample) {
        self.calls += measured.calls;
        self.elapsed += measured.elapsed;
        self.latency
            .add(&measured.latency)
            .expect("same histogram bounds");
        self.cpu.service += cpu.service;
        self.cpu.postgres += cpu.postgres;
    }

    fn rate(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }

    fn ms(&self, quantile: f64) -> f64 {
        self.latency.value_at_quantile(quantile) as f64 / 1000.0
    }
}

fn print(args: &Args, totals: &[Totals]) {
    let bare = &totals[0];
    println!(
        "gRPC over HTTP/2 on loopback, PostgreSQL, {} clients, {} rounds of {} s per scenario:",
        args.concurrency, args.rounds, args.seconds
    );
    println!(
        "| scenario | calls/s | vs bare | p50 ms | vs bare | p99 ms | vs bare | service CPU µs/call | PostgreSQL CPU µs/call |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (scenario, total) in Scenario::ALL.iter().zip(totals) {
        let (service, database) = total.cpu.per_request(total.calls, cpu::Server::Postgres);
        println!(
            "| {} | {:.0} | {:.2}x | {:.2} | {:.2}x | {:.2} | {:.2}x | {service:.0} | {database:.0} |",
            scenario.name(),
            total.rate(),
            total.rate() / bare.rate(),
            total.ms(0.5),
            total.ms(0.5) / bare.ms(0.5),
            total.ms(0.99),
            total.ms(0.99) / bare.ms(0.99),
        );
    }
}
