//! The database the command looks into: PostgreSQL, SQLite, or MySQL/MariaDB, and the SQL that
//! reads idem's key table on each (its differences are in `dialect`). Times come back as
//! milliseconds (ages and time left), so that the rest of the command is the same for all.

use std::{str::FromStr, time::Duration};

use serde::Serialize;

use crate::dialect::{self, Dialect};
use sqlx::{
    MySqlPool, PgPool, SqlitePool,
    mysql::MySqlPoolOptions,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
};

/// An error to print.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A pool on one of the databases.
pub enum Db {
    /// `postgres://...`
    Postgres(PgPool),
    /// `sqlite:<path>`
    Sqlite(SqlitePool),
    /// `mysql://...`: MySQL or MariaDB.
    MySql(MySqlPool),
}

/// The counts of `stats`.
#[derive(Debug, Serialize)]
pub struct Stats {
    /// Keys with a stored response.
    pub completed: i64,
    /// Claims in flight: `started` rows with a lease (external mode; a transactional claim is
    /// never visible outside its transaction).
    pub started: i64,
    /// The age of the oldest claim in flight, in milliseconds.
    pub oldest_started_ms: Option<i64>,
    /// Rows past their expiry that the purge has not deleted yet.
    pub expired: i64,
}

/// One key, as `inspect` and `in-flight` show it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Key {
    /// The scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// `started` or `completed`.
    pub status: String,
    /// The first request's method.
    pub method: String,
    /// The first request's path and query.
    pub path: String,
    /// The stored response's status.
    pub response_status: Option<i64>,
    /// Since the row was written, in milliseconds.
    pub age_ms: i64,
    /// Until it expires (negative: expired), in milliseconds.
    pub expires_in_ms: i64,
    /// Since the claim was taken, in milliseconds.
    pub claimed_ms: Option<i64>,
    /// Until the claim's lease ends (negative: ended), in milliseconds.
    pub lease_left_ms: Option<i64>,
    /// The recorded steps, as JSON.
    pub steps: Option<String>,
    /// The stored body, only when asked for.
    #[serde(skip)]
    pub response_body: Option<Vec<u8>>,
}

/// What `release` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    /// The started claim was deleted.
    Done,
    /// The key has a stored response: not released.
    Completed,
    /// No such key.
    Missing,
    /// MySQL: another transaction is writing the key's row this instant: not released.
    Busy,
}

/// Claims in flight: `started` rows with a lease (external mode). A transactional claim is
/// never one: on PostgreSQL and SQLite it has no row, on MySQL its row is uncommitted (nobody
/// else sees it), and the committed `started` row a handler that ran `COMMIT` itself leaves
/// behind has no lease and is already expired, so it counts as expired, and the purge takes it.
const IN_FLIGHT: &str = "status = 'started' AND lease_until IS NOT NULL";

/// Runs `$body` with `$pool` bound to the pool, whichever database it is on.
macro_rules! on_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            Db::Postgres($pool) => $body,
            Db::Sqlite($pool) => $body,
            Db::MySql($pool) => $body,
        }
    };
}

