//! The handle every background task's `spawn` returns.

use std::future::{Future, IntoFuture};

use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;

/// A running background task: its tokio task and the token that stops it.
///
/// The token is a child of the one the task was spawned with: cancelling that one (the
/// server's graceful shutdown) stops every task spawned from it, and [`TaskHandle::stop`] stops
/// this one alone.
///
/// Dropping the handle does **not** stop the task: it runs on, detached, until its shutdown
/// token is cancelled. Awaiting the handle waits for the end without asking for it; a task
/// that panicked gives the [`JoinError`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use idem_task::{CancellationToken, TaskHandle};
///
/// let shutdown = CancellationToken::new();
/// let task = TaskHandle::spawn(&shutdown, |stop| async move { stop.cancelled().await });
/// shutdown.cancel();
/// task.await.unwrap();
/// # }
/// ```
#[derive(Debug)]
pub struct TaskHandle {
    join: JoinHandle<()>,
    stop: CancellationToken,
}

impl TaskHandle {
    /// Spawns `task` on the current runtime with a child token of `shutdown`, which `task` must
    /// end on once it is cancelled.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn<F, Fut>(shutdown: &CancellationToken, task: F) -> Self
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let stop = shutdown.child_token();
        let join = tokio::spawn(task(stop.clone()));
        Self { join, stop }
    }

    /// Cancels the task and waits until it has ended.
    ///
    /// # Errors
    ///
    /// The [`JoinError`] of a task that panicked.
    pub async fn stop(self) -> Result<(), JoinError> {
        self.stop.cancel();
        self.join.await
    }

    /// Whether the task has ended (stopped, or panicked).
    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
}

impl IntoFuture for TaskHandle {
    type Output = Result<(), JoinError>;
    type IntoFuture = JoinHandle<()>;

    /// Waits for the task's end, without cancelling it.
    fn into_future(self) -> Self::IntoFuture {
        self.join
    }
}
