//! The HTTP/1 server of the example's binaries: an axum router served by hyper, with a bound on
//! how long a client may take to send a request's head.
//!
//! `axum::serve` builds hyper's connections without a timer, and hyper's header-read timeout
//! (30 s by default) only takes effect with one: under `axum::serve` a client that sends its
//! headers one byte a second, or connects and sends nothing, holds its connection for as long
//! as it likes. Here hyper has tokio's timer and a bound ([`HEADER_READ_TIMEOUT`] in the
//! binaries): a connection whose request head has not fully arrived that long after the server
//! started waiting for it is closed, without an answer. The wait starts when the connection is
//! accepted and again after each answer, so an idle keep-alive connection is closed after the
//! same time.

use std::{pin::pin, time::Duration};

use axum::{Router, serve::Listener};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;

/// How long a client may take to send a request's head (the request line and the headers),
/// from when the server starts waiting for it: 10 s.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` on `listener`, each connection in a task of its own and given
/// `header_read_timeout` for each request's head, until `shutdown` completes; then accepts no
/// more connections, lets those with a request in flight finish it, closes the idle ones, and
/// returns once all are closed.
///
/// An accept that fails is retried as `axum::serve` does (at once for an error of that
/// connection, after a second for one of the process, such as too many open files).
pub async fn serve(
    mut listener: TcpListener,
    router: Router,
    header_read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    let connections = GracefulShutdown::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let stream = tokio::select! {
            (stream, _) = Listener::accept(&mut listener) => stream,
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(router.clone());
        let connection = connections.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A client that went away or took too long; nothing to answer.
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection closed");
            }
        });
    }
    drop(listener);
    connections.shutdown().await;
}
