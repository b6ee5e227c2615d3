//! Counts the SQL statements sqlx runs, switched on only for short calibration passes so that
//! the timed runs pay nothing for it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tracing::{Metadata, Subscriber, subscriber::Interest};
use tracing_subscriber::{Layer, layer::Context, prelude::*};

static COUNTING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: AtomicU64 = AtomicU64::new(0);

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
        metadata.target() == "sqlx::query" && COUNTING.load(Ordering::Relaxed)
    }

    fn on_event(&self, _: &tracing::Event<'_>, _: Context<'_, S>) {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Installs the counter as the global subscriber (call once, first thing).
pub fn install() {
    tracing_subscriber::registry().with(Counter).init();
}

/// Counts the statements run while `pass` runs.
pub async fn count<F: Future>(pass: F) -> (F::Output, u64) {
    STATEMENTS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let output = pass.await;
    COUNTING.store(false, Ordering::SeqCst);
    (output, STATEMENTS.load(Ordering::SeqCst))
}
