//! Several real `payments` processes on one database, as behind a load balancer: nothing is
//! shared between them but the database. Duplicates sent to all of them at once make one
//! payment, and every process replays it. Also: a process refuses, at start, a setting of its
//! background tasks that it does not know.

use crate::support;

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::{
    MySql, Postgres, Transaction,
    pool::PoolConnection,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use support::{Database, start_payments, wait_until};

#[sqlx::test(migrations = false)]
async fn postgres_duplicates_over_three_processes_make_one_payment(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    one_payment_over_three_processes(support::postgres(connect).await).await;
}

#[tokio::test]
async fn sqlite_duplicates_over_three_processes_make_one_payment() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    one_payment_over_three_processes(support::sqlite(&dir).await).await;
}

#[tokio::test]
async fn mysql_duplicates_over_three_processes_make_one_payment() {
    support::on_mysql(one_payment_over_three_processes).await;
}

/// What the test holds so that the first payment waits in its `INSERT INTO payments`, the key
/// claimed, until the test lets it go.
enum Blocker {
    /// A transaction holding `LOCK TABLE payments IN EXCLUSIVE MODE`.
    Postgres(Transaction<'static, Postgres>),
    /// A connection holding `LOCK TABLES payments WRITE` (a metadata lock of the session).
    MySql(PoolConnection<MySql>),
}

impl Blocker {
    /// Holds the lock and sends the first request (`send_first`); returns once it waits for
    /// the lock in its `INSERT`, its key claimed. `None` on SQLite, which has no lock the test
    /// can hold without stopping the claim itself.
    async fn hold<T>(database: &Database, send_first: impl FnOnce() -> T) -> Option<(Self, T)> {
        match database {
            Database::Postgres { pool, .. } => {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("LOCK TABLE payments IN EXCLUSIVE MODE")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let first = send_first();
                wait_until("the first payment to wait for the table lock", || {
                    database.waits_for_a_lock_on("payments")
                })
                .await;
                Some((Self::Postgres(tx), first))
            }
            Database::MySql { pool, .. } => {
                let mut locked = pool.acquire().await.unwrap();
                sqlx::raw_sql("LOCK TABLES payments WRITE")
                    .execute(&mut *locked)
                    .await
                    .unwrap();
                let first = send_first();
                // The handler's INSERT waits for the table's metadata lock, inside the
                // transaction that claimed the key (from another connection of the pool).
                wait_until("the first payment to wait for the table lock", || {
                    database.waits_for_a_lock_on("payments")
                })
                .await;
                Some((Self::MySql(locked), first))
            }
            Database::Sqlite { .. } => None,
        }
    }

    async fn release(self) {
        match self {
            Self::Postgres(tx) => tx.commit().await.unwrap(),
            Self::MySql(mut locked) => {
                sqlx::raw_sql("UNLOCK TABLES")
                    .execute(&mut *locked)
                    .await
                    .unwrap();
            }
        }
    }
}

async fn one_payment_over_three_processes(database: Database) {
    let client = Client::new();
    // No refunds here: the processor's address is never called.
    let mut services = Vec::new();
    for _ in 0..3 {
        services.push(start_payments(&client, &database, "http://127.0.0.1:9").await);
    }
    let body = json!({"amount": 4200, "currency": "usd", "customer": "cus_1"});
    let post = |base: &str, body: &Value| {
        client
            .post(format!("{base}/v1/payments"))
            .bearer_auth("t1")
            .header("Idempotency-Key", "shared-key")
            .json(body)
            .send()
    };

    // On PostgreSQL and MySQL the test holds a lock on `payments`: the first request claims
    // the key and blocks in its INSERT, so every duplicate, at every process, certainly arrives
    // while the key is held. (SQLite has no lock the test can hold without stopping the claim
    // itself: there the requests are simply sent together.)
    let blocker = Blocker::hold(&database, || tokio::spawn(post(&services[0].1, &body))).await;
    let pending: Vec<_> = (0..30)
        .map(|i| tokio::spawn(post(&services[i % 3].1, &body)))
        .collect();
    let pending = match blocker {
        Some((blocker, first)) => {
            // Every duplicate was refused at once, while the first still held the key.
            // A duplicate that ran the handler would wait on the lock too: the deadline
            // turns that into a failure that says so.
            for reply in pending {
                let reply = tokio::time::timeout(std::time::Duration::from_secs(60), reply)
                    .await
                    .expect("a duplicate got no 409 while the first held the key")
                    .unwrap()
                    .expect("the service answers");
                assert_eq!(reply.status(), StatusCode::CONFLICT);
            }
            blocker.release().await;
            vec![first]
        }
        None => pending,
    };
    let mut executions = Vec::new();
    for reply in pending {
        let reply = reply.await.unwrap().expect("the service answers");
        let status = reply.status();
        let replayed = reply.headers().contains_key("idempotent-replayed");
        let text = reply.text().await.unwrap();
        match status {
            StatusCode::CREATED if !replayed => executions.push(text),
            StatusCode::CREATED | StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}: {text}"),
        }
    }
    assert_eq!(executions.len(), 1, "one request made the payment");
    assert_eq!(database.count("payments").await, 1);
    assert_eq!(database.count("idem_keys").await, 1);

    // Settled: every process replays it, and refuses the key for another body.
    let made: Value = serde_json::from_str(&executions[0]).unwrap();
    for (_, base) in &services {
        let replay = post(base, &body).await.unwrap();
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.json::<Value>().await.unwrap(), made);
        let other = post(
            base,
            &json!({"amount": 1, "currency": "usd", "customer": "cus_1"}),
        )
        .await
        .unwrap();
        assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    }
    assert_eq!(database.count("payments").await, 1);
}

/// `payments` with `RECOVERY_HOOK` or `PURGE_EVERY` set to what it does not know exits at once,
/// status 1, naming the variable and what it takes: a typo does not silently run the default.
#[tokio::test]
async fn the_service_refuses_at_start_a_recovery_hook_or_purge_interval_it_does_not_know() {
    for (variable, value, takes) in [
        ("RECOVERY_HOOK", "Release", "`settle`"),
        ("RECOVERY_HOOK", "", "`release`"),
        ("PURGE_EVERY", "-1", "whole number of seconds"),
        ("PURGE_EVERY", "1m", "whole number of seconds"),
    ] {
        let (code, stderr) =
            support::exit_at_start(env!("CARGO_BIN_EXE_payments"), &[(variable, value)]).await;
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains(variable)
                && stderr.contains(takes)
                && stderr.contains(&format!("{value:?}")),
            "{variable}={value:?}: the refusal names the variable, what it takes and what it got: {stderr}"
        );
    }
}
