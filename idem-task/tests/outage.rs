//! The loop's reporting rule: one warning when an outage starts, one info line when it ends.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_task::{CancellationToken, Next, PassContext, Schedule, Work};
use tokio::sync::mpsc;
use tracing::{Level, Subscriber};
use tracing_subscriber::{Layer, layer::Context, prelude::*};

/// Counts the events of each level.
#[derive(Clone, Default)]
struct Counts {
    warn: Arc<AtomicUsize>,
    info: Arc<AtomicUsize>,
    debug: Arc<AtomicUsize>,
}

impl<S: Subscriber> Layer<S> for Counts {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let counter = match *event.metadata().level() {
            Level::WARN => &self.warn,
            Level::INFO => &self.info,
            Level::DEBUG => &self.debug,
            _ => return,
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

/// Fails or succeeds as its script says, then tells the test the script is over and idles.
struct Scripted {
    script: Vec<bool>,
    done: mpsc::UnboundedSender<()>,
}

impl Work for Scripted {
    type Error = &'static str;

    async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, &'static str> {
        if self.script.is_empty() {
            self.done.send(()).ok();
            return Ok(Next::Idle);
        }
        if self.script.remove(0) {
            Ok(Next::Busy)
        } else {
            Err("the database is away")
        }
    }
}

#[tokio::test]
async fn each_outage_gives_one_warning_when_it_starts_and_one_info_line_when_it_ends() {
    let counts = Counts::default();
    let _guard = tracing_subscriber::registry()
        .with(counts.clone())
        .set_default();
    let (done, mut finished) = mpsc::unbounded_channel();
    // Two outages, of three failures and of two, each followed by a success.
    let script = vec![false, false, false, true, true, false, false, true];
    let shutdown = CancellationToken::new();
    let task = idem_task::spawn(
        Scripted { script, done },
        Schedule::new(Duration::from_secs(3600))
            .with_backoff(Duration::from_millis(1), Duration::from_millis(2)),
        shutdown,
    );
    tokio::time::timeout(Duration::from_secs(10), finished.recv())
        .await
        .expect("the script ran to its end")
        .expect("the task is still running");
    task.stop().await.expect("the task did not panic");
    assert_eq!(
        counts.warn.load(Ordering::SeqCst),
        2,
        "one warning per outage"
    );
    assert_eq!(
        counts.info.load(Ordering::SeqCst),
        2,
        "one info line per outage's end"
    );
    assert_eq!(
        counts.debug.load(Ordering::SeqCst),
        3,
        "the other failures are debug lines"
    );
}
