//! `claim`: what each way of claiming a key costs PostgreSQL, without HTTP or the service.
//!
//! Every variant runs the same transaction around one business `INSERT`, on `concurrency`
//! connections at once, in interleaved rounds: `bare` is that transaction alone; `peer` adds the
//! peer design's key row (`INSERT … ON CONFLICT DO NOTHING`, then `UPDATE` with the response);
//! the others claim and complete as idem's PostgreSQL backend can. Reported: transactions per
//! second, round trips, and PostgreSQL's CPU per transaction, each against `bare`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use sqlx::{Connection, PgConnection, PgPool, Row, SqlSafeStr};

use crate::{cpu, db, http::median};

/// Arguments of the claim benchmark.
#[derive(clap::Args, Clone)]
pub struct Args {
    /// Concurrent connections.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Rounds; each runs every variant once, in turn.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Seconds per variant per round.
    #[arg(long, default_value_t = 3)]
    pub seconds: u64,
    /// Only these variants (by their number in the table, 0 being `bare`, always run).
    #[arg(long, num_args = 1..)]
    pub only: Vec<usize>,
}

/// The ways of running one keyed transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// `BEGIN`, the business `INSERT`, `COMMIT`.
    Bare,
    /// The peer design's key row around it.
    Peer,
    /// idem's claim: the lock and the idle timeout in `BEGIN`'s simple query, the lock marking
    /// the transaction (a `LOCAL` setting); the prepared read, which reads the mark; the
    /// completion, which checks it.
    Call,
    /// The claim before the mark: taking the lock assigned the transaction its id, which the
    /// read and the completion checked.
    LockInBegin,
    /// Only the claim's read, without a lock: what one prepared round trip costs.
    ReadAlone,
    /// Only the completion's row, inserted without a claim.
    InsertAlone,
    /// A candidate: the claim inserts the key's row, `started`, in one prepared statement that
    /// takes the lock first (`ON CONFLICT DO NOTHING` sees rows committed after the statement's
    /// snapshot) and marks the transaction; the completion updates the row's status and
    /// response, checking the mark. The peer's two statements, plus the lock and the mark.
    RowClaim,
    /// A candidate: `BEGIN`, the lock and the check in one round trip, as server-side prepared
    /// statements run by `EXECUTE` in `BEGIN`'s simple query; the check raises when the key is
    /// not free (so the common path needs no result); the completion as in `Call`.
    Folded,
}

const VARIANTS: [Variant; 8] = [
    Variant::Bare,
    Variant::Peer,
    Variant::Folded,
    Variant::RowClaim,
    Variant::Call,
    Variant::LockInBegin,
    Variant::ReadAlone,
    Variant::InsertAlone,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Peer => "peer",
            Self::Call => "idem: claim (lock marks the transaction) + completion",
            Self::LockInBegin => "earlier idem: claim (lock assigns an id) + completion",
            Self::ReadAlone => "the claim's read alone",
            Self::InsertAlone => "the completion's INSERT alone",
            Self::RowClaim => "candidate: claim INSERTs the row (lock in it) + completion UPDATE",
            Self::Folded => "candidate: lock and check EXECUTEd in BEGIN's round trip + completion",
        }
    }
}

const WORK: &str = "CREATE TABLE IF NOT EXISTS bench_work (id text PRIMARY KEY, amount bigint NOT NULL, \
     created_at timestamptz NOT NULL DEFAULT now())";

// The read of the earlier claim, after the lock in `BEGIN`.
const LOCK_IN_BEGIN_READ: &str = "SELECT pg_current_xact_id_if_assigned()::text AS mark, \
     k.status, k.method, k.path, k.fingerprint, k.response_status, k.response_headers, \
     k.response_body, k.expires_at > now() AS live \
     FROM (SELECT 1) AS claim LEFT JOIN idem_keys k ON k.scope = $1 AND k.key = $2";

// idem's read and completion, checking the transaction's mark.
const MARKED_READ: &str = "SELECT current_setting('idem.claim', true) = $3 AS held, \
     k.status, k.method, k.path, k.fingerprint, k.response_status, k.response_headers, \
     k.response_body, k.expires_at > now() AS live \
     FROM (SELECT 1) AS claim LEFT JOIN idem_keys k ON k.scope = $1 AND k.key = $2";