impl Db {
    /// Opens `url`: `sqlite:<path>` for SQLite (the file must exist), `mysql://...` for MySQL or
    /// MariaDB, anything else for PostgreSQL. Checks that idem's key table is there.
    ///
    /// # Errors
    ///
    /// When the URL does not parse, the database cannot be reached, or it has no key table.
    pub async fn open(url: &str) -> Result<Self, Error> {
        let db = if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| format!("{url} is not a SQLite URL: {e}"))?
                .create_if_missing(false)
                .busy_timeout(Duration::from_secs(30));
            Self::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(2)
                    .connect_with(options)
                    .await
                    .map_err(|e| format!("cannot open {url}: {e}"))?,
            )
        } else if url.starts_with("mysql:") {
            Self::MySql(
                MySqlPoolOptions::new()
                    .max_connections(2)
                    .connect(url)
                    .await
                    .map_err(|e| format!("cannot connect to the database: {e}"))?,
            )
        } else {
            Self::Postgres(
                PgPoolOptions::new()
                    .max_connections(2)
                    .connect(url)
                    .await
                    .map_err(|e| format!("cannot connect to the database: {e}"))?,
            )
        };
        if db
            .scalar("SELECT COUNT(*) FROM idem_keys WHERE 1 = 0")
            .await
            .is_err()
        {
            return Err(
                "the database has no idem_keys table: is this the service's database, \
                        and has the service run once (it creates the table)?"
                    .into(),
            );
        }
        Ok(db)
    }

    async fn scalar(&self, sql: &str) -> Result<Option<i64>, sqlx::Error> {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        on_pool!(self, pool => sqlx::query_scalar(sql).fetch_one(pool).await)
    }

    const fn dialect(&self) -> &'static Dialect {
        match self {
            Self::Postgres(_) => &dialect::POSTGRES,
            Self::Sqlite(_) => &dialect::SQLITE,
            Self::MySql(_) => &dialect::MYSQL,
        }
    }

    /// The counts of `stats`.
    ///
    /// # Errors
    ///
    /// When a statement fails.
    pub async fn stats(&self) -> Result<Stats, Error> {
        let Dialect { now, ms, .. } = *self.dialect();
        let count = |condition: &str| format!("SELECT COUNT(*) FROM idem_keys WHERE {condition}");
        Ok(Stats {
            completed: self
                .scalar(&count("status = 'completed'"))
                .await?
                .unwrap_or(0),
            started: self.scalar(&count(IN_FLIGHT)).await?.unwrap_or(0),
            oldest_started_ms: self
                .scalar(&format!(
                    "SELECT MAX({now} - {}) FROM idem_keys WHERE {IN_FLIGHT}",
                    ms("locked_at")
                ))
                .await?,
            expired: self
                .scalar(&count(&format!("{} <= {now}", ms("expires_at"))))
                .await?
                .unwrap_or(0),
        })
    }

    /// The key `(scope, key)`, its body only when `body`.
    ///
    /// # Errors
    ///
    /// When the statement fails.
    pub async fn inspect(&self, scope: &str, key: &str, body: bool) -> Result<Option<Key>, Error> {
        let dialect = self.dialect();
        let sql = sqlx::AssertSqlSafe(format!(
            "SELECT {} FROM idem_keys WHERE {}",
            dialect.key_columns(body),
            dialect.this_key(),
        ));
        Ok(on_pool!(self, pool => {
            sqlx::query_as(sql)
                .bind(scope)
                .bind(key)
                .fetch_optional(pool)
                .await?
        }))
    }

    /// The claims in flight for longer than `older_than`, oldest first.
    ///
    /// # Errors
    ///
    /// When the statement fails.
    pub async fn in_flight(&self, older_than: Duration) -> Result<Vec<Key>, Error> {
        let dialect = self.dialect();
        let sql = sqlx::AssertSqlSafe(format!(
            "SELECT {} FROM idem_keys WHERE {IN_FLIGHT} AND {} - {} >= {} ORDER BY locked_at",
            dialect.key_columns(false),
            dialect.now,
            (dialect.ms)("locked_at"),
            (dialect.param)(1),
        ));
        let older = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        Ok(on_pool!(self, pool => sqlx::query_as(sql).bind(older).fetch_all(pool).await?))
    }

    /// Deletes the started claim `(scope, key)`; never a completed key, nor a row another
    /// transaction holds.
    ///
    /// # Errors
    ///
    /// When a statement fails.
    pub async fn release(&self, scope: &str, key: &str) -> Result<Release, Error> {
        let delete = sqlx::AssertSqlSafe(format!(
            "DELETE FROM idem_keys WHERE {} AND status = 'started'",
            self.dialect().this_key()
        ));
        let deleted = match self {
            Self::MySql(pool) => return self.release_unlocked(pool, scope, key).await,
            Self::Postgres(pool) => sqlx::query(delete)
                .bind(scope)
                .bind(key)
                .execute(pool)
                .await?
                .rows_affected(),
            Self::Sqlite(pool) => sqlx::query(delete)
                .bind(scope)
                .bind(key)
                .execute(pool)
                .await?
                .rows_affected(),
        };
        if deleted == 1 {
            return Ok(Release::Done);
        }
        Ok(match self.inspect(scope, key, false).await? {
            Some(_) => Release::Completed,
            None => Release::Missing,
        })
    }

    /// MySQL: a key a transaction holds (a transactional claim's uncommitted row, or a row
    /// being completed or renewed) is skipped rather than waited for, so the command neither
    /// blocks on it nor deletes what a handler is writing.
    async fn release_unlocked(
        &self,
        pool: &MySqlPool,
        scope: &str,
        key: &str,
    ) -> Result<Release, Error> {
        let mut tx = pool.begin().await?;
        let status: Option<String> = sqlx::query_scalar(
            "SELECT status FROM idem_keys WHERE scope = ? AND `key` = ? FOR UPDATE SKIP LOCKED",
        )
        .bind(scope)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        let release = match status.as_deref() {
            Some("started") => {
                sqlx::query(
                    "DELETE FROM idem_keys WHERE scope = ? AND `key` = ? AND status = 'started'",
                )
                .bind(scope)
                .bind(key)
                .execute(&mut *tx)
                .await?;
                Release::Done
            }
            Some(_) => Release::Completed,
            // Not there, or held by a transaction: a plain read tells which (an uncommitted
            // claim is invisible to it, as on the other databases).
            None => Release::Missing,
        };
        tx.commit().await?;
        if release == Release::Missing && self.inspect(scope, key, false).await?.is_some() {
            return Ok(Release::Busy);
        }
        Ok(release)
    }

    /// Deletes the expired rows with idem's own purge; returns how many.
    ///
    /// # Errors
    ///
    /// When the purge fails.
    pub async fn purge(&self) -> Result<u64, Error> {
        let options = idem_runtime::tasks::PurgeOptions::default();
        let report = on_pool!(self, pool => {
            idem_runtime::Store::new(pool.clone())
                .purge_expired(options)
                .await?
        });
        Ok(report.rows)
    }
}
