//! The example's own tables, created on start, for each database.

use std::{future::Future, path::Path};

use idem_runtime::Backend;
use sqlx::{MySql, Pool, Postgres, Sqlite, SqlitePool};

const POSTGRES_TABLES: &str = r"
CREATE TABLE IF NOT EXISTS payments (
    id         text        PRIMARY KEY,
    tenant     text        NOT NULL,
    amount     bigint      NOT NULL,
    currency   text        NOT NULL,
    customer   text        NOT NULL,
    status     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS payments_tenant_created_idx ON payments (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS payouts (
    id         text        PRIMARY KEY,
    tenant     text        NOT NULL,
    amount     bigint      NOT NULL,
    currency   text        NOT NULL,
    customer   text        NOT NULL,
    status     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS payouts_tenant_created_idx ON payouts (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS refunds (
    id         text        PRIMARY KEY,
    tenant     text        NOT NULL,
    payment    text        NOT NULL,
    amount     bigint      NOT NULL,
    status     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS refunds_tenant_created_idx ON refunds (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS inventory (
    sku   text   PRIMARY KEY,
    stock bigint NOT NULL CHECK (stock >= 0)
);
CREATE TABLE IF NOT EXISTS orders (
    id         text        PRIMARY KEY,
    tenant     text        NOT NULL,
    sku        text        NOT NULL,
    quantity   bigint      NOT NULL,
    customer   text        NOT NULL,
    amount     bigint      NOT NULL,
    charge     text        NOT NULL,
    status     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS orders_tenant_created_idx ON orders (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS shipments (
    order_id   text        PRIMARY KEY REFERENCES orders (id),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS balance_credits (
    webhook_id text        NOT NULL,
    tenant     text        NOT NULL,
    amount     bigint      NOT NULL CHECK (amount > 0),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS balance_credits_tenant_idx ON balance_credits (tenant);
";

const SQLITE_TABLES: &str = r"
CREATE TABLE IF NOT EXISTS payments (
    id         text        PRIMARY KEY,
    tenant     text        NOT NULL,
    amount     INTEGER      NOT NULL,
    currency   text        NOT NULL,
    customer   text        NOT NULL,
    status     text        NOT NULL,
    created_at TEXT        NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);
CREATE INDEX IF NOT EXISTS payments_tenant_created_idx ON payments (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS payouts (
    id         text        PRIMARY KEY,
    tenant     text        NOT NULL,
    amount     INTEGER      NOT NULL,
    currency   text        NOT NULL,
    customer   text        NOT NULL,
    status     text        NOT NULL,
    created_at TEXT        NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);
CREATE INDEX IF NOT EXISTS payouts_tenant_created_idx ON payouts (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS refunds (
    id         text        PRIMARY KEY,
    tenant     text        NOT NULL,
    payment    text        NOT NULL,
    amount     INTEGER      NOT NULL,
    status     text        NOT NULL,
    created_at TEXT        NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);
CREATE INDEX IF NOT EXISTS refunds_tenant_created_idx ON refunds (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS inventory (
    sku   text    PRIMARY KEY,
    stock INTEGER NOT NULL CHECK (stock >= 0)
);
CREATE TABLE IF NOT EXISTS orders (
    id         text    PRIMARY KEY,
    tenant     text    NOT NULL,
    sku        text    NOT NULL,
    quantity   INTEGER NOT NULL,
    customer   text    NOT NULL,
    amount     INTEGER NOT NULL,
    charge     text    NOT NULL,
    status     text    NOT NULL,
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);
CREATE INDEX IF NOT EXISTS orders_tenant_created_idx ON orders (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS shipments (
    order_id   text PRIMARY KEY REFERENCES orders (id),
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);
CREATE TABLE IF NOT EXISTS balance_credits (
    webhook_id text    NOT NULL,
    tenant     text    NOT NULL,
    amount     INTEGER NOT NULL CHECK (amount > 0),
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))
);
CREATE INDEX IF NOT EXISTS balance_credits_tenant_idx ON balance_credits (tenant);
";

// MySQL and MariaDB: InnoDB; the identifiers that are compared (ids, tenants, SKUs) are
// VARBINARY, byte for byte as on the other databases (a text collation, even utf8mb4_bin, pads
// with spaces: `pay_1 ` would find `pay_1`); the other text is utf8mb4 with its binary
// collation. Times are DATETIME(6) in UTC. MySQL commits each CREATE TABLE by itself, so every
// statement creates only what is missing (indexes with their tables) and a start that failed
// halfway is finished by the next. The foreign key is a table constraint: MySQL ignores a
// column's REFERENCES.
const MYSQL_TABLES: &str = r"
CREATE TABLE IF NOT EXISTS payments (
    id         VARBINARY(255) NOT NULL PRIMARY KEY,
    tenant     VARBINARY(255) NOT NULL,
    amount     BIGINT         NOT NULL,
    currency   TEXT           NOT NULL,
    customer   TEXT           NOT NULL,
    status     TEXT           NOT NULL,
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX payments_tenant_created_idx (tenant, created_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS payouts (
    id         VARBINARY(255) NOT NULL PRIMARY KEY,
    tenant     VARBINARY(255) NOT NULL,
    amount     BIGINT         NOT NULL,
    currency   TEXT           NOT NULL,
    customer   TEXT           NOT NULL,
    status     TEXT           NOT NULL,
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX payouts_tenant_created_idx (tenant, created_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS refunds (
    id         VARBINARY(255) NOT NULL PRIMARY KEY,
    tenant     VARBINARY(255) NOT NULL,
    payment    TEXT           NOT NULL,
    amount     BIGINT         NOT NULL,
    status     TEXT           NOT NULL,
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX refunds_tenant_created_idx (tenant, created_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS inventory (
    sku   VARBINARY(256) NOT NULL PRIMARY KEY,
    stock BIGINT         NOT NULL CHECK (stock >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS orders (
    id         VARBINARY(255) NOT NULL PRIMARY KEY,
    tenant     VARBINARY(255) NOT NULL,
    sku        VARBINARY(256) NOT NULL,
    quantity   BIGINT         NOT NULL,
    customer   TEXT           NOT NULL,
    amount     BIGINT         NOT NULL,
    charge     TEXT           NOT NULL,
    status     TEXT           NOT NULL,
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX orders_tenant_created_idx (tenant, created_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS shipments (
    order_id   VARBINARY(255) NOT NULL PRIMARY KEY,
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    FOREIGN KEY (order_id) REFERENCES orders (id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS balance_credits (
    webhook_id VARBINARY(512) NOT NULL,
    tenant     VARBINARY(255) NOT NULL,
    amount     BIGINT         NOT NULL CHECK (amount > 0),
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX balance_credits_tenant_idx (tenant)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
";

/// A database the example can create its tables in.
pub trait Tables: Backend + idem_events::Backend {
    /// The `ORDER BY` of lists, newest first, without ties: PostgreSQL's and MySQL's
    /// `created_at` have microseconds; SQLite's only milliseconds, so its insertion order
    /// (`rowid`) breaks ties.
    const NEWEST_FIRST: &'static str;

    /// Creates the example's tables if they do not exist.
    fn create_tables(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl Tables for Postgres {
    const NEWEST_FIRST: &'static str = "ORDER BY created_at DESC, id DESC";

    async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(POSTGRES_TABLES).execute(pool).await?;
        Ok(())
    }
}

impl Tables for Sqlite {
    const NEWEST_FIRST: &'static str = "ORDER BY created_at DESC, rowid DESC";

    async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(SQLITE_TABLES).execute(pool).await?;
        Ok(())
    }
}

impl Tables for MySql {
    const NEWEST_FIRST: &'static str = "ORDER BY created_at DESC, id DESC";

    async fn create_tables(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(MYSQL_TABLES).execute(pool).await?;
        Ok(())
    }
}

/// Creates idem's key table, its event tables and the example's tables, if they do not exist.
///
/// # Errors
///
/// When the database cannot be reached or a statement fails.
pub async fn create<DB: Tables>(
    pool: &Pool<DB>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    idem_runtime::migrate(pool).await?;
    idem_events::migrate(pool).await?;
    DB::create_tables(pool).await?;
    Ok(())
}

/// Opens (creating it if needed) the SQLite file at `path` the way idem wants it
/// ([`idem_runtime::sqlite::connect`]): WAL, so that readers never wait for the writer; a busy
/// timeout, so that writers queue for SQLite's single write lock instead of failing with
/// "database is locked".
///
/// # Errors
///
/// When the file cannot be opened or created.
pub async fn connect_sqlite(path: &Path) -> Result<SqlitePool, sqlx::Error> {
    idem_runtime::sqlite::connect(path).await
}
