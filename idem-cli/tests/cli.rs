//! The `idem` command against real databases (PostgreSQL, a SQLite file, MariaDB or MySQL), on
//! a key table that holds a completed key, two completed gRPC calls (a message and a status), a
//! claim stuck in flight with a recorded step, an expired key, and two claims the recovery
//! parked (past their key's expiry).

use std::process::{Command, Output};

use serde_json::Value;
use sqlx::{
    mysql::MySqlPoolOptions,
    postgres::{PgConnectOptions, PgPoolOptions},
};

const BODY: &str = "SECRET-BODY-7f3a";

const POSTGRES_ROWS: &str = r#"
INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, response_status,
                       response_headers, response_body, created_at, expires_at)
VALUES ('t1', 'done', 'POST', '/v1/payments', '\x00', 'completed', 201, '[]',
        convert_to('SECRET-BODY-7f3a', 'UTF8'), now(), now() + interval '1 day'),
       ('t2', 'old', 'POST', '/v1/payments', '\x00', 'completed', 201, '[]', '\x00',
        now() - interval '2 days', now() - interval '1 hour'),
       ('t1', 'grpc-declined', 'GRPC', '/idem.example.v1.Payments/CreatePayment', '\x00',
        'completed', 400, '[]', '\x0809120d63617264206465636c696e6564', now(),
        now() + interval '1 day'),
       ('t1', 'grpc-paid', 'GRPC', '/idem.example.v1.Payments/CreatePayment', '\x00',
        'completed', 200, '[]', '\x0a03706179', now(), now() + interval '1 day');
INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, expires_at,
                       locked_at, lease_until, claim_token, steps)
VALUES ('t1', 'stuck', 'POST', '/v1/orders', '\x00', 'started', now() - interval '10 minutes',
        now() + interval '1 day', now() - interval '10 minutes', now() - interval '9 minutes',
        1, '[{"step": "reserve", "output": 1}, {"step": "charge", "output": "ch_1"}]');
INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, expires_at,
                       locked_at, recovery_attempts, recovery_error, parked_at)
VALUES ('t1', 'dead', 'POST', '/v1/orders', '\x00', 'started', now() - interval '2 days',
        now() - interval '1 hour', now() - interval '2 days', 20, 'the processor did not answer',
        now() - interval '30 minutes'),
       ('t1', 'dead2', 'POST', '/v1/orders', '\x00', 'started', now() - interval '2 days',
        now() - interval '1 hour', now() - interval '2 days', 20, NULL, now() - interval '20 minutes');
"#;

const SQLITE_ROWS: &str = r#"
INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, response_status,
                       response_headers, response_body, created_at, expires_at)
VALUES ('t1', 'done', 'POST', '/v1/payments', x'00', 'completed', 201, '[]',
        CAST('SECRET-BODY-7f3a' AS BLOB), unixepoch() * 1000, unixepoch() * 1000 + 86400000),
       ('t2', 'old', 'POST', '/v1/payments', x'00', 'completed', 201, '[]', x'00',
        unixepoch() * 1000 - 172800000, unixepoch() * 1000 - 3600000),
       ('t1', 'grpc-declined', 'GRPC', '/idem.example.v1.Payments/CreatePayment', x'00',
        'completed', 400, '[]', x'0809120d63617264206465636c696e6564', unixepoch() * 1000,
        unixepoch() * 1000 + 86400000),
       ('t1', 'grpc-paid', 'GRPC', '/idem.example.v1.Payments/CreatePayment', x'00',
        'completed', 200, '[]', x'0a03706179', unixepoch() * 1000, unixepoch() * 1000 + 86400000);
INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, expires_at,
                       locked_at, lease_until, claim_token, steps)
VALUES ('t1', 'stuck', 'POST', '/v1/orders', x'00', 'started', unixepoch() * 1000 - 600000,
        unixepoch() * 1000 + 86400000, unixepoch() * 1000 - 600000, unixepoch() * 1000 - 540000,
        1, '[{"step": "reserve", "output": 1}, {"step": "charge", "output": "ch_1"}]');
INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, expires_at,
                       locked_at, recovery_attempts, recovery_error, parked_at)
VALUES ('t1', 'dead', 'POST', '/v1/orders', x'00', 'started', unixepoch() * 1000 - 172800000,
        unixepoch() * 1000 - 3600000, unixepoch() * 1000 - 172800000, 20,
        'the processor did not answer', unixepoch() * 1000 - 1800000),
       ('t1', 'dead2', 'POST', '/v1/orders', x'00', 'started', unixepoch() * 1000 - 172800000,
        unixepoch() * 1000 - 3600000, unixepoch() * 1000 - 172800000, 20, NULL,
        unixepoch() * 1000 - 1200000);
"#;

const MYSQL_ROWS: &str = r#"
INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, response_status,
                       response_headers, response_body, created_at, expires_at)
VALUES ('t1', 'done', 'POST', '/v1/payments', x'00', 'completed', 201, '[]',
        'SECRET-BODY-7f3a', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY),
       ('t2', 'old', 'POST', '/v1/payments', x'00', 'completed', 201, '[]', x'00',
        UTC_TIMESTAMP(6) - INTERVAL 2 DAY, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR),
       ('t1', 'grpc-declined', 'GRPC', '/idem.example.v1.Payments/CreatePayment', x'00',
        'completed', 400, '[]', x'0809120d63617264206465636c696e6564', UTC_TIMESTAMP(6),
        UTC_TIMESTAMP(6) + INTERVAL 1 DAY),
       ('t1', 'grpc-paid', 'GRPC', '/idem.example.v1.Payments/CreatePayment', x'00',
        'completed', 200, '[]', x'0a03706179', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY);
INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, created_at, expires_at,
                       locked_at, lease_until, claim_token, steps)
