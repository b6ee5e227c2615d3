//! Counts the SQL statements sqlx runs, switched on only for short calibration passes so that
//! the timed runs pay nothing for it; and, for `scale`, keeps each statement's text and time.

use std::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use tracing::{Metadata, Subscriber, subscriber::Interest};
use tracing_subscriber::{Layer, layer::Context, prelude::*};

static COUNTING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: AtomicU64 = AtomicU64::new(0);
static TIMING: AtomicBool = AtomicBool::new(false);
static TIMED: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());

/// Reads a statement's text and time from sqlx's event.
#[derive(Default)]
struct Statement {
    summary: String,
    text: String,
    seconds: f64,
}

impl tracing::field::Visit for Statement {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "summary" => value.clone_into(&mut self.summary),
            "db.statement" => value.clone_into(&mut self.text),
            _ => {}
        }
    }

    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        if field.name() == "elapsed_secs" {
            self.seconds = value;
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "summary" && self.summary.is_empty() {
            self.summary = format!("{value:?}");
        }
    }
}

struct Counter;

impl<S: Subscriber> Layer<S> for Counter {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if metadata.target() == "sqlx::query" {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        metadata.target() == "sqlx::query"
            && (COUNTING.load(Ordering::Relaxed) || TIMING.load(Ordering::Relaxed))
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
        if TIMING.load(Ordering::Relaxed) {
            let mut statement = Statement::default();
            event.record(&mut statement);
            let text = if statement.text.trim().is_empty() {
                statement.summary
            } else {
                statement.text
            };
            TIMED
                .lock()
                .expect("timed statements")
                .push((text, statement.seconds));
        }
    }
}

/// Installs the counter as the global subscriber (first thing; again, it does nothing).
pub fn install() {
    let _ = tracing_subscriber::registry().with(Counter).try_init();
}

/// Counts the statements run while `pass` runs.
pub async fn count<F: Future>(pass: F) -> (F::Output, u64) {
    STATEMENTS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let output = pass.await;
    COUNTING.store(false, Ordering::SeqCst);
    (output, STATEMENTS.load(Ordering::SeqCst))
}

/// The statements run while `pass` runs, each with its text and its time in seconds, in the
/// order they ended (meant for one request at a time).
pub async fn time<F: Future>(pass: F) -> (F::Output, Vec<(String, f64)>) {
    TIMED.lock().expect("timed statements").clear();
    TIMING.store(true, Ordering::SeqCst);
    let output = pass.await;
    TIMING.store(false, Ordering::SeqCst);
    let timed = std::mem::take(&mut *TIMED.lock().expect("timed statements"));
    (output, timed)
}
