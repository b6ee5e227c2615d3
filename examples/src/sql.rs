//! The example's SQL, behind one trait: the handlers in [`crate::payments`] are generic over the
//! database and call these methods; sqlx's executors are per database type, so the bodies are
//! written once in a macro and implemented for PostgreSQL and SQLite, and apart for MySQL and
//! MariaDB (`sql/mysql.rs`), whose parameters and upserts are spelled otherwise.

use std::future::Future;

use sqlx::Transaction;

use crate::{
    balance::Balance,
    orders::{Order, STOCK_PER_SKU},
    payments::Transfer,
    refunds::Refund,
    schema::Tables,
};

mod mysql;
pub mod spelling;

/// A database the payments API runs on.
pub trait Sql: Tables {
    /// Inserts a transfer (`sql` is the kind's `INSERT`) in the handler's transaction.
    fn insert_transfer<'a>(
        tx: &'a mut Transaction<'_, Self>,
        sql: &'static str,
        transfer: &'a Transfer,
        tenant: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Sets a transfer's status (`sql` is the kind's `UPDATE`, binding the status, then the id).
    fn settle<'a>(
        tx: &'a mut Transaction<'_, Self>,
        sql: &'static str,
        id: &'a str,
        status: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The transfers `sql` selects for `tenant`, with more binds in `ids`.
    fn transfers<'a>(
        conn: &'a mut Self::Connection,
        sql: String,
        tenant: &'a str,
        ids: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<Transfer>, sqlx::Error>> + Send + 'a;

    /// The customer of `tenant`'s payment `payment`, if it exists.
    fn payment_customer<'a>(
        conn: &'a mut Self::Connection,
        tenant: &'a str,
        payment: &'a str,
    ) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send + 'a;

    /// Records a refund the processor executed; a second time changes nothing.
    fn insert_refund<'a>(
        conn: &'a mut Self::Connection,
        refund: &'a Refund,
        tenant: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The refunds `sql` selects for `tenant`, with more binds in `ids`.
    fn refunds<'a>(
        conn: &'a mut Self::Connection,
        sql: String,
        tenant: &'a str,
        ids: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<Refund>, sqlx::Error>> + Send + 'a;

    /// Takes `quantity` from `sku`'s stock (which starts at [`STOCK_PER_SKU`] the first time
    /// the SKU is seen); `false`, with nothing taken, when the stock is too low.
    fn reserve<'a>(
        conn: &'a mut Self::Connection,
        sku: &'a str,
        quantity: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Puts `quantity` back into `sku`'s stock.
    fn give_back<'a>(
        conn: &'a mut Self::Connection,
        sku: &'a str,
        quantity: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Records a confirmed order of `tenant` and its shipment.
    fn insert_order<'a>(
        conn: &'a mut Self::Connection,
        order: &'a Order,
        tenant: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The orders `sql` selects for `tenant`, with more binds in `ids`.
    fn orders<'a>(
        conn: &'a mut Self::Connection,
        sql: String,
        tenant: &'a str,
        ids: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<Order>, sqlx::Error>> + Send + 'a;

    /// `sku`'s stock, if the SKU has been seen.
    fn stock<'a>(
        conn: &'a mut Self::Connection,
        sku: &'a str,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// Credits `amount` to `tenant`'s balance, as the webhook `webhook_id` says, in the
    /// handler's transaction.
    fn credit<'a>(
        tx: &'a mut Transaction<'_, Self>,
        webhook_id: &'a str,
        tenant: &'a str,
        amount: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// `tenant`'s balance: the sum of its credits and their number (zeros for none).
    fn balance<'a>(
        conn: &'a mut Self::Connection,
        tenant: &'a str,
    ) -> impl Future<Output = Result<Balance, sqlx::Error>> + Send + 'a;
}

