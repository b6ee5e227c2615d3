//! `cargo run --bin payments`: the payments API the README describes.
//!
//! Listens on `$ADDR` (default `127.0.0.1:3000`) for HTTP, and on `$GRPC_ADDR` (default
//! `127.0.0.1:50051`) for gRPC: the service `idem.example.v1.Payments`
//! ([`idem_examples::grpc`]), on the same database. Stores everything in `$DATABASE_URL`
//! (PostgreSQL; `mysql://…/<database>`, MySQL or MariaDB, the database created if missing; or
//! `sqlite:<path>`); without it, in the SQLite file `$SQLITE_PATH` (default `payments.db`), so
//! that nothing needs to be installed. Creates its tables on start, sends
//! refunds and order charges to the processor at `$PROCESSOR_URL` (default
//! `http://127.0.0.1:3001`), and runs the purge and recovery tasks until it stops. With
//! `$CRASH_AFTER` set to a step of `POST /v1/orders` (`reserve`, `charge`, `ship`, or
//! `charge-call`), it aborts right after that step, for crash tests; with `publish`, right
//! after the broker confirmed the relay's first batch, before it is marked published. `$RECOVERY_EVERY` sets the
//! seconds between passes of the recovery task (default 10; `0` turns it off, for all but one
//! of several instances sharing a database), `$RECOVERY_MAX_ATTEMPTS` the rounds its hook
//! gets at one abandoned claim before the claim is parked for a person (default 20; `idem
//! dead` lists them), and `$RECOVERY_HOOK` the hook: `settle` (the default,
//! [`SettleAbandoned`]: abandoned orders finished or given back, refunds released) or `release`
//! (idem's own [`ReleaseAbandoned`], which releases claims without recorded steps and leaves
//! the orders' claims to retries). `$PURGE_EVERY` sets the seconds between passes of the purge
//! of expired keys (default 60; `0` turns it off, for the alerts' test of a service without one).
//!
//! Every succeeded payment enqueues a `payment.succeeded` event in its transaction; the
//! service relays them to RabbitMQ at `$AMQP_URL`, or with `$EVENTS=redis` to the Redis stream
//! `$EVENTS_STREAM` (default `idem.events`) at `$REDIS_URL`, or with `$EVENTS=nats` to NATS
//! JetStream at `$NATS_URL` (default `nats://127.0.0.1:4222`; a comma-separated list of the
//! cluster's servers, all used for reconnects) on the subject `<$EVENTS_STREAM>.<topic>`
//! (`idem.events.payment.succeeded`) of the stream `$EVENTS_STREAM` with its dots made
//! underscores (`idem_events`), created when missing with one replica per server of the
//! cluster, at most 3, or `$NATS_REPLICAS`; `$EVENTS=off` runs no relay. A
//! broker that is down stops nothing: events wait in the outbox until it is back. On SQLite,
//! the relay holds topics under `$RELAY_NAME` (default `payments`): give each instance that
//! shares a SQLite file a name of its own, kept across restarts.
//!
//! `POST /v1/webhooks/processor` receives the processor's webhooks (Standard Webhooks v1, the
//! `webhook-id` their idempotency key): a `balance.credited` event grows its tenant's balance
//! once per id, which `GET /v1/balance` reads ([`idem_examples::webhooks`]). Their signatures
//! are verified with `$WEBHOOK_SECRET` (`whsec_<base64 of the key>`, default
//! [`DEFAULT_SECRET`](idem_examples::webhook_secret::DEFAULT_SECRET), the processor's default
//! too); a malformed one stops the service at start.
//!
//! With `$IDEM_ENCRYPTION_KEYS` set (`<id>:<base64 of 32 bytes>`, comma-separated, the first
//! sealing and every one opening, so that keys rotate), every answer the service stores is
//! sealed at rest ([`EncryptionKeys`]): the key table keeps its status in the clear, its headers
//! and body sealed; unset, answers are stored as they are. A malformed value (not base64, not
//! 32 bytes, an empty or repeated id) stops the service at start, before it opens the database.
//!
//! A database that stops answering stops no request for long: each waits on it at most idem's
//! `database_timeout` (10 s), then gets a 503 with `Retry-After`, reads included
//! ([`idem_examples::bounded`]). A client gets 10 s to send each request's head, and an idle
//! keep-alive connection is closed after as long ([`idem_examples::server`]).

use std::{process::ExitCode, time::Duration};

