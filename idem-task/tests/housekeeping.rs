//! The loop's housekeeping: once before the first pass, then no more often than asked.

use std::{convert::Infallible, time::Duration};

use idem_task::{CancellationToken, Next, PassContext, Schedule, Work};
use tokio::sync::mpsc;

/// Records the order of its passes and housekeeping; tells the test after `passes` passes.
struct Recorder {
    log: Vec<&'static str>,
    passes: usize,
    done: mpsc::UnboundedSender<Vec<&'static str>>,
}

impl Work for Recorder {
    type Error = Infallible;

    async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, Infallible> {
        self.log.push("pass");
        if self.log.iter().filter(|entry| **entry == "pass").count() == self.passes {
            self.done.send(self.log.clone()).ok();
        }
        Ok(Next::Busy)
    }

    async fn housekeep(&mut self) {
        self.log.push("housekeeping");
    }
}

#[tokio::test]
async fn housekeeping_runs_before_the_first_pass_and_then_at_its_interval_only() {
    let (done, mut finished) = mpsc::unbounded_channel();
    let task = idem_task::spawn(
        Recorder {
            log: Vec::new(),
            passes: 3,
            done,
        },
        Schedule::new(Duration::ZERO).with_housekeeping(Duration::from_secs(3600)),
        CancellationToken::new(),
    );
    let log = tokio::time::timeout(Duration::from_secs(10), finished.recv())
        .await
        .expect("three passes ran")
        .expect("the task is still running");
    task.stop().await.expect("the task did not panic");
    assert_eq!(log, ["housekeeping", "pass", "pass", "pass"]);
}
