//! The payments service with `IDEM_ENCRYPTION_KEYS`: its stored answers sealed at rest, replayed
//! all the same, after a rotation too; and a malformed value refused at start, within 15 s,
//! naming the variable and the fault, before anything is written to the database.

use std::time::Duration;

use crate::support::{self, Database, start_payments_with};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The key `k1` (the bytes 0 to 31).
const KEY_1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
/// The key `k2` (the bytes 32 to 63).
const KEY_2: &str = "k2:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";

/// The customer of the sealed payments: what the key table must not show.
const CUSTOMER: &str = "cus_sealed_7c1e";

/// How long a refusal at start may take.
const REFUSED_WITHIN: Duration = Duration::from_secs(15);

/// Each kind of malformed value, and the words of its fault.
fn malformed() -> [(String, &'static str); 4] {
    [
        ("k1:not base64!".to_owned(), "not base64"),
        (
            "k1:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==".to_owned(),
            "is 31 bytes long",
        ),
        (
            ":AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".to_owned(),
            r#"key id """#,
        ),
        (format!("{KEY_1},{KEY_1}"), r#"key id "k1" is given twice"#),
    ]
}

/// Starts `payments` with `database_env` and each malformed `IDEM_ENCRYPTION_KEYS`, and checks
/// that it exits within [`REFUSED_WITHIN`], status 1, naming the variable and the fault and
/// showing no key; `nothing_written` is checked after each.
async fn refuses_each_malformed_value<F, Fut>(database_env: &[(&str, &str)], nothing_written: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()>,
{
    for (keys, fault) in malformed() {
        let env = [database_env, &[("IDEM_ENCRYPTION_KEYS", keys.as_str())]].concat();
        let (code, stderr) =
            support::exit_at_start_within(REFUSED_WITHIN, env!("CARGO_BIN_EXE_payments"), &env)
                .await;
        assert_eq!(code, Some(1), "{keys:?}: {stderr}");
        assert!(
            stderr.contains("IDEM_ENCRYPTION_KEYS") && stderr.contains(fault),
            "{keys:?}: the refusal names the variable and the fault ({fault}): {stderr}"
        );
        assert!(
            !stderr.contains("AAECAwQF"),
            "{keys:?}: a key in the refusal: {stderr}"
        );
        nothing_written().await;
    }
}

#[tokio::test]
async fn sqlite_the_service_refuses_malformed_encryption_keys_at_start_without_creating_the_file() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("payments.db");
    let path_text = path.to_str().expect("a UTF-8 path");
    let dir_path = dir.path().to_owned();
    refuses_each_malformed_value(&[("SQLITE_PATH", path_text)], || {
        let left: Vec<_> = std::fs::read_dir(&dir_path)
            .expect("the directory")
            .map(|entry| entry.expect("an entry").file_name())
            .collect();
        assert!(left.is_empty(), "written before the refusal: {left:?}");
        std::future::ready(())
    })
    .await;
}

#[sqlx::test(migrations = false)]
async fn postgres_the_service_refuses_malformed_encryption_keys_at_start_without_creating_a_table(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let Database::Postgres { pool, url } = support::postgres(connect).await else {
        unreachable!("a PostgreSQL database");
    };
    refuses_each_malformed_value(&[("DATABASE_URL", &url)], || {
        let pool = pool.clone();
        async move {
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT table_name::text FROM information_schema.tables \
             WHERE table_schema = current_schema()",
            )
            .fetch_all(&pool)
            .await
            .expect("the tables");
            assert!(tables.is_empty(), "written before the refusal: {tables:?}");
        }
    })
    .await;
}

/// On MySQL the service creates its database when the server has none of that name: refused,
/// it has not.
#[tokio::test]
async fn mysql_the_service_refuses_malformed_encryption_keys_at_start_without_creating_the_database()
 {
    let (database, name) = support::mysql().await;
    let Database::MySql { pool, url } = database else {
        unreachable!("a MySQL database");
    };
    let absent = format!("{name}_absent");
    let absent_url = url.replacen(&name, &absent, 1);
    refuses_each_malformed_value(&[("DATABASE_URL", &absent_url)], || {
        let (pool, absent) = (pool.clone(), absent.clone());
        async move {
            let found: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM information_schema.schemata WHERE schema_name = ?",
            )
            .bind(&absent)
            .fetch_one(&pool)
            .await
            .expect("the databases");
            assert_eq!(
                found, 0,
                "the database {absent} was created before the refusal"
            );
        }
    })
    .await;
    pool.close().await;
    idem_tests::MySqlDb::drop_named(&name).await;
}

