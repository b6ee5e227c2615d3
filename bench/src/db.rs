//! A scratch database per run, dropped at the end.

use sqlx::{Connection, MySqlConnection, PgConnection, PgPool, postgres::PgPoolOptions};

/// The error type of the benchmarks.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A database created for this run.
pub struct Scratch {
    admin_url: String,
    name: String,
    /// Its URL.
    pub url: String,
    /// A pool on it.
    pub pool: PgPool,
}

impl Scratch {
    /// Creates `idem_bench_<pid>` on the server of `$DATABASE_URL` (default: the local server)
    /// with idem's, the example's and the peer's tables.
    pub async fn create(max_connections: u32) -> Result<Self, Error> {
        Self::named(max_connections, "main").await
    }

    /// As [`Scratch::create`], for a second database of the same run: `idem_bench_<pid>_<label>`.
    pub async fn named(max_connections: u32, label: &str) -> Result<Self, Error> {
        let admin_url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let name = format!("idem_bench_{}_{label}", std::process::id());
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .map_err(|e| format!("cannot connect to {admin_url}: {e} (set DATABASE_URL)"))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await?;
        let url = match admin_url.rsplit_once('/') {
            Some((server, _)) => format!("{server}/{name}"),
            None => return Err("DATABASE_URL has no database path".into()),
        };
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(&url)
            .await?;
        idem_examples::schema::create(&pool).await?;
        sqlx::raw_sql(crate::peer::TABLE).execute(&pool).await?;
        Ok(Self {
            admin_url,
            name,
            url,
            pool,
        })
    }

    /// Drops the database.
    pub async fn drop(self) -> Result<(), Error> {
        self.pool.close().await;
        let mut admin = PgConnection::connect(&self.admin_url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut admin)
        .await?;
        Ok(())
    }
}

/// A MySQL (MariaDB) database created for this run, dropped at the end.
pub struct MySqlScratch {
    server_url: String,
    name: String,
    /// Its URL.
    pub url: String,
}

impl MySqlScratch {
    /// Creates `idem_bench_<pid>` on the server of `$MYSQL_URL` (default: the local server,
    /// as root) with idem's, the example's and the peer's tables.
    pub async fn create() -> Result<Self, Error> {
        Self::with_name(format!("idem_bench_{}", std::process::id())).await
    }

    /// As [`MySqlScratch::create`], for a database of its own beside others of the same
    /// process (tests run at once): `idem_bench_<pid>_<label>`.
    pub async fn named(label: &str) -> Result<Self, Error> {
        Self::with_name(format!("idem_bench_{}_{label}", std::process::id())).await
    }

    async fn with_name(name: String) -> Result<Self, Error> {
        let server_url =
            std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_owned());
        let mut admin = MySqlConnection::connect(&server_url)
            .await
            .map_err(|e| format!("cannot connect to {server_url}: {e} (set MYSQL_URL)"))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name}; CREATE DATABASE {name}"
        )))
        .execute(&mut admin)
        .await?;
        let url = format!("{}/{name}", server_url.trim_end_matches('/'));
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await?;
        idem_examples::schema::create(&pool).await?;
        sqlx::raw_sql(crate::peer::MYSQL_TABLE)
            .execute(&pool)
            .await?;
        pool.close().await;
        Ok(Self {
            server_url,
            name,
            url,
        })
    }

    /// Drops the database.
    pub async fn drop(self) -> Result<(), Error> {
        let mut admin = MySqlConnection::connect(&self.server_url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {}",
            self.name
        )))
        .execute(&mut admin)
        .await?;
        Ok(())
    }
}
