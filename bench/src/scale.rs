//! `scale`: does the claim slow down as the key table grows? The claim and the completion are
//! timed on an empty table and on one with millions of keys, in interleaved rounds.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use idem_runtime::__private::{Begun, Completion, Fingerprint, KeyRef, Storage, StoredResponse};
use sqlx::{PgPool, Postgres};

use crate::{db, http::median, load::fresh_key};

/// Arguments of the scale benchmark.
#[derive(clap::Args)]
pub struct Args {
    /// Keys in the large table.
    #[arg(long, default_value_t = 10_000_000)]
    keys: i64,
    /// Rounds; each times both tables in turn.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Claims per table per round.
    #[arg(long, default_value_t = 2000)]
    claims: usize,
}

/// Runs the benchmark and prints its table.
pub async fn run(args: Args) -> Result<(), db::Error> {
    let empty = db::Scratch::named(4, "empty").await?;
    let large = match db::Scratch::named(4, "large").await {
        Ok(large) => large,
        Err(error) => {
            empty.drop().await?;
            return Err(error);
        }
    };
    let result = measure(&args, &empty.pool, &large.pool).await;
    empty.drop().await?;
    large.drop().await?;
    result
}

async fn measure(args: &Args, empty: &PgPool, large: &PgPool) -> Result<(), db::Error> {
    let chunk = 1_000_000_i64;
    let mut seeded = 0;
    while seeded < args.keys {
        let n = chunk.min(args.keys - seeded);
        sqlx::query(
            "INSERT INTO idem_keys (scope, key, method, path, fingerprint, status, \
               response_status, response_headers, response_body, expires_at) \
             SELECT 'tenant_' || (g % 10000), md5(g::text), 'POST', '/v1/payments', \
               sha256(g::text::bytea), 'completed', 201, '[]'::jsonb, '\\x00'::bytea, \
               now() + interval '1 day' \
             FROM generate_series($1 + 1, $1 + $2) g",
        )
        .bind(seeded)
        .bind(n)
        .execute(large)
        .await?;
        seeded += n;
        eprintln!("seeded {seeded} keys");
    }
    sqlx::raw_sql("VACUUM ANALYZE idem_keys")
        .execute(large)
        .await?;
    sqlx::raw_sql("VACUUM ANALYZE idem_keys")
        .execute(empty)
        .await?;
    let size: String =
        sqlx::query_scalar("SELECT pg_size_pretty(pg_total_relation_size('idem_keys'))")
            .fetch_one(large)
            .await?;

    // Warm both, then alternate.
    time_claims(empty, 200).await?;
    time_claims(large, 200).await?;
    let mut rounds: [Vec<(f64, f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for round in 1..=args.rounds {
        eprintln!("round {round}/{}", args.rounds);
        for (index, pool) in [empty, large].into_iter().enumerate() {
            // Each pass leaves its rolled-back rows behind as dead tuples; clear them so that
            // both tables are measured as autovacuum would keep them.
            sqlx::raw_sql("VACUUM idem_keys").execute(pool).await?;
            let (claim, complete) = time_claims(pool, args.claims).await?;
            rounds[index].push((
                quantile(&claim, 0.5),
                quantile(&claim, 0.99),
                quantile(&complete, 0.5),
                quantile(&complete, 0.99),
            ));
        }
    }
    println!(
        "claim and completion latency, {} fresh keys per table per round, {} rounds",
        args.claims, args.rounds
    );
    println!();
    println!("| table | claim p50 ms | claim p99 ms | complete p50 ms | complete p99 ms |");
    println!("|---|---|---|---|---|");
    let labels = ["empty".to_owned(), format!("{} keys ({size})", args.keys)];
    let medians: Vec<[f64; 4]> = rounds
        .iter()
        .map(|r| {
            [
                median(r.iter().map(|x| x.0)),
                median(r.iter().map(|x| x.1)),
                median(r.iter().map(|x| x.2)),
                median(r.iter().map(|x| x.3)),
            ]
        })
        .collect();
    for (label, m) in labels.iter().zip(&medians) {
        println!(
            "| {label} | {:.3} | {:.3} | {:.3} | {:.3} |",
            m[0], m[1], m[2], m[3]
        );
    }
    let ratio = median(
        rounds[1]
            .iter()
            .zip(&rounds[0])
            .map(|(large, empty)| large.0 / empty.0),
    );
    println!();
    println!("claim p50 large/empty {ratio:.2} (median of per-round ratios; target <= 1.2)");
    Ok(())
}

/// Claims `n` fresh keys one after another, each in its own transaction, completing and then
/// rolling back (so the table does not grow); returns the claim (with its `BEGIN`, sent in the
/// same round trip) and completion latencies.
async fn time_claims(
    pool: &PgPool,
    n: usize,
) -> Result<(Histogram<u64>, Histogram<u64>), db::Error> {
    let mut claim = Histogram::<u64>::new(3)?;
    let mut complete = Histogram::<u64>::new(3)?;
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: br#"{"id":"pay_1"}"#.to_vec(),
    };
    let fingerprint = Fingerprint::from_slice(&[7; 32]).expect("32 bytes");
    for i in 0..n {
        let key = KeyRef::new(format!("tenant_{}", i % 10_000), fresh_key());
        let conn = pool.acquire().await?;
        let started = Instant::now();
        let begun = <Postgres as Storage>::begin_claim(conn, &key, None).await?;
        record(&mut claim, started.elapsed());
        let Begun::Acquired(mut tx, mark) = begun else {
            return Err("a fresh key was not acquired".into());
        };
        let completion = Completion {
            key: &key,
            method: "POST",
            path: "/v1/payments",
            fingerprint: &fingerprint,
            response: &response,
            mark: mark.as_deref(),
        };
        let started = Instant::now();
        if !<Postgres as Storage>::complete(&mut tx, &completion, Duration::from_secs(86_400))
            .await?
        {
            return Err("the completion was refused".into());
        }
        record(&mut complete, started.elapsed());
        tx.rollback().await?;
    }
    Ok((claim, complete))
}

fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    let _ = histogram.record((elapsed.as_micros() as u64).max(1));
}

fn quantile(histogram: &Histogram<u64>, q: f64) -> f64 {
    histogram.value_at_quantile(q) as f64 / 1000.0
}