/// `key`'s row as stored: its headers and steps as text, and its body.
async fn raw_row(database: &Database, key: &str) -> (String, Vec<u8>, Option<String>) {
    match database {
        Database::Postgres { pool, .. } => {
            sqlx::query_as(
                "SELECT response_headers::text, response_body, steps::text \
             FROM idem_keys WHERE key = $1",
            )
            .bind(key)
            .fetch_one(pool)
            .await
        }
        Database::Sqlite { pool, .. } => {
            sqlx::query_as(
                "SELECT CAST(response_headers AS TEXT), response_body, CAST(steps AS TEXT) \
             FROM idem_keys WHERE key = $1",
            )
            .bind(key)
            .fetch_one(pool)
            .await
        }
        Database::MySql { pool, .. } => {
            sqlx::query_as(
                "SELECT CAST(response_headers AS CHAR), response_body, CAST(steps AS CHAR) \
             FROM idem_keys WHERE `key` = ?",
            )
            .bind(key.as_bytes())
            .fetch_one(pool)
            .await
        }
    }
    .expect("the key's row")
}

/// Checks that `key`'s row keeps only the id of the key that sealed it in the clear: neither
/// the customer nor any of the `answered` body.
async fn assert_sealed(database: &Database, key: &str, sealed_with: &str, answered: &str) {
    let (headers, body, steps) = raw_row(database, key).await;
    let headers: Value = serde_json::from_str(&headers).expect("JSON headers");
    assert_eq!(headers, json!([["idem-sealed", sealed_with]]), "{key}");
    let payment: Value = serde_json::from_str(answered).expect("a JSON payment");
    let id = payment["id"].as_str().expect("the payment's id");
    let shown = String::from_utf8_lossy(&body);
    for clear in [CUSTOMER, id, answered] {
        assert!(
            !shown.contains(clear),
            "{key}: {clear:?} in the stored body"
        );
    }
    assert!(
        !steps.unwrap_or_default().contains(CUSTOMER),
        "{key}: the customer in the steps"
    );
}

async fn sealed_payments_replay_and_their_rows_show_neither_customer_nor_body(database: Database) {
    let client = Client::new();
    let pay = |base: String, key: &'static str| {
        let request = client
            .post(format!("{base}/v1/payments"))
            .bearer_auth("t1")
            .header("Idempotency-Key", key)
            .json(&json!({"amount": 4200, "currency": "usd", "customer": CUSTOMER}));
        async move {
            let reply = request.send().await.expect("the service answers");
            let status = reply.status();
            let replayed = reply.headers().contains_key("idempotent-replayed");
            (status, replayed, reply.text().await.expect("a body"))
        }
    };

    let (service, base) = start_payments_with(
        &client,
        &database,
        "http://127.0.0.1:9",
        &[("IDEM_ENCRYPTION_KEYS", KEY_1)],
    )
    .await;
    let (status, replayed, made) = pay(base.clone(), "sealed-1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{made}");
    assert!(
        made.contains(CUSTOMER),
        "the answer names its customer: {made}"
    );
    let replay = pay(base.clone(), "sealed-1").await;
    assert_eq!(replay, (StatusCode::CREATED, true, made.clone()));
    assert_sealed(&database, "sealed-1", "k1", &made).await;
    drop(service);

    // Rotated: `k2` seals, `k1` still opens what it sealed.
    let (_service, base) = start_payments_with(
        &client,
        &database,
        "http://127.0.0.1:9",
        &[("IDEM_ENCRYPTION_KEYS", &format!("{KEY_2},{KEY_1}"))],
    )
    .await;
    let replay = pay(base.clone(), "sealed-1").await;
    assert_eq!(replay, (StatusCode::CREATED, true, made));
    let (status, replayed, second) = pay(base.clone(), "sealed-2").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{second}");
    assert_eq!(
        pay(base, "sealed-2").await,
        (StatusCode::CREATED, true, second.clone())
    );
    assert_sealed(&database, "sealed-2", "k2", &second).await;
    assert_eq!(database.count("payments").await, 2);
}

support::on_every_database!(sealed_payments_replay_and_their_rows_show_neither_customer_nor_body);
