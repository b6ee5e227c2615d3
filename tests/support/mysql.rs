//! A database of its own on the MySQL (MariaDB) server for each test, dropped after it, and the
//! spelling of the tests' statements there.

use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::{Connection, MySqlConnection, mysql::MySqlConnectOptions};

/// The server the MySQL tests run on: `MYSQL_URL`, or the local server's root account.
pub fn server_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_owned())
}

/// A database created for one test ([`MySqlDb::drop_named`] drops it).
#[derive(Debug)]
pub struct MySqlDb {
    name: String,
    /// The server's URL, as given to [`MySqlDb::create_on`].
    server: String,
    options: MySqlConnectOptions,
}

impl MySqlDb {
    /// Creates a fresh database on the server at `$MYSQL_URL` (default: the local server, as
    /// root).
    ///
    /// # Panics
    ///
    /// When the server cannot be reached or refuses: the message says which server and how to
    /// point the tests at another.
    pub async fn create() -> Self {
        Self::create_on(&server_url()).await
    }

    /// Creates a fresh database on the server at `url` (`mysql://user@host:port`): on a Galera
    /// cluster, at one node, from which it reaches the others.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached or refuses.
    pub async fn create_on(url: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "idem_test_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let server: MySqlConnectOptions = url
            .parse()
            .unwrap_or_else(|e| panic!("MYSQL_URL {url:?} is not a MySQL URL: {e}"));
        let mut conn = MySqlConnection::connect_with(&server)
            .await
            .unwrap_or_else(|e| {
                panic!("connect to MySQL at {url} (set MYSQL_URL to use another server): {e}")
            });
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name}; CREATE DATABASE {name} CHARACTER SET utf8mb4"
        )))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("create the test database {name}: {e}"));
        let _ = conn.close().await;
        Self {
            options: server.clone().database(&name),
            server: url.to_owned(),
            name,
        }
    }

    /// How to connect to the test's database.
    pub fn options(&self) -> &MySqlConnectOptions {
        &self.options
    }

    /// The test's database as a URL (`mysql://user@host:port/<name>`), for a process of its own
    /// (`DATABASE_URL`): the server's URL with the database's name as its path.
    pub fn url(&self) -> String {
        let (server, query) = match self.server.split_once('?') {
            Some((server, query)) => (server, format!("?{query}")),
            None => (self.server.as_str(), String::new()),
        };
        format!("{}/{}{query}", server.trim_end_matches('/'), self.name)
    }
}

impl MySqlDb {
    /// The database's name, for [`MySqlDb::drop_named`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Drops the test database `name` (from [`MySqlDb::name`]), once the test's pools are gone:
    /// awaited on the test's runtime, which closes their connections meanwhile (a blocking
    /// `Drop` would stall them, and the `DROP` would wait for them). A test that fails leaves
    /// its database behind; `scripts/test` drops what earlier runs left.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub async fn drop_named(name: &str) {
        Self::drop_named_on(&server_url(), name).await;
    }

    /// [`MySqlDb::drop_named`] on the server at `url`.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub async fn drop_named_on(url: &str, name: &str) {
        let server: MySqlConnectOptions = url.parse().expect("MYSQL_URL is a MySQL URL");
        let mut conn = MySqlConnection::connect_with(&server)
            .await
            .unwrap_or_else(|e| panic!("connect to MySQL at {url}: {e}"));
        // A connection of the test still open in a transaction makes the DROP wait for its
        // metadata lock: bounded, and then left to the next run, as a failed test's database.
        let dropped = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET SESSION lock_wait_timeout = 30; DROP DATABASE IF EXISTS {name}"
        )))
        .execute(&mut conn)
        .await;
        if let Err(error) = dropped {
            eprintln!("the test database {name} was not dropped ({error}); the next run drops it");
        }
        let _ = conn.close().await;
    }
}
