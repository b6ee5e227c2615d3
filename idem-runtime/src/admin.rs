//! What an operator reads and does in the key table, for a command or an admin endpoint:
//! counts ([`Store::stats`]), one key ([`Store::inspect`]), the claims in flight
//! ([`Store::in_flight`]), releasing a stuck claim ([`Store::release_claim`]), and the claims
//! the recovery gave up on ([`Store::parked`], [`Store::resume_parked`],
//! [`Store::abandon_parked`]); erasing a scope's answers ([`Store::forget`]); sealing every
//! stored answer again with the sealing key ([`Store::rekey`]); the purge is
//! [`Store::purge_expired`]. `AnyStore` (with a database feature on) is a store on whichever database a URL names, for a
//! tool that serves them all (the `idem` command).
//!
//! A sealed answer ([`EncryptionKeys`](crate::seal::EncryptionKeys)) says which key sealed it
//! ([`KeyInfo::sealed_with`]); [`Store::inspect`] opens it, with its body, with the store's
//! keys, or says why it cannot ([`KeyInfo::unopened`]).
//!
//! Times are reported as milliseconds (ages, time left), computed by the database from its own
//! clock, so that a report is the same on every database and needs no clock of the caller's.

use std::time::Duration;

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use crate::tasks::{PurgeOptions, PurgeReport};
use crate::{backend::Backend, store::Store};

#[cfg(feature = "grpc")]
pub use crate::report::GrpcAnswer;
pub use crate::report::{Forgotten, KeyInfo, ParkedClaim, Rekeyed, Released, Stats, Unparked};

impl<DB: Backend> Store<DB> {
    /// The counts of the key table: completed keys, claims in flight and the oldest one's age,
    /// expired rows not purged yet.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::error::Error::Database) when a statement fails (a database without
    /// the key table: [`Error::is_missing_key_table`](crate::error::Error::is_missing_key_table)).
    pub async fn stats(&self) -> Result<Stats, crate::error::Error> {
        DB::stats(self.pool()).await
    }

