//! What a test reads and moves in the database directly: row counts, key rows, locks, leases
//! and expiries, seeded keys, and one pass of the background tasks.

use idem_runtime::{
    Store,
    sqlx::{MySql, Postgres, Sqlite},
    tasks::{
        Purge, PurgeOptions, PurgeReport, Recovery, RecoveryHook, RecoveryOptions, RecoveryReport,
        TaskHandle,
    },
};

use crate::{AnyStore, App, Db};

/// `$body` with `$pool` bound to the app's pool, whatever its database: sqlx's executors are per
/// database type, the statement the same.
macro_rules! on_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            Db::Postgres($pool) => $body,
            Db::Sqlite($pool) => $body,
            Db::MySql($pool) => $body,
        }
    };
}

/// The statements of the probes, written for PostgreSQL and SQLite, as MySQL spells them: its
/// positional parameters, and its reserved word `key` quoted.
fn for_db(db: &Db, sql: &str) -> String {
    match db {
        Db::MySql(_) => {
            let (sql, _) = crate::positional(sql);
            sql.replace(" key ", " `key` ")
                .replace(" key,", " `key`,")
                .replace("(key,", "(`key`,")
        }
        _ => sql.to_owned(),
    }
}

impl App {
    /// Runs a statement that has no parameters.
    pub async fn execute(&self, sql: &'static str) {
        on_pool!(&self.db, pool => sqlx::raw_sql(sql).execute(pool).await.map(|_| ()))
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn scalar(&self, sql: String, bind: Option<&str>) -> i64 {
        let sql = sqlx::AssertSqlSafe(for_db(&self.db, &sql));
        on_pool!(&self.db, pool => {
            let query = sqlx::query_scalar::<_, i64>(sql);
            match bind {
                Some(value) => query.bind(value).fetch_one(pool).await,
                None => query.fetch_one(pool).await,
            }
        })
        .expect("a number")
    }

    /// Locks the database holds for keys right now: PostgreSQL's advisory locks in this test's
    /// database (other databases on the server are not counted); on SQLite, 1 while some
    /// connection holds the write lock (found by trying to take it without waiting), else 0; on
    /// MySQL, the row locks of this test's database's open transactions (the claims' rows).
    pub async fn db_locks(&self) -> i64 {
        match self.db {
            Db::MySql(_) => {
                self.scalar(
                    "SELECT CAST(COALESCE(SUM(t.trx_rows_locked), 0) AS SIGNED) \
                     FROM information_schema.innodb_trx t \
                     JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id \
                     WHERE p.db = DATABASE() AND p.id <> CONNECTION_ID()"
                        .into(),
                    None,
                )
                .await
            }
            Db::Postgres(_) => {
                self.scalar(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                        .into(),
                    None,
                )
                .await
            }
            Db::Sqlite(_) => {
                use sqlx::Connection;
                let dir = self.dir.as_ref().expect("a SQLite app has its directory");
                let options = sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(dir.path().join("test.db"))
                    .busy_timeout(std::time::Duration::ZERO);
                let mut conn = sqlx::SqliteConnection::connect_with(&options)
                    .await
                    .expect("open the SQLite file");
                let taken = sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK")
                    .execute(&mut conn)
                    .await;
                match taken {
                    Ok(_) => 0,
                    Err(sqlx::Error::Database(e)) if e.message().contains("locked") => 1,
                    Err(error) => panic!("probing SQLite's write lock: {error}"),
                }
            }
        }
    }

    /// Ends, as a database administrator or a failover would, every other connection to the
    /// app's database that is inside a transaction, and waits until the server has closed
    /// them; returns how many there were. PostgreSQL: `pg_terminate_backend`; MySQL: `KILL`.
    ///
    /// # Panics
    ///
    /// On SQLite, which has no server connection to end.
    pub async fn end_connections_in_transactions(&self) -> usize {
        match &self.db {
            Db::Postgres(pool) => {
                let pids: Vec<i32> = sqlx::query_scalar(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
                     AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()",
                )
                .fetch_all(pool)
                .await
                .expect("list the open transactions");
                for &pid in &pids {
                    sqlx::query("SELECT pg_terminate_backend($1)")
                        .bind(pid)
                        .execute(pool)
                        .await
                        .expect("terminate");
                }
                crate::wait_until("the ended connections to be gone", || async {
                    let left: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
                    )
                    .bind(&pids)
                    .fetch_one(pool)
                    .await
                    .expect("count the ended connections");
                    left == 0
                })
                .await;
                pids.len()
            }
            Db::MySql(pool) => {
                let ids: Vec<u64> = sqlx::query_scalar(
                    "SELECT t.trx_mysql_thread_id FROM information_schema.innodb_trx t \
                     JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id \
                     WHERE p.db = DATABASE() AND p.id <> CONNECTION_ID()",
                )
                .fetch_all(pool)
                .await
                .expect("list the open transactions");
                for id in &ids {
                    // KILL takes no parameter; the id is a number the server gave.
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
                        .execute(pool)
                        .await
                        .expect("kill");
                }
                crate::wait_until("the killed connections to be gone", || async {
                    let mut left = 0i64;
                    for &id in &ids {
                        let found: i64 = sqlx::query_scalar(
                            "SELECT count(*) FROM information_schema.processlist WHERE id = ?",
                        )
                        .bind(id)
                        .fetch_one(pool)
                        .await
                        .expect("look for a killed connection");
                        left += found;
                    }
                    left == 0
                })
                .await;
                ids.len()
            }
            Db::Sqlite(_) => panic!("SQLite has no server connection to end"),
        }
    }

