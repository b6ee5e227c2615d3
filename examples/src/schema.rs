//! The example's own tables, created on start.

use sqlx::PgPool;

const TABLES: &str = r"
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
";

/// Creates idem's key table and the example's tables, if they do not exist.
///
/// # Errors
///
/// When the database cannot be reached or a statement fails.
pub async fn create(pool: &PgPool) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    idem_runtime::migrate(pool).await?;
    sqlx::raw_sql(TABLES).execute(pool).await?;
    Ok(())
}
