//! `bank.v1.Transfers`, a tonic service made retry-safe with idem: `CreateTransfer` updates two
//! accounts in one transaction, and runs once per `idempotency-key`; a retry gets the first
//! call's answer back.
//!
//! Environment: `TRANSFERS_DB` (the SQLite file, default `transfers.db`), `TRANSFERS_ADDR`
//! (default `127.0.0.1:50052`), `METRICS_ADDR` (Prometheus's scrape address, default
//! `127.0.0.1:9102`).

use std::{borrow::Cow, net::SocketAddr};

use idem_runtime::{
    CancellationToken, FromRef, IdempotencyScope, Store,
    grpc::FromMetadata,
    idempotent,
    tasks::{Purge, PurgeOptions, Recovery, RecoveryOptions, ReleaseAbandoned},
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use sqlx::{Sqlite, SqlitePool, Transaction};
use tonic::{
    Extensions, Request, Response, Status,
    metadata::MetadataMap,
    transport::{Server, server::TcpIncoming},
};

mod bank {
    tonic::include_proto!("bank.v1");
}

use bank::{
    CreateTransferRequest, Transfer,
    transfers_server::{Transfers, TransfersServer},
};

/// The service. It hands idem its store as an Axum router's state does, through `FromRef`.
#[derive(Clone)]
struct TransfersApi {
    store: Store<Sqlite>,
}

impl FromRef<TransfersApi> for Store<Sqlite> {
    fn from_ref(api: &TransfersApi) -> Self {
        api.store.clone()
    }
}

/// The caller, from the `x-customer` metadata (in a real service: from its credentials). Keys
/// are kept per customer: two customers never see each other's answers.
struct Customer(String);

impl FromMetadata for Customer {
    fn from_metadata(metadata: &MetadataMap, _: &Extensions) -> Result<Self, Status> {
        match metadata
            .get("x-customer")
            .and_then(|value| value.to_str().ok())
        {
            Some(customer) if !customer.is_empty() => Ok(Self(customer.to_owned())),
            _ => Err(Status::unauthenticated("say who you are in `x-customer`")),
        }
    }
}

impl IdempotencyScope for Customer {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[idem_runtime::grpc]
#[tonic::async_trait]
impl Transfers for TransfersApi {
    #[idempotent(scope = "customer", retention = "24h")]
    async fn create_transfer(
        &self,
        customer: Customer,
        tx: &mut Transaction<'_, Sqlite>,
        request: Request<CreateTransferRequest>,
    ) -> Result<Response<Transfer>, Status> {
        let CreateTransferRequest { from, to, amount } = request.into_inner();
        if amount <= 0 || from == to {
            // Final: stored and replayed, as an HTTP 4xx is.
            return Err(Status::invalid_argument(
                "a positive amount between two accounts",
            ));
        }
        // Checked before any write: a final status commits what the method wrote.
        let owned: i64 =
            sqlx::query_scalar("SELECT count(*) FROM accounts WHERE owner = $1 AND id IN ($2, $3)")
                .bind(&customer.0)
                .bind(&from)
                .bind(&to)
                .fetch_one(&mut **tx)
                .await
                .map_err(database)?;
        if owned != 2 {
            return Err(Status::not_found("both accounts must be yours"));
        }
        let debited = sqlx::query(
            "UPDATE accounts SET balance = balance - $1 WHERE id = $2 AND balance >= $1",
        )
        .bind(amount)
        .bind(&from)
        .execute(&mut **tx)
        .await
        .map_err(database)?;
        if debited.rows_affected() != 1 {
            return Err(Status::failed_precondition("not enough money"));
        }
        sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
            .bind(amount)
            .bind(&to)
            .execute(&mut **tx)
            .await
            .map_err(database)?;
        let id = sqlx::query_scalar(
            "INSERT INTO transfers (source, target, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(&from)
        .bind(&to)
        .bind(amount)
        .fetch_one(&mut **tx)
        .await
        .map_err(database)?;
        // Stored with the two updates, in the same commit.
        Ok(Response::new(Transfer {
            id,
            from,
            to,
            amount,
        }))
    }
}

/// A statement that failed: `UNAVAILABLE`, like a 5xx: rolled back, not stored, retried.
fn database(error: sqlx::Error) -> Status {
    Status::unavailable(format!("database: {error}"))
}

/// The application's own tables, and two accounts to move money between.
async fn create_tables(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS accounts (
             id TEXT PRIMARY KEY, owner TEXT NOT NULL, balance INTEGER NOT NULL);
         CREATE TABLE IF NOT EXISTS transfers (
             id INTEGER PRIMARY KEY, source TEXT NOT NULL, target TEXT NOT NULL,
             amount INTEGER NOT NULL);
         INSERT OR IGNORE INTO accounts VALUES
             ('alice-checking', 'alice', 1000), ('alice-savings', 'alice', 0);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Durations as histograms, which the dashboard's panels and the alert rules read.
    let metrics_addr: SocketAddr = env_or("METRICS_ADDR", "127.0.0.1:9102").parse()?;
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".to_owned()),
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ],
        )?
        .with_http_listener(metrics_addr)
        .install()?;

    let pool = idem_runtime::sqlite::connect(env_or("TRANSFERS_DB", "transfers.db")).await?;
    idem_runtime::migrate(&pool).await?; // idem's key table, created once
    create_tables(&pool).await?;
    let store = Store::new(pool);

    // Expired keys deleted (without it the key table only grows), and claims a crashed
    // process left in external mode settled. Transactional methods, as here, leave none: their
    // claim rolls back with the transaction; the recovery costs nothing then.
    let shutdown = CancellationToken::new();
    let purge = Purge::new(store.clone(), PurgeOptions::default()).spawn(shutdown.clone());
    let recovery = Recovery::new(store.clone(), ReleaseAbandoned, RecoveryOptions::default())
        .spawn(shutdown.clone());

    let listener =
        tokio::net::TcpListener::bind(env_or("TRANSFERS_ADDR", "127.0.0.1:50052")).await?;
    println!("serving bank.v1.Transfers on {}", listener.local_addr()?);
    Server::builder()
        .add_service(TransfersServer::new(TransfersApi { store }))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    purge.stop().await?;
    recovery.stop().await?;
    Ok(())
}
