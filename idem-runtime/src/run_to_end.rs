//! A future that is finished on the runtime when its caller stops waiting for it.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

/// Polls `F` in the caller's task, like awaiting it; if the caller is dropped before `F`
/// finished (a request whose client went away), `F` is moved to a task of its own and run to
/// its end there, its output dropped.
///
/// This is `tokio::spawn(f).await` without a task and a wake-up across threads on the common
/// path, where the caller waits to the end.
pub(crate) struct RunToEnd<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    future: Option<Pin<Box<F>>>,
}

impl<F> RunToEnd<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    pub(crate) fn new(future: F) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<F> Future for RunToEnd<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(future) = self.future.as_mut() else {
            panic!("RunToEnd polled after it finished");
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<F> Drop for RunToEnd<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            // Outside a runtime (it is shutting down) there is nothing left to finish it on;
            // the future is dropped, as any other of that runtime.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(future);
            }
        }
    }
}
