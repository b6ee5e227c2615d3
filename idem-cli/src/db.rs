//! The database the command looks into: PostgreSQL or SQLite, and the SQL that reads idem's
//! key table on each. Times come back as milliseconds (ages and time left), so that the rest
//! of the command is the same for both.

use std::{str::FromStr, time::Duration};

use serde::Serialize;
use sqlx::{
    PgPool, SqlitePool,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
};

/// An error to print.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A pool on either database.
pub enum Db {
    /// `postgres://...`
    Postgres(PgPool),
    /// `sqlite:<path>`
    Sqlite(SqlitePool),
}

/// The counts of `stats`.
#[derive(Debug, Serialize)]
pub struct Stats {
    /// Keys with a stored response.
    pub completed: i64,
    /// Claims in flight (external mode; a transactional claim is never visible outside its
    /// transaction).
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
}

// The same statements for both databases, but for how a time becomes milliseconds.
const PG_NOW: &str = "(EXTRACT(EPOCH FROM now()) * 1000)::bigint";

fn key_columns(now: &str, ms: fn(&str) -> String, body: bool) -> String {
    format!(
        "scope, key, status, method, path, CAST(response_status AS BIGINT) AS response_status, \
         {now} - {created} AS age_ms, {expires} - {now} AS expires_in_ms, \
         {now} - {locked} AS claimed_ms, {lease} - {now} AS lease_left_ms, \
         CAST(steps AS TEXT) AS steps, {body} AS response_body",
        created = ms("created_at"),
        expires = ms("expires_at"),
        locked = ms("locked_at"),
        lease = ms("lease_until"),
        body = if body { "response_body" } else { "NULL" },
    )
}

fn pg_ms(column: &str) -> String {
    format!("(EXTRACT(EPOCH FROM {column}) * 1000)::bigint")
}

fn sqlite_ms(column: &str) -> String {
    column.to_owned()
}

const SQLITE_NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

impl Db {
    /// Opens `url`: `sqlite:<path>` for SQLite (the file must exist), anything else for
    /// PostgreSQL. Checks that idem's key table is there.
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
        match self {
            Self::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
            Self::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
        }
    }

    fn now(&self) -> &'static str {
        match self {
            Self::Postgres(_) => PG_NOW,
            Self::Sqlite(_) => SQLITE_NOW,
        }
    }

    fn ms(&self) -> fn(&str) -> String {
        match self {
            Self::Postgres(_) => pg_ms,
            Self::Sqlite(_) => sqlite_ms,
        }
    }

    /// The counts of `stats`.
    ///
    /// # Errors
    ///
    /// When a statement fails.
    pub async fn stats(&self) -> Result<Stats, Error> {
        let (now, ms) = (self.now(), self.ms());
        let count =
            |status: &str| format!("SELECT COUNT(*) FROM idem_keys WHERE status = '{status}'");
        Ok(Stats {
            completed: self.scalar(&count("completed")).await?.unwrap_or(0),
            started: self.scalar(&count("started")).await?.unwrap_or(0),
            oldest_started_ms: self
                .scalar(&format!(
                    "SELECT MAX({now} - {}) FROM idem_keys WHERE status = 'started'",
                    ms("locked_at")
                ))
                .await?,
            expired: self
                .scalar(&format!(
                    "SELECT COUNT(*) FROM idem_keys WHERE {} <= {now}",
                    ms("expires_at")
                ))
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
        let sql = sqlx::AssertSqlSafe(format!(
            "SELECT {} FROM idem_keys WHERE scope = $1 AND key = $2",
            key_columns(self.now(), self.ms(), body)
        ));
        Ok(match self {
            Self::Postgres(pool) => {
                sqlx::query_as(sql)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(pool)
                    .await?
            }
            Self::Sqlite(pool) => {
                sqlx::query_as(sql)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(pool)
                    .await?
            }
        })
    }

    /// The claims in flight for longer than `older_than`, oldest first.
    ///
    /// # Errors
    ///
    /// When the statement fails.
    pub async fn in_flight(&self, older_than: Duration) -> Result<Vec<Key>, Error> {
        let (now, ms) = (self.now(), self.ms());
        let sql = sqlx::AssertSqlSafe(format!(
            "SELECT {} FROM idem_keys WHERE status = 'started' AND {now} - {} >= $1 \
             ORDER BY locked_at",
            key_columns(now, ms, false),
            ms("locked_at"),
        ));
        let older = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        Ok(match self {
            Self::Postgres(pool) => sqlx::query_as(sql).bind(older).fetch_all(pool).await?,
            Self::Sqlite(pool) => sqlx::query_as(sql).bind(older).fetch_all(pool).await?,
        })
    }

    /// Deletes the started claim `(scope, key)`; never a completed key.
    ///
    /// # Errors
    ///
    /// When a statement fails.
    pub async fn release(&self, scope: &str, key: &str) -> Result<Release, Error> {
        const DELETE: &str =
            "DELETE FROM idem_keys WHERE scope = $1 AND key = $2 AND status = 'started'";
        let deleted = match self {
            Self::Postgres(pool) => sqlx::query(DELETE)
                .bind(scope)
                .bind(key)
                .execute(pool)
                .await?
                .rows_affected(),
            Self::Sqlite(pool) => sqlx::query(DELETE)
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

    /// Deletes the expired rows with idem's own purge; returns how many.
    ///
    /// # Errors
    ///
    /// When the purge fails.
    pub async fn purge(&self) -> Result<u64, Error> {
        let options = idem_runtime::tasks::PurgeOptions::default();
        let report = match self {
            Self::Postgres(pool) => {
                idem_runtime::Store::new(pool.clone())
                    .purge_expired(options)
                    .await?
            }
            Self::Sqlite(pool) => {
                idem_runtime::Store::new(pool.clone())
                    .purge_expired(options)
                    .await?
            }
        };
        Ok(report.rows)
    }
}
