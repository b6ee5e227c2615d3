//! `idem`: idem's operator command. Looks at the idempotency keys of a service's database,
//! releases a stuck claim, purges expired keys, erases a customer's keys (`forget`), on
//! PostgreSQL, SQLite, MySQL or MariaDB.
//!
//! ```text
//! idem [--database-url URL] [--json] stats
//! idem inspect --scope S --key K [--body]
//! idem in-flight [--older-than 1m]
//! idem release --scope S --key K
//! idem dead
//! idem resume --scope S --key K
//! idem abandon --scope S --key K
//! idem purge [--dry-run]
//! idem forget --scope S
//! idem rekey [--dry-run]
//! ```
//!
//! The URL is `--database-url` or `$DATABASE_URL` (`postgres://...`, `mysql://...` for MySQL
//! and MariaDB, or `sqlite:<path>`).
//! Output is a table for people, JSON with `--json`. A stored response's body, and what its
//! recorded steps saved, are printed only with `inspect --body`.
//!
//! A service that seals its answers (`IDEM_ENCRYPTION_KEYS`, as the example's) keeps only their
//! status in the clear: `inspect` says which key sealed one, and `inspect --body` opens it with
//! the keys in `$IDEM_ENCRYPTION_KEYS` (`<id>:<base64 of 32 bytes>`, comma-separated, as the
//! service's), or says which key id it needs and exits 1. `rekey` seals every stored answer
//! again with the first of those keys (the step of a rotation after which the others can be
//! retired), in batches, beside the running service. A malformed value stops the command
//! before it connects.
//!
//! Exit codes: 0 done, 1 refused, not found, or a sealed answer that does not open with the
//! keys given; 2 the database failed, or the settings are wrong. `forget` exits 0 when it has
//! deleted what it could, claims left or not: it says how many it left. `rekey` exits 0 when
//! every completed key and parked claim is sealed with the first key (claims in flight are
//! left to their owner, and counted), 1 when some did not open or were held by another
//! transaction (it names them; run it again). `--timeout` bounds the whole command: give a
//! longer one to `rekey`, `forget` or `purge` a large table (what they did before it stays
//! done, and running them again goes on).

mod output;

