//! The handle every `spawn` returns: stopping, finishing, detaching.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use idem_task::{CancellationToken, Next, PassContext, Schedule, TaskHandle, Work};

/// A pass that never ends, counting how often it started.
struct Stuck(Arc<AtomicU32>);

impl Work for Stuck {
    type Error = Infallible;

    async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

async fn until(what: &str, check: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn stop_ends_a_task_in_the_middle_of_its_pass_promptly() {
    let started = Arc::new(AtomicU32::new(0));
    let shutdown = CancellationToken::new();
    let task = idem_task::spawn(
        Stuck(Arc::clone(&started)),
        Schedule::new(Duration::from_secs(3600)),
        shutdown.clone(),
    );
    until("the pass started", || started.load(Ordering::SeqCst) == 1).await;
    tokio::time::timeout(Duration::from_secs(5), task.stop())
        .await
        .expect("stop ends the task promptly")
        .expect("the task did not panic");
    assert!(
        !shutdown.is_cancelled(),
        "stop cancels the task's own token only"
    );
}

#[tokio::test]
async fn a_task_stopped_by_its_shutdown_token_reports_finished() {
    let started = Arc::new(AtomicU32::new(0));
    let shutdown = CancellationToken::new();
    let task = idem_task::spawn(
        Stuck(Arc::clone(&started)),
        Schedule::new(Duration::from_secs(3600)),
        shutdown.clone(),
    );
    until("the pass started", || started.load(Ordering::SeqCst) == 1).await;
    assert!(!task.is_finished());
    shutdown.cancel();
    until("the handle reports the end", || task.is_finished()).await;
    task.await.expect("the task did not panic");
}

#[tokio::test]
async fn dropping_the_handle_leaves_the_task_running() {
    let shutdown = CancellationToken::new();
    let (ended_tx, ended_rx) = tokio::sync::oneshot::channel();
    let stop = shutdown.clone();
    drop(TaskHandle::spawn(&shutdown, |token| async move {
        token.cancelled().await;
        ended_tx.send(()).ok();
    }));
    tokio::task::yield_now().await;
    assert!(!stop.is_cancelled());
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), ended_rx)
        .await
        .expect("the detached task ran until its token was cancelled")
        .expect("the detached task ended by itself");
}
