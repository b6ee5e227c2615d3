//! The alert rules (`deploy/prometheus/idem.rules.yml`) against real faults. A real Prometheus
//! scrapes the example's real services (`payments` and `ledger`, on MariaDB and RabbitMQ) every
//! second and evaluates the rules; ordinary clients pay and replay throughout. For each alert,
//! its fault is made to happen for real (the database partitioned away until a first burst of
//! requests fails, a client reusing a key, duplicates racing, the service SIGKILLed mid-refund,
//! the service started without its purge or its recovery task, an order's process aborted mid-way with
//! the processor away or a hook that leaves it to retries, the broker away, a topic bound to no
//! queue, a message the ledger cannot read), the test waits until Prometheus lists the alert as
//! firing, ends the fault, and waits until the alert is gone over freshly scraped series (not
//! merely in the gap a restarted service leaves in its series). Then the same services carry
//! ordinary traffic for as long as the longest fault lasted, and no alert may fire. The times
//! are printed as a table (`--success-output immediate`, or `--no-capture`, shows it).
//!
//! Prometheus loads a copy of the shipped rules whose time windows are sixty times shorter
//! ([`with_short_windows`]: a minute becomes a second); nothing else of the rules changes, so
//! what fires here is what the shipped file says. The copy is checked by its own fast test,
//! with `promtool check rules`.
//!
//! The faults are the table [`faults`], one row per alert: the alert, how its fault is caused
//! and how it is ended. A fast test checks that every alert of the rules has its row, so an
//! alert added to the rules without a fault here fails the suite.
//!
//! The long test runs in a pass of its own after the suite (`scripts/test`), so that its
//! times are not another test's load; it takes about five and a half minutes, most of it the
//! alerts' windows running out: `IdemPurgeBehind` alone needs a service without its purge for
//! over a minute (the copy's hour), and the healthy run then lasts as long.

use crate::support::{self, Database, Process, Processor, refunds_executed, wait_until};

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_events::{Message, Publisher};
use idem_runtime::{Store, admin::Unparked};
use idem_tests::{BrokerKind, DEADLINE, PartitionProxy, TcpProxy, TestBroker};
use reqwest::{Client, StatusCode, Url};
use serde_json::{Value, json};
use sqlx::MySql;
use tokio::{task::JoinHandle, time::Instant};

/// The rules as shipped.
const RULES: &str = include_str!("../../../deploy/prometheus/idem.rules.yml");

/// How many times shorter the copy's time windows are: a minute of the shipped rules is a
/// second of the copy.
const SCALE: u64 = 60;

/// The tenant of every request of the test.
const TENANT: &str = "tenant-alerts";

// ---------------------------------------------------------------------------------------------
// The copy of the rules with short windows.

/// The shipped rules with their time windows divided by [`SCALE`], for a test that must see
/// an alert fire and resolve within seconds. Exactly three kinds of number change:
///
/// - in expressions, range and subquery durations (`[15m]` → `[15s]`) and `offset`s
///   (`offset 15m` → `offset 15s`);
/// - `for:` durations (`for: 5m` → `for: 5s`);
/// - a threshold compared with a gauge in seconds, a series whose name ends `_seconds`: an age,
///   such as the relay's lag (`max(idem_outbox_oldest_waiting_seconds) > 60` → `> 1`), or a
///   time measured from a timestamp, such as the purge's (`time() -
///   max(idem_purge_last_success_timestamp_seconds) > 3600` → `> 60`: the hour without a
///   pass that got through becomes a minute; the timestamp itself, a date, is not scaled).
///
/// Everything else stays as shipped: ratios (`> 0.2`), counts (`> 3`), rates (`> 0.1`, per
/// second), a latency read from a histogram (`_seconds_bucket`), labels, names and comments.
/// `IdemConflictsHigh`'s guard, a request every ten seconds (`> 0.1` per second), is a rate and
/// stays: the test's traffic is far above it. Quoted expressions are refused (none is quoted):
/// the rewrite reads them bare.
///
/// What the services do in time is not shortened: the store's database deadline (10 s), the
/// relay's backoff (up to 30 s), the consumer's retries. So `IdemStoreFailing` fires only once
/// requests have waited out their deadline; and in an outage longer than the test's, the
/// relay's backoff would leave the copy's 10 s window with fewer than four failed passes and
/// `IdemRelayFailing` would end by itself (it would not with the shipped ten minutes): the test
/// ends each fault as soon as its alert fires.
fn with_short_windows(rules: &str) -> String {
    let lines: Vec<&str> = rules.lines().collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut at = 0;
    while at < lines.len() {
        let line = lines[at];
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        if let Some(value) = trimmed.strip_prefix("for:") {
            out.push(format!("{indent}for: {}", shorter_duration(value.trim())));
        } else if let Some(rest) = trimmed.strip_prefix("expr:") {
            let rest = rest.trim();
            assert!(
                !rest.starts_with(['"', '\'']),
                "a quoted expression, which the rewrite does not read: {line}"
            );
            if matches!(rest, "|" | "|-" | ">" | ">-") {
                out.push(line.to_owned());
                let mut block = Vec::new();
                while let Some(next) = lines.get(at + 1)
                    && (next.trim().is_empty()
                        || next.len() - next.trim_start().len() > indent.len())
                {
                    block.push(*next);
                    at += 1;
                }
                out.extend(
                    shorter_expr(&block.join("\n"))
                        .split('\n')
                        .map(str::to_owned),
                );
            } else {
                out.push(format!("{indent}expr: {}", shorter_expr(rest)));
            }
        } else {
            out.push(line.to_owned());
        }
        at += 1;
    }
    out.join("\n") + "\n"
}

/// `expr` with its range, subquery and offset durations, and the thresholds of its gauges in
/// seconds, divided by [`SCALE`] (see [`with_short_windows`]).
fn shorter_expr(expr: &str) -> String {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = String::with_capacity(expr.len());
    // A gauge in seconds was read since the last comparison or set operator: the number the
    // next comparison sets it against is a time.
    let mut seconds_read = false;
    let mut at = 0;
    let take = |at: &mut usize, keep: &dyn Fn(char) -> bool| {
        let start = *at;
        while *at < chars.len() && keep(chars[*at]) {
            *at += 1;
        }
        chars[start..*at].iter().collect::<String>()
    };
    while at < chars.len() {
        let c = chars[at];
        if matches!(c, '"' | '\'' | '`') {
            // A string (a label's value) as it is, escapes included.
            out.push(c);
            at += 1;
            while at < chars.len() && chars[at] != c {
                if chars[at] == '\\' && c != '`' {
                    out.push(chars[at]);
                    at += 1;
                }
                if at < chars.len() {
                    out.push(chars[at]);
                    at += 1;
                }
            }
            if at < chars.len() {
                out.push(c);
                at += 1;
            }
        } else if c == '[' {
            at += 1;
            let inner = take(&mut at, &|c| c != ']');
            let parts: Vec<String> = inner
                .split(':')
                .map(|part| {
                    if part.trim().is_empty() {
                        part.to_owned()
                    } else {
                        shorter_duration(part.trim())
                    }
                })
                .collect();
            write!(out, "[{}]", parts.join(":")).expect("a string takes it");
            at += 1;
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let word = take(&mut at, &|c| {
                c.is_ascii_alphanumeric() || c == '_' || c == ':'
            });
            out.push_str(&word);
            match word.as_str() {
                "offset" => {
                    out.push_str(&take(&mut at, &char::is_whitespace));
                    let duration = take(&mut at, &|c| c.is_ascii_alphanumeric());
                    out.push_str(&shorter_duration(&duration));
                }
                "and" | "or" | "unless" => seconds_read = false,
                name if name.ends_with("_seconds") => seconds_read = true,
                _ => {}
            }
        } else if matches!(c, '>' | '<' | '=' | '!') {
            let operator = take(&mut at, &|c| matches!(c, '>' | '<' | '=' | '!' | '~'));
            out.push_str(&operator);
            let comparison = matches!(operator.as_str(), ">" | ">=" | "<" | "<=" | "==" | "!=");
            if comparison && seconds_read {
                out.push_str(&take(&mut at, &char::is_whitespace));
                if chars.get(at).is_some_and(char::is_ascii_digit) {
                    let number = take(&mut at, &|c| c.is_ascii_digit() || c == '.');
                    out.push_str(&shorter_number(&number));
                    seconds_read = false;
                }
            }
        } else {
            out.push(c);
            at += 1;
        }
    }
    out
}

