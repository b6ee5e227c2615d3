//! `relay`: the outbox relay on each broker, on PostgreSQL. How many events per second it takes
//! from a full outbox to the broker's acknowledgement (timed until the last is marked
//! published), and how long an event takes from its commit to its consumer's commit while
//! events are committed at a steady rate.
//!
//! The brokers are RabbitMQ at `$AMQP_URL`, Redis at `$REDIS_URL` and NATS JetStream at
//! `$NATS_URL` (the local defaults otherwise). Each run uses names of its own
//! (`idem.bench.<pid>.<broker>.<phase>`) and removes them at the end.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;
use idem_events::{
    CancellationToken, Consumer, ConsumerOptions, EventHandler, Message, Publisher, Relay,
    RelayOptions, Subscriber, nats::Nats, rabbitmq::RabbitMq, redis::RedisStreams,
};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::Notify;

use crate::db;

/// The topic the events go to.
const TOPIC: &str = "bench.relay";

/// The consumer's name.
const CONSUMER: &str = "bench";

/// Events enqueued per transaction when the outbox is filled up front.
const FILL_CHUNK: usize = 1000;

/// Events relayed before the throughput is timed, so that connecting is not timed.
const WARM_UP: usize = 100;

/// How long the consumers may take to catch up with the last event.
const CATCH_UP: Duration = Duration::from_secs(60);

/// A broker the benchmark runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Broker {
    /// RabbitMQ at `$AMQP_URL`.
    Rabbitmq,
    /// Redis Streams at `$REDIS_URL`.
    Redis,
    /// NATS JetStream at `$NATS_URL`.
    Nats,
}

impl Broker {
    fn name(self) -> &'static str {
        match self {
            Self::Rabbitmq => "rabbitmq",
            Self::Redis => "redis",
            Self::Nats => "nats",
        }
    }

    fn url(self) -> String {
        let (var, default) = match self {
            Self::Rabbitmq => ("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
            Self::Redis => ("REDIS_URL", "redis://127.0.0.1:6379"),
            Self::Nats => ("NATS_URL", "nats://127.0.0.1:4222"),
        };
        std::env::var(var).unwrap_or_else(|_| default.to_owned())
    }
}

/// Arguments of the relay benchmark.
#[derive(clap::Args)]
pub struct Args {
    /// The brokers, in order (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "rabbitmq,redis,nats")]
    brokers: Vec<Broker>,
    /// Events committed into the outbox before the relay starts (the throughput).
    #[arg(long, default_value_t = 10_000)]
    events: usize,
    /// Events committed per second while the consumer consumes (the latency).
    #[arg(long, default_value_t = 200)]
    rate: u32,
    /// Seconds of steady commits (the latency).
    #[arg(long, default_value_t = 10)]
    secs: u64,
    /// The relay's poll interval when the outbox is empty, in milliseconds (the library's
    /// default: 200).
    #[arg(long, default_value_t = 200)]
    poll_ms: u64,
}

/// What one broker measured.
struct Figures {
    broker: Broker,
    per_second: f64,
    latency: Histogram<u64>,
}

/// Runs the benchmark and prints its table.
///
/// # Errors
///
/// When the database or a broker cannot be reached, or the consumer does not catch up within
/// a minute.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let scratch = db::Scratch::create(16).await?;
    let mut figures = Vec::new();
    let mut failed = None;
    for &broker in &args.brokers {
        eprintln!("{}: relaying...", broker.name());
        let outcome = on(broker, &args, &scratch.pool).await;
        let removed = remove(broker).await;
        match (outcome, removed) {
            (Ok(measured), Ok(())) => figures.push(measured),
            (Err(error), _) | (Ok(_), Err(error)) => {
                failed = Some(format!("{}: {error}", broker.name()));
                break;
            }
        }
    }
    scratch.drop().await?;
    if let Some(error) = failed {
        return Err(error.into());
    }
    print(&args, &figures);
    Ok(())
}

fn print(args: &Args, figures: &[Figures]) {
    println!(
        "relay on PostgreSQL: {} events committed up front, relayed until all are marked \
         published; then {} events/s for {} s, from commit to the consumer's commit \
         (relay batch {}, poll {} ms)",
        args.events,
        args.rate,
        args.secs,
        RelayOptions::default().batch(),
        args.poll_ms
    );
    println!(
        "  {:<10} {:>10} {:>10} {:>10} {:>10}",
        "broker", "events/s", "p50 ms", "p99 ms", "max ms"
    );
    for measured in figures {
        let ms = |q: f64| measured.latency.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "  {:<10} {:>10.0} {:>10.1} {:>10.1} {:>10.1}",
            measured.broker.name(),
            measured.per_second,
            ms(0.5),
            ms(0.99),
            measured.latency.max() as f64 / 1000.0
        );
    }
}

