//! A TCP proxy in front of a broker that the test can break: cut every open connection, cut
//! each connection once it has carried some bytes to the server, or refuse new connections
//! (the broker looks down).

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicUsize, Ordering},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
};

#[derive(Debug)]
struct State {
    refusing: AtomicBool,
    cut_after: AtomicUsize,
    cuts: AtomicUsize,
    cut_all: watch::Sender<u64>,
}

/// The proxy: connections to [`TcpProxy::port`] reach the upstream server.
#[derive(Debug, Clone)]
pub struct TcpProxy {
    port: u16,
    state: Arc<State>,
}

impl TcpProxy {
    /// Listens on a loopback port and forwards every connection to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let port = listener.local_addr().expect("local addr").port();
        let state = Arc::new(State {
            refusing: AtomicBool::new(false),
            cut_after: AtomicUsize::new(0),
            cuts: AtomicUsize::new(0),
            cut_all: watch::channel(0).0,
        });
        let shared = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if shared.refusing.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let state = Arc::clone(&shared);
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        forward(state, client, server).await;
                    }
                });
            }
        });
        Self { port, state }
    }

    /// The port to connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every open connection now.
    pub fn cut_all(&self) {
        self.state
            .cut_all
            .send_modify(|generation| *generation += 1);
    }

    /// While on, new connections are closed as soon as they are accepted, and open ones are
    /// cut: the server looks down.
    pub fn refuse(&self, on: bool) {
        self.state.refusing.store(on, Ordering::SeqCst);
        if on {
            self.cut_all();
        }
    }

    /// Each connection opened from now on is cut once it has carried `bytes` bytes to the
    /// server (0: never).
    pub fn cut_after(&self, bytes: usize) {
        self.state.cut_after.store(bytes, Ordering::SeqCst);
    }

    /// How many connections were cut, by any of the means above.
    pub fn cuts(&self) -> usize {
        self.state.cuts.load(Ordering::SeqCst)
    }
}

async fn forward(state: Arc<State>, mut client: TcpStream, mut server: TcpStream) {
    let limit = state.cut_after.load(Ordering::SeqCst);
    let mut cut_all = state.cut_all.subscribe();
    cut_all.mark_unchanged();
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let upstream = async {
        let mut sent = 0usize;
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => n,
            };
            let n = if limit > 0 { n.min(limit - sent) } else { n };
            if server_write.write_all(&buf[..n]).await.is_err() {
                return false;
            }
            sent += n;
            if limit > 0 && sent >= limit {
                return true;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let cut = tokio::select! {
        cut = upstream => cut,
        () = downstream => false,
        _ = cut_all.changed() => true,
    };
    if cut {
        state.cuts.fetch_add(1, Ordering::SeqCst);
    }
}
