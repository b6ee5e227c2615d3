//! How the command prints: tables for people, JSON for scripts.

use comfy_table::Table;
use serde_json::json;

use idem_runtime::admin::{GrpcAnswer, KeyInfo as Key, ParkedClaim, Stats};

/// Prints `value` as indented JSON, for scripts.
fn print_json<T: serde::Serialize + ?Sized>(value: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_default()
    );
}

fn ago(ms: Option<i64>) -> String {
    ms.map_or_else(String::new, |ms| {
        humantime::format_duration(std::time::Duration::from_millis(ms.unsigned_abs())).to_string()
    })
}

fn signed(ms: Option<i64>) -> String {
    match ms {
        Some(ms) if ms < 0 => format!("-{}", ago(Some(ms))),
        other => ago(other),
    }
}

/// The recovery point: the last recorded step and how many there are.
fn recovery_point(steps: Option<&str>) -> String {
    let Some(steps) = steps.and_then(|s| serde_json::from_str::<Vec<serde_json::Value>>(s).ok())
    else {
        return String::new();
    };
    steps.last().map_or_else(String::new, |last| {
        format!(
            "{} ({} recorded)",
            last["step"].as_str().unwrap_or("?"),
            steps.len()
        )
    })
}

pub fn stats(stats: &Stats, json: bool) {
    if json {
        print_json(stats);
        return;
    }
    let mut table = Table::new();
    table.set_header([
        "completed",
        "in flight",
        "oldest in flight",
        "expired, not purged",
        "parked",
    ]);
    table.add_row([
        stats.completed.to_string(),
        stats.started.to_string(),
        ago(stats.oldest_started_ms),
        stats.expired.to_string(),
        stats.parked.to_string(),
    ]);
    println!("{table}");
}

/// A gRPC code as gRPC spells it (`NOT_FOUND`).
fn code_name(code: tonic::Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

/// What `inspect` prints of a stored answer: its status (a gRPC call's code, which the HTTP
/// status it is kept under does not tell), and its body when asked (a gRPC status's message,
/// a protobuf message in hex, an HTTP body as text).
fn answer(key: &Key, with_body: bool) -> (String, Option<String>) {
    let http_status = || {
        key.response_status
            .map(|s| s.to_string())
            .unwrap_or_default()
    };
    let (status, body) = match key.grpc_answer() {
        Some(GrpcAnswer::Message(bytes)) => (
            format!("OK (a message of {} bytes)", bytes.len()),
            Some(bytes.iter().map(|byte| format!("{byte:02x}")).collect()),
        ),
        Some(GrpcAnswer::Status(code, message)) => (code_name(code), Some(message)),
        _ => (
            http_status(),
            key.response_body
                .as_deref()
                .map(|body| String::from_utf8_lossy(body).into_owned()),
        ),
    };
    (status, body.filter(|_| with_body))
}

pub fn key(key: &Key, with_body: bool, json: bool) {
    let (status, body) = answer(key, with_body);
    if json {
        let mut value = serde_json::to_value(key).unwrap_or_default();
        match key.grpc_answer() {
            Some(GrpcAnswer::Message(bytes)) => {
                value["grpc_status"] = json!("OK");
                value["grpc_message_bytes"] = json!(bytes.len());
            }
            Some(GrpcAnswer::Status(code, _)) => value["grpc_status"] = json!(code_name(code)),
            _ => {}
        }
        if let Some(body) = body {
            value["response_body"] = json!(body);
        }
        print_json(&value);
        return;
    }
    let mut table = Table::new();
    let rows = [
        ("scope", key.scope.clone()),
        ("key", key.key.clone()),
        ("status", key.status.clone()),
        ("route", format!("{} {}", key.method, key.path)),
        ("response status", status),
        ("age", ago(Some(key.age_ms))),
        ("expires in", signed(Some(key.expires_in_ms))),
        ("claimed", ago(key.claimed_ms)),
        ("lease left", signed(key.lease_left_ms)),
        ("recovery point", recovery_point(key.steps.as_deref())),
    ];
    for (name, value) in rows {
        table.add_row([name.to_owned(), value]);
    }
    if let Some(body) = body {
        table.add_row(["body".to_owned(), body]);
    }
    println!("{table}");
}

pub fn keys(keys: &[Key], json: bool) {
    if json {
        print_json(keys);
        return;
    }
    let mut table = Table::new();
    table.set_header([
        "scope",
        "key",
        "route",
        "claimed",
        "lease left",
        "recovery point",
    ]);
    for key in keys {
        table.add_row([
            key.scope.clone(),
            key.key.clone(),
            format!("{} {}", key.method, key.path),
            ago(key.claimed_ms),
            signed(key.lease_left_ms),
            recovery_point(key.steps.as_deref()),
        ]);
    }
    println!("{table}");
}

pub fn parked(claims: &[ParkedClaim], json: bool) {
    if json {
        print_json(claims);
        return;
    }
    let mut table = Table::new();
    table.set_header([
        "scope",
        "key",
        "route",
        "rounds",
        "last error",
        "parked",
        "claimed",
    ]);
    for claim in claims {
        table.add_row([
            claim.scope.clone(),
            claim.key.clone(),
            format!("{} {}", claim.method, claim.path),
            claim.attempts.to_string(),
            claim.last_error.clone().unwrap_or_default(),
            ago(Some(claim.parked_ms)),
            ago(claim.claimed_ms),
        ]);
    }
    println!("{table}");
}

pub fn message(json: bool, done: &str, scope: &str, key: &str) {
    if json {
        println!("{}", json!({ "result": done, "scope": scope, "key": key }));
    } else {
        println!("{done}: key {key:?} in scope {scope:?}");
    }
}

pub fn purged(rows: u64, dry_run: bool, json: bool) {
    if json {
        println!("{}", json!({ "expired": rows, "deleted": !dry_run }));
    } else if dry_run {
        println!("{rows} expired keys would be deleted");
    } else {
        println!("deleted {rows} expired keys");
    }
}