/// The names of `broker`'s `phase`.
fn names(broker: Broker, phase: &str) -> String {
    format!(
        "idem.bench.{}.{}.{phase}",
        std::process::id(),
        broker.name()
    )
}

/// Both phases on `broker`.
async fn on(broker: Broker, args: &Args, pool: &PgPool) -> Result<Figures, db::Error> {
    let url = broker.url();
    let (fill, steady) = (names(broker, "fill"), names(broker, "steady"));
    let (per_second, latency) = match broker {
        Broker::Rabbitmq => {
            let (a, b) = (RabbitMq::new(&url, &fill), RabbitMq::new(&url, &steady));
            let subscriber = |at: &RabbitMq| at.subscriber(CONSUMER).bind(TOPIC);
            a.subscriber(CONSUMER).bind(TOPIC).declare().await?;
            let per_second = throughput(pool, a.publisher(), args).await?;
            let latency = steady_latency(pool, b.publisher(), subscriber(&b), args).await?;
            (per_second, latency)
        }
        Broker::Redis => {
            let (a, b) = (
                RedisStreams::new(&url, &fill)?,
                RedisStreams::new(&url, &steady)?,
            );
            a.subscriber(CONSUMER).declare().await?;
            let per_second = throughput(pool, a.publisher(), args).await?;
            let latency = steady_latency(pool, b.publisher(), b.subscriber(CONSUMER), args).await?;
            (per_second, latency)
        }
        Broker::Nats => {
            let (a, b) = (Nats::new(&url, &fill)?, Nats::new(&url, &steady)?);
            a.subscriber(CONSUMER).declare().await?;
            let per_second = throughput(pool, a.publisher(), args).await?;
            let latency = steady_latency(pool, b.publisher(), b.subscriber(CONSUMER), args).await?;
            (per_second, latency)
        }
    };
    Ok(Figures {
        broker,
        per_second,
        latency,
    })
}

/// Fills the outbox with `count` events, in transactions of [`FILL_CHUNK`].
async fn fill(pool: &PgPool, count: usize) -> Result<(), db::Error> {
    let mut left = count;
    while left > 0 {
        let chunk = left.min(FILL_CHUNK);
        let mut tx = pool.begin().await?;
        for seq in 0..chunk {
            idem_events::enqueue(&mut tx, TOPIC, &serde_json::json!({ "seq": seq })).await?;
        }
        tx.commit().await?;
        left -= chunk;
    }
    Ok(())
}

/// Events per second from a full outbox to the last one marked published, after a warm-up.
async fn throughput<P: Publisher>(
    pool: &PgPool,
    publisher: P,
    args: &Args,
) -> Result<f64, db::Error> {
    let mut relay = Relay::new(pool.clone(), publisher, RelayOptions::default());
    fill(pool, WARM_UP).await?;
    let warmed = relay.drain().await?;
    if warmed != WARM_UP {
        return Err(format!("the warm-up published {warmed} of {WARM_UP} events").into());
    }
    fill(pool, args.events).await?;
    let started = Instant::now();
    let published = relay.drain().await?;
    let elapsed = started.elapsed();
    let waiting = relay.waiting().await?.events;
    if published != args.events || waiting != 0 {
        return Err(format!(
            "the relay published {published} of {} events; {waiting} wait",
            args.events
        )
        .into());
    }
    Ok(published as f64 / elapsed.as_secs_f64())
}

/// The ids of committed events and when their commit returned; what the consumer records.
#[derive(Default)]
struct Latencies {
    committed: Mutex<HashMap<String, Instant>>,
    histogram: Mutex<Option<Histogram<u64>>>,
    consumed: AtomicUsize,
    changed: Notify,
}

impl Latencies {
    /// Notes the consumer's commit of `message`.
    fn consumed(&self, message: &Message) {
        let now = Instant::now();
        let committed = self
            .committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(message.id());
        if let Some(committed) = committed {
            let micros =
                u64::try_from(now.duration_since(committed).as_micros()).unwrap_or(u64::MAX);
            if let Some(histogram) = self
                .histogram
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
            {
                histogram.saturating_record(micros.max(1));
            }
            self.consumed.fetch_add(1, Ordering::SeqCst);
            self.changed.notify_waiters();
        }
    }
}

/// Applies nothing: the benchmark measures the way to the consumer, not a handler.
struct Discard;

impl EventHandler<Postgres> for Discard {
    type Error = std::convert::Infallible;

    async fn handle<'a>(
        &'a self,
        _: &'a Message,
        _: &'a mut Transaction<'static, Postgres>,
    ) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Commits `args.rate` events a second for `args.secs` seconds, one per transaction, while the