const MARKED_COMPLETE: &str = "INSERT INTO idem_keys \
     (scope, key, method, path, fingerprint, status, response_status, response_headers, \
      response_body, created_at, expires_at) \
     SELECT $1, $2, $3, $4, $5, 'completed', $6, $7, $8, now(), \
            now() + make_interval(secs => $9) \
     WHERE current_setting('idem.claim', true) = $10";

// The earlier completion, checking the transaction's id.
const COMPLETE: &str = "INSERT INTO idem_keys \
     (scope, key, method, path, fingerprint, status, response_status, response_headers, \
      response_body, created_at, expires_at) \
     SELECT $1, $2, $3, $4, $5, 'completed', $6, $7, $8, now(), \
            now() + make_interval(secs => $9) \
     WHERE pg_current_xact_id_if_assigned()::text = $10";

// The candidate's claim: the lock, then the key's row with everything known before the handler
// runs, then the mark; `got` tells a held key (no lock) from a row in the way (lock, no mark).
const ROW_CLAIM: &str = "WITH lock AS (SELECT pg_try_advisory_xact_lock($1) AS got), \
     claimed AS ( \
       INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, created_at, \
         expires_at) \
       SELECT $2, $3, $4, $5, $6, 'started', now(), now() + make_interval(secs => $7) \
       FROM lock WHERE got \
       ON CONFLICT (scope, key) DO NOTHING \
       RETURNING set_config('idem.claim', $8, true) AS mark) \
     SELECT (SELECT got FROM lock) AS got, (SELECT mark FROM claimed) AS mark";
const ROW_COMPLETE: &str = "UPDATE idem_keys SET status = 'completed', response_status = $3, \
       response_headers = $4, response_body = $5 \
     WHERE scope = $1 AND key = $2 AND current_setting('idem.claim', true) = $6";

// The folded claim's statements, prepared once per connection.
const REFUSE: &str = "CREATE OR REPLACE FUNCTION bench_refuse(reason text) RETURNS boolean \
     LANGUAGE plpgsql VOLATILE AS $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'ID001', \
     MESSAGE = reason; END $$";
const PREPARE_LOCK: &str = "PREPARE bench_lock(bigint, text) AS \
     SELECT set_config('idle_in_transaction_session_timeout', $2, true), \
     CASE WHEN pg_try_advisory_xact_lock($1) THEN set_config('idem.claim', $1::text, true) END";
const PREPARE_CHECK: &str = "PREPARE bench_check(text, text, text) AS \
     SELECT CASE WHEN current_setting('idem.claim', true) IS DISTINCT FROM $3 \
       THEN bench_refuse('busy') \
       WHEN EXISTS (SELECT 1 FROM idem_keys WHERE scope = $1 AND key = $2) \
       THEN bench_refuse('found') END";

const BODY: &[u8] = br#"{"id":"pay_0123456789abcdef","status":"succeeded","amount":1250,"currency":"eur","customer":"cus_ok","created_at":"2026-12-02T04:00:00Z"}"#;

/// Runs the benchmark and prints its table.
///
/// # Errors
///
/// When the scratch database cannot be created or a statement fails.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let scratch = db::Scratch::named(args.concurrency as u32 + 2, "claim").await?;
    let result = measure(&args, &scratch.pool).await;
    scratch.drop().await?;
    result
}