VALUES ('t1', 'stuck', 'POST', '/v1/orders', x'00', 'started',
        UTC_TIMESTAMP(6) - INTERVAL 10 MINUTE, UTC_TIMESTAMP(6) + INTERVAL 1 DAY,
        UTC_TIMESTAMP(6) - INTERVAL 10 MINUTE, UTC_TIMESTAMP(6) - INTERVAL 9 MINUTE,
        1, '[{"step": "reserve", "output": 1}, {"step": "charge", "output": "ch_1"}]');
INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, status, created_at, expires_at,
                       locked_at, recovery_attempts, recovery_error, parked_at)
VALUES ('t1', 'dead', 'POST', '/v1/orders', x'00', 'started', UTC_TIMESTAMP(6) - INTERVAL 2 DAY,
        UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, UTC_TIMESTAMP(6) - INTERVAL 2 DAY, 20,
        'the processor did not answer', UTC_TIMESTAMP(6) - INTERVAL 30 MINUTE),
       ('t1', 'dead2', 'POST', '/v1/orders', x'00', 'started', UTC_TIMESTAMP(6) - INTERVAL 2 DAY,
        UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, UTC_TIMESTAMP(6) - INTERVAL 2 DAY, 20, NULL,
        UTC_TIMESTAMP(6) - INTERVAL 20 MINUTE);
"#;

/// The row a transactional claim writes on MySQL (uncommitted while the handler runs; left
/// committed, already expired and without a lease, by a handler that ran `COMMIT` itself).
const MYSQL_CLAIM: &str = "INSERT INTO idem_keys (scope, `key`, method, path, fingerprint, \
     status, created_at, expires_at, claim_token) \
     VALUES (?, ?, '', '', '', 'started', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 7)";

fn idem(url: &str, args: &[&str]) -> Output {
    idem_with_keys(url, None, args)
}

/// `idem` with `IDEM_ENCRYPTION_KEYS` set to `keys`, or unset.
fn idem_with_keys(url: &str, keys: Option<&str>, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .env_remove("DATABASE_URL")
        .env_remove("IDEM_ENCRYPTION_KEYS");
    if let Some(keys) = keys {
        command.env("IDEM_ENCRYPTION_KEYS", keys);
    }
    command
        .arg("--database-url")
        .arg(url)
        .args(args)
        .output()
        .expect("run idem")
}

