//! Hostile input over HTTP: a seeded campaign of random, malformed and abusive requests against
//! the example service, served by `axum::serve` on a loopback port and sent over raw TCP (so
//! that repeated headers, invalid bytes and broken HTTP can be sent), on every database.
//!
//! Every answer must be a documented status (never a 500), every problem must be
//! `application/problem+json`, a replay must repeat an earlier answer, the service must still
//! serve a valid payment at the end, and the rows written must match the first executions the
//! client saw: one payment or payout row per 201/402 without `Idempotent-Replayed: true`, one
//! refund row per such 201. Allowed, and named where they are: the router's empty 404/405 for an
//! unknown path or method, hyper's empty 400 for a request it cannot parse, and axum's `text/plain`
//! 400 for a path id that is not UTF-8 (the example's handlers take `axum::extract::Path`).
//!
//! At the end: a route whose scope comes from the path shows what idem does with a scope the
//! database cannot store (`%00`, or thousands of characters).
//!
//! The seed is printed; set `IDEM_HOSTILE_SEED` to replay a campaign (requests are sent four at
//! a time, so which duplicate of a key gets the 409 may differ between runs).

mod campaign;
mod rng;
mod scopes;
mod tally;
mod wire;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    time::Instant,
};

use crate::service::{self, executed_refunds, spawn_processor};
use campaign::{Campaign, KeyScope, Kind, Plan, Route, example, race_in_batch};
use idem_runtime::ProblemKind;
use idem_tests::{App, TestDb, backend_tests};
use rng::{Rng, seed};
use tally::Tally;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use wire::{Answer, Wire, exchange, wire_target_has_query};

/// Requests per database.
const REQUESTS: usize = 500;
/// Requests in flight at once.
const CONCURRENCY: usize = 4;
/// The store's default request body limit.
const LIMIT: usize = 1024 * 1024;
const DEFAULT_SEED: u64 = 0x1de4_5eed_2026;
const SEED_VAR: &str = "IDEM_HOSTILE_SEED";
const TENANTS: [&str; 3] = ["t_alpha", "t_beta", "t_gamma"];
/// Every status the guide's "What a request gets" and the example's errors document.
const DOCUMENTED: [u16; 12] = [200, 201, 400, 401, 402, 404, 405, 409, 413, 415, 422, 503];
const EXAMPLE_TYPE: &str = "tag:payments.idem.example,2026:";

backend_tests! {
    async fn hostile_requests_get_documented_problems_never_500_and_rows_match_first_executions(db) {
        let backend = match &db {
            TestDb::Postgres(_) => "postgres",
            TestDb::Sqlite(_) => "sqlite",
            TestDb::MySql(_) => "mysql",
        };
        let processor = spawn_processor().await;
        let app = service::with_processor(db, processor.clone()).await;
        let addr = app.serve().await;
        let seed = seed();
        println!("{backend}: hostile campaign with seed {seed} ({SEED_VAR}={seed} replays it)");
        let started = Instant::now();
        let mut campaign = Campaign {
            rng: Rng(seed),
            next_key: 0,
            sent: Vec::new(),
            payments: Vec::new(),
            changed: HashSet::new(),
        };
        let mut tally = Tally::default();
        let mut planned = 0;
        while planned < REQUESTS {
            let mut batch: Vec<Plan> = (0..CONCURRENCY.min(REQUESTS - planned))
                .map(|_| campaign.plan())
                .collect();
            race_in_batch(&mut batch);
            planned += batch.len();
            let tasks: Vec<_> = batch
                .iter()
                .map(|plan| tokio::spawn(exchange(addr, plan.wire.clone(), plan.head)))
                .collect();
            let mut answers = Vec::with_capacity(tasks.len());
            for task in tasks {
                answers.push(task.await.expect("request task"));
            }
            for (plan, answer) in batch.iter().zip(&answers) {
                match answer {
                    Ok(answer) => {
                        if let (Some(id), Some((tenant, _))) = (tally.check(plan, answer), &plan.scope) {
                            campaign.payments.push((tenant.clone(), id));
                        }
                    }
                    Err(error) => {
                        *tally.by_kind.entry(format!("{:?} no answer", plan.kind)).or_default() += 1;
                        tally.fail(plan, None, format!("no answer: {error}"));
                    }
                }
            }
            for (plan, answer) in batch.iter().zip(&answers) {
                if let Ok(answer) = answer {
                    tally.check_replay(plan, answer);
                }
            }
        }

        let rows = [
            (Route::Payments, app.count("payments").await),
            (Route::Payouts, app.count("payouts").await),
            (Route::Refunds, app.count("refunds").await),
        ];
        let executed = executed_refunds(&processor).await.len() as i64;
        println!(
            "{backend}: {planned} requests in {:.1} s; by status: {:?}; replays: {}; \
             first executions: {:?}; rows: {rows:?}; refunds at the processor: {executed}",
            started.elapsed().as_secs_f64(),
            tally.by_status,
            tally.replays,
            tally.first,
        );
        println!("{backend}: by kind: {:?}", tally.by_kind);
        println!(
            "{backend}: text/plain Path rejections (known, not problems): {}",
            tally.plain
        );
        for failure in &tally.failures {
            println!("{backend}: FAILED {failure}");
        }
        assert!(
            tally.failures.is_empty(),
            "{} answers broke the contract (above)",
            tally.failures.len()
        );
        let first = |route| tally.first.get(&route).copied().unwrap_or_default();
        for (route, rows) in rows {
            assert_eq!(rows, first(route), "{route:?}: rows against first executions seen");
        }
        assert_eq!(executed, first(Route::Refunds), "refunds executed by the processor");

        // The service still serves a valid payment, and replays it.
        let body = r#"{"amount": 4200, "currency": "usd", "customer": "cus_final"}"#;
        let last = || {
            Wire::new("POST", "/v1/payments")
                .tenant("t_final")
                .key("the-last-key")
                .json(body)
                .bytes()
        };
        let made = exchange(addr, last(), false).await.expect("a final answer");
        let text = String::from_utf8_lossy(&made.body).into_owned();
        assert_eq!((made.status, made.replayed()), (201, false), "{text}");
        let again = exchange(addr, last(), false).await.expect("a final replay");
        assert_eq!((again.status, again.replayed()), (201, true));
        assert_eq!(again.body, made.body);
        assert_eq!(app.count("payments").await, first(Route::Payments) + 1);
    }
}