/// relay publishes and a consumer consumes; records from each commit to the consumer's commit.
async fn steady_latency<P: Publisher, S: Subscriber>(
    pool: &PgPool,
    publisher: P,
    subscriber: S,
    args: &Args,
) -> Result<Histogram<u64>, db::Error> {
    let latencies = Arc::new(Latencies {
        // Microseconds, up to the catch-up's limit.
        histogram: Mutex::new(Some(Histogram::new_with_bounds(1, 120_000_000, 3)?)),
        ..Latencies::default()
    });
    let stop = CancellationToken::new();
    let relay = Relay::new(
        pool.clone(),
        publisher,
        RelayOptions::default().with_poll(Duration::from_millis(args.poll_ms)),
    )
    .spawn(stop.clone());
    let consumer = {
        let latencies = Arc::clone(&latencies);
        Consumer::new(pool.clone(), Discard, ConsumerOptions::new(CONSUMER))
            .with_subscriber(subscriber)
            .on_committed(move |message| latencies.consumed(message))
            .spawn(stop.clone())
    };
    let count = usize::try_from(u64::from(args.rate) * args.secs).unwrap_or(usize::MAX);
    let committing = commit_steadily(pool, &latencies, args.rate, count).await;
    let caught_up = match committing {
        Ok(()) => match catch_up(&latencies, count).await {
            Ok(()) => all_marked(pool).await,
            Err(error) => Err(error),
        },
        Err(error) => Err(error),
    };
    stop.cancel();
    let _ = relay.await;
    let _ = consumer.await;
    caught_up?;
    let histogram = latencies
        .histogram
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .ok_or("no histogram")?;
    Ok(histogram)
}

/// Commits `count` events at `rate` a second, noting when each commit returned.
async fn commit_steadily(
    pool: &PgPool,
    latencies: &Latencies,
    rate: u32,
    count: usize,
) -> Result<(), db::Error> {
    let mut ticks = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for seq in 0..count {
        ticks.tick().await;
        let mut tx = pool.begin().await?;
        let id = idem_events::enqueue(&mut tx, TOPIC, &serde_json::json!({ "seq": seq })).await?;
        // Noted before the commit returns, so that a consumer that is quicker than this task
        // finds it; the time is set right after the commit.
        let now = Instant::now();
        latencies
            .committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), now);
        tx.commit().await?;
        if let Some(at) = latencies
            .committed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&id.to_string())
        {
            *at = Instant::now();
        }
    }
    Ok(())
}

/// Waits until the consumer committed `count` events, for at most [`CATCH_UP`].
async fn catch_up(latencies: &Latencies, count: usize) -> Result<(), db::Error> {
    let deadline = tokio::time::Instant::now() + CATCH_UP;
    loop {
        let changed = latencies.changed.notified();
        let consumed = latencies.consumed.load(Ordering::SeqCst);
        if consumed >= count {
            return Ok(());
        }
        if tokio::time::timeout_at(deadline, changed).await.is_err() {
            return Err(format!(
                "the consumer committed {consumed} of {count} events within {CATCH_UP:?}"
            )
            .into());
        }
    }
}

/// Waits until the relay marked every event published (a consumed event may still be in the
/// batch it publishes), for at most [`CATCH_UP`]: one stopped before would leave its batch to
/// the next broker's relay.
async fn all_marked(pool: &PgPool) -> Result<(), db::Error> {
    let deadline = Instant::now() + CATCH_UP;
    loop {
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE published_at IS NULL")
                .fetch_one(pool)
                .await?;
        if waiting == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(
                format!("{waiting} events not marked published within {CATCH_UP:?}").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Removes the exchanges, queues and streams of both phases on `broker`.
async fn remove(broker: Broker) -> Result<(), db::Error> {
    let url = broker.url();
    for phase in ["fill", "steady"] {
        let name = names(broker, phase);
        match broker {
            Broker::Rabbitmq => {
                let connection =
                    lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
                        .await?;
                let channel = connection.create_channel().await?;
                let names = RabbitMq::new(&url, &name);
                for queue in [names.queue(CONSUMER), names.dead_letter_queue(CONSUMER)] {
                    channel
                        .queue_delete(queue.as_str().into(), Default::default())
                        .await?;
                }
                channel
                    .exchange_delete(name.as_str().into(), Default::default())
                    .await?;
                let _ = connection.close(200, "removed".into()).await;
            }
            Broker::Redis => {
                let streams = RedisStreams::new(&url, &name)?;
                let mut conn = redis::Client::open(url.as_str())?
                    .get_multiplexed_async_connection()
                    .await?;
                redis::AsyncCommands::del::<_, ()>(
                    &mut conn,
                    &[name.clone(), streams.dead_letter_stream()],
                )
                .await?;
            }
            Broker::Nats => {
                let nats = Nats::new(&url, &name)?;
                let (_client, jetstream) = nats.connect().await?;
                jetstream.delete_stream(nats.stream()).await?;
            }
        }
    }
    Ok(())
}
