//! # idem-task: the one shape of idem's background tasks
//!
//! The purge of expired keys, the recovery of abandoned claims (crate `idem-runtime`), the
//! outbox relay and the consumers (crate `idem-events`) all run the same loop and hand back the
//! same handle. This crate holds both, and the one way they bound database work in time: it depends on tokio, tokio-util and tracing only,
//! so that the events crate does not compile the HTTP side, nor the reverse.
//!
//! - [`Work`] is one task's pass, plus the wording of its reports and an optional
//!   housekeeping step.
//! - [`run`] is the loop: a pass, then a wait ([`Schedule::idle`] when there was nothing to do,
//!   a [`Backoff`] step when the pass failed), the housekeeping every
//!   [`Schedule::housekeeping`], until the token is cancelled. An outage gives one warning when
//!   it starts and one line when it ends, not one per attempt.
//! - [`spawn`] runs the loop in a task of its own and returns its [`TaskHandle`].
//! - [`Deadline`] bounds database work in time, the one way both crates do it.
//!
//! ```
//! use std::{convert::Infallible, time::Duration};
//! use idem_task::{CancellationToken, Next, PassContext, Schedule, Work};
//!
//! struct Tick(u32);
//!
//! impl Work for Tick {
//!     type Error = Infallible;
//!
//!     async fn pass(&mut self, _cx: &mut PassContext<'_>) -> Result<Next, Infallible> {
//!         self.0 += 1;
//!         Ok(Next::Idle)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let shutdown = CancellationToken::new();
//! let task = idem_task::spawn(Tick(0), Schedule::new(Duration::from_secs(1)), shutdown.clone());
//! // ... serve, then:
//! task.stop().await.unwrap();
//! # }
//! ```

mod backoff;
mod deadline;
mod handle;
mod repeat;
mod schedule;

pub use backoff::Backoff;
pub use deadline::Deadline;
pub use handle::TaskHandle;
pub use repeat::{Next, PassContext, Work, run, spawn};
pub use schedule::Schedule;
/// The token that stops a task: cancel it with the server's graceful shutdown.
pub use tokio_util::sync::CancellationToken;