use std::{process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use idem_runtime::{
    admin::{AnyStore, Released, Unparked},
    seal::{EncryptionKeys, Unopened},
    tasks::PurgeOptions,
};

/// The variable that holds the keys sealed answers are opened with: the service's own.
const KEYS_VARIABLE: &str = "IDEM_ENCRYPTION_KEYS";

/// An error to print.
type Error = Box<dyn std::error::Error + Send + Sync>;

/// idem's operator command.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Cli {
    /// The service's database: `postgres://...`, `mysql://...` (MySQL, MariaDB) or
    /// `sqlite:<path>`.
    #[arg(long, env = "DATABASE_URL", global = true)]
    database_url: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// The longest the command waits for the database (`10s`, `1m`): one that stops
    /// answering without refusing (a partition) fails the command after it.
    #[arg(long, global = true, value_parser = humantime::parse_duration, default_value = "30s")]
    timeout: std::time::Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Keys by status, the oldest claim in flight, expired rows the purge has not deleted yet.
    Stats,
    /// One key: status, route, ages, recovery point (the body only with --body).
    Inspect {
        /// The key's scope (the caller).
        #[arg(long)]
        scope: String,
        /// The Idempotency-Key.
        #[arg(long)]
        key: String,
        /// Also print the stored response's body.
        #[arg(long)]
        body: bool,
    },
    /// Claims in flight (external mode), oldest first.
    InFlight {
        /// Only claims taken at least this long ago (`30s`, `5m`, `1h`).
        #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
        older_than: Duration,
    },
    /// Deletes a started claim, so that a retry runs the handler again. Refuses a completed
    /// key.
    Release {
        /// The key's scope.
        #[arg(long)]
        scope: String,
        /// The Idempotency-Key.
        #[arg(long)]
        key: String,
    },
    /// Claims the recovery gave up on (parked): route, rounds, the hook's last error, age.
    Dead,
    /// Hands a parked claim back to the recovery, its count of rounds reset: its next pass
    /// gives it to the hook again. Refuses a key that is not parked.
    Resume {
        /// The key's scope.
        #[arg(long)]
        scope: String,
        /// The Idempotency-Key.
        #[arg(long)]
        key: String,
    },
    /// Deletes a parked claim (and its recorded steps), so that the next retry runs the
    /// handler from the start: once you know its work did not happen, or undid it. Refuses a
    /// key that is not parked.
    Abandon {
        /// The key's scope.
        #[arg(long)]
        scope: String,
        /// The Idempotency-Key.
        #[arg(long)]
        key: String,
    },
    /// Deletes every completed key of a scope, expired or not (erasing a customer's stored
    /// answers): a retry of one runs the handler again. Leaves the scope's claims in flight
    /// and parked claims, and says how many.
    Forget {
        /// The scope whose keys to delete (the customer).
        #[arg(long)]
        scope: String,
    },
    /// Seals again, with the first key of $IDEM_ENCRYPTION_KEYS, every stored answer and
    /// recorded step sealed with another key or stored in the clear, in batches, beside the
    /// running service; claims in flight are left to their owner. With --dry-run, opens and
    /// counts them and writes nothing.
    Rekey {
        /// Open and count, do not write.
        #[arg(long)]
        dry_run: bool,
    },
    /// Deletes the expired keys now (with --dry-run, only counts them).
    Purge {
        /// Count, do not delete.
        #[arg(long)]
        dry_run: bool,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(url) = cli.database_url.as_deref() else {
        eprintln!("idem: give the database with --database-url or $DATABASE_URL");
        return ExitCode::from(2);
    };
    // Before connecting: a malformed value is a setting to fix, whatever the database says.
    let keys = match encryption_keys() {
        Ok(keys) => keys,
        Err(error) => {
            eprintln!("idem: {error}");
            return ExitCode::from(2);
        }
    };
    if matches!(cli.command, Command::Rekey { .. }) && keys.is_none() {
        eprintln!(
            "idem: rekey seals with the first key of {KEYS_VARIABLE}, which is not set: set it \
             to the service's keys, the one to seal with first"
        );
        return ExitCode::from(2);
    }
    let work = async {
        // Two connections: the command runs one statement at a time, and the purge's
        // batches leave room for nothing else.
        let mut store = AnyStore::connect(url, 2).await?;
        if let Some(keys) = keys {
            store = store.with_encryption_keys(keys);
        }
        run(&store, cli.command, cli.json).await
    };
    match tokio::time::timeout(cli.timeout, work).await {
        Ok(Ok(code)) => code,
        Ok(Err(error)) => {
            eprintln!("idem: {}", explained(&*error));
            ExitCode::from(2)
        }
        Err(_) => {
            eprintln!(
                "idem: the database did not answer within {}; nothing more was done (a \
                 release, purge, forget or rekey that had reached the database may have \
                 happened, in part; run the command again to see, or to go on)",
                humantime::format_duration(cli.timeout)
            );
            ExitCode::from(2)
        }
    }
}

/// `$IDEM_ENCRYPTION_KEYS`, the keys sealed answers are opened with; `None` when it is not set.
///
/// # Errors
///
/// A message naming the variable and what is wrong with its value (never a key's bytes).
fn encryption_keys() -> Result<Option<EncryptionKeys>, String> {
    match std::env::var(KEYS_VARIABLE) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!(
            "{KEYS_VARIABLE} must be `<id>:<base64 of 32 bytes>`, comma-separated; got a value \
             that is not text"
        )),
        Ok(value) => EncryptionKeys::parse(&zeroize::Zeroizing::new(value))
            .map(Some)
            .map_err(|error| format!("{KEYS_VARIABLE} is malformed: {error}")),
    }
}

