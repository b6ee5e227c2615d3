//! The example's SQL on MySQL and MariaDB: the statements of the other databases with `?`
//! parameters, `ON DUPLICATE KEY UPDATE` for `ON CONFLICT`, and the identifiers that the
//! tables keep as `VARBINARY` (so that they compare byte for byte) read back as UTF-8 text.

use sqlx::{MySql, MySqlConnection, Row, Transaction, mysql::MySqlRow};

use super::{Sql, spelling::in_order};
use crate::{
    balance::Balance,
    orders::{Order, STOCK_PER_SKU},
    payments::Transfer,
    refunds::Refund,
};

/// The text of `column`, stored as bytes (`VARBINARY`).
fn text(row: &MySqlRow, column: &str) -> Result<String, sqlx::Error> {
    let bytes: Vec<u8> = row.try_get(column)?;
    String::from_utf8(bytes).map_err(|e| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: Box::new(e),
    })
}

impl Sql for MySql {
    async fn insert_transfer<'a>(
        tx: &'a mut Transaction<'_, Self>,
        sql: &'static str,
        transfer: &'a Transfer,
        tenant: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(sqlx::AssertSqlSafe(in_order(sql)))
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
        sqlx::query(sqlx::AssertSqlSafe(in_order(sql)))
            .bind(status)
            .bind(id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn transfers<'a>(
        conn: &'a mut MySqlConnection,
        sql: String,
        tenant: &'a str,
        ids: &'a [&'a str],
    ) -> Result<Vec<Transfer>, sqlx::Error> {
        let mut query = sqlx::query(sqlx::AssertSqlSafe(in_order(&sql))).bind(tenant);
        for id in ids {
            query = query.bind(*id);
        }
        let rows = query.fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|row| {
                Ok(Transfer {
                    id: text(row, "id")?,
                    amount: row.try_get("amount")?,
                    currency: row.try_get("currency")?,
                    customer: row.try_get("customer")?,
                    status: row.try_get("status")?,
                })
            })
            .collect()
    }

    async fn payment_customer<'a>(
        conn: &'a mut MySqlConnection,
        tenant: &'a str,
        payment: &'a str,
    ) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT customer FROM payments WHERE tenant = ? AND id = ?")
            .bind(tenant)
            .bind(payment)
            .fetch_optional(&mut *conn)
            .await
    }

    async fn insert_refund<'a>(
        conn: &'a mut MySqlConnection,
        refund: &'a Refund,
        tenant: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO refunds (id, tenant, payment, amount, status) \
             VALUES (?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE id = id",
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
        conn: &'a mut MySqlConnection,
        sql: String,
        tenant: &'a str,
        ids: &'a [&'a str],
    ) -> Result<Vec<Refund>, sqlx::Error> {
        let mut query = sqlx::query(sqlx::AssertSqlSafe(in_order(&sql))).bind(tenant);
        for id in ids {
            query = query.bind(*id);
        }
        let rows = query.fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|row| {
                Ok(Refund {
                    id: text(row, "id")?,
                    payment: row.try_get("payment")?,
                    amount: row.try_get("amount")?,
                    status: row.try_get("status")?,
                })
            })
            .collect()
    }

    async fn reserve<'a>(
        conn: &'a mut MySqlConnection,
        sku: &'a str,
        quantity: i64,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query(
            "INSERT INTO inventory (sku, stock) VALUES (?, ?) ON DUPLICATE KEY UPDATE sku = sku",
        )
        .bind(sku)
        .bind(STOCK_PER_SKU)
        .execute(&mut *conn)
        .await?;
        let taken =
            sqlx::query("UPDATE inventory SET stock = stock - ? WHERE sku = ? AND stock >= ?")
                .bind(quantity)
                .bind(sku)
                .bind(quantity)
                .execute(&mut *conn)
                .await?;
        Ok(taken.rows_affected() == 1)
    }

    async fn give_back<'a>(
        conn: &'a mut MySqlConnection,
        sku: &'a str,
        quantity: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE inventory SET stock = stock + ? WHERE sku = ?")
            .bind(quantity)
            .bind(sku)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn insert_order<'a>(
        conn: &'a mut MySqlConnection,
        order: &'a Order,
        tenant: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO orders (id, tenant, sku, quantity, customer, amount, charge, status) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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
        sqlx::query("INSERT INTO shipments (order_id) VALUES (?)")
            .bind(&order.id)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn orders<'a>(
        conn: &'a mut MySqlConnection,
        sql: String,
        tenant: &'a str,
        ids: &'a [&'a str],
    ) -> Result<Vec<Order>, sqlx::Error> {
        let mut query = sqlx::query(sqlx::AssertSqlSafe(in_order(&sql))).bind(tenant);
        for id in ids {
            query = query.bind(*id);
        }
        let rows = query.fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|row| {
                Ok(Order {
                    id: text(row, "id")?,
                    sku: text(row, "sku")?,
                    quantity: row.try_get("quantity")?,
                    customer: row.try_get("customer")?,
                    amount: row.try_get("amount")?,
                    charge: row.try_get("charge")?,
                    status: row.try_get("status")?,
                })
            })
            .collect()
    }

    async fn stock<'a>(
        conn: &'a mut MySqlConnection,
        sku: &'a str,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar("SELECT stock FROM inventory WHERE sku = ?")
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
        sqlx::query("INSERT INTO balance_credits (webhook_id, tenant, amount) VALUES (?, ?, ?)")
            .bind(webhook_id)
            .bind(tenant)
            .bind(amount)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn balance<'a>(
        conn: &'a mut MySqlConnection,
        tenant: &'a str,
    ) -> Result<Balance, sqlx::Error> {
        // MySQL sums a BIGINT as DECIMAL: cast back.
        let (balance, credits) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(amount), 0) AS SIGNED), COUNT(*) \
             FROM balance_credits WHERE tenant = ?",
        )
        .bind(tenant)
        .fetch_one(&mut *conn)
        .await?;
        Ok(Balance { balance, credits })
    }
}