use axum::Router;
use idem_events::{Publisher, Relay, RelayOptions, rabbitmq::RabbitMq};
use idem_examples::{
    api_doc,
    grpc::PaymentsApi,
    ledger,
    orders::SettleAbandoned,
    payments::{self, AppState},
    refunds::ProcessorClient,
    schema,
    setup::{self, Broker, Database, Error},
    sql::Sql,
    telemetry,
    webhook_secret::WebhookSecret,
};
use idem_runtime::{
    CancellationToken, Store, StoreOptions,
    seal::EncryptionKeys,
    tasks::{Purge, PurgeOptions, Recovery, RecoveryOptions, ReleaseAbandoned, TaskHandle},
};
use sqlx::{MySql, Pool, Postgres, Sqlite};

#[tokio::main]
async fn main() -> ExitCode {
    setup::main("payments", run()).await
}

async fn run() -> Result<(), Error> {
    // Read before anything runs, so that a setting the service does not know stops it at once.
    let tasks = Tasks::from_env()?;
    let webhooks = WebhookSecret::from_env()?;
    let options = store_options()?;
    let broker = setup::broker()?;
    match setup::database("payments.db", 32).await? {
        Database::Postgres(pool) => {
            serve(
                pool,
                payments::routes::<Postgres>(),
                broker,
                tasks,
                webhooks,
                options,
            )
            .await
        }
        Database::Sqlite(pool) => {
            let routes = payments::routes::<Sqlite>();
            serve(pool, routes, broker, tasks, webhooks, options).await
        }
        Database::MySql(pool) => {
            let routes = payments::routes::<MySql>();
            serve(pool, routes, broker, tasks, webhooks, options).await
        }
    }
}

/// How the background tasks run, from the environment.
#[derive(Debug, Clone, Copy)]
struct Tasks {
    /// `$PURGE_EVERY`; `None`: off.
    purge_every: Option<Duration>,
    /// `$RECOVERY_EVERY`; `None`: off.
    recovery_every: Option<Duration>,
    /// `$RECOVERY_HOOK`.
    recovery_hook: Hook,
    /// `$RECOVERY_MAX_ATTEMPTS`.
    recovery_max_attempts: u32,
}

impl Tasks {
    fn from_env() -> Result<Self, Error> {
        Ok(Self {
            purge_every: purge_every()?,
            recovery_every: recovery_every()?,
            recovery_hook: recovery_hook()?,
            recovery_max_attempts: recovery_max_attempts()?,
        })
    }
}