    /// The key `key` of `scope`; its stored headers and body only when `with_body`.
    ///
    /// A sealed answer ([`KeyInfo::sealed_with`]) read with its body is opened with this
    /// store's keys ([`StoreOptions::with_encryption_keys`](crate::StoreOptions::with_encryption_keys)):
    /// its headers and body are then the ones the handler answered. One that does not open (no
    /// keys, not the key it names, or altered) has neither, and [`KeyInfo::unopened`] says why,
    /// naming the key id it needs. Sealed step outputs ([`KeyInfo::steps`]) read with the body
    /// are opened alike; ones that do not open are left as stored, and said in `unopened`.
    ///
    /// # Errors
    ///
    /// As [`stats`](Store::stats).
    pub async fn inspect(
        &self,
        scope: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<KeyInfo>, crate::error::Error> {
        let found = DB::inspect(self.pool(), scope, key, with_body).await?;
        Ok(found.map(|info| self.opened_info(info, with_body)))
    }

    /// `info`, its sealed answer and sealed step outputs opened when it was read with its body.
    fn opened_info(&self, mut info: KeyInfo, with_body: bool) -> KeyInfo {
        if !with_body {
            return info;
        }
        let key = crate::record::KeyRef::new(info.scope.clone(), info.key.clone());
        let keys = self.options().encryption_keys();
        let recorded = info
            .steps
            .as_deref()
            .and_then(|text| serde_json::from_str::<Vec<crate::record::RecordedStep>>(text).ok());
        if let Some(steps) = recorded {
            match crate::seal::open_steps(keys, steps, &key) {
                Ok(opened) => info.steps = serde_json::to_string(&opened).ok(),
                Err(unopened) => info.unopened = Some(unopened),
            }
        }
        let (Some(_), Some(status), Some(headers), Some(body)) = (
            &info.sealed_with,
            info.response_status,
            &info.response_headers,
            &info.response_body,
        ) else {
            return info;
        };
        // A status out of range is not idem's: it opens with none, and says so as altered.
        let stored = crate::record::StoredResponse {
            status: u16::try_from(status).unwrap_or(0),
            headers: headers.clone(),
            body: body.clone(),
        };
        match crate::seal::open_response(keys, stored, &key) {
            Ok(opened) => {
                info.response_headers = Some(opened.headers);
                info.response_body = Some(opened.body);
            }
            Err(unopened) => {
                info.response_headers = None;
                info.response_body = None;
                info.unopened = Some(unopened);
            }
        }
        info
    }

    /// The claims in flight (external mode) taken at least `older_than` ago, oldest first.
    ///
    /// # Errors
    ///
    /// As [`stats`](Store::stats).
    pub async fn in_flight(
        &self,
        older_than: Duration,
    ) -> Result<Vec<KeyInfo>, crate::error::Error> {
        DB::in_flight(self.pool(), older_than).await
    }

    /// Deletes the claim in flight of `key` in `scope`, so that the next retry runs the handler
    /// again; never a completed key, a parked claim, nor a row another transaction is writing.
    ///
    /// # Errors
    ///
    /// As [`stats`](Store::stats).
    pub async fn release_claim(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Released, crate::error::Error> {
        DB::release_claim(self.pool(), scope, key).await
    }

    /// The claims the recovery gave up on, oldest parking first.
    ///
    /// # Errors
    ///
    /// As [`stats`](Store::stats).
    pub async fn parked(&self) -> Result<Vec<ParkedClaim>, crate::error::Error> {
        DB::parked(self.pool()).await
    }

    /// Hands the parked claim of `key` in `scope` back to the recovery, its count of rounds
    /// reset: the next pass gives it to the hook again (whose lease ends now; a claim parked
    /// past its key's retention is kept at least an hour more). Retries are still refused
    /// (`claimparked`) until the hook settles it. Refuses a key that is not parked.
    ///
    /// # Errors
    ///
    /// As [`stats`](Store::stats).
    pub async fn resume_parked(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Unparked, crate::error::Error> {
        DB::unpark(self.pool(), scope, key, true).await
    }

    /// Deletes the parked claim of `key` in `scope`, and its recorded steps: the next retry
    /// runs the handler from the start. For a claim whose side effect a person has checked
    /// (it did not happen, or was undone). Refuses a key that is not parked.
    ///
    /// # Errors
    ///
    /// As [`stats`](Store::stats).
    pub async fn abandon_parked(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Unparked, crate::error::Error> {
        DB::unpark(self.pool(), scope, key, false).await
    }

    /// Deletes every completed key of `scope`, expired or not: the erasure of a customer's
    /// stored answers (when the customer is deleted). A retry of a forgotten key runs the
    /// handler again, as a first request would.
    ///
    /// Claims of the scope are left, and counted in the report ([`Forgotten`]): a claim in
    /// flight is work under way (deleting it would let a retry run its side effect a second
    /// time), and a parked one is a person's to settle ([`resume_parked`](Store::resume_parked),
    /// [`abandon_parked`](Store::abandon_parked)). Once they complete, a second `forget`
    /// erases them.
    ///
    /// The keys are deleted in statements of at most 1,000 rows, each its own transaction,
    /// until none is left: a scope of millions never holds one long transaction. Keys
    /// completed while it runs may be deleted or left.
    ///
    /// # Errors
    ///
    /// As [`stats`](Store::stats). The batches deleted before a failure stay deleted: run it
    /// again to finish.
    pub async fn forget(&self, scope: &str) -> Result<Forgotten, crate::error::Error> {
        DB::forget(self.pool(), scope, FORGET_BATCH).await
    }
}

/// The most completed keys one statement of [`Store::forget`] deletes.
const FORGET_BATCH: u32 = 1_000;

/// A [`Store`] on whichever database a URL names: for a tool that serves every database idem
/// supports (the `idem` command), where the database is known only when it runs. A service
/// knows its database and uses `Store<DB>`.
///
/// One variant per database whose feature is on; a match on it names each (a database added
/// to idem is a new variant, and a new release).
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
#[derive(Debug, Clone)]
pub enum AnyStore {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(Store<sqlx::Postgres>),
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(Store<sqlx::Sqlite>),
    /// MySQL or MariaDB.
    #[cfg(feature = "mysql")]
    MySql(Store<sqlx::MySql>),
}

/// `$body` with `$store` bound to the store, whatever its database.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
macro_rules! on_store {
    ($any:expr, $store:ident => $body:expr) => {
        match $any {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres($store) => $body,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite($store) => $body,
            #[cfg(feature = "mysql")]
            AnyStore::MySql($store) => $body,
        }
    };
}

/// `AnyStore`'s operator methods, each the [`Store`] method of the same name on whichever
/// database it is.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
macro_rules! delegate_to_store {
    ($(fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {$(
        #[doc = concat!("As [`Store::", stringify!($name), "`].")]
        ///
        /// # Errors
        ///
        #[doc = concat!("As [`Store::", stringify!($name), "`].")]
        pub async fn $name(&self, $($arg: $ty),*) -> Result<$ret, crate::error::Error> {
            on_store!(self, store => store.$name($($arg),*).await)
        }
    )*};
}

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
impl AnyStore {
    /// The same store, opening sealed answers with `keys`
    /// ([`StoreOptions::with_encryption_keys`](crate::StoreOptions::with_encryption_keys)): what
    /// [`inspect`](Self::inspect) reads with the body is opened with them.
    #[must_use]
    pub fn with_encryption_keys(self, keys: crate::seal::EncryptionKeys) -> Self {
        fn keyed<DB: Backend>(store: Store<DB>, keys: crate::seal::EncryptionKeys) -> Store<DB> {
            let options = store.options().clone().with_encryption_keys(keys);
            store.with_options(options)
        }
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => Self::Postgres(keyed(store, keys)),
            #[cfg(feature = "sqlite")]
            Self::Sqlite(store) => Self::Sqlite(keyed(store, keys)),
            #[cfg(feature = "mysql")]
            Self::MySql(store) => Self::MySql(keyed(store, keys)),
        }
    }

    /// Connects to `url` with a pool of at most `max_connections`: `sqlite:<path>` (an existing
    /// file), `mysql://…` (MySQL or MariaDB), `postgres://…` or `postgresql://…`; and checks
    /// that idem's key table is there.
    ///
    /// # Errors
    ///
    /// [`Error::Setup`](crate::error::Error::Setup) when the URL names a database whose feature is
    /// off or none at all, or the database has no key table (it names
    /// [`migrate`](crate::backend::migrate)); [`Error::Database`](crate::error::Error::Database) when the URL
    /// does not parse or the database cannot be reached.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, crate::error::Error> {
        let scheme = url.split(':').next().unwrap_or_default();
        let store = match scheme {
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                use std::str::FromStr as _;
                let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)?
                    .create_if_missing(false)
                    .busy_timeout(Duration::from_secs(30));
                let pool = sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(max_connections)
                    .connect_with(options)
                    .await?;
                Self::Sqlite(Store::new(pool))
            }
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => Self::MySql(Store::new(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(max_connections)
                    .connect(url)
                    .await?,
            )),
            #[cfg(feature = "postgres")]
            // Without `extra_float_digits`, which a stock PgBouncer refuses.
            "postgres" | "postgresql" => Self::Postgres(Store::new(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(max_connections)
                    .connect_with(crate::pooler::connect_options(url)?)
                    .await?,
            )),
            other => {
                return Err(crate::error::Error::Setup {
                    reason: format!(
                        "the URL's scheme `{other}` names no database this build of idem \
                         supports ({})",
                        supported_schemes()
                    ),
                });
            }
        };
        // A statement that reads no row: a check that costs nothing on a table of any size.
        let probe = "SELECT 1 FROM idem_keys WHERE 1 = 0";
        let probed: Result<(), crate::error::Error> = on_store!(&store, store => {
            sqlx::query(probe).fetch_optional(store.pool()).await.map(|_| ()).map_err(Into::into)
        });
        match probed {
            Err(error) if error.is_missing_key_table() => Err(crate::error::Error::Setup {
                reason: "the database has no idem_keys table: is it the service's database, \
                         and has the service run `idem_runtime::migrate` on it?"
                    .to_owned(),
            }),
            Err(error) => Err(error),
            Ok(_) => Ok(store),
        }
    }

    delegate_to_store! {
        fn stats() -> Stats;
        fn inspect(scope: &str, key: &str, with_body: bool) -> Option<KeyInfo>;
        fn in_flight(older_than: Duration) -> Vec<KeyInfo>;
        fn release_claim(scope: &str, key: &str) -> Released;
        fn parked() -> Vec<ParkedClaim>;
        fn resume_parked(scope: &str, key: &str) -> Unparked;
        fn abandon_parked(scope: &str, key: &str) -> Unparked;
        fn forget(scope: &str) -> Forgotten;
        fn rekey(dry_run: bool) -> Rekeyed;
        fn purge_expired(options: PurgeOptions) -> PurgeReport;
    }
}

/// The URL schemes of the databases whose features are on.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
fn supported_schemes() -> String {
    let schemes = [
        (cfg!(feature = "postgres"), "postgres://"),
        (cfg!(feature = "mysql"), "mysql://"),
        (cfg!(feature = "sqlite"), "sqlite:"),
    ];
    let on: Vec<&str> = schemes
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, s)| *s)
        .collect();
    on.join(", ")
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use crate::{
        Store, StoreOptions,
        record::{KeyRef, StoredResponse},
        seal::{EncryptionKeys, Unopened},
    };