fn json(output: &Output) -> Value {
    assert!(
        output.status.success(),
        "idem failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON on stdout")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Checks that `table` shows no age to the millisecond past a second (`4m 45s 543ms`).
fn assert_readable_ages(table: &str) {
    let words: Vec<&str> = table.split_whitespace().collect();
    for pair in words.windows(2) {
        let unit = |word: &str, unit: &str| {
            word.strip_suffix(unit)
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        };
        assert!(
            !(unit(pair[1], "ms") && (unit(pair[0], "s") || unit(pair[0], "m"))),
            "an age to the millisecond ({} {}) in: {table}",
            pair[0],
            pair[1]
        );
    }
}

/// Checks that `output` succeeded and says `none` (its words `said`) rather than printing an
/// empty table.
fn assert_says_none(output: &Output, said: &str) {
    let shown = text(&output.stdout);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(shown.starts_with(said), "no {said:?} in: {shown}");
    assert!(
        !shown.contains('+') && !shown.contains('|'),
        "a table: {shown}"
    );
}

/// Every check, on the database at `url` that `count` looks into (`count(Some(key))`: the rows
/// of that key; `count(None)`: all rows).
async fn the_command_does_what_it_says<F, Fut>(url: &str, count: F)
where
    F: Fn(Option<&'static str>) -> Fut,
    Fut: Future<Output = i64>,
{
    // stats
    let stats = json(&idem(url, &["--json", "stats"]));
    assert_eq!(stats["completed"], 4);
    assert_eq!(stats["in_flight"], 1, "the table's words: {stats}");
    assert_eq!(stats["expired"], 1, "parked claims are not the purge's");
    assert_eq!(stats["parked"], 2);
    assert!(
        stats["oldest_in_flight_ms"].as_i64().unwrap() >= 600_000,
        "{stats}"
    );
    assert!(stats.get("started").is_none(), "{stats}");
    let table = idem(url, &["stats"]);
    assert!(table.status.success());
    let shown = text(&table.stdout);
    assert!(
        shown.contains("in flight") && shown.contains("oldest in flight"),
        "a table: {shown}"
    );
    assert!(
        shown.contains("a transactional handler's claim is invisible"),
        "what the counts cannot show: {shown}"
    );
    assert_readable_ages(&shown);

    // inspect: the body only when asked
    let plain = idem(url, &["inspect", "--scope", "t1", "--key", "done"]);
    assert!(plain.status.success());
    assert!(text(&plain.stdout).contains("completed"));
    assert!(!text(&plain.stdout).contains(BODY), "no body unless asked");
    let as_json = json(&idem(
        url,
        &["--json", "inspect", "--scope", "t1", "--key", "done"],
    ));
    assert!(
        !as_json.to_string().contains(BODY),
        "no body unless asked: {as_json}"
    );
    assert_eq!(as_json["response_status"], 201);
    let with_body = idem(
        url,
        &["inspect", "--scope", "t1", "--key", "done", "--body"],
    );
    assert!(text(&with_body.stdout).contains(BODY));
    let stuck = idem(url, &["inspect", "--scope", "t1", "--key", "stuck"]);
    let shown = text(&stuck.stdout);
    assert!(shown.contains("charge (2 recorded)"), "{shown}");
    // Claimed 10 minutes ago, its lease ended 9 minutes ago, its key expires in a day.
    for age in ["| 10m ", "| -9m ", "| 23h 59m "] {
        assert!(shown.contains(age), "no {age:?} in: {shown}");
    }
    assert_readable_ages(&shown);
    let missing = idem(url, &["inspect", "--scope", "t1", "--key", "nope"]);
    assert_eq!(missing.status.code(), Some(1));

    // inspect a gRPC call's answer: its code (several share the HTTP status it is kept under),
    // its message only when asked
    let declined = json(&idem(
        url,
        &[
            "--json",
            "inspect",
            "--scope",
            "t1",
            "--key",
            "grpc-declined",
        ],
    ));
    assert_eq!(declined["grpc_status"], "FAILED_PRECONDITION", "{declined}");
    assert!(declined.get("response_body").is_none(), "{declined}");
    assert!(
        declined.get("response_status").is_none(),
        "the HTTP status a gRPC answer is kept under is no answer of the call: {declined}"
    );
    let declined = idem(
        url,
        &[
            "inspect",
            "--scope",
            "t1",
            "--key",
            "grpc-declined",
            "--body",
        ],
    );
    let shown = text(&declined.stdout);
    assert!(
        shown.contains("FAILED_PRECONDITION") && shown.contains("card declined"),
        "{shown}"
    );
    let paid = json(&idem(
        url,
        &[
            "--json",
            "inspect",
            "--scope",
            "t1",
            "--key",
            "grpc-paid",
            "--body",
        ],
    ));
    assert_eq!(
        (&paid["grpc_status"], &paid["grpc_message_bytes"]),
        (&"OK".into(), &5.into()),
        "{paid}"
    );
    assert_eq!(
        paid["response_body"], "0a03706179",
        "the message in hex: {paid}"
    );
    assert!(paid.get("response_status").is_none(), "{paid}");
    let shown = text(&idem(url, &["inspect", "--scope", "t1", "--key", "grpc-paid"]).stdout);
    assert!(
        shown.contains("grpc status") && !shown.contains("response status"),
        "{shown}"
    );

    // in-flight
    let flying = json(&idem(url, &["--json", "in-flight", "--older-than", "5m"]));
    assert_eq!(flying.as_array().unwrap().len(), 1, "{flying}");
    assert_eq!(flying[0]["key"], "stuck");
    assert_eq!(
        flying[0]["steps"],
        serde_json::json!([{ "step": "reserve" }, { "step": "charge" }]),
        "what a step saved is shown with `inspect --body` only: {flying}"
    );
    let stuck = ["--json", "inspect", "--scope", "t1", "--key", "stuck"];
    let shown = json(&idem(url, &stuck));
    assert!(!shown.to_string().contains("ch_1"), "{shown}");
    let shown = json(&idem(url, &[&stuck[..], &["--body"]].concat()));
    assert!(shown["steps"].as_str().unwrap().contains("ch_1"), "{shown}");
    let none = json(&idem(url, &["--json", "in-flight", "--older-than", "1h"]));
    assert_eq!(none.as_array().unwrap().len(), 0);
    let none = idem(url, &["in-flight", "--older-than", "1h"]);
    assert_says_none(&none, "none in flight for 1h or longer");
    assert!(
        text(&none.stdout).contains("a transactional handler's claim is invisible"),
        "{}",
        text(&none.stdout)
    );
    let table = text(&idem(url, &["in-flight"]).stdout);
    assert!(table.contains("| 10m "), "{table}");
    assert_readable_ages(&table);

    // release: never a completed key
    let refused = idem(url, &["release", "--scope", "t1", "--key", "done"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        text(&refused.stderr).contains("completed"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(count(Some("done")).await, 1);
    let released = idem(url, &["release", "--scope", "t1", "--key", "stuck"]);
    assert!(released.status.success(), "{}", text(&released.stderr));
    assert_eq!(count(Some("stuck")).await, 0);
    let again = idem(url, &["release", "--scope", "t1", "--key", "stuck"]);
    assert_eq!(again.status.code(), Some(1), "nothing left to release");

    // dead, resume, abandon: the parked claims, never a body; only a parked claim
    let dead = json(&idem(url, &["--json", "dead"]));
    assert_eq!(dead.as_array().unwrap().len(), 2, "{dead}");
    assert_eq!(dead[0]["key"], "dead", "the longest parked first");
    assert_eq!(dead[0]["attempts"], 20);
    assert_eq!(dead[0]["last_error"], "the processor did not answer");
    assert_eq!(dead[0]["path"], "/v1/orders");
    assert!(
        dead[0]["parked_ms"].as_i64().unwrap() >= 1_800_000,
        "{dead}"
    );
    let table = text(&idem(url, &["dead"]).stdout);
    assert!(table.contains("the processor did not answer"), "{table}");
    // Parked 30 minutes ago, claimed 2 days ago.
    for age in ["| 30m ", "| 2days "] {
        assert!(table.contains(age), "no {age:?} in: {table}");
    }
    assert_readable_ages(&table);
    for verb in ["resume", "abandon"] {
        let refused = idem(url, &[verb, "--scope", "t1", "--key", "done"]);
        assert_eq!(refused.status.code(), Some(1), "{verb}");
        assert!(
            text(&refused.stderr).contains("is not parked"),
            "{verb}: {}",
            text(&refused.stderr)
        );
        let missing = idem(url, &[verb, "--scope", "t1", "--key", "nope"]);
        assert_eq!(missing.status.code(), Some(1), "{verb}");
    }
    assert_eq!(count(Some("done")).await, 1);
    let refused = idem(url, &["release", "--scope", "t1", "--key", "dead"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        text(&refused.stderr).contains("is parked"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(
        count(Some("dead")).await,
        1,
        "a parked claim is abandon's, not release's"
    );
    let resumed = idem(url, &["resume", "--scope", "t1", "--key", "dead2"]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    let abandoned = idem(url, &["abandon", "--scope", "t1", "--key", "dead"]);
    assert!(abandoned.status.success(), "{}", text(&abandoned.stderr));
    assert_eq!(count(Some("dead")).await, 0);
    let again = idem(url, &["abandon", "--scope", "t1", "--key", "dead2"]);
    assert_eq!(again.status.code(), Some(1), "resumed: no longer parked");
    let flying = json(&idem(url, &["--json", "in-flight"]));
    assert_eq!(
        flying.as_array().unwrap().len(),
        1,
        "resumed, in flight: {flying}"
    );
    assert_eq!(flying[0]["key"], "dead2");
    assert!(
        json(&idem(url, &["--json", "dead"]))
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_says_none(&idem(url, &["dead"]), "none parked");
    let released = idem(url, &["release", "--scope", "t1", "--key", "dead2"]);
    assert!(released.status.success(), "{}", text(&released.stderr));

    // purge
    let dry = json(&idem(url, &["--json", "purge", "--dry-run"]));
    assert_eq!(dry["expired"], 1);
    assert_eq!(count(Some("old")).await, 1, "a dry run");
    let purged = json(&idem(url, &["--json", "purge"]));
    assert_eq!(purged["expired"], 1);
    assert_eq!(count(Some("old")).await, 0);
    assert_eq!(count(None).await, 3, "only the live keys are left");
}

/// `forget`, on the database at `url` seeded with the rows of the module doc (`count` as in
/// [`the_command_does_what_it_says`]): the completed keys of `t1` deleted, its claim in flight
/// and its parked claims left and counted, the key of `t2` untouched until its own turn.
async fn forget_erases_a_scopes_completed_keys<F, Fut>(url: &str, count: F)
where
    F: Fn(Option<&'static str>) -> Fut,
    Fut: Future<Output = i64>,
{
    let forgotten = json(&idem(url, &["--json", "forget", "--scope", "t1"]));
    assert_eq!(
        forgotten,
        serde_json::json!({ "deleted": 3, "in_flight_left": 1, "parked_left": 2 })
    );
    for key in ["done", "grpc-declined", "grpc-paid"] {
        assert_eq!(count(Some(key)).await, 0, "{key} forgotten");
    }
    for key in ["stuck", "dead", "dead2"] {
        assert_eq!(count(Some(key)).await, 1, "the claim {key} left");
    }
    assert_eq!(count(Some("old")).await, 1, "another scope's key untouched");

    // Again: nothing more of t1's; the table says what it left and why.
    let again = idem(url, &["forget", "--scope", "t1"]);
    assert!(again.status.success(), "{}", text(&again.stderr));
    let shown = text(&again.stdout);
    assert!(shown.contains("deleted 0 completed keys"), "{shown}");
    assert!(
        shown.contains("left 1 claims in flight") && shown.contains("run its side effect twice"),
        "{shown}"
    );
    assert!(
        shown.contains("left 2 parked claims") && shown.contains("idem abandon"),
        "{shown}"
    );

    // t2's key, expired, goes on its own scope's turn.
    let forgotten = json(&idem(url, &["--json", "forget", "--scope", "t2"]));
    assert_eq!(forgotten["deleted"], 1, "{forgotten}");
    assert_eq!(count(Some("old")).await, 0);
    assert_eq!(count(None).await, 3, "only t1's claims are left");
}

/// The key `k1` (the bytes 0 to 31), as `IDEM_ENCRYPTION_KEYS` gives it.
const KEY_1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
/// The key `k2` (the bytes 32 to 63).
const KEY_2: &str = "k2:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";

/// What the sealed answer of the key `sealed` of `t1` holds: a payment of this customer.
const SEALED_BODY: &str = r#"{"id":"pay_sealed","customer":"cus_sealed_9d2"}"#;

/// The answer (201, `content-type: application/json`, [`SEALED_BODY`]) of the key `sealed` of
/// `t1` sealed with `k1` as the runtime seals it, computed apart (Python's `cryptography`,
/// AES-256-GCM, the nonce `5a` twelve times): the nonce, then the ciphertext and tag of the
/// headers' JSON length (u32, big-endian), the headers' JSON and the body, with the associated
/// data `idem answer v1\0t1\0sealed\0` and the status (u16, big-endian).
const SEALED_HEX: &str = "5a5a5a5a5a5a5a5a5a5a5a5a8730e47be96361336117fb12ede2be7405ee85878b06a7d4\
     c22b917da424c24883a45ed7a3ddef46dc6089e3976dd30002397c2067775b6c727c4c65878f8a63c36c94888e98d2\
     45f1ad29d3a72d286791c32759e477380c9877d0120abd68fcfc63e373c8b8fed7";

/// The columns of the sealed row but its times, in the order of [`SEALED_VALUES`].
const SEALED_COLUMNS: &str = "scope, {key}, method, path, fingerprint, status, response_status, response_headers, \
     response_body, created_at, expires_at";

/// The sealed row's values, `{blob}` the sealed answer as the database writes a blob literal,
/// `{now}` and `{day}` now and a day from now.
const SEALED_VALUES: &str = "'t1', 'sealed', 'POST', '/v1/payments', {zero}, 'completed', 201, \
     '[[\"idem-sealed\",\"k1\"]]', {blob}, {now}, {day}";

/// Inserts the sealed row with `run`, the SQL spelled for the database by the rest.
fn sealed_row(key: &str, zero: &str, blob: &str, now: &str, day: &str) -> String {
    format!(
        "INSERT INTO idem_keys ({}) VALUES ({})",
        SEALED_COLUMNS.replace("{key}", key),
        SEALED_VALUES
            .replace("{zero}", zero)
            .replace("{blob}", blob)
            .replace("{now}", now)
            .replace("{day}", day)
    )
}

/// `inspect` of the sealed answer on the database at `url`: without the body it says which key
/// sealed it and needs none; with the body it opens it with the keys of
/// `IDEM_ENCRYPTION_KEYS` (the sealing one among others), and without them (none, or others)
/// it fails, status 1, naming the key id it needs.
fn sealed_answers_open_with_the_keys_given(url: &str) {
    let inspect = ["inspect", "--scope", "t1", "--key", "sealed"];
    let with_body = ["inspect", "--scope", "t1", "--key", "sealed", "--body"];

    let plain = idem_with_keys(url, None, &inspect);
    let shown = text(&plain.stdout);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    assert!(
        shown.contains("sealed with key") && shown.contains("k1") && shown.contains("201"),
        "{shown}"
    );
    assert!(!shown.contains("cus_sealed_9d2"), "{shown}");
    let as_json = json(&idem_with_keys(
        url,
        None,
        &[&["--json"], &inspect[..]].concat(),
    ));
    assert_eq!(as_json["sealed_with"], "k1", "{as_json}");
    assert_eq!(as_json["response_status"], 201, "{as_json}");
    assert!(as_json.get("response_body").is_none(), "{as_json}");

    for keys in [KEY_1, format!("{KEY_2},{KEY_1}").as_str()] {
        let opened = idem_with_keys(url, Some(keys), &with_body);
        let shown = text(&opened.stdout);
        assert!(opened.status.success(), "{keys}: {}", text(&opened.stderr));
        assert!(shown.contains("cus_sealed_9d2"), "{keys}: {shown}");
        let as_json = json(&idem_with_keys(
            url,
            Some(keys),
            &[&["--json"], &with_body[..]].concat(),
        ));
        assert_eq!(as_json["response_body"], SEALED_BODY, "{keys}: {as_json}");
    }

    for keys in [None, Some(KEY_2)] {
        let refused = idem_with_keys(url, keys, &with_body);
        let said = text(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "{keys:?}: {said}");
        assert!(
            said.contains(r#"key id "k1""#) && said.contains("IDEM_ENCRYPTION_KEYS"),
            "{keys:?}: the refusal names the key id it needs: {said}"
        );
        assert!(
            !text(&refused.stdout).contains("cus_sealed_9d2"),
            "{}",
            text(&refused.stdout)
        );
    }
}

/// `rekey`, on the database at `url` holding the sealed row: it needs keys (status 2 without,
/// naming the variable); it leaves an answer that does not open with the keys given and names
/// the key id and the key (status 1); a dry run writes nothing; with `k2` first it seals the
/// answer again with `k2`, which then opens it alone, and `k1` no longer does.
fn rekey_seals_the_answer_again_with_the_first_key(url: &str) {
    let sealed_with = |url: &str| {
        let shown = json(&idem_with_keys(
            url,
            None,
            &["--json", "inspect", "--scope", "t1", "--key", "sealed"],
        ));
        shown["sealed_with"].as_str().expect("sealed").to_owned()
    };
    let without = idem_with_keys(url, None, &["rekey"]);
    assert_eq!(without.status.code(), Some(2), "{}", text(&without.stderr));
    assert!(
        text(&without.stderr).contains("IDEM_ENCRYPTION_KEYS"),
        "{}",
        text(&without.stderr)
    );

    let lost = idem_with_keys(url, Some(KEY_2), &["rekey"]);
    let shown = text(&lost.stdout);
    assert_eq!(lost.status.code(), Some(1), "{shown}{}", text(&lost.stderr));
    assert!(
        shown.contains(r#"key id "k1""#) && shown.contains(r#"scope "t1", key "sealed""#),
        "{shown}"
    );
    assert_eq!(sealed_with(url), "k1", "left as it is");

    let rotated = format!("{KEY_2},{KEY_1}");
    let dry = json(&idem_with_keys(
        url,
        Some(&rotated),
        &["--json", "rekey", "--dry-run"],
    ));
    assert_eq!(
        (
            &dry["dry_run"],
            &dry["read"],
            &dry["resealed"],
            &dry["current"]
        ),
        (
            &Value::Bool(true),
            &Value::from(1),
            &Value::from(1),
            &Value::from(0)
        ),
        "{dry}"
    );
    assert_eq!(sealed_with(url), "k1", "a dry run writes nothing");

    let done = idem_with_keys(url, Some(&rotated), &["rekey"]);
    let shown = text(&done.stdout);
    assert!(done.status.success(), "{shown}{}", text(&done.stderr));
    assert!(shown.contains(r#"sealed again 1 with key "k2""#), "{shown}");
    assert_eq!(sealed_with(url), "k2");
    let with_body = [
        "--json", "inspect", "--scope", "t1", "--key", "sealed", "--body",
    ];
    let opened = json(&idem_with_keys(url, Some(KEY_2), &with_body));
    assert_eq!(opened["response_body"], SEALED_BODY, "{opened}");
    let refused = idem_with_keys(url, Some(KEY_1), &with_body);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        text(&refused.stderr).contains(r#"key id "k2""#),
        "{}",
        text(&refused.stderr)
    );
}

/// Writes the sealed row with `insert` through `pool`, and runs `check` on the database at
/// `url`.
async fn with_the_sealed_row<'p, P: sqlx::Executor<'p>>(
    pool: P,
    insert: String,
    url: String,
    check: fn(&str),
) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(insert))
        .execute(pool)
        .await
        .expect("the sealed row");
    tokio::task::spawn_blocking(move || check(&url))
        .await
        .expect("the checks");
}

/// The test database of a `#[sqlx::test]`, migrated, and its URL for the command.
async fn migrated_postgres(connect: PgConnectOptions) -> (sqlx::PgPool, String) {
    let name = connect.get_database().expect("a test database").to_owned();
    let pool = PgPoolOptions::new()
        .connect_with(connect)
        .await
        .expect("connect");
    idem_runtime::migrate(&pool).await.expect("migrate");
    (pool, postgres_url("DATABASE_URL", &name))
}

/// A SQLite file in `dir`, migrated, and its URL for the command.
async fn migrated_sqlite(dir: &tempfile::TempDir) -> (sqlx::SqlitePool, String) {
    let path = dir.path().join("keys.db");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = sqlx::SqlitePool::connect_with(options).await.expect("open");
    idem_runtime::migrate(&pool).await.expect("migrate");
    (pool, format!("sqlite:{}", path.display()))
}

/// Runs `check` on a fresh PostgreSQL database holding the sealed row.
async fn on_postgres_with_the_sealed_row(connect: PgConnectOptions, check: fn(&str)) {
    let (pool, url) = migrated_postgres(connect).await;
    let insert = sealed_row(
        "key",
        r"'\x00'",
        &format!(r"'\x{SEALED_HEX}'"),
        "now()",
        "now() + interval '1 day'",
    );
    with_the_sealed_row(&pool, insert, url, check).await;
}

/// Runs `check` on a fresh SQLite file holding the sealed row.
async fn on_sqlite_with_the_sealed_row(check: fn(&str)) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (pool, url) = migrated_sqlite(&dir).await;
    let insert = sealed_row(
        "key",
        "x'00'",
        &format!("x'{SEALED_HEX}'"),
        "unixepoch() * 1000",
        "unixepoch() * 1000 + 86400000",
    );
    with_the_sealed_row(&pool, insert, url, check).await;
}

/// Runs `check` on a fresh MySQL database, named `name`, holding the sealed row.
async fn on_mysql_with_the_sealed_row(name: &str, check: fn(&str)) {
    let mysql = FreshMySql::create(name).await;
    idem_runtime::migrate(&mysql.pool).await.expect("migrate");
    let insert = sealed_row(
        "`key`",
        "x'00'",
        &format!("x'{SEALED_HEX}'"),
        "UTC_TIMESTAMP(6)",
        "UTC_TIMESTAMP(6) + INTERVAL 1 DAY",
    );
    with_the_sealed_row(&mysql.pool, insert, mysql.url.clone(), check).await;
    mysql.drop().await;
}

#[sqlx::test(migrations = false)]
async fn postgres_inspect_opens_a_sealed_answer_only_with_its_key(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    on_postgres_with_the_sealed_row(connect, sealed_answers_open_with_the_keys_given).await;
}

#[tokio::test]
async fn sqlite_inspect_opens_a_sealed_answer_only_with_its_key() {
    on_sqlite_with_the_sealed_row(sealed_answers_open_with_the_keys_given).await;
}

#[tokio::test]
async fn mysql_inspect_opens_a_sealed_answer_only_with_its_key() {
    on_mysql_with_the_sealed_row(
        "idem_test_cli_sealed",
        sealed_answers_open_with_the_keys_given,
    )
    .await;
}

#[sqlx::test(migrations = false)]
async fn postgres_rekey_seals_the_answer_again_with_the_first_key(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    on_postgres_with_the_sealed_row(connect, rekey_seals_the_answer_again_with_the_first_key).await;
}

#[tokio::test]
async fn sqlite_rekey_seals_the_answer_again_with_the_first_key() {
    on_sqlite_with_the_sealed_row(rekey_seals_the_answer_again_with_the_first_key).await;
}

#[tokio::test]
async fn mysql_rekey_seals_the_answer_again_with_the_first_key() {
    on_mysql_with_the_sealed_row(
        "idem_test_cli_rekey",
        rekey_seals_the_answer_again_with_the_first_key,
    )
    .await;
}

#[tokio::test]
async fn mysql_forget_erases_a_scopes_completed_keys() {
    let mysql = FreshMySql::create("idem_test_cli_forget").await;
    idem_runtime::migrate(&mysql.pool).await.expect("migrate");
    sqlx::raw_sql(MYSQL_ROWS)
        .execute(&mysql.pool)
        .await
        .expect("rows");
    forget_erases_a_scopes_completed_keys(&mysql.url, |key| mysql_count(mysql.pool.clone(), key))
        .await;
    mysql.drop().await;
}

/// A malformed `IDEM_ENCRYPTION_KEYS` stops the command, status 2, before it connects (the
/// database here does not exist): the message names the variable and the fault, never a key.
#[test]
fn malformed_encryption_keys_stop_the_command_before_it_connects_naming_the_variable() {
    for (keys, fault) in [
        ("k1:not base64!", "not base64"),
        (
            "k1:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==",
            "31 bytes",
        ),
        (
            ":AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
            r#"key id """#,
        ),
        (format!("{KEY_1},{KEY_1}").as_str(), "given twice"),
    ] {
        let output = idem_with_keys("sqlite:/nonexistent/keys.db", Some(keys), &["stats"]);
        let said = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{keys}: {said}");
        assert!(
            said.contains("IDEM_ENCRYPTION_KEYS") && said.contains(fault),
            "{keys}: the refusal names the variable and the fault: {said}"
        );
        assert!(
            !said.contains("AAECAwQF") && !said.contains("unable to open"),
            "{keys}: neither a key nor a connection in: {said}"
        );
    }
}

/// The rows of `key` in the key table of `pool` (all rows: `None`), on PostgreSQL.
async fn postgres_count(pool: sqlx::PgPool, key: Option<&'static str>) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idem_keys WHERE $1 IS NULL OR key = $1")
        .bind(key)
        .fetch_one(&pool)
        .await
        .expect("count")
}

/// [`postgres_count`] on SQLite.
async fn sqlite_count(pool: sqlx::SqlitePool, key: Option<&'static str>) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idem_keys WHERE $1 IS NULL OR key = $1")
        .bind(key)
        .fetch_one(&pool)
        .await
        .expect("count")
}

/// [`postgres_count`] on MySQL.
async fn mysql_count(pool: sqlx::MySqlPool, key: Option<&'static str>) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idem_keys WHERE ? IS NULL OR `key` = ?")
        .bind(key)
        .bind(key)
        .fetch_one(&pool)
        .await
        .expect("count")
}

/// The database `name` on the PostgreSQL server (or pooler) of the URL in `$variable`.
fn postgres_url(variable: &str, name: &str) -> String {
    let base =
        std::env::var(variable).unwrap_or_else(|_| panic!("{variable} is set by scripts/test"));
    let (server, _) = base
        .split('?')
        .next()
        .unwrap()
        .rsplit_once('/')
        .expect("a database path");
    format!("{server}/{name}")
}

/// [`migrated_postgres`] holding the rows of the module doc ([`POSTGRES_ROWS`]).
async fn seeded_postgres(connect: PgConnectOptions) -> (sqlx::PgPool, String) {
    let (pool, url) = migrated_postgres(connect).await;
    sqlx::raw_sql(POSTGRES_ROWS)
        .execute(&pool)
        .await
        .expect("rows");
    (pool, url)
}

/// [`migrated_sqlite`] holding the rows of the module doc ([`SQLITE_ROWS`]).
async fn seeded_sqlite(dir: &tempfile::TempDir) -> (sqlx::SqlitePool, String) {
    let (pool, url) = migrated_sqlite(dir).await;
    sqlx::raw_sql(SQLITE_ROWS)
        .execute(&pool)
        .await
        .expect("rows");
    (pool, url)
}

#[sqlx::test(migrations = false)]
async fn postgres_the_command_does_what_it_says(_: PgPoolOptions, connect: PgConnectOptions) {
    let (pool, url) = seeded_postgres(connect).await;
    the_command_does_what_it_says(&url, |key| postgres_count(pool.clone(), key)).await;
}

#[tokio::test]
async fn sqlite_the_command_does_what_it_says() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (pool, url) = seeded_sqlite(&dir).await;
    the_command_does_what_it_says(&url, |key| sqlite_count(pool.clone(), key)).await;
}

#[sqlx::test(migrations = false)]
async fn postgres_forget_erases_a_scopes_completed_keys(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, url) = seeded_postgres(connect).await;
    forget_erases_a_scopes_completed_keys(&url, |key| postgres_count(pool.clone(), key)).await;
}

#[tokio::test]
async fn sqlite_forget_erases_a_scopes_completed_keys() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (pool, url) = seeded_sqlite(&dir).await;
    forget_erases_a_scopes_completed_keys(&url, |key| sqlite_count(pool.clone(), key)).await;
}

/// The server of `MYSQL_URL` (default: the local MariaDB), without a database path.
fn mysql_server() -> String {
    let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
    let url = url.split('?').next().unwrap_or_default().to_owned();
    match url.split_once("://") {
        Some((scheme, rest)) => format!("{scheme}://{}", rest.split('/').next().unwrap_or("")),
        None => url,
    }
}

/// A fresh database on the server of `MYSQL_URL`, dropped by [`FreshMySql::drop`] (a failed
/// test leaves it, for the next run's `DROP DATABASE IF EXISTS` or scripts/test).
struct FreshMySql {
    /// A connection to the server, without a database.
    admin: sqlx::MySqlPool,
    name: String,
    /// The database's URL, for the command.
    url: String,
    /// Two connections to the database, for the test.
    pool: sqlx::MySqlPool,
}

impl FreshMySql {
    /// The database `<prefix>_<process id>`, emptied if a run before left it.
    async fn create(prefix: &str) -> Self {
        let server = mysql_server();
        let name = format!("{prefix}_{}", std::process::id());
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&server)
            .await
            .expect("connect to MYSQL_URL");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name}; CREATE DATABASE {name}"
        )))
        .execute(&admin)
        .await
        .expect("a fresh database");
        let url = format!("{server}/{name}");
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .expect("connect to the test database");
        Self {
            admin,
            name,
            url,
            pool,
        }
    }

    /// Drops the database, its pool closed first.
    async fn drop(self) {
        self.pool.close().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {}", self.name)))
            .execute(&self.admin)
            .await
            .expect("drop the test database");
    }
}

#[tokio::test]
async fn mysql_the_command_does_what_it_says() {
    let FreshMySql {
        admin,
        name,
        url,
        pool,
    } = FreshMySql::create("idem_test_cli").await;

    // Before the service has run: no key table.
    let output = idem(&url, &["stats"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        text(&output.stderr).contains("no idem_keys table"),
        "{}",
        text(&output.stderr)
    );

    idem_runtime::migrate(&pool).await.expect("migrate");
    sqlx::raw_sql(MYSQL_ROWS)
        .execute(&pool)
        .await
        .expect("rows");
    let count = |key: Option<&'static str>| mysql_count(pool.clone(), key);
    the_command_does_what_it_says(&url, count).await;

    // A transactional claim in flight is the claiming transaction's uncommitted row: not in
    // flight for the command, not found, not waited for.
    let mut claim = pool.begin().await.expect("begin");
    sqlx::query(MYSQL_CLAIM)
        .bind("t4")
        .bind("claimed")
        .execute(&mut *claim)
        .await
        .expect("an uncommitted claim");
    let stats = json(&idem(&url, &["--json", "--timeout", "10s", "stats"]));
    assert_eq!(stats["in_flight"], 0, "{stats}");
    assert_eq!(stats["expired"], 0, "{stats}");
    let held = idem(
        &url,
        &[
            "--timeout",
            "10s",
            "release",
            "--scope",
            "t4",
            "--key",
            "claimed",
        ],
    );
    assert_eq!(held.status.code(), Some(1), "{}", text(&held.stderr));
    assert!(
        text(&held.stderr).contains("no key"),
        "{}",
        text(&held.stderr)
    );
    let purged = json(&idem(&url, &["--json", "--timeout", "10s", "purge"]));
    assert_eq!(
        purged["expired"], 0,
        "the claim is not the purge's: {purged}"
    );
    claim.rollback().await.expect("rollback");
    assert_eq!(count(Some("claimed")).await, 0, "the rollback took it");

    // A handler that ran COMMIT itself leaves a committed started row, expired, without a
    // lease: not in flight, purged like any expired row.
    sqlx::query(MYSQL_CLAIM)
        .bind("t3")
        .bind("committed")
        .execute(&pool)
        .await
        .expect("a committed claim");
    // A row another transaction is writing (locked) is not released under it.
    let mut writer = pool.begin().await.expect("begin");
    sqlx::query("SELECT status FROM idem_keys WHERE `key` = 'committed' FOR UPDATE")
        .execute(&mut *writer)
        .await
        .expect("lock the row");
    let busy = idem(
        &url,
        &[
            "--timeout",
            "10s",
            "release",
            "--scope",
            "t3",
            "--key",
            "committed",
        ],
    );
    assert_eq!(busy.status.code(), Some(1), "{}", text(&busy.stderr));
    assert!(
        text(&busy.stderr).contains("being written by another transaction"),
        "{}",
        text(&busy.stderr)
    );
    writer.commit().await.expect("commit");
    assert_eq!(count(Some("committed")).await, 1, "not released");
    let stats = json(&idem(&url, &["--json", "stats"]));
    assert_eq!(stats["in_flight"], 0, "{stats}");
    assert_eq!(stats["oldest_in_flight_ms"], Value::Null, "{stats}");
    assert_eq!(stats["expired"], 1, "{stats}");
    let flying = json(&idem(&url, &["--json", "in-flight"]));
    assert_eq!(flying.as_array().unwrap().len(), 0, "{flying}");
    let purged = json(&idem(&url, &["--json", "purge"]));
    assert_eq!(purged["expired"], 1, "{purged}");
    assert_eq!(count(Some("committed")).await, 0);
    assert_eq!(count(None).await, 3, "only the live keys are left");

    FreshMySql {
        admin,
        name,
        url,
        pool,
    }
    .drop()
    .await;
}

#[tokio::test]
async fn a_database_without_the_key_table_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("empty.db");
    std::fs::File::create(&path).expect("an empty file");
    let output = idem(&format!("sqlite:{}", path.display()), &["stats"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        text(&output.stderr).contains("no idem_keys table"),
        "{}",
        text(&output.stderr)
    );
}

/// Runs `idem --timeout 1s stats` against a server that accepts connections and never answers,
/// as a database behind a partition looks (nothing is refused, nothing comes back), at the URL
/// `url` makes of its port; checks that the command fails at its timeout.
async fn fails_at_its_timeout(url: fn(u16) -> String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let port = listener.local_addr().expect("addr").port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&accepted);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(socket);
        }
    });
    let url = url(port);
    let output = tokio::task::spawn_blocking(move || idem(&url, &["--timeout", "1s", "stats"]))
        .await
        .expect("run idem");
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
    assert!(
        text(&output.stderr).contains("did not answer within 1s"),
        "{}",
        text(&output.stderr)
    );
    assert!(
        accepted.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the command reached the silent server"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_database_that_does_not_answer_fails_the_command_at_its_timeout() {
    fails_at_its_timeout(|port| {
        format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=disable")
    })
    .await;
}

/// MySQL's server speaks first (its handshake): a silent one leaves the connection waiting.
#[tokio::test(flavor = "multi_thread")]
async fn a_mysql_server_that_does_not_answer_fails_the_command_at_its_timeout() {
    fails_at_its_timeout(|port| format!("mysql://root@127.0.0.1:{port}/idem")).await;
}

#[test]
fn a_url_that_names_no_supported_database_is_refused_with_the_schemes_that_are() {
    let output = idem("redis://127.0.0.1:6379", &["stats"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("`redis` names no database")
            && stderr.contains("postgres://")
            && stderr.contains("mysql://")
            && stderr.contains("sqlite:"),
        "{stderr}"
    );
}

/// The command through PgBouncer (Debian's 1.18) in transaction mode, of PgBouncer's stock
/// configuration (no `ignore_startup_parameters`): what it refuses is said as the service says
/// it, with the remedies, not as sqlx's bare error (`prepared statement "sqlx_s_1" already
/// exists at line 412`). Needs `$POOLER_STOCK_TRANSACTION_URL` (`POOL_MODE=transaction
/// POOLER_IGNORE_STARTUP_PARAMETERS= scripts/pooler up`): ignored in the suite, run by
/// scripts/test's pooler pass.
mod pooler {
    use super::{idem, postgres_url, text};
    use sqlx::{
        Connection,
        postgres::{PgConnectOptions, PgConnection, PgPoolOptions},
    };

    #[sqlx::test(migrations = false)]
    #[ignore = "needs scripts/pooler: run by scripts/test"]
    async fn through_a_stock_transaction_mode_pgbouncer_the_command_says_what_the_pooler_does(
        _: PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        let name = connect.get_database().expect("a test database").to_owned();
        let direct = PgPoolOptions::new()
            .connect_with(connect)
            .await
            .expect("connect");
        idem_runtime::migrate(&direct).await.expect("migrate");
        let url = postgres_url("POOLER_STOCK_TRANSACTION_URL", &name);

        // The pooler's server connection keeps the statement another client prepared under
        // sqlx's first name, and hands it to the command's first statement next.
        let options = idem_runtime::postgres::connect_options(&url).expect("the pooler's URL");
        let mut other = PgConnection::connect_with(&options)
            .await
            .expect("connect through the pooler");
        sqlx::query("SELECT 1")
            .execute(&mut other)
            .await
            .expect("a prepared statement through the pooler");
        other.close().await.expect("close");
        let output = idem(&url, &["stats"]);
        let said = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{said}");
        assert!(
            !said.contains("unsupported startup parameter"),
            "the command sends no startup parameter a stock PgBouncer refuses: {said}"
        );
        for words in [
            "a pooler in transaction mode",
            "sqlx_s_1",
            "session mode",
            "max_prepared_statements",
            "a direct connection",
        ] {
            assert!(said.contains(words), "no {words:?} in: {said}");
        }
        assert!(!said.contains(" at line "), "sqlx's bare error: {said}");

        // A startup parameter of the person's own (libpq's `options`), refused by the pooler.
        let output = idem(
            &format!("{url}?options=-c%20statement_timeout%3D5000"),
            &["stats"],
        );
        let said = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{said}");
        for words in [
            "PgBouncer",
            "unsupported startup parameter: options",
            "ignore_startup_parameters",
        ] {
            assert!(said.contains(words), "no {words:?} in: {said}");
        }
    }
}