async fn serve<DB: Sql>(
    pool: Pool<DB>,
    routes: Router<AppState<DB>>,
    broker: Option<Broker>,
    tasks: Tasks,
    webhooks: WebhookSecret,
    options: StoreOptions,
) -> Result<(), Error> {
    // First, so that what the tasks count from their first pass on is recorded.
    let metrics = telemetry::install()?;
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let own = setup::migration_pool::<DB>().await?;
    let migrations = own.as_ref().unwrap_or(&pool);
    schema::create(migrations)
        .await
        .map_err(|e| format!("cannot create the tables: {e}"))?;
    if let Some(own) = own {
        own.close().await;
    }
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let grpc_addr = std::env::var("GRPC_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".to_owned());
    let grpc_listener = tokio::net::TcpListener::bind(&grpc_addr)
        .await
        .map_err(|e| format!("cannot listen on {grpc_addr} for gRPC (GRPC_ADDR): {e}"))?;
    let processor_url =
        std::env::var("PROCESSOR_URL").unwrap_or_else(|_| "http://127.0.0.1:3001".to_owned());
    let store = Store::new(pool.clone()).with_options(options);
    let stop = CancellationToken::new();
    // Payments enqueue `payment.succeeded` in their transaction; the relay publishes them. A
    // broker that is away stops nothing: events wait in the outbox.
    let crash_after = std::env::var("CRASH_AFTER")
        .ok()
        .filter(|point| !point.is_empty());
    let abort_after_publish = crash_after.as_deref() == Some("publish");
    let relay = match broker {
        Some(Broker::RabbitMq(broker)) => {
            tracing::info!("relaying events to RabbitMQ");
            // In the background: a broker that does not answer must not hold up the start.
            tokio::spawn(declare_ledger_queue(broker.clone()));
            relay(pool, broker.publisher(), abort_after_publish).spawn(stop.clone())
        }
        Some(Broker::Redis(broker)) => {
            tracing::info!("relaying events to Redis");
            relay(pool, broker.publisher(), abort_after_publish).spawn(stop.clone())
        }
        Some(Broker::Nats(broker)) => {
            tracing::info!(stream = %broker.stream(), "relaying events to NATS JetStream");
            relay(pool, broker.publisher(), abort_after_publish).spawn(stop.clone())
        }
        None => {
            tracing::info!("event relay off (EVENTS=off); events wait in the outbox");
            TaskHandle::spawn(&stop, |_| async {})
        }
    };
    // Keys expire per route (24 h, 7 d); sweeping every minute keeps the table small. Refund
    // and order claims lease for 5 s; abandoned refunds are released so that a retry runs again
    // (the processor deduplicates through the derived key), abandoned orders are finished or
    // have their stock given back.
    let purge = match tasks.purge_every {
        Some(every) => Purge::new(store.clone(), PurgeOptions::default().with_interval(every))
            .spawn(stop.clone()),
        None => {
            tracing::warn!("purge task off (PURGE_EVERY=0): expired keys stay");
            TaskHandle::spawn(&stop, |_| async {})
        }
    };
    let processor = ProcessorClient::new(processor_url);
    // Where several instances share a database, one running the recovery is enough.
    let recovery = match tasks.recovery_every {
        Some(every) => {
            let options = RecoveryOptions::default()
                .with_interval(every)
                .with_max_attempts(tasks.recovery_max_attempts);
            match tasks.recovery_hook {
                Hook::Settle => Recovery::new(
                    store.clone(),
                    SettleAbandoned::new(processor.clone()),
                    options,
                )
                .spawn(stop.clone()),
                Hook::Release => {
                    tracing::info!(
                        "recovery hook: idem's ReleaseAbandoned (RECOVERY_HOOK=release); \
                         abandoned orders are left to their retries"
                    );
                    Recovery::new(store.clone(), ReleaseAbandoned, options).spawn(stop.clone())
                }
            }
        }
        None => {
            tracing::info!("recovery task off (RECOVERY_EVERY=0)");
            TaskHandle::spawn(&stop, |_| async {})
        }
    };
    let state = AppState {
        store,
        processor,
        crash_after,
        webhooks,
    };
    tracing::info!(addr = %listener.local_addr()?, "payments service listening");
    tracing::info!(addr = %grpc_listener.local_addr()?, "payments gRPC service listening");
    // A gRPC server that fails stops the whole service (HTTP included), which then exits with
    // its error: half a service serving is not what its clients were promised.
    let grpc = {
        let server = tonic::transport::Server::builder()
            .add_service(PaymentsApi::new(state.clone()).server())
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(grpc_listener),
                stop.clone().cancelled_owned(),
            );
        let stop = stop.clone();
        tokio::spawn(async move {
            let served = server.await;
            if let Err(error) = &served {
                tracing::error!(%error, "the gRPC server failed; stopping the service");
                stop.cancel();
            }
            served
        })
    };
    let router = routes
        .with_state(state)
        .merge(telemetry::router(metrics))
        .merge(api_doc::router()?);
    setup::serve(listener, router, stop).await?;
    let (_, _, _, grpc) = tokio::join!(purge, recovery, relay, grpc);
    if let Ok(Err(error)) = grpc {
        return Err(format!("the gRPC server failed: {error}").into());
    }
    Ok(())
}

/// The relay, which with `CRASH_AFTER=publish` aborts the process after the broker confirmed
/// its first batch, before the batch is marked published: the next process publishes it again.
fn relay<DB: Sql, P: Publisher>(
    pool: Pool<DB>,
    publisher: P,
    abort_after_publish: bool,
) -> Relay<DB, P> {
    let name = std::env::var("RELAY_NAME").unwrap_or_else(|_| "payments".to_owned());
    let relay = Relay::new(pool, publisher, RelayOptions::default().with_name(name));
    if abort_after_publish {
        relay.on_confirmed(|_| std::process::abort())
    } else {
        relay
    }
}