    /// 0, 1, …, 31 under the id `a`.
    const KEY_A: &str = "a:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    /// 32, 33, …, 63 under the id `b`.
    const KEY_B: &str = "b:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";

    /// A key table in memory, empty.
    pub(super) async fn migrated_memory() -> sqlx::SqlitePool {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .expect("an in-memory database");
        crate::migrate(&pool).await.expect("migrate");
        pool
    }

    /// A key table in memory holding the key `k1` of `t1`, its answer sealed with `KEY_A` as a
    /// store with that key seals it.
    async fn sealed_row() -> (sqlx::SqlitePool, StoredResponse) {
        let pool = migrated_memory().await;
        let answer = StoredResponse {
            status: 201,
            headers: vec![("content-type".to_owned(), "application/json".to_owned())],
            body: br#"{"customer":"cus_secret"}"#.to_vec(),
        };
        let keys = EncryptionKeys::parse(KEY_A).expect("a key");
        let sealed = keys.seal_response(&answer, &KeyRef::new("t1".into(), "k1".into()));
        sqlx::query(
            "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
             response_status, response_headers, response_body, created_at, expires_at) \
             VALUES ('t1', 'k1', 'POST', '/v1/payments', x'00', 'completed', $1, $2, $3, \
             unixepoch() * 1000, unixepoch() * 1000 + 86400000)",
        )
        .bind(i64::from(sealed.status))
        .bind(serde_json::to_string(&sealed.headers).expect("headers"))
        .bind(sealed.body)
        .execute(&pool)
        .await
        .expect("the sealed row");
        (pool, answer)
    }

    fn with_keys(pool: &sqlx::SqlitePool, keys: &str) -> Store<sqlx::Sqlite> {
        Store::new(pool.clone()).with_options(
            StoreOptions::default()
                .with_encryption_keys(EncryptionKeys::parse(keys).expect("keys")),
        )
    }

    #[tokio::test]
    async fn inspect_opens_a_sealed_answer_with_the_key_it_names_among_the_stores_keys() {
        let (pool, answer) = sealed_row().await;
        // The key that sealed it opens it, second of two (rotated).
        let store = with_keys(&pool, &format!("{KEY_B},{KEY_A}"));
        let info = store.inspect("t1", "k1", true).await.unwrap().unwrap();
        assert_eq!(info.sealed_with.as_deref(), Some("a"));
        assert_eq!(info.response_status, Some(201));
        assert_eq!(info.response_headers, Some(answer.headers));
        assert_eq!(info.response_body, Some(answer.body));
        assert_eq!(info.unopened, None);
    }

    #[tokio::test]
    async fn inspect_without_the_key_a_sealed_answer_names_says_which_it_needs_and_shows_no_bytes()
    {
        let (pool, _) = sealed_row().await;
        for store in [Store::new(pool.clone()), with_keys(&pool, KEY_B)] {
            let info = store.inspect("t1", "k1", true).await.unwrap().unwrap();
            assert_eq!(info.sealed_with.as_deref(), Some("a"));
            let unopened = info.unopened.expect("not opened");
            assert!(
                matches!(&unopened, Unopened::KeyNotConfigured { id, .. } if id == "a"),
                "{unopened:?}"
            );
            assert_eq!((info.response_headers, info.response_body), (None, None));
        }
        // Without the body nothing is opened, and nothing is said to fail; the key id is known.
        let info = Store::new(pool.clone())
            .inspect("t1", "k1", false)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.sealed_with.as_deref(), Some("a"));
        assert_eq!(
            (info.response_headers, info.response_body, info.unopened),
            (None, None, None)
        );
    }

    #[tokio::test]
    async fn inspect_of_a_sealed_answer_moved_to_another_key_says_it_does_not_open() {
        let (pool, _) = sealed_row().await;
        sqlx::query("UPDATE idem_keys SET key = 'k2'")
            .execute(&pool)
            .await
            .expect("move the row");
        let info = with_keys(&pool, KEY_A)
            .inspect("t1", "k2", true)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.unopened, Some(Unopened::Altered { id: "a".into() }));
        assert_eq!(info.response_body, None);
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod forget_tests {
    /// The backend's `forget` with a batch of `batch` rows.
    async fn forget<DB: crate::Backend>(
        pool: &sqlx::Pool<DB>,
        scope: &str,
        batch: u32,
    ) -> crate::admin::Forgotten {
        DB::forget(pool, scope, batch).await.expect("forget")
    }

    /// `forget` in batches smaller than the scope: it loops until the scope's completed keys
    /// are all gone, and leaves its claims and the other scopes.
    #[tokio::test]
    async fn forget_deletes_in_batches_until_none_is_left() {
        let pool = super::tests::migrated_memory().await;
        sqlx::raw_sql(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 7) \
             INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, \
               expires_at, lease_until, parked_at) \
             SELECT 't1', 'k' || i, 'POST', '/', x'00', 'completed', 0, 0, NULL, NULL FROM n \
             UNION ALL SELECT 't2', 'k1', 'POST', '/', x'00', 'completed', 0, 0, NULL, NULL \
             UNION ALL SELECT 't1', 'flying', 'POST', '/', x'00', 'started', 0, 0, 1, NULL \
             UNION ALL SELECT 't1', 'parked', 'POST', '/', x'00', 'started', 0, 0, NULL, 1",
        )
        .execute(&pool)
        .await
        .expect("rows");
        let forgotten = forget(&pool, "t1", 3).await;
        assert_eq!(
            (
                forgotten.deleted,
                forgotten.in_flight_left,
                forgotten.parked_left
            ),
            (7, 1, 1)
        );
        let left: Vec<(String, String)> =
            sqlx::query_as("SELECT scope, key FROM idem_keys ORDER BY scope, key")
                .fetch_all(&pool)
                .await
                .expect("rows left");
        let left: Vec<(&str, &str)> = left.iter().map(|(s, k)| (&**s, &**k)).collect();
        assert_eq!(left, [("t1", "flying"), ("t1", "parked"), ("t2", "k1")]);
    }
}
