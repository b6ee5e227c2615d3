//! How the command prints: tables for people, JSON for scripts.

use comfy_table::Table;
use serde_json::json;

use idem_runtime::{
    admin::{Forgotten, GrpcAnswer, KeyInfo as Key, ParkedClaim, Rekeyed, Stats},
    grpc::code_name,
};

/// Prints `value` as indented JSON, for scripts.
fn print_json<T: serde::Serialize + ?Sized>(value: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_default()
    );
}

/// A length of time as a person reads it: milliseconds under a second (`543ms`), then whole
/// units down to one below the largest (`45s`, `4m 45s`, `2h 5m`, `3days 4h`), never
/// `4m 45s 543ms`.
fn ago(ms: Option<i64>) -> String {
    const SECOND: u64 = 1_000;
    const MINUTE: u64 = 60 * SECOND;
    const HOUR: u64 = 60 * MINUTE;
    const DAY: u64 = 24 * HOUR;
    ms.map_or_else(String::new, |ms| {
        let ms = ms.unsigned_abs();
        let unit = match ms {
            DAY.. => HOUR,
            HOUR.. => MINUTE,
            SECOND.. => SECOND,
            _ => 1,
        };
        humantime::format_duration(std::time::Duration::from_millis(ms / unit * unit)).to_string()
    })
}

fn signed(ms: Option<i64>) -> String {
    match ms {
        Some(ms) if ms < 0 => format!("-{}", ago(Some(ms))),
        other => ago(other),
    }
}

