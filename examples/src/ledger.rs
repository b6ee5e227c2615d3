//! The ledger: an idempotent consumer of `payment.succeeded` events, and `GET /v1/ledger`.
//!
//! For each event it adds one entry and raises the tenant's balance by the amount, in the
//! transaction in which idem records the event's id: a redelivered event changes nothing.

use std::{future::Future, sync::Arc};

use axum::{Json, Router, extract::State, routing::get};
use idem_events::{Backend, EventHandler, Message};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, MySqlConnection, Pool, Postgres, Sqlite, Transaction};

use idem_runtime::StoreOptions;

use crate::{auth::Tenant, bounded, error::ApiError};

/// The consumer's name: the key its processed ids are recorded under, its RabbitMQ queue
/// (`<exchange>.ledger`), its Redis consumer group and its NATS durable consumer.
pub const CONSUMER: &str = "ledger";

/// The topic it consumes.
pub const TOPIC: &str = "payment.succeeded";

/// The payload of `payment.succeeded`, as the payments service enqueues it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentSucceeded {
    /// The event's id (also the message id).
    pub event_id: String,
    /// The payment's id.
    pub payment: String,
    /// The tenant the payment belongs to.
    pub tenant: String,
    /// The amount, in minor units.
    pub amount: i64,
    /// The currency.
    pub currency: String,
}

/// What `GET /v1/ledger` answers: the caller's entries and their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Balance {
    /// How many entries.
    pub entries: i64,
    /// The sum of their amounts.
    pub balance: i64,
}