async fn measure(args: &Args, pool: &PgPool) -> Result<(), db::Error> {
    sqlx::raw_sql(WORK).execute(pool).await?;
    sqlx::raw_sql(REFUSE).execute(pool).await?;
    let mut connections = Vec::new();
    for _ in 0..args.concurrency {
        let mut conn = pool.acquire().await?.detach();
        sqlx::raw_sql(PREPARE_LOCK).execute(&mut conn).await?;
        sqlx::raw_sql(PREPARE_CHECK).execute(&mut conn).await?;
        connections.push(conn);
    }
    let variants: Vec<Variant> = VARIANTS
        .iter()
        .enumerate()
        .filter(|(index, _)| *index == 0 || args.only.is_empty() || args.only.contains(index))
        .map(|(_, variant)| *variant)
        .collect();
    let counter = Arc::new(AtomicU64::new(0));
    let mut rates: Vec<Vec<f64>> = variants.iter().map(|_| Vec::new()).collect();
    let mut cpus: Vec<Vec<f64>> = variants.iter().map(|_| Vec::new()).collect();
    eprintln!("warming up...");
    for &variant in &variants {
        connections = round(connections, variant, Duration::from_secs(1), &counter)
            .await?
            .0;
    }
    for round_no in 1..=args.rounds {
        eprintln!("round {round_no}/{}", args.rounds);
        for (index, &variant) in variants.iter().enumerate() {
            let before = cpu::Sample::now();
            let (back, done, elapsed) = round(
                connections,
                variant,
                Duration::from_secs(args.seconds),
                &counter,
            )
            .await?;
            connections = back;
            let used = cpu::Sample::now().since(before);
            rates[index].push(done as f64 / elapsed.as_secs_f64());
            cpus[index].push(used.postgres.as_secs_f64() * 1e6 / done.max(1) as f64);
        }
    }
    println!(
        "PostgreSQL, one business INSERT per transaction, {} connections, {} rounds x {} s",
        args.concurrency, args.rounds, args.seconds
    );
    println!();
    println!("| variant | tx/s | / bare | PostgreSQL µs/tx | added µs/tx |");
    println!("|---|---|---|---|---|");
    let bare_cpu = median(cpus[0].iter().copied());
    for (index, &variant) in variants.iter().enumerate() {
        let ratio = median(rates[index].iter().zip(&rates[0]).map(|(v, b)| v / b));
        let cpu = median(cpus[index].iter().copied());
        println!(
            "| {} | {:.0} | {ratio:.2} | {cpu:.0} | {:.0} |",
            variant.name(),
            median(rates[index].iter().copied()),
            cpu - bare_cpu
        );
    }
    Ok(())
}

/// Runs `variant` on every connection for `length`: the connections back, the transactions
/// done and the time taken.
async fn round(
    connections: Vec<PgConnection>,
    variant: Variant,
    length: Duration,
    counter: &Arc<AtomicU64>,
) -> Result<(Vec<PgConnection>, u64, Duration), db::Error> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = connections
        .into_iter()
        .map(|mut conn| {
            let stop = stop.clone();
            let done = done.clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    one(&mut conn, variant, n).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, sqlx::Error>(conn)
            })
        })
        .collect();
    tokio::time::sleep(length).await;
    stop.store(true, Ordering::Relaxed);
    let mut back = Vec::new();
    for task in tasks {
        back.push(task.await??);
    }
    Ok((back, done.load(Ordering::Relaxed), start.elapsed()))
}

// The completion's row, inserted without a claim.
const INSERT_ALONE: &str = "INSERT INTO idem_keys (scope, key, method, path, fingerprint, \
     status, response_status, response_headers, response_body, created_at, expires_at) \
     VALUES ($1, $2, $3, $4, $5, 'completed', $6, $7, $8, now(), \
     now() + make_interval(secs => $9))";

/// `sql`, a completion, with its first nine parameters bound for `key`.
fn completion<'q>(
    sql: &'static str,
    key: &'q str,
    headers: serde_json::Value,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind("tenant")
        .bind(key)
        .bind("POST")
        .bind("/v1/payments")
        .bind(&[7_u8; 32][..])
        .bind(201_i16)
        .bind(headers)
        .bind(BODY)
        .bind(86_400.0_f64)
}