/// Declares the ledger's queue, bound to the payments' topic, so that events wait in the broker
/// (not in the outbox, refused as unroutable) until a ledger runs. A broker that is away now is
/// no reason not to start: the relay waits for it, and the ledger declares the queue itself.
async fn declare_ledger_queue(broker: RabbitMq) {
    let queue = broker.subscriber(ledger::CONSUMER).bind(ledger::TOPIC);
    match queue.declare().await {
        Ok(()) => tracing::info!(
            queue = %broker.queue(ledger::CONSUMER),
            "the ledger's queue is declared: events wait there until a ledger runs"
        ),
        Err(error) => tracing::warn!(
            %error,
            "cannot declare the ledger's queue now; events wait in the outbox until the broker \
             answers and a queue is bound"
        ),
    }
}

/// The variable that holds the keys the service seals its stored answers with.
const KEYS_VARIABLE: &str = "IDEM_ENCRYPTION_KEYS";

/// The store's options: its answers sealed with `$IDEM_ENCRYPTION_KEYS` when it is set
/// (`<id>:<base64 of 32 bytes>`, comma-separated, the first sealing), stored as they are when it
/// is not.
fn store_options() -> Result<StoreOptions, Error> {
    let options = StoreOptions::default();
    let value = match std::env::var(KEYS_VARIABLE) {
        Err(std::env::VarError::NotPresent) => return Ok(options),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(format!(
                "{KEYS_VARIABLE} must be `<id>:<base64 of 32 bytes>`, comma-separated; got a \
                 value that is not text"
            )
            .into());
        }
        // Zeroed once parsed: the keys live on only in the store's ciphers.
        Ok(value) => zeroize::Zeroizing::new(value),
    };
    // The error names the entry at fault by its id or place, never a key's bytes.
    let keys = EncryptionKeys::parse(&value)
        .map_err(|error| format!("{KEYS_VARIABLE} is malformed: {error}"))?;
    tracing::info!(
        sealing = keys.sealing_id(),
        keys = keys.ids().count(),
        "stored answers are sealed ({KEYS_VARIABLE})"
    );
    Ok(options.with_encryption_keys(keys))
}

/// `$RECOVERY_MAX_ATTEMPTS`: the rounds the recovery's hook gets at one claim before it is
/// parked (default 20).
fn recovery_max_attempts() -> Result<u32, Error> {
    let Ok(value) = std::env::var("RECOVERY_MAX_ATTEMPTS") else {
        return Ok(RecoveryOptions::default().max_attempts());
    };
    match value.parse::<u32>() {
        Ok(attempts) if attempts > 0 => Ok(attempts),
        _ => Err(format!(
            "RECOVERY_MAX_ATTEMPTS must be a whole number of rounds, at least 1, got {value:?}"
        )
        .into()),
    }
}

/// The recovery's hook, as `$RECOVERY_HOOK` names it.
#[derive(Debug, Clone, Copy)]
enum Hook {
    /// `settle` (the default): [`SettleAbandoned`].
    Settle,
    /// `release`: idem's [`ReleaseAbandoned`].
    Release,
}

/// `$RECOVERY_HOOK`: `settle` (default) or `release`.
fn recovery_hook() -> Result<Hook, Error> {
    let Some(value) = std::env::var_os("RECOVERY_HOOK") else {
        return Ok(Hook::Settle);
    };
    match value.to_str() {
        Some("settle") => Ok(Hook::Settle),
        Some("release") => Ok(Hook::Release),
        _ => Err(format!(
            "RECOVERY_HOOK must be `settle` (the example's hook, the default) or `release` \
             (idem's ReleaseAbandoned), got {value:?}"
        )
        .into()),
    }
}

/// `$PURGE_EVERY`: seconds between passes of the purge (default 60); `0` turns it off.
fn purge_every() -> Result<Option<Duration>, Error> {
    let Ok(value) = std::env::var("PURGE_EVERY") else {
        return Ok(Some(PurgeOptions::default().interval()));
    };
    let secs: u64 = value.parse().map_err(|_| {
        format!("PURGE_EVERY must be a whole number of seconds (0: off), got {value:?}")
    })?;
    Ok((secs > 0).then(|| Duration::from_secs(secs)))
}

/// `$RECOVERY_EVERY`: seconds between passes of the recovery task (default 10); `0` turns it
/// off.
fn recovery_every() -> Result<Option<Duration>, Error> {
    let Ok(value) = std::env::var("RECOVERY_EVERY") else {
        return Ok(Some(Duration::from_secs(10)));
    };
    let secs: u64 = value.parse().map_err(|_| {
        format!("RECOVERY_EVERY must be a whole number of seconds (0: off), got {value:?}")
    })?;
    Ok((secs > 0).then(|| Duration::from_secs(secs)))
}