    /// Rows in `table` (a fixed name from the tests).
    pub async fn count(&self, table: &str) -> i64 {
        self.scalar(format!("SELECT count(*) FROM {table}"), None)
            .await
    }

    /// Rows of the key table for `key`, in any scope.
    pub async fn keys_named(&self, key: &str) -> i64 {
        self.scalar(
            "SELECT count(*) FROM idem_keys WHERE key = $1".into(),
            Some(key),
        )
        .await
    }

    /// Live rows of the key table for `key` (not past their expiry), in any scope.
    pub async fn live_keys_named(&self, key: &str) -> i64 {
        let sql = match self.db {
            Db::Postgres(_) => {
                "SELECT count(*) FROM idem_keys WHERE key = $1 AND expires_at > now()"
            }
            Db::Sqlite(_) => {
                "SELECT count(*) FROM idem_keys WHERE key = $1 \
                 AND expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)"
            }
            Db::MySql(_) => {
                "SELECT count(*) FROM idem_keys WHERE key = $1 AND expires_at > UTC_TIMESTAMP(6)"
            }
        };
        self.scalar(sql.into(), Some(key)).await
    }

    /// Live rows of the key table (not past their expiry).
    pub async fn live_keys(&self) -> i64 {
        let sql = match self.db {
            Db::Postgres(_) => "SELECT count(*) FROM idem_keys WHERE expires_at > now()",
            Db::Sqlite(_) => {
                "SELECT count(*) FROM idem_keys \
                 WHERE expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)"
            }
            Db::MySql(_) => "SELECT count(*) FROM idem_keys WHERE expires_at > UTC_TIMESTAMP(6)",
        };
        self.scalar(sql.into(), None).await
    }

    /// Rows of the key table with `status`.
    pub async fn keys_with_status(&self, status: &str) -> i64 {
        self.scalar(
            "SELECT count(*) FROM idem_keys WHERE status = $1".into(),
            Some(status),
        )
        .await
    }

    /// The status of `key`'s row, if there is one.
    pub async fn key_status(&self, key: &str) -> Option<String> {
        let sql = sqlx::AssertSqlSafe(for_db(
            &self.db,
            "SELECT status FROM idem_keys WHERE key = $1",
        ));
        on_pool!(&self.db, pool => sqlx::query_scalar(sql).bind(key).fetch_optional(pool).await)
            .expect("read key")
    }

    /// Seconds between `key`'s creation and its expiry.
    pub async fn retention_secs(&self, key: &str) -> i64 {
        let sql = match self.db {
            Db::Postgres(_) => {
                "SELECT extract(epoch FROM expires_at - created_at)::int8 FROM idem_keys WHERE key = $1"
            }
            Db::Sqlite(_) => {
                "SELECT (expires_at - created_at) / 1000 FROM idem_keys WHERE key = $1"
            }
            Db::MySql(_) => {
                "SELECT TIMESTAMPDIFF(SECOND, created_at, expires_at) FROM idem_keys WHERE key = $1"
            }
        };
        self.scalar(sql.into(), Some(key)).await
    }

    /// The stored response status of `key`.
    pub async fn response_status(&self, key: &str) -> i64 {
        self.scalar(
            match self.db {
                Db::MySql(_) => {
                    "SELECT CAST(response_status AS SIGNED) FROM idem_keys WHERE key = $1"
                }
                _ => "SELECT CAST(response_status AS BIGINT) FROM idem_keys WHERE key = $1",
            }
            .into(),
            Some(key),
        )
        .await
    }