macro_rules! sql {
    ($db:ty) => {
        impl Sql for $db {
            async fn insert_transfer<'a>(
                tx: &'a mut Transaction<'_, Self>,
                sql: &'static str,
                transfer: &'a Transfer,
                tenant: &'a str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(sql)
                    .bind(&transfer.id)
                    .bind(tenant)
                    .bind(transfer.amount)
                    .bind(&transfer.currency)
                    .bind(&transfer.customer)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            async fn settle<'a>(
                tx: &'a mut Transaction<'_, Self>,
                sql: &'static str,
                id: &'a str,
                status: &'a str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(sql)
                    .bind(status)
                    .bind(id)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            async fn transfers<'a>(
                conn: &'a mut Self::Connection,
                sql: String,
                tenant: &'a str,
                ids: &'a [&'a str],
            ) -> Result<Vec<Transfer>, sqlx::Error> {
                let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(tenant);
                for id in ids {
                    query = query.bind(*id);
                }
                query.fetch_all(&mut *conn).await
            }

            async fn payment_customer<'a>(
                conn: &'a mut Self::Connection,
                tenant: &'a str,
                payment: &'a str,
            ) -> Result<Option<String>, sqlx::Error> {
                sqlx::query_scalar("SELECT customer FROM payments WHERE tenant = $1 AND id = $2")
                    .bind(tenant)
                    .bind(payment)
                    .fetch_optional(&mut *conn)
                    .await
            }

            async fn insert_refund<'a>(
                conn: &'a mut Self::Connection,
                refund: &'a Refund,
                tenant: &'a str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(
                    "INSERT INTO refunds (id, tenant, payment, amount, status) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING",
                )
                .bind(&refund.id)
                .bind(tenant)
                .bind(&refund.payment)
                .bind(refund.amount)
                .bind(&refund.status)
                .execute(&mut *conn)
                .await?;
                Ok(())
            }

            async fn refunds<'a>(
                conn: &'a mut Self::Connection,
                sql: String,
                tenant: &'a str,
                ids: &'a [&'a str],
            ) -> Result<Vec<Refund>, sqlx::Error> {
                let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(tenant);
                for id in ids {
                    query = query.bind(*id);
                }
                query.fetch_all(&mut *conn).await
            }

            async fn reserve<'a>(
                conn: &'a mut Self::Connection,
                sku: &'a str,
                quantity: i64,
            ) -> Result<bool, sqlx::Error> {
                sqlx::query("INSERT INTO inventory (sku, stock) VALUES ($1, $2) ON CONFLICT (sku) DO NOTHING")
                    .bind(sku)
                    .bind(STOCK_PER_SKU)
                    .execute(&mut *conn)
                    .await?;
                let taken = sqlx::query(
                    "UPDATE inventory SET stock = stock - $2 WHERE sku = $1 AND stock >= $2",
                )
                .bind(sku)
                .bind(quantity)
                .execute(&mut *conn)
                .await?;
                Ok(taken.rows_affected() == 1)
            }

            async fn give_back<'a>(
                conn: &'a mut Self::Connection,
                sku: &'a str,
                quantity: i64,
            ) -> Result<(), sqlx::Error> {
                sqlx::query("UPDATE inventory SET stock = stock + $2 WHERE sku = $1")
                    .bind(sku)
                    .bind(quantity)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }

            async fn insert_order<'a>(
                conn: &'a mut Self::Connection,
                order: &'a Order,
                tenant: &'a str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(
                    "INSERT INTO orders (id, tenant, sku, quantity, customer, amount, charge, status) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                )
                .bind(&order.id)
                .bind(tenant)
                .bind(&order.sku)
                .bind(order.quantity)
                .bind(&order.customer)
                .bind(order.amount)
                .bind(&order.charge)
                .bind(&order.status)
                .execute(&mut *conn)
                .await?;
                sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
                    .bind(&order.id)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }

            async fn orders<'a>(
                conn: &'a mut Self::Connection,
                sql: String,
                tenant: &'a str,
                ids: &'a [&'a str],
            ) -> Result<Vec<Order>, sqlx::Error> {
                let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(tenant);
                for id in ids {
                    query = query.bind(*id);
                }
                query.fetch_all(&mut *conn).await
            }

            async fn stock<'a>(
                conn: &'a mut Self::Connection,
                sku: &'a str,
            ) -> Result<Option<i64>, sqlx::Error> {
                sqlx::query_scalar("SELECT stock FROM inventory WHERE sku = $1")
                    .bind(sku)
                    .fetch_optional(&mut *conn)
                    .await
            }

            async fn credit<'a>(
                tx: &'a mut Transaction<'_, Self>,
                webhook_id: &'a str,
                tenant: &'a str,
                amount: i64,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(
                    "INSERT INTO balance_credits (webhook_id, tenant, amount) VALUES ($1, $2, $3)",
                )
                .bind(webhook_id)
                .bind(tenant)
                .bind(amount)
                .execute(&mut **tx)
                .await?;
                Ok(())
            }

            async fn balance<'a>(
                conn: &'a mut Self::Connection,
                tenant: &'a str,
            ) -> Result<Balance, sqlx::Error> {
                // PostgreSQL sums a bigint as numeric: cast back.
                let (balance, credits) = sqlx::query_as(
                    "SELECT CAST(COALESCE(SUM(amount), 0) AS BIGINT), COUNT(*) \
                     FROM balance_credits WHERE tenant = $1",
                )
                .bind(tenant)
                .fetch_one(&mut *conn)
                .await?;
                Ok(Balance { balance, credits })
            }
        }
    };
}

sql!(sqlx::Postgres);
sql!(sqlx::Sqlite);
