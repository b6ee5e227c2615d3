//! `cargo run --bin ledger`: the example's idempotent consumer of `payment.succeeded`.
//!
//! Stores in `$DATABASE_URL` (PostgreSQL; `mysql://…/<database>`, MySQL or MariaDB, created if
//! missing; or `sqlite:<path>`); without it, in the SQLite file `$SQLITE_PATH` (default
//! `ledger.db`). Consumes from RabbitMQ at `$AMQP_URL` (queue
//! `<$EVENTS_STREAM>.ledger`, bound to `payment.succeeded`), or with `$EVENTS=redis` from the
//! Redis stream `$EVENTS_STREAM` (default `idem.events`) at `$REDIS_URL`, as the consumer group
//! `ledger`, or with `$EVENTS=nats` from NATS JetStream at `$NATS_URL` (default
//! `nats://127.0.0.1:4222`, or a comma-separated list of servers), as the durable consumer
//! `ledger` of the stream `$EVENTS_STREAM` with its dots made underscores (`idem_events`;
//! created when missing as the payments service would, `$NATS_REPLICAS` included). On NATS,
//! `$NATS_ACK_WAIT` is the seconds a message the ledger took may stay unacknowledged before
//! JetStream delivers it again (default 30; read when the durable consumer is created). Serves
//! `GET /v1/ledger` on `$LEDGER_ADDR` (default `127.0.0.1:3002`).
//!
//! Each message is acknowledged after the transaction that applied it commits; one that fails
//! five times goes to the broker's dead-letter place.
//!
//! For crash tests, `$CRASH_AFTER=apply` aborts the process inside the handler of the first
//! message, after its writes and before its commit; `$CRASH_AFTER=commit` aborts it after the
//! first commit, before the acknowledgement.

use std::{process::ExitCode, time::Duration};

use idem_events::{CancellationToken, Consumer, ConsumerOptions};
use idem_examples::{
    api_doc,
    ledger::{self, CONSUMER, Ledger, LedgerSql, TOPIC},
    setup::{self, Broker, Database, Error},
    telemetry,
};
use sqlx::Pool;

#[tokio::main]
async fn main() -> ExitCode {
    setup::main("ledger", run()).await
}

async fn run() -> Result<(), Error> {
    let Some(broker) = setup::broker()? else {
        return Err("EVENTS=off: the ledger has nothing to consume".into());
    };
    let ack_wait = nats_ack_wait()?;
    match setup::database("ledger.db", 8).await? {
        Database::Postgres(pool) => serve(pool, broker, ack_wait).await,
        Database::Sqlite(pool) => serve(pool, broker, ack_wait).await,
        Database::MySql(pool) => serve(pool, broker, ack_wait).await,
    }
}

/// Consumes from `broker` into `pool` and serves the ledger, until Ctrl-C or SIGTERM; on
/// NATS, `ack_wait` is the durable consumer's.
async fn serve<DB: LedgerSql>(
    pool: Pool<DB>,
    broker: Broker,
    ack_wait: Duration,
) -> Result<(), Error> {
    let own = setup::migration_pool::<DB>().await?;
    let migrations = own.as_ref().unwrap_or(&pool);
    idem_events::migrate(migrations)
        .await
        .map_err(|e| format!("cannot create idem's event tables: {e}"))?;
    DB::create_tables(migrations)
        .await
        .map_err(|e| format!("cannot create the ledger's tables: {e}"))?;
    if let Some(own) = own {
        own.close().await;
    }
    // First, so that what the consumer counts from its first message on is recorded.
    let metrics = telemetry::install()?;
    let addr = std::env::var("LEDGER_ADDR").unwrap_or_else(|_| "127.0.0.1:3002".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let stop = CancellationToken::new();
    let crash_after = std::env::var("CRASH_AFTER").unwrap_or_default();
    let mut consumer = Consumer::new(
        pool.clone(),
        Ledger::default().abort_after_apply(crash_after == "apply"),
        ConsumerOptions::new(CONSUMER),
    );
    if crash_after == "commit" {
        consumer = consumer.on_committed(|_| std::process::abort());
    }
    let consuming = match broker {
        Broker::RabbitMq(broker) => {
            tracing::info!("consuming from RabbitMQ");
            consumer
                .with_subscriber(broker.subscriber(CONSUMER).bind(TOPIC))
                .spawn(stop.clone())
        }
        Broker::Redis(broker) => {
            tracing::info!("consuming from Redis");
            consumer
                .with_subscriber(broker.subscriber(CONSUMER))
                .spawn(stop.clone())
        }
        Broker::Nats(broker) => {
            tracing::info!(stream = %broker.stream(), "consuming from NATS JetStream");
            consumer
                .with_subscriber(broker.subscriber(CONSUMER).with_ack_wait(ack_wait))
                .spawn(stop.clone())
        }
    };
    tracing::info!(addr = %listener.local_addr()?, "ledger listening");
    setup::serve(
        listener,
        ledger::router(pool, idem_runtime::StoreOptions::default())
            .merge(telemetry::router(metrics))
            .merge(api_doc::ledger_router()?),
        stop,
    )
    .await?;
    // The message in flight is finished and settled before the consumer stops.
    let _ = consuming.await;
    Ok(())
}

/// `$NATS_ACK_WAIT`: the seconds a message may stay unacknowledged before JetStream delivers it
/// again (default 30).
fn nats_ack_wait() -> Result<Duration, Error> {
    let Ok(value) = std::env::var("NATS_ACK_WAIT") else {
        return Ok(Duration::from_secs(30));
    };
    match value.parse::<u64>() {
        Ok(secs) if secs > 0 => Ok(Duration::from_secs(secs)),
        _ => Err(
            format!("NATS_ACK_WAIT must be a whole number of seconds above 0, got {value:?}")
                .into(),
        ),
    }
}