/// A Prometheus duration (`15m`, `1h30m`, `500ms`) in milliseconds.
fn millis(duration: &str) -> u64 {
    let mut total = 0;
    let mut rest = duration;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let (number, tail) = rest.split_at(digits);
        let unit_len = tail.len()
            - tail
                .trim_start_matches(|c: char| c.is_ascii_alphabetic())
                .len();
        let (unit, tail) = tail.split_at(unit_len);
        let number: u64 = number
            .parse()
            .unwrap_or_else(|_| panic!("{duration:?} is no Prometheus duration"));
        let unit = match unit {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            "y" => 31_536_000_000,
            _ => panic!("{duration:?} is no Prometheus duration"),
        };
        total += number * unit;
        rest = tail;
    }
    total
}

/// `duration` divided by [`SCALE`], written in seconds when whole, else in milliseconds.
fn shorter_duration(duration: &str) -> String {
    let shorter = millis(duration) / SCALE;
    assert!(
        shorter > 0,
        "{duration} is too short to be divided by {SCALE}"
    );
    if shorter.is_multiple_of(1000) {
        format!("{}s", shorter / 1000)
    } else {
        format!("{shorter}ms")
    }
}

/// A threshold in seconds divided by [`SCALE`].
fn shorter_number(number: &str) -> String {
    let value: f64 = number
        .parse()
        .unwrap_or_else(|_| panic!("{number:?} is no number"));
    let shorter = value / SCALE as f64;
    format!("{shorter}")
}

/// The alerts a rules file names, in its order.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|line| line.trim_start().strip_prefix("- alert:"))
        .map(|name| name.trim().to_owned())
        .collect()
}