    /// Moves every key past its expiry, as time would.
    pub async fn expire_all_keys(&self) {
        match self.db {
            Db::Postgres(_) => {
                self.execute("UPDATE idem_keys SET expires_at = now() - interval '1 second'")
                    .await;
            }
            Db::Sqlite(_) => {
                self.execute(
                    "UPDATE idem_keys SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000",
                )
                .await;
            }
            Db::MySql(_) => {
                self.execute(
                    "UPDATE idem_keys SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND",
                )
                .await;
            }
        }
    }

    /// Ends the lease of `key`'s claim, as if its process had stalled.
    pub async fn lapse_lease(&self, key: &str) {
        let sql = match self.db {
            Db::Postgres(_) => {
                "UPDATE idem_keys SET lease_until = now() - interval '1 second' WHERE key = $1"
            }
            Db::Sqlite(_) => {
                "UPDATE idem_keys SET lease_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000 WHERE key = $1"
            }
            Db::MySql(_) => {
                "UPDATE idem_keys SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE key = $1"
            }
        };
        let sql = sqlx::AssertSqlSafe(for_db(&self.db, sql));
        on_pool!(&self.db, pool => sqlx::query(sql).bind(key).execute(pool).await.map(|_| ()))
            .expect("lapse lease");
    }

    /// Inserts `n` completed keys in `scope`, expiring `expires_in_secs` from now (negative:
    /// already expired).
    pub async fn seed_keys(&self, scope: &str, n: i64, expires_in_secs: i64) {
        match &self.db {
            Db::Postgres(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
                   response_status, response_headers, response_body, expires_at) \
                 SELECT $1, 'seed-' || $1 || '-' || g, 'POST', '/v1/payments', \
                   sha256(g::text::bytea), 'completed', 201, '[]'::jsonb, ''::bytea, \
                   now() + make_interval(secs => $3) \
                 FROM generate_series(1, $2) g",
            )
            .bind(scope)
            .bind(n)
            .bind(expires_in_secs as f64)
            .execute(pool)
            .await
            .map(|_| ()),
            Db::Sqlite(pool) => sqlx::query(
                "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < $2) \
                 INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
                   response_status, response_headers, response_body, created_at, expires_at) \
                 SELECT $1, 'seed-' || $1 || '-' || n, 'POST', '/v1/payments', randomblob(32), \
                   'completed', 201, '[]', x'', CAST(unixepoch('subsec') * 1000 AS INTEGER), \
                   CAST(unixepoch('subsec') * 1000 AS INTEGER) + $3 * 1000 \
                 FROM g",
            )
            .bind(scope)
            .bind(n)
            .bind(expires_in_secs)
            .execute(pool)
            .await
            .map(|_| ()),
            Db::MySql(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, \
                   response_status, response_headers, response_body, created_at, expires_at) \
                 SELECT ?, CONCAT('seed-', ?, '-', seq), 'POST', '/v1/payments', \
                   UNHEX(SHA2(seq, 256)), 'completed', 201, '[]', '', UTC_TIMESTAMP(6), \
                   UTC_TIMESTAMP(6) + INTERVAL ? SECOND \
                 FROM seq_1_to_1000000 WHERE seq <= ?",
            )
            .bind(scope)
            .bind(scope)
            .bind(expires_in_secs)
            .bind(n)
            .execute(pool)
            .await
            .map(|_| ()),
        }
        .expect("seed keys");
    }

    /// Writes a `started` claim of `POST path` taken a minute ago whose lease ran out 55 s ago,
    /// as a crash between the external call and the completion leaves it.
    pub async fn abandoned_claim(&self, scope: &str, key: &str, path: &str, fingerprint: &[u8]) {
        match &self.db {
            Db::Postgres(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, expires_at, \
                   locked_at, lease_until, claim_token) \
                 VALUES ($1, $2, 'POST', $4, $3, 'started', now() + interval '1 day', \
                   now() - interval '1 minute', now() - interval '55 seconds', 42)",
            )
            .bind(scope)
            .bind(key)
            .bind(fingerprint)
            .bind(path)
            .execute(pool)
            .await
            .map(|_| ()),
            Db::Sqlite(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, \
                   expires_at, locked_at, lease_until, claim_token) \
                 VALUES ($1, $2, 'POST', $5, $3, 'started', $4 - 60000, \
                   $4 + 86400000, $4 - 60000, $4 - 55000, 42)",
            )
            .bind(scope)
            .bind(key)
            .bind(fingerprint)
            .bind(now_ms())
            .bind(path)
            .execute(pool)
            .await
            .map(|_| ()),
            Db::MySql(pool) => sqlx::query(
                "INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, created_at, \
                   expires_at, locked_at, lease_until, claim_token) \
                 VALUES (?, ?, 'POST', ?, ?, 'started', UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE, \
                   UTC_TIMESTAMP(6) + INTERVAL 1 DAY, UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE, \
                   UTC_TIMESTAMP(6) - INTERVAL 55 SECOND, 42)",
            )
            .bind(scope)
            .bind(key)
            .bind(path)
            .bind(fingerprint)
            .execute(pool)
            .await
            .map(|_| ()),
        }
        .expect("insert claim");
    }

    /// Keeps `key`'s claim within its lease for another minute.
    pub async fn renew_lease(&self, key: &str) {
        let sql = match self.db {
            Db::Postgres(_) => {
                "UPDATE idem_keys SET lease_until = now() + interval '1 minute' WHERE key = $1"
            }
            Db::Sqlite(_) => {
                "UPDATE idem_keys SET lease_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) + 60000 WHERE key = $1"
            }
            Db::MySql(_) => {
                "UPDATE idem_keys SET lease_until = UTC_TIMESTAMP(6) + INTERVAL 1 MINUTE WHERE key = $1"
            }
        };
        let sql = sqlx::AssertSqlSafe(for_db(&self.db, sql));
        on_pool!(&self.db, pool => sqlx::query(sql).bind(key).execute(pool).await.map(|_| ()))
            .expect("renew lease");
    }

    /// The net units `POST /test/orders` moved out of stock (takes less give-backs).
    pub async fn units_taken(&self) -> i64 {
        let sql = match self.db {
            Db::MySql(_) => "SELECT CAST(COALESCE(-sum(units), 0) AS SIGNED) FROM test_stock_moves",
            _ => "SELECT CAST(COALESCE(-sum(units), 0) AS bigint) FROM test_stock_moves",
        };
        self.scalar(sql.into(), None).await
    }

    /// Everything the key table holds of its rows' requests and answers, as a reader of the
    /// table sees it: per row, its scope, key, method, path, stored headers and steps as text,
    /// and its stored body's bytes.
    pub async fn key_table_contents(&self) -> Vec<(String, Vec<u8>)> {
        let sql = match self.db {
            Db::Postgres(_) => {
                "SELECT concat_ws(' ', scope, key, method, path, response_headers::text, \
                 steps::text), coalesce(response_body, ''::bytea) FROM idem_keys"
            }
            Db::Sqlite(_) => {
                "SELECT scope || ' ' || key || ' ' || method || ' ' || path || ' ' || \
                 coalesce(response_headers, '') || ' ' || coalesce(steps, ''), \
                 coalesce(response_body, x'') FROM idem_keys"
            }
            Db::MySql(_) => {
                "SELECT CAST(CONCAT_WS(' ', scope, `key`, method, path, \
                 CAST(response_headers AS CHAR), CAST(steps AS CHAR)) AS CHAR), \
                 COALESCE(response_body, '') FROM idem_keys"
            }
        };
        let sql = sqlx::AssertSqlSafe(sql);
        on_pool!(&self.db, pool => sqlx::query_as(sql).fetch_all(pool).await)
            .expect("read the key table")
    }

    /// Copies the stored answer of key `from` onto the row of key `to`, as someone who can
    /// write the table might.
    pub async fn copy_answer(&self, from: &str, to: &str) {
        let sql = match self.db {
            Db::Postgres(_) => {
                "UPDATE idem_keys t SET response_body = s.response_body, \
                 response_headers = s.response_headers FROM idem_keys s \
                 WHERE s.key = $1 AND t.key = $2"
            }
            Db::Sqlite(_) => {
                "UPDATE idem_keys SET \
                 response_body = (SELECT response_body FROM idem_keys WHERE key = $1), \
                 response_headers = (SELECT response_headers FROM idem_keys WHERE key = $1) \
                 WHERE key = $2"
            }
            Db::MySql(_) => {
                "UPDATE idem_keys t JOIN idem_keys s ON s.`key` = ? \
                 SET t.response_body = s.response_body, t.response_headers = s.response_headers \
                 WHERE t.`key` = ?"
            }
        };
        let sql = sqlx::AssertSqlSafe(sql);
        let copied = on_pool!(&self.db, pool => sqlx::query(sql)
            .bind(from)
            .bind(to)
            .execute(pool)
            .await
            .map(|done| done.rows_affected()))
        .expect("copy the answer");
        assert_eq!(copied, 1, "{to} has a row to copy onto");
    }

    /// The names of the steps recorded on `key`, in order (none when it has no row).
    pub async fn recorded_steps(&self, key: &str) -> Vec<String> {
        let sql = match self.db {
            Db::Postgres(_) => "SELECT steps::text FROM idem_keys WHERE key = $1",
            Db::Sqlite(_) => "SELECT steps FROM idem_keys WHERE key = $1",
            Db::MySql(_) => "SELECT steps FROM idem_keys WHERE key = $1",
        };
        let sql = sqlx::AssertSqlSafe(for_db(&self.db, sql));
        let steps: Option<Option<String>> =
            on_pool!(&self.db, pool => sqlx::query_scalar(sql).bind(key).fetch_optional(pool).await)
                .expect("read the steps");
        let Some(Some(steps)) = steps else {
            return Vec::new();
        };
        let steps: Vec<serde_json::Value> = serde_json::from_str(&steps).expect("steps are JSON");
        steps
            .iter()
            .map(|step| step["step"].as_str().expect("a step name").to_owned())
            .collect()
    }

    /// Gives `key`'s claim to an owner no request has, as a takeover by another process would:
    /// the request that held it no longer owns it.
    pub async fn steal_claim(&self, key: &str) {
        let sql = for_db(
            &self.db,
            "UPDATE idem_keys SET claim_token = 0 WHERE key = $1",
        );
        let sql = sqlx::AssertSqlSafe(sql);
        on_pool!(&self.db, pool => sqlx::query(sql).bind(key).execute(pool).await.map(|_| ()))
            .expect("steal the claim");
    }

    /// Runs `during` while another transaction holds the row of `key` in `scope` locked (that
    /// row alone, by its primary key), as a retry taking an expired key over would
    /// (PostgreSQL and MySQL; SQLite locks the whole database).
    pub async fn while_row_held<T>(
        &self,
        scope: &str,
        key: &str,
        during: impl std::future::Future<Output = T>,
    ) -> T {
        let sql = for_db(
            &self.db,
            "SELECT 1 FROM idem_keys WHERE scope = $1 AND key = $2 FOR UPDATE",
        );
        let sql = sqlx::AssertSqlSafe(sql);
        assert!(
            !matches!(self.db, Db::Sqlite(_)),
            "SQLite locks the whole database, not a row"
        );
        on_pool!(&self.db, pool => {
            let mut tx = pool.begin().await.expect("begin");
            let query = sqlx::query(sql).bind(scope).bind(key);
            query.fetch_one(&mut *tx).await.expect("lock the row");
            let out = during.await;
            tx.rollback().await.expect("rollback");
            out
        })
    }

    /// One purge pass.
    pub async fn purge(&self, options: PurgeOptions) -> PurgeReport {
        on_pool!(&self.db, pool => Store::new(pool.clone()).purge_expired(options).await)
            .expect("purge")
    }

    /// One recovery pass.
    pub async fn recover<H: RecoveryHook<Postgres> + RecoveryHook<Sqlite> + RecoveryHook<MySql>>(
        &self,
        hook: &H,
    ) -> RecoveryReport {
        self.recover_with(hook, &RecoveryOptions::default()).await
    }

    /// One recovery pass with `options` (its limit and its rounds before a claim is parked),
    /// by this instance's store: with its settings (its encryption keys among them).
    pub async fn recover_with<
        H: RecoveryHook<Postgres> + RecoveryHook<Sqlite> + RecoveryHook<MySql>,
    >(
        &self,
        hook: &H,
        options: &RecoveryOptions,
    ) -> RecoveryReport {
        match self.store() {
            AnyStore::Postgres(store) => store.recover_abandoned(hook, options).await,
            AnyStore::Sqlite(store) => store.recover_abandoned(hook, options).await,
            AnyStore::MySql(store) => store.recover_abandoned(hook, options).await,
        }
        .expect("recover")
    }

    /// The background purge task, a pass every `every`.
    pub fn spawn_purge(
        &self,
        every: std::time::Duration,
        stop: idem_runtime::CancellationToken,
    ) -> TaskHandle {
        let options = PurgeOptions::default().with_interval(every);
        on_pool!(&self.db, pool => Purge::new(Store::new(pool.clone()), options).spawn(stop))
    }

    /// The background recovery task with `hook`, a pass every `every`.
    pub fn spawn_recovery<
        H: RecoveryHook<Postgres> + RecoveryHook<Sqlite> + RecoveryHook<MySql>,
    >(
        &self,
        hook: H,
        every: std::time::Duration,
        stop: idem_runtime::CancellationToken,
    ) -> TaskHandle {
        let options = RecoveryOptions::default().with_interval(every);
        on_pool!(&self.db, pool => Recovery::new(Store::new(pool.clone()), hook, options).spawn(stop))
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