// No unique constraint on event_id: the consumer's record of processed ids is what keeps an
// event to one entry (and the example's tests check that it does).
const POSTGRES_TABLES: &str = r"
CREATE TABLE IF NOT EXISTS ledger_entries (
    event_id   text        NOT NULL,
    tenant     text        NOT NULL,
    payment    text        NOT NULL,
    amount     bigint      NOT NULL,
    currency   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS ledger_entries_tenant_idx ON ledger_entries (tenant);
CREATE TABLE IF NOT EXISTS ledger_balances (
    tenant  text   PRIMARY KEY,
    entries bigint NOT NULL,
    balance bigint NOT NULL
);
";

const SQLITE_TABLES: &str = r"
CREATE TABLE IF NOT EXISTS ledger_entries (
    event_id   TEXT    NOT NULL,
    tenant     TEXT    NOT NULL,
    payment    TEXT    NOT NULL,
    amount     INTEGER NOT NULL,
    currency   TEXT    NOT NULL,
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX IF NOT EXISTS ledger_entries_tenant_idx ON ledger_entries (tenant);
CREATE TABLE IF NOT EXISTS ledger_balances (
    tenant  TEXT    PRIMARY KEY,
    entries INTEGER NOT NULL,
    balance INTEGER NOT NULL
);
";

// MySQL and MariaDB: the tenant, compared, is VARBINARY (byte for byte, as on the other
// databases); times are DATETIME(6) in UTC.
const MYSQL_TABLES: &str = r"
CREATE TABLE IF NOT EXISTS ledger_entries (
    event_id   TEXT           NOT NULL,
    tenant     VARBINARY(255) NOT NULL,
    payment    TEXT           NOT NULL,
    amount     BIGINT         NOT NULL,
    currency   TEXT           NOT NULL,
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX ledger_entries_tenant_idx (tenant)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS ledger_balances (
    tenant  VARBINARY(255) NOT NULL PRIMARY KEY,
    entries BIGINT         NOT NULL,
    balance BIGINT         NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
";

const INSERT_ENTRY: &str = "INSERT INTO ledger_entries (event_id, tenant, payment, amount, currency) \
     VALUES ($1, $2, $3, $4, $5)";

const RAISE_BALANCE: &str = "INSERT INTO ledger_balances (tenant, entries, balance) \
     VALUES ($1, 1, $2) \
     ON CONFLICT (tenant) DO UPDATE \
     SET entries = ledger_balances.entries + 1, balance = ledger_balances.balance + excluded.balance";

const BALANCE: &str = "SELECT entries, balance FROM ledger_balances WHERE tenant = $1";

/// A database the ledger runs on.
pub trait LedgerSql: Backend {
    /// Creates idem's tables and the ledger's, if they do not exist.
    fn create_tables(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Adds `event`'s entry and raises its tenant's balance, in `tx`.
    fn record<'a>(
        tx: &'a mut Transaction<'static, Self>,
        event: &'a PaymentSucceeded,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The balance of `tenant` (zero when it has no entry).
    fn balance<'a>(
        conn: &'a mut Self::Connection,
        tenant: &'a str,
    ) -> impl Future<Output = Result<Balance, sqlx::Error>> + Send + 'a;
}

macro_rules! ledger_sql {
    ($db:ty, $tables:expr) => {
        impl LedgerSql for $db {
            async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
                sqlx::raw_sql($tables).execute(pool).await?;
                Ok(())
            }

            async fn record(
                tx: &mut Transaction<'static, Self>,
                event: &PaymentSucceeded,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(INSERT_ENTRY)
                    .bind(&event.event_id)
                    .bind(&event.tenant)
                    .bind(&event.payment)
                    .bind(event.amount)
                    .bind(&event.currency)
                    .execute(&mut **tx)
                    .await?;
                sqlx::query(RAISE_BALANCE)
                    .bind(&event.tenant)
                    .bind(event.amount)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            async fn balance(
                conn: &mut Self::Connection,
                tenant: &str,
            ) -> Result<Balance, sqlx::Error> {
                let row: Option<(i64, i64)> = sqlx::query_as(BALANCE)
                    .bind(tenant)
                    .fetch_optional(&mut *conn)
                    .await?;
                let (entries, balance) = row.unwrap_or_default();
                Ok(Balance { entries, balance })
            }
        }
    };
}

ledger_sql!(Postgres, POSTGRES_TABLES);
ledger_sql!(Sqlite, SQLITE_TABLES);

/// On MySQL and MariaDB: `?` parameters, and `ON DUPLICATE KEY UPDATE` for the balance (the
/// amount bound twice, rather than MySQL 8's deprecated `VALUES()` or its `AS` alias, which
/// MariaDB does not know).
impl LedgerSql for MySql {
    async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(MYSQL_TABLES).execute(pool).await?;
        Ok(())
    }

    async fn record(
        tx: &mut Transaction<'static, Self>,
        event: &PaymentSucceeded,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO ledger_entries (event_id, tenant, payment, amount, currency) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&event.event_id)
        .bind(&event.tenant)
        .bind(&event.payment)
        .bind(event.amount)
        .bind(&event.currency)
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "INSERT INTO ledger_balances (tenant, entries, balance) VALUES (?, 1, ?) \
             ON DUPLICATE KEY UPDATE entries = entries + 1, balance = balance + ?",
        )
        .bind(&event.tenant)
        .bind(event.amount)
        .bind(event.amount)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn balance(conn: &mut MySqlConnection, tenant: &str) -> Result<Balance, sqlx::Error> {
        let row: Option<(i64, i64)> =
            sqlx::query_as("SELECT entries, balance FROM ledger_balances WHERE tenant = ?")
                .bind(tenant)
                .fetch_optional(&mut *conn)
                .await?;
        let (entries, balance) = row.unwrap_or_default();
        Ok(Balance { entries, balance })
    }
}

/// Why an event could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The payload is not a `payment.succeeded` event: it never will be, and goes to the
    /// dead-letter place after the attempts.
    #[error("the payload is not a payment.succeeded event: {0}")]
    Payload(#[from] serde_json::Error),
    /// The database failed.
    #[error("the database failed: {0}")]
    Database(#[from] sqlx::Error),
}

/// The consumer's handler.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ledger {
    abort_after_apply: bool,
}

impl Ledger {
    /// With `true`, the handler aborts the process after its writes, before the commit: the
    /// crash point `CRASH_AFTER=apply` of the `ledger` binary.
    #[must_use]
    pub fn abort_after_apply(mut self, abort: bool) -> Self {
        self.abort_after_apply = abort;
        self
    }
}

impl<DB: LedgerSql> EventHandler<DB> for Ledger {
    type Error = LedgerError;

    async fn handle(
        &self,
        message: &Message,
        tx: &mut Transaction<'static, DB>,
    ) -> Result<(), LedgerError> {
        let event: PaymentSucceeded = message.json()?;
        DB::record(tx, &event).await?;
        if self.abort_after_apply {
            std::process::abort();
        }
        Ok(())
    }
}

/// What `GET /v1/ledger` reads from: the pool, and the options of idem's store that bound its work
/// ([`bounded::within_deadline`]).
#[derive(Debug)]
pub struct LedgerState<DB: sqlx::Database> {
    pool: Pool<DB>,
    options: Arc<StoreOptions>,
}

impl<DB: sqlx::Database> Clone for LedgerState<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            options: Arc::clone(&self.options),
        }
    }
}

/// `GET /v1/ledger` over `pool`, its reads bounded as `options` say.
pub fn router<DB: LedgerSql>(pool: Pool<DB>, options: StoreOptions) -> Router {
    Router::new()
        .route("/v1/ledger", get(balance::<DB>))
        .with_state(LedgerState {
            pool,
            options: Arc::new(options),
        })
}

/// `GET /v1/ledger`: the caller's entries and balance.
#[utoipa::path(get, path = "/v1/ledger", tag = "ledger",
    summary = "The caller's ledger: entries made from its succeeded payments, and their sum",
    responses((status = 200, description = "The caller's entries and balance.", body = Balance)))]
pub async fn balance<DB: LedgerSql>(
    tenant: Tenant,
    State(state): State<LedgerState<DB>>,
) -> Result<Json<Balance>, ApiError> {
    let balance = bounded::within_deadline(&state.pool, &state.options, async |conn| {
        DB::balance(conn, &tenant.0).await
    })
    .await?;
    Ok(Json(balance))
}