/// The metric names (`idem_…`) an expression reads.
fn series_read(query: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = query;
    while let Some(at) = rest.find("idem_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The line with every number (a duration with its unit included) made `#`, and the numbers.
fn numbers_of(line: &str) -> (String, Vec<String>) {
    let chars: Vec<char> = line.chars().collect();
    let (mut masked, mut numbers) = (String::new(), Vec::new());
    let mut at = 0;
    while at < chars.len() {
        let starts_number = chars[at].is_ascii_digit()
            && (at == 0
                || !(chars[at - 1].is_ascii_alphanumeric()
                    || matches!(chars[at - 1], '_' | ':' | '.')));
        if starts_number {
            let start = at;
            while at < chars.len() && (chars[at].is_ascii_digit() || chars[at] == '.') {
                at += 1;
            }
            while at < chars.len() && chars[at].is_ascii_alphabetic() {
                at += 1;
            }
            numbers.push(chars[start..at].iter().collect());
            masked.push('#');
        } else {
            masked.push(chars[at]);
            at += 1;
        }
    }
    (masked, numbers)
}

/// `promtool`'s verdict on a rules file, or what it said against it.
fn promtool_check(path: &Path) -> Result<(), String> {
    let output = Command::new("promtool")
        .args(["check", "rules"])
        .arg(path)
        .output()
        .unwrap_or_else(|error| {
            panic!(
                "run promtool: {error} (Debian, Ubuntu: apt-get install prometheus; scripts/test \
                 installs it)"
            )
        });
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// The copy differs from the shipped rules in durations, each divided by sixty, and in the
/// thresholds of gauges in seconds alone; and Prometheus takes it (`promtool check rules`).
#[test]
fn the_rules_copy_with_short_windows_changes_only_time_windows_and_passes_promtool() {
    let short = with_short_windows(RULES);
    let (shipped, copy): (Vec<&str>, Vec<&str>) =
        (RULES.lines().collect(), short.lines().collect());
    assert_eq!(
        shipped.len(),
        copy.len(),
        "the copy has the shipped file's lines:\n{short}"
    );
    let mut changed = BTreeMap::<&str, usize>::new();
    for (number, (before, after)) in shipped.iter().zip(&copy).enumerate() {
        let (masked_before, numbers_before) = numbers_of(before);
        let (masked_after, numbers_after) = numbers_of(after);
        assert_eq!(
            masked_before,
            masked_after,
            "line {} changed in more than its numbers",
            number + 1
        );
        for (was, is) in numbers_before.iter().zip(&numbers_after) {
            if was == is {
                continue;
            }
            if was.ends_with(|c: char| c.is_ascii_alphabetic()) {
                assert_eq!(
                    millis(is) * SCALE,
                    millis(was),
                    "line {}: {was} made {is}, not {SCALE} times shorter",
                    number + 1
                );
                *changed.entry("duration").or_default() += 1;
            } else {
                let (was_value, is_value): (f64, f64) = (
                    was.parse().expect("a number"),
                    is.parse().expect("a number"),
                );
                assert!(
                    (is_value * SCALE as f64 - was_value).abs() < 1e-9,
                    "line {}: {was} made {is}, not {SCALE} times smaller",
                    number + 1
                );
                assert!(
                    before.contains("_seconds)") || before.contains("_seconds "),
                    "line {}: {was} changed, but it is compared with no gauge in seconds: {before}",
                    number + 1
                );
                *changed.entry("seconds threshold").or_default() += 1;
            }
        }
    }
    // What the rules hold today: ranges, offsets and `for:`s, the relay's lag, and the time
    // since the purge's last pass that got through.
    assert!(
        changed.get("duration").is_some_and(|n| *n >= 10),
        "the durations were shortened: {changed:?}\n{short}"
    );
    assert_eq!(changed.get("seconds threshold"), Some(&2), "{short}");
    let purge_behind = format!(
        "time() - max by (job) (idem_purge_last_success_timestamp_seconds) > {}",
        PURGE_BEHIND.as_secs()
    );
    for expected in [
        "for: 5s",
        "for: 15s",
        "[15s]",
        "offset 15s",
        "max by (job) (idem_outbox_oldest_waiting_seconds) > 1",
        purge_behind.as_str(),
        "> 0.2",
        "> 0.1",
        "> 3",
    ] {
        assert!(short.contains(expected), "{expected} in the copy:\n{short}");
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("idem.rules.short.yml");
    std::fs::write(&path, &short).expect("write the copy");
    if let Err(said) = promtool_check(&path) {
        panic!("promtool refuses the copy: {said}\n{short}");
    }
}

/// Every alert the shipped rules define has its row in [`faults`], and every row names one of
/// them: an alert added without a fault that fires it fails here.
#[test]
fn every_alert_of_the_rules_has_a_fault_that_fires_it() {
    let rules: BTreeSet<String> = alert_names(RULES).into_iter().collect();
    let rows: BTreeSet<String> = faults().iter().map(|row| row.alert.to_owned()).collect();
    let without_row: Vec<&String> = rules.difference(&rows).collect();
    let without_alert: Vec<&String> = rows.difference(&rules).collect();
    assert!(
        without_row.is_empty(),
        "alerts of idem.rules.yml with no fault in alerts.rs' `faults()`: {without_row:?}; add a \
         row that causes each for real"
    );
    assert!(
        without_alert.is_empty(),
        "rows of `faults()` that name no alert of idem.rules.yml: {without_alert:?}"
    );
    assert_eq!(rows.len(), faults().len(), "one row per alert");
}

/// Where the rules' `runbook_url`s point: the operations chapter on the repository's pages
/// (the workspace's `repository`, branch `main`).
const RUNBOOKS: &str = "https://github.com/idem-rs/idem/blob/main/docs/guide/operations.md#";

/// Every alert's `runbook_url` annotation is a link (Alertmanager's and Grafana's notifications
/// show it as one; a repository path is no address) to its runbook: a heading `### <alert>`
/// of the operations chapter, whose anchor GitHub makes by lowercasing it.
#[test]
fn every_alert_links_to_its_runbook_in_the_operations_chapter() {
    let repository = include_str!("../../../Cargo.toml")
        .lines()
        .find_map(|line| line.strip_prefix("repository = "))
        .expect("the workspace names its repository")
        .trim_matches('"');
    assert!(
        RUNBOOKS.starts_with(&format!("{repository}/blob/main/")),
        "{RUNBOOKS} is under the workspace's repository, {repository}"
    );
    let guide = include_str!("../../../docs/guide/operations.md");
    let headings: BTreeSet<&str> = guide
        .lines()
        .filter_map(|line| line.strip_prefix("### "))
        .map(str::trim)
        .collect();
    let mut links = BTreeMap::new();
    let mut alert = None;
    for line in RULES.lines().map(str::trim_start) {
        if let Some(name) = line.strip_prefix("- alert:") {
            alert = Some(name.trim());
        } else if let Some(url) = line.strip_prefix("runbook_url:") {
            let alert = alert.expect("a runbook_url inside an alert");
            links.insert(alert, url.trim().trim_matches('"'));
        }
    }
    for alert in alert_names(RULES) {
        let link = links
            .get(alert.as_str())
            .unwrap_or_else(|| panic!("{alert} has no runbook_url annotation"));
        assert_eq!(
            *link,
            format!("{RUNBOOKS}{}", alert.to_lowercase()),
            "{alert}'s runbook_url"
        );
        assert!(
            headings.contains(alert.as_str()),
            "docs/guide/operations.md has no heading `### {alert}`, the runbook {link} points to"
        );
    }
    assert!(
        !RULES.contains("runbook:"),
        "a runbook annotation by a repository path is left"
    );
}

// ---------------------------------------------------------------------------------------------
// The table of faults.

/// Causes a fault or ends it, returning when it took effect.
type Step = for<'a> fn(&'a mut Stack) -> Pin<Box<dyn Future<Output = Instant> + 'a>>;

/// One alert, the fault that must fire it, and what ends the fault.
struct Fault {
    alert: &'static str,
    /// What [`Fault::cause`] does, for the table and the failures.
    fault: &'static str,
    /// What [`Fault::end`] does.
    fix: &'static str,
    cause: Step,
    end: Step,
    /// How long the alert may take to fire once the fault is caused, and to resolve once it
    /// is ended: [`DEADLINE`], unless the alert's own threshold is near it.
    within: Duration,
}

/// How long the purge may go without a pass that got through before `IdemPurgeBehind` fires,
/// in the copy of the rules: the shipped hour, [`SCALE`] times shorter (the fast test checks
/// that the copy says so).
const PURGE_BEHIND: Duration = Duration::from_secs(3600 / SCALE);

/// The key of the order whose claim the recovery parks (`IdemClaimsParked`).
const PARKED_ORDER: &str = "order-parked";

/// The key of the order whose claim stays past its lease (`IdemClaimsPastLease`).
const UNTAKEN_ORDER: &str = "order-past-lease";

/// One row per alert of the rules, run in this order. Each row starts from the services as
/// [`Stack::start`] leaves them (with ordinary traffic) and, once its fault is ended, leaves
/// them so.
fn faults() -> Vec<Fault> {
    vec![
        Fault {
            alert: "IdemStoreFailing",
            fault: "the payments service's database link partitioned (MariaDB stops answering) \
                    until its first requests fail, then healed at once: one burst of failures, \
                    on a series the process had not exported before",
            fix: "nothing: the partition is healed already",
            cause: |stack| Box::pin(stack.a_first_burst_of_store_failures()),
            end: |_| Box::pin(async { Instant::now() }),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemKeysReusedWithAnotherRequest",
            fault: "a client sends a key again with another body (422)",
            fix: "nothing: that client sends no more",
            cause: |stack| Box::pin(stack.reuse_a_key()),
            end: |_| Box::pin(async { Instant::now() }),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemConflictsHigh",
            fault: "ten duplicates at once, round after round, of payments that take a second \
                    (409s)",
            fix: "the duplicates stop",
            cause: |stack| Box::pin(async move { stack.start_duplicates() }),
            end: |stack| Box::pin(stack.stop_duplicates()),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemClaimsTakenOver",
            fault: "payments SIGKILLed mid-refund, started again without its recovery task; the \
                    client's retry takes the claim over",
            fix: "payments started again with its recovery task",
            cause: |stack| Box::pin(stack.take_over_an_abandoned_refund()),
            end: |stack| Box::pin(stack.restart_payments()),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemRecoveryNotRunning",
            fault: "payments started again without its recovery task (RECOVERY_EVERY=0); a \
                    refund, an external claim, made",
            fix: "payments started again with its recovery task",
            cause: |stack| Box::pin(stack.external_claims_without_a_recovery()),
            end: |stack| Box::pin(stack.restart_payments()),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemAbandonedClaimsRecovered",
            fault: "payments SIGKILLed mid-refund and started again; its recovery task settles the \
                    claim",
            fix: "nothing: the claim is settled",
            cause: |stack| Box::pin(stack.abandon_a_refund_to_the_recovery()),
            end: |_| Box::pin(async { Instant::now() }),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemClaimsParked",
            fault: "payments aborted after an order's first step (CRASH_AFTER=reserve), started \
                    again with RECOVERY_MAX_ATTEMPTS=1 and the processor refusing connections: \
                    the recovery's hook keeps the order (it cannot ask whether it was charged), \
                    which is parked",
            fix: "the processor back, payments started again with its usual settings, and the \
                  claim resumed (`idem resume`): the recovery gives the order's stock back and \
                  releases it",
            cause: |stack| Box::pin(stack.park_an_order()),
            end: |stack| Box::pin(stack.resume_the_parked_order()),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemClaimsPastLease",
            fault: "payments aborted after an order's first step (CRASH_AFTER=reserve), started \
                    again with idem's ReleaseAbandoned (RECOVERY_HOOK=release), which leaves a \
                    claim with recorded steps to its retry; none comes",
            fix: "payments started again with its own hook, which handles claims with steps: \
                  the recovery gives the order's stock back and releases it",
            cause: |stack| Box::pin(stack.leave_an_order_past_its_lease()),
            end: |stack| Box::pin(stack.restart_payments()),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemPurgeBehind",
            fault: "payments started again without its purge task (PURGE_EVERY=0): no pass ever \
                    gets through",
            fix: "payments started again with its purge task: its first pass gets through",
            cause: |stack| Box::pin(stack.restart_payments_with(&[("PURGE_EVERY", "0")])),
            end: |stack| Box::pin(stack.restart_payments()),
            // The alert fires only once the threshold has passed since the process started.
            within: PURGE_BEHIND + DEADLINE,
        },
        Fault {
            alert: "IdemRelayLagging",
            fault: "the relay's broker refuses every connection (a TCP proxy)",
            fix: "the broker takes connections again",
            cause: |stack| Box::pin(async move { stack.broker_away(true) }),
            end: |stack| Box::pin(async move { stack.broker_away(false) }),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemRelayFailing",
            fault: "the relay's broker refuses every connection (a TCP proxy)",
            fix: "the broker takes connections again",
            cause: |stack| Box::pin(async move { stack.broker_away(true) }),
            end: |stack| Box::pin(async move { stack.broker_away(false) }),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemEventsRefused",
            fault: "the ledger stopped and its queue deleted: its topic is bound to no queue",
            fix: "the ledger started again (it declares and binds its queue)",
            cause: |stack| Box::pin(stack.unbind_the_ledgers_topic()),
            end: |stack| Box::pin(stack.start_ledger()),
            within: DEADLINE,
        },
        Fault {
            alert: "IdemMessagesDeadLettered",
            fault: "a message the ledger cannot read, on its topic (five attempts, then the \
                    dead-letter queue)",
            fix: "the dead-letter queue emptied (a person took the message)",
            cause: |stack| Box::pin(stack.publish_a_poison_message()),
            end: |stack| Box::pin(stack.empty_the_dead_letter_queue()),
            within: DEADLINE,
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// The services, their links, and the faults they can be given.

/// How often the ordinary clients send a new payment (and a replay of the last one).
const PACE: Duration = Duration::from_millis(200);

/// The most ordinary requests in flight at once (while the database hangs, they wait).
const IN_FLIGHT: usize = 32;

/// The duplicates sent together in each round of the conflicts' fault.
const DUPLICATES: usize = 10;

/// The payments service and the ledger on one MariaDB database and one RabbitMQ exchange, the
/// service reaching the database through a [`PartitionProxy`], the broker through a
/// [`TcpProxy`] and the card processor (in the test process) through another; ordinary clients
/// paying.
struct Stack {
    client: Client,
    dir: tempfile::TempDir,
    database: Database,
    /// The database's URL, for the ledger (not through the partition).
    database_url: String,
    database_link: PartitionProxy,
    broker: TestBroker,
    broker_link: TcpProxy,
    processor: Processor,
    processor_link: TcpProxy,
    payments: Option<Process>,
    payments_addr: String,
    grpc_addr: String,
    ledger: Option<Process>,
    ledger_addr: String,
    traffic: Option<Traffic>,
    duplicates: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl Stack {
    /// Starts the ledger (its queue bound before the first event), then the payments service,
    /// then the ordinary clients.
    async fn start(database: Database) -> Self {
        let Database::MySql { url, .. } = &database else {
            panic!("the alerts run on MariaDB")
        };
        let database_url = url.clone();
        let server = Url::parse(&database_url).expect("a database URL");
        let database_link = PartitionProxy::tcp(format!(
            "{}:{}",
            server.host_str().expect("a host"),
            server.port().unwrap_or(3306)
        ))
        .await;
        let broker = TestBroker::new(BrokerKind::RabbitMq).used_by("ledger");
        let broker_link = TcpProxy::start(broker.address()).await;
        let processor = Processor::start(Some("/v1/refunds")).await;
        let processor_link = TcpProxy::start(
            processor
                .url
                .strip_prefix("http://")
                .expect("the processor's URL is http://host:port")
                .to_owned(),
        )
        .await;
        let mut stack = Self {
            client: Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("a client"),
            dir: tempfile::tempdir().expect("a temporary directory"),
            database,
            database_url,
            database_link,
            broker,
            broker_link,
            processor,
            processor_link,
            payments: None,
            payments_addr: support::free_addr(),
            grpc_addr: support::free_addr(),
            ledger: None,
            ledger_addr: support::free_addr(),
            traffic: None,
            duplicates: None,
        };
        stack.start_ledger().await;
        stack.start_payments(&[]).await;
        stack.traffic = Some(Traffic::start(stack.client.clone(), stack.base()));
        stack
    }

    fn base(&self) -> String {
        format!("http://{}", self.payments_addr)
    }

    /// The addresses Prometheus scrapes, by job.
    fn targets(&self) -> [(&'static str, String); 2] {
        [
            ("payments", self.payments_addr.clone()),
            ("ledger", self.ledger_addr.clone()),
        ]
    }

    /// A log file of the test's directory, appended to by each process started under `name`.
    fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{name}.log")))
            .expect("a log file")
    }

    /// Starts the payments service on its addresses, with its recovery task and its purge
    /// every second unless `env` says otherwise, and waits until it answers.
    ///
    /// The purge runs every second (the service's default is a minute) because the healthy
    /// run lasts as long as the longest fault, `IdemPurgeBehind`'s, over [`PURGE_BEHIND`]: with
    /// a pass a minute, the time since the last one would reach the copy's threshold in
    /// ordinary operation.
    async fn start_payments(&mut self, env: &[(&str, &str)]) -> Instant {
        assert!(self.payments.is_none(), "one payments process at a time");
        let mut database_url = Url::parse(&self.database_url).expect("a database URL");
        database_url.set_host(Some("127.0.0.1")).expect("a host");
        database_url
            .set_port(Some(self.database_link.port()))
            .expect("a port");
        let mut amqp_url =
            Url::parse(&idem_tests::broker_url(BrokerKind::RabbitMq)).expect("a broker URL");
        amqp_url.set_host(Some("127.0.0.1")).expect("a host");
        amqp_url
            .set_port(Some(self.broker_link.port()))
            .expect("a port");
        let child = Command::new(env!("CARGO_BIN_EXE_payments"))
            .env("DATABASE_URL", database_url.as_str())
            .env("EVENTS", "rabbitmq")
            .env("EVENTS_STREAM", self.broker.name())
            .env("AMQP_URL", amqp_url.as_str())
            .env("ADDR", &self.payments_addr)
            .env("GRPC_ADDR", &self.grpc_addr)
            .env(
                "PROCESSOR_URL",
                format!("http://127.0.0.1:{}", self.processor_link.port()),
            )
            .env("RECOVERY_EVERY", "1")
            .env("PURGE_EVERY", "1")
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(self.log("payments"))
            .spawn()
            .expect("start payments");
        self.payments = Some(Process(child));
        support::wait_until_up(&self.client, &format!("{}/v1/payments", self.base())).await;
        Instant::now()
    }

    /// SIGKILLs the payments service; returns once it is reaped.
    fn kill_payments(&mut self) -> Instant {
        let mut payments = self.payments.take().expect("payments runs");
        payments.0.kill().expect("SIGKILL payments");
        payments.0.wait().expect("reap payments");
        Instant::now()
    }

    /// The payments service killed and started again as [`Stack::start`] started it.
    async fn restart_payments(&mut self) -> Instant {
        self.restart_payments_with(&[]).await
    }

    /// The payments service killed and started again with `env` over the usual settings.
    async fn restart_payments_with(&mut self, env: &[(&str, &str)]) -> Instant {
        self.kill_payments();
        self.start_payments(env).await
    }

    /// Starts the ledger, on the database directly and on the broker directly, and waits until
    /// it answers.
    async fn start_ledger(&mut self) -> Instant {
        assert!(self.ledger.is_none(), "one ledger at a time");
        let child = Command::new(env!("CARGO_BIN_EXE_ledger"))
            .env("DATABASE_URL", &self.database_url)
            .env("EVENTS", "rabbitmq")
            .env("EVENTS_STREAM", self.broker.name())
            .env("AMQP_URL", idem_tests::broker_url(BrokerKind::RabbitMq))
            .env("LEDGER_ADDR", &self.ledger_addr)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(self.log("ledger"))
            .spawn()
            .expect("start the ledger");
        self.ledger = Some(Process(child));
        support::wait_until_up(
            &self.client,
            &format!("http://{}/v1/ledger", self.ledger_addr),
        )
        .await;
        Instant::now()
    }

    /// `POST /v1/payments` under `key`.
    async fn pay(&self, key: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/payments", self.base()))
            .bearer_auth(TENANT)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .unwrap_or_else(|error| panic!("POST /v1/payments {key}: {error}"))
    }

    /// The database partitioned away while the ordinary clients pay, until the service's
    /// `GET /metrics` counts a first failed request (a request past its wait for a connection
    /// or for the database), then healed at once: the requests still waiting get their
    /// answers, and the failures are the one burst that came before the heal, on a series
    /// (`outcome="failed"`) that appears with them. Returns when the heal was made.
    async fn a_first_burst_of_store_failures(&mut self) -> Instant {
        let metrics = &format!("{}/metrics", self.base());
        assert_eq!(
            failed_requests(&self.client, metrics).await,
            None,
            "no request has failed in this process before the burst"
        );
        self.database_link.freeze();
        let client = &self.client;
        wait_until(
            "the service to count its first failed requests (GET /metrics)",
            || async { failed_requests(client, metrics).await.is_some() },
        )
        .await;
        self.database_link.heal();
        Instant::now()
    }

    /// The service started again without its recovery task, and a refund made (an external
    /// claim): a service that makes external claims with no recovery running.
    async fn external_claims_without_a_recovery(&mut self) -> Instant {
        let started = self.restart_payments_with(&[("RECOVERY_EVERY", "0")]).await;
        let payment: Value = self
            .pay(
                "payment-without-recovery",
                &json!({"amount": 900, "currency": "usd", "customer": "cus_1"}),
            )
            .await
            .json()
            .await
            .expect("the payment");
        let refund = self
            .refund("refund-without-recovery", &payment)
            .await
            .expect("the refund's answer");
        assert_eq!(refund.status(), StatusCode::CREATED, "the refund was made");
        started
    }

    async fn reuse_a_key(&mut self) -> Instant {
        let first = self
            .pay(
                "reused-key",
                &json!({"amount": 100, "currency": "usd", "customer": "cus_1"}),
            )
            .await;
        assert_eq!(first.status(), StatusCode::CREATED, "the key's first use");
        let other = self
            .pay(
                "reused-key",
                &json!({"amount": 200, "currency": "usd", "customer": "cus_1"}),
            )
            .await;
        assert_eq!(
            other.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "the key sent again with another body"
        );
        Instant::now()
    }

    /// Rounds of [`DUPLICATES`] identical payments sent at once, each for a customer the card
    /// network answers after a second: one runs, the others are answered 409. A round starts
    /// when the last ended, until [`Stack::stop_duplicates`].
    fn start_duplicates(&mut self) -> Instant {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let (stop, client, base) = (Arc::clone(&stop), self.client.clone(), self.base());
            async move {
                let mut round = 0;
                while !stop.load(Ordering::SeqCst) {
                    let key = format!("duplicated-{round}");
                    round += 1;
                    let mut sent = tokio::task::JoinSet::new();
                    for _ in 0..DUPLICATES {
                        let request = client
                            .post(format!("{base}/v1/payments"))
                            .bearer_auth(TENANT)
                            .header("Idempotency-Key", &key)
                            .json(
                                &json!({"amount": 700, "currency": "usd", "customer": "cus_slow"}),
                            )
                            .send();
                        sent.spawn(request);
                    }
                    while let Some(answer) = sent.join_next().await {
                        let answer = answer
                            .expect("a duplicate's task")
                            .unwrap_or_else(|error| panic!("a duplicate of {key}: {error}"));
                        assert!(
                            matches!(answer.status(), StatusCode::CREATED | StatusCode::CONFLICT),
                            "a duplicate of {key}: {}",
                            answer.status()
                        );
                    }
                }
            }
        });
        self.duplicates = Some((stop, task));
        Instant::now()
    }

    async fn stop_duplicates(&mut self) -> Instant {
        let (stop, task) = self.duplicates.take().expect("duplicates running");
        stop.store(true, Ordering::SeqCst);
        task.await.expect("the duplicates' rounds");
        Instant::now()
    }

    /// A payment, then a refund of it under `key` whose answer the processor holds after making
    /// it; the service is SIGKILLed meanwhile, leaving the refund's external claim behind. The
    /// service is down when this returns. Returns the kill's instant and the payment.
    async fn kill_mid_refund(&mut self, key: &str) -> (Instant, Value) {
        let payment: Value = self
            .pay(
                &format!("{key}-payment"),
                &json!({"amount": 900, "currency": "usd", "customer": "cus_1"}),
            )
            .await
            .json()
            .await
            .expect("the payment");
        let made = refunds_executed(&self.client, &self.processor.url)
            .await
            .len();
        self.processor.hold_next();
        let refund = tokio::spawn(self.refund(key, &payment));
        let (client, processor) = (&self.client, &self.processor.url);
        wait_until(
            "the processor to make the refund and hold its answer",
            || async { refunds_executed(client, processor).await.len() > made },
        )
        .await;
        let killed = self.kill_payments();
        self.processor.gate.add_permits(1);
        assert!(
            refund.await.expect("the refund's task").is_err(),
            "the client saw the connection die"
        );
        assert_eq!(
            self.database.key_status(key).await,
            "started",
            "the kill left the refund's claim behind"
        );
        (killed, payment)
    }

    /// `POST /v1/refunds` of `payment` under `key`.
    fn refund(
        &self,
        key: &str,
        payment: &Value,
    ) -> impl Future<Output = reqwest::Result<reqwest::Response>> + use<> {
        self.client
            .post(format!("{}/v1/refunds", self.base()))
            .bearer_auth(TENANT)
            .header("Idempotency-Key", key)
            .json(&json!({"payment": payment["id"], "amount": 300}))
            .send()
    }

    /// The service killed mid-refund, started again without its recovery task (which would
    /// settle the claim first); the claim's lease moved to its end (as its five seconds passing
    /// would); the client's retry then takes the claim over.
    async fn take_over_an_abandoned_refund(&mut self) -> Instant {
        let key = "refund-taken-over";
        let (killed, payment) = self.kill_mid_refund(key).await;
        // Without its recovery task too, the process exports `idem_takeovers_total` at 0 from
        // its `Store::new` on, so that the alert sees the first takeover's rise. Meanwhile
        // `IdemRecoveryNotRunning` may be pending (its `for:` is longer than this row).
        self.start_payments(&[("RECOVERY_EVERY", "0")]).await;
        self.database.lease_ends_in(key, -1).await;
        let retry = self
            .refund(key, &payment)
            .await
            .expect("the retry's answer");
        assert_eq!(
            retry.status(),
            StatusCode::CREATED,
            "the retry took the claim over"
        );
        assert!(
            retry.headers().get("idempotent-replayed").is_none(),
            "the retry ran the refund, not a replay"
        );
        killed
    }

    /// The service killed mid-refund and started again with its recovery task every second; the
    /// claim's lease moved to its end (as its five seconds passing would): the recovery settles
    /// it.
    async fn abandon_a_refund_to_the_recovery(&mut self) -> Instant {
        let key = "refund-recovered";
        let (killed, _) = self.kill_mid_refund(key).await;
        self.start_payments(&[]).await;
        self.database.lease_ends_in(key, -1).await;
        killed
    }

    /// `POST /v1/orders` of one unit under `key`.
    fn order(&self, key: &str) -> impl Future<Output = reqwest::Result<reqwest::Response>> + use<> {
        self.client
            .post(format!("{}/v1/orders", self.base()))
            .bearer_auth(TENANT)
            .header("Idempotency-Key", key)
            .json(&json!({"sku": "sku-alerts", "quantity": 1, "customer": "cus_1"}))
            .send()
    }

    /// The service started again to abort right after an order's first step
    /// (`CRASH_AFTER=reserve`), and an order sent under `key`: the process dies leaving the
    /// order's claim behind, with its stock reserved (a recorded step) and nothing charged. The
    /// service is down when this returns. Returns the instant the process was reaped.
    async fn crash_mid_order(&mut self, key: &str) -> Instant {
        self.kill_payments();
        self.start_payments(&[("CRASH_AFTER", "reserve")]).await;
        let answer = self.order(key).await;
        assert!(answer.is_err(), "the process died mid-order: {answer:?}");
        let mut crashed = self.payments.take().expect("payments ran");
        let status = crashed.0.wait().expect("reap payments");
        let at = Instant::now();
        assert!(!status.success(), "payments aborted: {status}");
        assert_eq!(
            self.database.key_status(key).await,
            "started",
            "the crash left the order's claim behind"
        );
        at
    }

    /// The store of the service's database, as an operator's tool (`idem`) opens it.
    fn store(&self) -> Store<MySql> {
        let Database::MySql { pool, .. } = &self.database else {
            panic!("the alerts run on MariaDB")
        };
        Store::new(pool.clone())
    }

    /// An order abandoned mid-way, then the service started again with one round for its
    /// recovery's hook (`RECOVERY_MAX_ATTEMPTS=1`) and the processor refusing connections;
    /// the order's lease moved to its end (as its five seconds passing would). The hook cannot
    /// ask whether the order was charged, keeps it, and the recovery parks it.
    async fn park_an_order(&mut self) -> Instant {
        let crashed = self.crash_mid_order(PARKED_ORDER).await;
        self.processor_link.refuse(true);
        self.start_payments(&[("RECOVERY_MAX_ATTEMPTS", "1")]).await;
        self.database.lease_ends_in(PARKED_ORDER, -1).await;
        crashed
    }

    /// The processor back, the service started again with its usual settings, and the parked
    /// order resumed as `idem dead` then `idem resume` would: the recovery's next pass hands it
    /// to the hook, which finds no charge, gives the stock back and releases the claim.
    async fn resume_the_parked_order(&mut self) -> Instant {
        self.processor_link.refuse(false);
        self.restart_payments().await;
        let store = self.store();
        let parked = store.parked().await.expect("the parked claims (idem dead)");
        let claim = parked
            .iter()
            .find(|claim| claim.key == PARKED_ORDER)
            .unwrap_or_else(|| panic!("{PARKED_ORDER} is parked: {parked:?}"));
        assert_eq!(
            store
                .resume_parked(&claim.scope, &claim.key)
                .await
                .expect("resume the parked claim (idem resume)"),
            Unparked::Done,
            "the parked order was resumed"
        );
        Instant::now()
    }

    /// An order abandoned mid-way, then the service started again with idem's
    /// `ReleaseAbandoned` for its recovery's hook (`RECOVERY_HOOK=release`), which leaves a
    /// claim with recorded steps to its retry; the order's lease moved to its end (as its five
    /// seconds passing would), and no retry comes.
    async fn leave_an_order_past_its_lease(&mut self) -> Instant {
        let crashed = self.crash_mid_order(UNTAKEN_ORDER).await;
        self.start_payments(&[("RECOVERY_HOOK", "release")]).await;
        self.database.lease_ends_in(UNTAKEN_ORDER, -1).await;
        crashed
    }

    fn broker_away(&self, away: bool) -> Instant {
        self.broker_link.refuse(away);
        Instant::now()
    }

    async fn unbind_the_ledgers_topic(&mut self) -> Instant {
        let mut ledger = self.ledger.take().expect("the ledger runs");
        ledger.0.kill().expect("SIGKILL the ledger");
        ledger.0.wait().expect("reap the ledger");
        support::delete_queue(&self.broker, "ledger").await;
        Instant::now()
    }

    async fn publish_a_poison_message(&mut self) -> Instant {
        let message = Message::new(
            uuid::Uuid::new_v4().to_string(),
            idem_examples::ledger::TOPIC,
            "not a payment.succeeded event",
        );
        self.broker
            .publisher()
            .publish(&[message])
            .await
            .expect("publish the message");
        Instant::now()
    }

    async fn empty_the_dead_letter_queue(&mut self) -> Instant {
        let url = idem_tests::broker_url(BrokerKind::RabbitMq);
        let queue = idem_events::rabbitmq::RabbitMq::new(&url, self.broker.name())
            .dead_letter_queue("ledger");
        let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("a channel");
        let purged = channel
            .queue_purge(queue.as_str().into(), Default::default())
            .await
            .expect("purge the dead-letter queue");
        assert_eq!(purged, 1, "the message was in the dead-letter queue");
        Instant::now()
    }
}

/// The requests `GET metrics` counts as failed (`idem_requests_total{outcome="failed"}`, every
/// route), or `None` while the service exports no such series.
async fn failed_requests(client: &Client, metrics: &str) -> Option<f64> {
    let text = client
        .get(metrics)
        .send()
        .await
        .unwrap_or_else(|error| panic!("GET {metrics}: {error}"))
        .text()
        .await
        .unwrap_or_else(|error| panic!("GET {metrics}: {error}"));
    let counts: Vec<f64> = text
        .lines()
        .filter(|line| {
            line.starts_with("idem_requests_total{") && line.contains(r#"outcome="failed""#)
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse().ok())
        .collect();
    (!counts.is_empty()).then(|| counts.iter().sum())
}

// ---------------------------------------------------------------------------------------------
// Ordinary clients.

/// How the ordinary clients' requests were answered.
#[derive(Debug, Default)]
struct Tally {
    created: AtomicUsize,
    replayed: AtomicUsize,
    /// Anything else, by status or error.
    other: Mutex<BTreeMap<String, usize>>,
}

impl Tally {
    fn snapshot(&self) -> (usize, usize, BTreeMap<String, usize>) {
        (
            self.created.load(Ordering::SeqCst),
            self.replayed.load(Ordering::SeqCst),
            self.other.lock().expect("the tally").clone(),
        )
    }
}

/// Clients paying at a steady pace: every [`PACE`] a payment under a new key, and a replay of
/// the last payment that was answered (so that no replay meets its first still running). The
/// pace is the workload, not a wait: nothing is synchronised on it.
struct Traffic {
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
    tally: Arc<Tally>,
}

impl Traffic {
    fn start(client: Client, base: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let task = tokio::spawn({
            let (stop, tally) = (Arc::clone(&stop), Arc::clone(&tally));
            async move {
                let permits = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
                let answered: Arc<Mutex<Option<(String, Value)>>> = Arc::default();
                let mut tick = tokio::time::interval(PACE);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut n = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    let new = (
                        format!("ordinary-{n}"),
                        json!({"amount": 1000 + n, "currency": "usd", "customer": "cus_1"}),
                    );
                    n += 1;
                    let last = answered.lock().expect("the last payment").clone();
                    for (request, replay) in [(Some(new), false), (last, true)] {
                        let Some((key, body)) = request else { continue };
                        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                            continue;
                        };
                        let sent = client
                            .post(format!("{base}/v1/payments"))
                            .bearer_auth(TENANT)
                            .header("Idempotency-Key", &key)
                            .json(&body)
                            .send();
                        let (tally, answered) = (Arc::clone(&tally), Arc::clone(&answered));
                        tokio::spawn(async move {
                            let outcome = match sent.await {
                                Ok(answer) if answer.status() == StatusCode::CREATED => {
                                    if answer.headers().contains_key("idempotent-replayed") {
                                        tally.replayed.fetch_add(1, Ordering::SeqCst);
                                    } else {
                                        tally.created.fetch_add(1, Ordering::SeqCst);
                                    }
                                    if !replay {
                                        *answered.lock().expect("the last payment") =
                                            Some((key, body));
                                    }
                                    None
                                }
                                Ok(answer) => Some(answer.status().to_string()),
                                Err(error) if error.is_connect() => Some("refused".to_owned()),
                                Err(_) => Some("no answer".to_owned()),
                            };
                            if let Some(outcome) = outcome {
                                *tally
                                    .other
                                    .lock()
                                    .expect("the tally")
                                    .entry(outcome)
                                    .or_default() += 1;
                            }
                            drop(permit);
                        });
                    }
                }
            }
        });
        Self { stop, task, tally }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("the ordinary clients");
    }
}

// ---------------------------------------------------------------------------------------------
// Prometheus.

/// An alert Prometheus lists (pending or firing).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Active {
    name: String,
    state: String,
}

/// A Prometheus server of the test's own: scraping every second, evaluating the rules every
/// second; killed when dropped.
struct Prometheus {
    process: Process,
    url: String,
    client: Client,
}

impl Prometheus {
    /// Starts `prometheus` (from `PATH`) on a reserved port with its storage in `dir`, scraping
    /// `targets` (job, `host:port`) and evaluating the rules at `rules`; waits until it is
    /// ready and every target is up.
    async fn start(dir: &Path, rules: &Path, targets: &[(&str, String)]) -> Self {
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\nscrape_configs:\n",
            rules.display()
        );
        for (job, addr) in targets {
            write!(
                config,
                "  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n"
            )
            .expect("a string takes it");
        }
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let log: PathBuf = dir.join("prometheus.log");
        let addr = support::free_addr();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("a log file"))
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "start prometheus: {error} (Debian, Ubuntu: apt-get install prometheus; \
                     scripts/test installs it)"
                )
            });
        let mut prometheus = Self {
            process: Process(child),
            url: format!("http://{addr}"),
            client: Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .expect("a client"),
        };
        let ready = format!("{}/-/ready", prometheus.url);
        let process = &mut prometheus.process;
        let client = &prometheus.client;
        wait_until("Prometheus to be ready (/-/ready)", || {
            if let Some(status) = process.0.try_wait().expect("try_wait") {
                panic!(
                    "prometheus exited ({status}):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            let ready = client.get(&ready).send();
            async move { ready.await.is_ok_and(|answer| answer.status().is_success()) }
        })
        .await;
        let expected = targets.len();
        wait_until(
            "every target to be scraped and up (/api/v1/targets)",
            || async {
                let Some(targets) = prometheus.get("/api/v1/targets").await else {
                    return false;
                };
                let active = targets["activeTargets"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                active.len() == expected && active.iter().all(|target| target["health"] == "up")
            },
        )
        .await;
        prometheus
    }

    /// The `data` of `GET path`, or `None` when Prometheus did not answer it.
    async fn get(&self, path: &str) -> Option<Value> {
        let answer = self
            .client
            .get(format!("{}{path}", self.url))
            .send()
            .await
            .ok()?;
        let body: Value = answer.json().await.ok()?;
        (body["status"] == "success").then(|| body["data"].clone())
    }

    /// The alerts listed now, pending or firing.
    async fn alerts(&self) -> Result<Vec<Active>, String> {
        let data = self
            .get("/api/v1/alerts")
            .await
            .ok_or("Prometheus did not answer /api/v1/alerts")?;
        let mut alerts: Vec<Active> = data["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|alert| Active {
                name: alert["labels"]["alertname"]
                    .as_str()
                    .unwrap_or("?")
                    .to_owned(),
                state: alert["state"].as_str().unwrap_or("?").to_owned(),
            })
            .collect();
        alerts.sort();
        alerts.dedup();
        Ok(alerts)
    }

    /// The rule of `alert`, as Prometheus loaded it.
    async fn rule(&self, alert: &str) -> Value {
        let data = self
            .get("/api/v1/rules?type=alert")
            .await
            .expect("Prometheus answers /api/v1/rules");
        data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
            .find(|rule| rule["name"] == alert)
            .unwrap_or_else(|| panic!("Prometheus loaded no rule {alert}"))
    }

    /// The series of `metric` Prometheus holds now, as `labels value` lines.
    async fn series(&self, metric: &str) -> Vec<String> {
        let query = format!("/api/v1/query?query={metric}");
        let Some(data) = self.get(&query).await else {
            return vec!["(Prometheus did not answer)".to_owned()];
        };
        data["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|sample| format!("{} {}", sample["metric"], sample["value"][1]))
            .collect()
    }

    /// What `expr` evaluates to now, as `labels value` lines; `None` when Prometheus did not
    /// answer.
    async fn evaluate(&self, expr: &str) -> Option<Vec<String>> {
        let url = Url::parse_with_params(&format!("{}/api/v1/query", self.url), [("query", expr)])
            .expect("a query URL");
        let answer = self.client.get(url).send().await.ok()?;
        let body: Value = answer.json().await.ok()?;
        (body["status"] == "success").then(|| {
            body["data"]["result"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|sample| format!("{} {}", sample["metric"], sample["value"][1]))
                .collect()
        })
    }

    /// Waits until `alert` is resolved on live series: not listed, its expression evaluating
    /// to nothing, and a series of every metric it reads scraped. A fix that restarts a
    /// service drops that service's series until its first scrape, and an alert on them ends
    /// meanwhile: that is not the fault ending, and this goes on waiting until the new
    /// process's series say so. Polls until `limit` is past; every alert seen firing meanwhile
    /// is added to `firing`. Returns when it held, or what was last seen.
    async fn until_resolved(
        &self,
        alert: &str,
        limit: Duration,
        firing: &mut BTreeSet<String>,
    ) -> Result<Instant, String> {
        let query = self.rule(alert).await["query"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let metrics = series_read(&query);
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let at = self
                .until(left, firing, |alerts| {
                    !alerts.iter().any(|active| active.name == alert)
                })
                .await
                .map_err(|last| format!("alerts listed: {last}"))?;
            let mut missing = Vec::new();
            for metric in &metrics {
                if self.series(metric).await.is_empty() {
                    missing.push(metric.clone());
                }
            }
            let seen = if missing.is_empty() {
                match self.evaluate(&query).await {
                    Some(value) if value.is_empty() => return Ok(at),
                    Some(value) => {
                        format!("{alert} not listed, but its expression gives {value:?}")
                    }
                    None => "Prometheus did not answer the rule's expression".to_owned(),
                }
            } else {
                format!(
                    "{alert} not listed, but no series of {missing:?} is scraped (a service \
                     restarted and not scraped yet, or stopped)"
                )
            };
            if Instant::now() >= deadline {
                return Err(seen);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `condition` holds for the alerts listed, polling them until `limit` is
    /// past; every alert seen firing meanwhile is added to `firing`. Returns when it held, or
    /// the alerts last listed.
    async fn until(
        &self,
        limit: Duration,
        firing: &mut BTreeSet<String>,
        condition: impl Fn(&[Active]) -> bool,
    ) -> Result<Instant, String> {
        let deadline = Instant::now() + limit;
        loop {
            let last = match self.alerts().await {
                Ok(alerts) => {
                    firing.extend(
                        alerts
                            .iter()
                            .filter(|alert| alert.state == "firing")
                            .map(|alert| alert.name.clone()),
                    );
                    if condition(&alerts) {
                        return Ok(Instant::now());
                    }
                    format!("{alerts:?}")
                }
                Err(error) => error,
            };
            if Instant::now() >= deadline {
                return Err(last);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until no alert is pending or firing.
    async fn until_quiet(&self, before: &str) {
        if let Err(last) = self
            .until(DEADLINE, &mut BTreeSet::new(), <[Active]>::is_empty)
            .await
        {
            panic!(
                "waited {DEADLINE:?} for no alert to be pending or firing {before}; listed: {last}"
            );
        }
    }

    /// Waits until Prometheus holds a series of every metric `alert` reads: an alert whose
    /// metric no service exports (renamed in the rules or in the code) fails here, saying so.
    async fn until_scraped(&self, alert: &str) {
        let query = self.rule(alert).await["query"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let metrics = series_read(&query);
        assert!(
            !metrics.is_empty(),
            "{alert} reads no idem_ series: {query}"
        );
        let deadline = Instant::now() + DEADLINE;
        loop {
            let mut missing = Vec::new();
            for metric in &metrics {
                if self.series(metric).await.is_empty() {
                    missing.push(metric.clone());
                }
            }
            if missing.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "waited {DEADLINE:?} for Prometheus to scrape every series {alert} reads: no \
                 service exports {missing:?} (the rule: {query})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What Prometheus says of `alert`'s rule and of the series it reads, for a failure.
    async fn explain(&self, alert: &str) -> String {
        let rule = self.rule(alert).await;
        let query = rule["query"].as_str().unwrap_or_default().to_owned();
        let mut said = format!(
            "the rule {alert} (health {}, state {}, last error {}):\n  {}\n",
            rule["health"],
            rule["state"],
            rule["lastError"],
            query.replace('\n', "\n  ")
        );
        for metric in series_read(&query) {
            let series = self.series(&metric).await;
            if series.is_empty() {
                writeln!(said, "{metric}: no series (no service exports it)")
            } else {
                writeln!(said, "{metric}:\n    {}", series.join("\n    "))
            }
            .expect("a string takes it");
        }
        said
    }
}

// ---------------------------------------------------------------------------------------------
// The test.

/// What one row measured.
struct Measured {
    alert: &'static str,
    fired_after: Duration,
    resolved_after: Duration,
    /// From the fault's start to the alert's end.
    lasted: Duration,
    /// Other alerts that fired meanwhile.
    also: BTreeSet<String>,
}

/// Causes `fault`, waits until its alert fires, ends the fault, waits until the alert is gone
/// on live series ([`Prometheus::until_resolved`]).
async fn prove(stack: &mut Stack, prometheus: &Prometheus, fault: &Fault) -> Measured {
    let alert = fault.alert;
    prometheus
        .until_quiet(&format!("before {alert}'s fault"))
        .await;
    prometheus.until_scraped(alert).await;
    let mut fired = BTreeSet::new();
    let began = (fault.cause)(stack).await;
    let within = fault.within;
    let firing = prometheus
        .until(within, &mut fired, |alerts| {
            alerts
                .iter()
                .any(|active| active.name == alert && active.state == "firing")
        })
        .await;
    let fired_at = match firing {
        Ok(at) => at,
        Err(last) => panic!(
            "waited {within:?} for {alert} to fire after its fault: {}; alerts listed: \
             {last}\n{}",
            fault.fault,
            prometheus.explain(alert).await
        ),
    };
    let fixed = (fault.end)(stack).await;
    let gone = prometheus.until_resolved(alert, within, &mut fired).await;
    let resolved_at = match gone {
        Ok(at) => at,
        Err(last) => panic!(
            "waited {within:?} for {alert} to resolve after its fault ended: {}; {last}\n{}",
            fault.fix,
            prometheus.explain(alert).await
        ),
    };
    fired.remove(alert);
    let measured = Measured {
        alert,
        fired_after: fired_at - began,
        resolved_after: resolved_at.saturating_duration_since(fixed),
        lasted: resolved_at - began,
        also: fired,
    };
    eprintln!(
        "{alert}: fired {:.1} s after {}; resolved {:.1} s after {}",
        measured.fired_after.as_secs_f64(),
        fault.fault,
        measured.resolved_after.as_secs_f64(),
        fault.fix
    );
    measured
}

/// Ordinary traffic for `length`, Prometheus polled throughout: no alert may fire, and one
/// still pending at the end must end without firing. Returns the alerts seen pending.
async fn healthy_run(stack: &Stack, prometheus: &Prometheus, length: Duration) -> BTreeSet<String> {
    prometheus.until_quiet("before the healthy run").await;
    let tally = &stack.traffic.as_ref().expect("ordinary traffic").tally;
    let (created, replayed, other) = tally.snapshot();
    let start = Instant::now();
    let mut pending = BTreeSet::new();
    while start.elapsed() < length {
        let alerts = prometheus
            .alerts()
            .await
            .unwrap_or_else(|error| panic!("{error}"));
        if let Some(firing) = alerts.iter().find(|alert| alert.state == "firing") {
            panic!(
                "{} fired {:.1} s into the healthy run (ordinary traffic only); listed: \
                 {alerts:?}\n{}",
                firing.name,
                start.elapsed().as_secs_f64(),
                prometheus.explain(&firing.name).await
            );
        }
        pending.extend(alerts.into_iter().map(|alert| alert.name));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut fired = BTreeSet::new();
    let ended = prometheus
        .until(DEADLINE, &mut fired, <[Active]>::is_empty)
        .await;
    assert!(
        fired.is_empty(),
        "{fired:?} fired after pending in the healthy run (ordinary traffic only)"
    );
    if let Err(last) = ended {
        panic!(
            "waited {DEADLINE:?} for the alerts pending at the end of the healthy run to end: \
             {last}"
        );
    }
    let (created_after, replayed_after, other_after) = tally.snapshot();
    assert_eq!(
        other, other_after,
        "every ordinary request of the healthy run was answered 201 (before it, after it)"
    );
    assert!(
        created_after > created && replayed_after > replayed,
        "the ordinary clients paid and replayed during the healthy run: {created}..{created_after} \
         payments, {replayed}..{replayed_after} replays"
    );
    pending
}

/// Every alert of the rules, evaluated by a real Prometheus over the real services, fires on
/// its real fault and resolves once the fault ends; ordinary traffic for as long as the longest
/// fault lasted fires none. Prints each alert's times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes of real faults and alert windows: scripts/test runs it in a pass of its own"]
async fn mysql_each_alert_fires_on_its_real_fault_and_resolves_once_it_ends_and_none_fires_on_healthy_traffic()
 {
    support::on_mysql(|database| async move {
        let test_start = Instant::now();
        let mut stack = Stack::start(database).await;
        let rules = stack.dir.path().join("idem.rules.short.yml");
        std::fs::write(&rules, with_short_windows(RULES)).expect("write the rules' copy");
        if let Err(said) = promtool_check(&rules) {
            panic!("promtool refuses the rules' copy: {said}");
        }
        let prometheus = Prometheus::start(stack.dir.path(), &rules, &stack.targets()).await;

        let mut measured = Vec::new();
        for fault in faults() {
            measured.push(prove(&mut stack, &prometheus, &fault).await);
        }
        let longest = measured
            .iter()
            .map(|row| row.lasted)
            .max()
            .expect("a row at least");
        let pending = healthy_run(&stack, &prometheus, longest).await;

        let mut table = format!(
            "{:<34} {:>12}  {:>14}  {}\n",
            "alert", "fired after", "resolved after", "also fired meanwhile"
        );
        for row in &measured {
            writeln!(
                table,
                "{:<34} {:>10.1} s  {:>12.1} s  {}",
                row.alert,
                row.fired_after.as_secs_f64(),
                row.resolved_after.as_secs_f64(),
                row.also.iter().cloned().collect::<Vec<_>>().join(", ")
            )
            .expect("a string takes it");
        }
        writeln!(
            table,
            "healthy run: {:.1} s of ordinary traffic (the longest fault, start to resolution), \
             no alert fired{}; the test took {:.0} s",
            longest.as_secs_f64(),
            if pending.is_empty() {
                String::new()
            } else {
                format!(" (pending a while: {pending:?})")
            },
            test_start.elapsed().as_secs_f64()
        )
        .expect("a string takes it");
        println!("{table}");
        stack.traffic.take().expect("ordinary traffic").stop().await;
    })
    .await;
}