/// The recorded steps `steps` (JSON) without what they saved: `[{"step": name}]`.
fn step_names(steps: &str) -> serde_json::Value {
    let steps: Vec<serde_json::Value> = serde_json::from_str(steps).unwrap_or_default();
    steps
        .iter()
        .map(|step| json!({ "step": step["step"] }))
        .collect()
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

/// Said under the counts and the claims in flight: what they cannot show.
const TRANSACTIONAL_UNSEEN: &str = "in flight: external-mode claims only; a transactional \
     handler's claim is invisible outside its own transaction until it commits";

pub fn stats(stats: &Stats, json: bool) {
    if json {
        // `in_flight`, as the table says: one word for one thing.
        print_json(&json!({
            "completed": stats.completed,
            "in_flight": stats.started,
            "oldest_in_flight_ms": stats.oldest_started_ms,
            "expired": stats.expired,
            "parked": stats.parked,
        }));
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
    println!("{TRANSACTIONAL_UNSEEN}");
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
        Some(GrpcAnswer::Status(code, message)) => (code_name(code).to_owned(), Some(message)),
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
    let grpc = key.grpc_answer();
    if json {
        let mut value = serde_json::to_value(key).unwrap_or_default();
        // A gRPC call's answer is its code: the HTTP status it is kept under is left out, as
        // it is no answer the caller got (several codes share one).
        if grpc.is_some()
            && let Some(fields) = value.as_object_mut()
        {
            fields.remove("response_status");
        }
        match grpc {
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
        // What a step saved is content, as a body is: its name alone without `--body`.
        if !with_body && let Some(steps) = key.steps.as_deref() {
            value["steps"] = json!(step_names(steps));
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
        (
            if grpc.is_some() {
                "grpc status"
            } else {
                "response status"
            },
            status,
        ),
        ("age", ago(Some(key.age_ms))),
        ("expires in", signed(Some(key.expires_in_ms))),
        ("claimed", ago(key.claimed_ms)),
        ("lease left", signed(key.lease_left_ms)),
        ("recovery point", recovery_point(key.steps.as_deref())),
    ];
    for (name, value) in rows {
        table.add_row([name.to_owned(), value]);
    }
    if let Some(id) = &key.sealed_with {
        table.add_row(["sealed with key".to_owned(), id.clone()]);
    }
    if let Some(body) = body {
        table.add_row(["body".to_owned(), body]);
    }
    if with_body && let Some(steps) = &key.steps {
        table.add_row(["recorded steps".to_owned(), steps.clone()]);
    }
    println!("{table}");
}

/// The claims in flight taken at least `older_than` ago; "none" rather than an empty table.
pub fn keys(keys: &[Key], older_than: std::time::Duration, json: bool) {
    if json {
        // What a step saved is content: its name alone, as `inspect` shows it without `--body`.
        let mut value = serde_json::to_value(keys).unwrap_or_default();
        if let Some(listed) = value.as_array_mut() {
            for (shown, key) in listed.iter_mut().zip(keys) {
                if let Some(steps) = key.steps.as_deref() {
                    shown["steps"] = json!(step_names(steps));
                }
            }
        }
        print_json(&value);
        return;
    }
    if keys.is_empty() {
        if older_than.is_zero() {
            println!("none in flight");
        } else {
            println!(
                "none in flight for {} or longer",
                ago(i64::try_from(older_than.as_millis()).ok())
            );
        }
        println!("{TRANSACTIONAL_UNSEEN}");
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
    println!("{TRANSACTIONAL_UNSEEN}");
}

/// The parked claims; "none" rather than an empty table.
pub fn parked(claims: &[ParkedClaim], json: bool) {
    if json {
        print_json(claims);
        return;
    }
    if claims.is_empty() {
        println!("none parked");
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

/// What `forget` deleted of `scope`, and what it left and why.
pub fn forgotten(forgotten: &Forgotten, scope: &str, json: bool) {
    if json {
        print_json(forgotten);
        return;
    }
    println!(
        "deleted {} completed keys of scope {scope:?}: a retry of one runs the handler again",
        forgotten.deleted
    );
    println!(
        "left {} claims in flight: their handler or the recovery is at work, and deleting one \
         would let a retry run its side effect twice; forget again once they complete",
        forgotten.in_flight_left
    );
    println!(
        "left {} parked claims: whether their work happened is for a person to find out \
         (`idem dead`, then `idem resume` or `idem abandon`)",
        forgotten.parked_left
    );
}

/// What `rekey` sealed again, or with `--dry-run` would, and what it left and why.
pub fn rekeyed(rekeyed: &Rekeyed, json: bool) {
    if json {
        print_json(rekeyed);
        return;
    }
    let id = &rekeyed.sealing_id;
    let verb = if rekeyed.dry_run {
        "would seal again"
    } else {
        "sealed again"
    };
    println!(
        "read {} completed keys and parked claims: {verb} {} with key {id:?} ({} of them held \
         something in the clear); {} already sealed with it",
        rekeyed.read, rekeyed.resealed, rekeyed.from_clear, rekeyed.current
    );
    if rekeyed.in_flight_left > 0 {
        println!(
            "left {} claims in flight: their answer is sealed with key {id:?} when they \
             complete; rekey again once they have, before retiring a key",
            rekeyed.in_flight_left
        );
    }
    for (needed, rows) in &rekeyed.unopened {
        println!(
            "left {rows} that do not open with key id {needed:?}: give that key in \
             IDEM_ENCRYPTION_KEYS (after the first), or they were altered; a retry of one is \
             answered 500"
        );
    }
    if rekeyed.corrupt > 0 {
        println!(
            "left {} whose headers, steps or status do not read as idem writes them",
            rekeyed.corrupt
        );
    }
    for (scope, key) in &rekeyed.unopened_keys {
        println!("  left: scope {scope:?}, key {key:?} (idem inspect --body)");
    }
    if rekeyed.busy > 0 {
        println!(
            "left {} held by another transaction (a retry taking an expired key over): run \
             rekey again",
            rekeyed.busy
        );
    }
    if rekeyed.gone > 0 {
        println!(
            "{} were deleted or taken over while it ran (the purge, forget, a retry): nothing \
             of them was left to seal",
            rekeyed.gone
        );
    }
}