/// `error` as a person reads it: what a pooler in front of PostgreSQL refused and what to do,
/// as the service says it ([`idem_runtime::postgres::pooler_refusal`]), rather than sqlx's
/// bare message; any other error as it is.
fn explained(error: &(dyn std::error::Error + 'static)) -> String {
    if let Some(idem_runtime::Error::Database(database)) = error.downcast_ref()
        && let Some(reason) = idem_runtime::postgres::pooler_refusal(database)
    {
        return reason;
    }
    error.to_string()
}

async fn run(db: &AnyStore, command: Command, json: bool) -> Result<ExitCode, Error> {
    match command {
        Command::Stats => output::stats(&db.stats().await?, json),
        Command::Inspect { scope, key, body } => {
            // The body is read whatever `--body` says: a gRPC answer's code is in it. It is
            // printed only when asked.
            let Some(found) = db.inspect(&scope, &key, true).await? else {
                eprintln!("idem: no key {key:?} in scope {scope:?}");
                return Ok(ExitCode::FAILURE);
            };
            if body && let Some(unopened) = &found.unopened {
                let id = unopened.key_id();
                let remedy = if matches!(unopened, Unopened::KeyNotConfigured { .. }) {
                    format!("; set {KEYS_VARIABLE} to keys that include the key of id {id:?}")
                } else {
                    String::new()
                };
                eprintln!(
                    "idem: what key {key:?} in scope {scope:?} stored (its answer or its \
                     recorded steps) needs key id {id:?}: {unopened}{remedy}"
                );
                return Ok(ExitCode::FAILURE);
            }
            output::key(&found, body, json);
        }
        Command::InFlight { older_than } => {
            output::keys(&db.in_flight(older_than).await?, older_than, json);
        }
        Command::Release { scope, key } => match db.release_claim(&scope, &key).await? {
            Released::Done => output::message(json, "released", &scope, &key),
            Released::Completed => {
                eprintln!(
                    "idem: key {key:?} in scope {scope:?} is completed: its response is stored \
                     and replayed; release only deletes a claim in flight"
                );
                return Ok(ExitCode::FAILURE);
            }
            Released::Missing => {
                eprintln!("idem: no key {key:?} in scope {scope:?}");
                return Ok(ExitCode::FAILURE);
            }
            Released::Parked => {
                eprintln!(
                    "idem: key {key:?} in scope {scope:?} is parked: the recovery gave up on it, \
                     and whether its work happened is for a person to find out; `idem abandon` \
                     lets the next retry run it, `idem resume` hands it back to the recovery"
                );
                return Ok(ExitCode::FAILURE);
            }
            Released::Busy => {
                eprintln!(
                    "idem: key {key:?} in scope {scope:?} is being written by another \
                     transaction (a completion or a recovery): not released; run the command \
                     again to see where it stands"
                );
                return Ok(ExitCode::FAILURE);
            }
        },
        Command::Dead => output::parked(&db.parked().await?, json),
        Command::Resume { scope, key } => {
            let done = db.resume_parked(&scope, &key).await?;
            return Ok(unparked(done, "resumed", json, &scope, &key));
        }
        Command::Abandon { scope, key } => {
            let done = db.abandon_parked(&scope, &key).await?;
            return Ok(unparked(done, "abandoned", json, &scope, &key));
        }
        Command::Forget { scope } => output::forgotten(&db.forget(&scope).await?, &scope, json),
        Command::Rekey { dry_run } => {
            let rekeyed = db.rekey(dry_run).await?;
            output::rekeyed(&rekeyed, json);
            if !rekeyed.is_complete() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Purge { dry_run } => {
            let rows = if dry_run {
                u64::try_from(db.stats().await?.expired).unwrap_or(0)
            } else {
                db.purge_expired(PurgeOptions::default()).await?.rows
            };
            output::purged(rows, dry_run, json);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Reports a `resume` or an `abandon`.
fn unparked(done: Unparked, verb: &str, json: bool, scope: &str, key: &str) -> ExitCode {
    match done {
        Unparked::Done => {
            output::message(json, verb, scope, key);
            ExitCode::SUCCESS
        }
        Unparked::NotParked => {
            eprintln!(
                "idem: key {key:?} in scope {scope:?} is not parked (`idem dead` lists the \
                 parked claims; `idem inspect` shows this key): nothing done"
            );
            ExitCode::FAILURE
        }
        Unparked::Missing => {
            eprintln!("idem: no key {key:?} in scope {scope:?}");
            ExitCode::FAILURE
        }
    }
}