/// One transaction of `variant` with the key number `n`.
async fn one(conn: &mut PgConnection, variant: Variant, n: u64) -> Result<(), sqlx::Error> {
    let key = format!("key-{n}");
    let lock = n as i64;
    let mut tx = match variant {
        Variant::LockInBegin => {
            let begin = format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL idle_in_transaction_session_timeout = 10000; \
                 SELECT CASE WHEN pg_try_advisory_xact_lock({lock}) THEN pg_current_xact_id() END"
            );
            sqlx::Transaction::begin(&mut *conn, Some(sqlx::AssertSqlSafe(begin).into_sql_str()))
                .await?
        }
        Variant::Folded => {
            let begin = format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; EXECUTE bench_lock({lock}, '10000'); \
                 EXECUTE bench_check('tenant', '{key}', '{lock}')"
            );
            sqlx::Transaction::begin(&mut *conn, Some(sqlx::AssertSqlSafe(begin).into_sql_str()))
                .await?
        }
        Variant::RowClaim => {
            let begin = "BEGIN ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL idle_in_transaction_session_timeout = 10000";
            sqlx::Transaction::begin(&mut *conn, Some(begin.into_sql_str())).await?
        }
        Variant::Call => {
            let begin = format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL idle_in_transaction_session_timeout = 10000; \
                 SELECT CASE WHEN pg_try_advisory_xact_lock({lock}) \
                 THEN set_config('idem.claim', '{lock}', true) END"
            );
            sqlx::Transaction::begin(&mut *conn, Some(sqlx::AssertSqlSafe(begin).into_sql_str()))
                .await?
        }
        _ => conn.begin().await?,
    };
    let mark: Option<String> = match variant {
        Variant::Bare | Variant::InsertAlone => None,
        Variant::Folded => Some(lock.to_string()),
        Variant::Peer => {
            sqlx::query(
                "INSERT INTO peer_idempotency (user_id, idempotency_key, created_at) \
                 VALUES ($1, $2, now()) ON CONFLICT DO NOTHING",
            )
            .bind("tenant")
            .bind(&key)
            .execute(&mut *tx)
            .await?;
            None
        }
        Variant::RowClaim => {
            let row = sqlx::query(ROW_CLAIM)
                .bind(lock)
                .bind("tenant")
                .bind(&key)
                .bind("POST")
                .bind("/v1/payments")
                .bind(&[7_u8; 32][..])
                .bind(86_400.0_f64)
                .bind(lock.to_string())
                .fetch_one(&mut *tx)
                .await?;
            row.try_get("mark")?
        }
        Variant::Call => {
            let mark = lock.to_string();
            let row = sqlx::query(MARKED_READ)
                .bind("tenant")
                .bind(&key)
                .bind(&mark)
                .fetch_one(&mut *tx)
                .await?;
            let held: Option<bool> = row.try_get("held")?;
            held.unwrap_or(false).then_some(mark)
        }
        Variant::LockInBegin | Variant::ReadAlone => {
            let row = sqlx::query(LOCK_IN_BEGIN_READ)
                .bind("tenant")
                .bind(&key)
                .fetch_one(&mut *tx)
                .await?;
            row.try_get("mark")?
        }
    };
    sqlx::query("INSERT INTO bench_work (id, amount) VALUES ($1, $2)")
        .bind(&key)
        .bind(1250_i64)
        .execute(&mut *tx)
        .await?;
    let headers = serde_json::json!([["content-type", "application/json"]]);
    match variant {
        Variant::Bare | Variant::ReadAlone => {}
        Variant::Peer => {
            sqlx::query(
                "UPDATE peer_idempotency SET response_status_code = $3, response_headers = $4, \
                 response_body = $5 WHERE user_id = $1 AND idempotency_key = $2",
            )
            .bind("tenant")
            .bind(&key)
            .bind(201_i16)
            .bind(headers)
            .bind(BODY)
            .execute(&mut *tx)
            .await?;
        }
        Variant::RowClaim => {
            let done = sqlx::query(ROW_COMPLETE)
                .bind("tenant")
                .bind(&key)
                .bind(201_i16)
                .bind(headers)
                .bind(BODY)
                .bind(mark.unwrap_or_default())
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() != 1 {
                return Err(sqlx::Error::Protocol(format!(
                    "{}: the completion wrote {} rows",
                    variant.name(),
                    done.rows_affected()
                )));
            }
        }
        Variant::InsertAlone => {
            completion(INSERT_ALONE, &key, headers)
                .execute(&mut *tx)
                .await?;
        }
        Variant::Call | Variant::LockInBegin | Variant::Folded => {
            let complete = if variant != Variant::LockInBegin {
                MARKED_COMPLETE
            } else {
                COMPLETE
            };
            let done = completion(complete, &key, headers)
                .bind(mark.unwrap_or_default())
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() != 1 {
                return Err(sqlx::Error::Protocol(format!(
                    "{}: the completion wrote {} rows",
                    variant.name(),
                    done.rows_affected()
                )));
            }
        }
    }
    tx.commit().await?;
    Ok(())
}
