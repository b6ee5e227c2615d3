//! A TCP proxy in front of PostgreSQL that can cut a connection during its COMMIT: it forwards
//! the COMMIT to the server, lets the server commit, and closes the client's connection before
//! the answer reaches it. The client cannot know whether its transaction committed.
//!
//! It can also hold the server's answer to a claim's `BEGIN` (the query that tries the key's
//! lock) until the test lets it go, so that a test can drop the request in between.

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicUsize, Ordering},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

/// The proxy; connections made through [`CommitCutter::port`] reach the server at `upstream`.
#[derive(Debug, Clone)]
pub struct CommitCutter {
    port: u16,
    armed: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
    hold_armed: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
    release: Arc<tokio::sync::Semaphore>,
}

impl CommitCutter {
    /// Listens on a loopback port and forwards every connection to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let port = listener.local_addr().expect("local addr").port();
        let proxy = Self {
            port,
            armed: Arc::default(),
            cuts: Arc::default(),
            hold_armed: Arc::default(),
            held: Arc::default(),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
        };
        let shared = proxy.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let proxy = shared.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        proxy.relay(client, server).await;
                    }
                });
            }
        });
        proxy
    }

    /// The port to connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The next COMMIT through the proxy (on any connection) is cut.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// How many COMMITs were cut so far (the server's answer had arrived each time).
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }

    /// The answer to the next query that tries a key's lock (a claim's `BEGIN`) is held until
    /// [`CommitCutter::release`].
    pub fn hold_next_claim(&self) {
        self.hold_armed.store(true, Ordering::SeqCst);
    }

    /// How many answers were held so far (each is held from its first byte).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Lets a held answer go on to the client.
    pub fn release(&self) {
        self.release.add_permits(1);
    }

    async fn relay(self, client: TcpStream, server: TcpStream) {
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        let cutting = Arc::new(AtomicBool::new(false));
        let holding = Arc::new(AtomicBool::new(false));
        // Server to client: bytes as they come, until a cut COMMIT's answer arrives, which is
        // dropped with the connection; a held answer waits for its release.
        let answers = {
            let (cutting, cuts) = (Arc::clone(&cutting), Arc::clone(&self.cuts));
            let (holding, held) = (Arc::clone(&holding), Arc::clone(&self.held));
            let release = Arc::clone(&self.release);
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 64 * 1024];
                loop {
                    let n = match server_read.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if holding.swap(false, Ordering::SeqCst) {
                        held.fetch_add(1, Ordering::SeqCst);
                        match release.acquire().await {
                            Ok(permit) => permit.forget(),
                            Err(_) => return,
                        }
                    }
                    if cutting.load(Ordering::SeqCst) {
                        cuts.fetch_add(1, Ordering::SeqCst);
                        let _ = client_write.shutdown().await;
                        return;
                    }
                    if client_write.write_all(&buffer[..n]).await.is_err() {
                        return;
                    }
                }
            })
        };
        // Client to server, message by message: the startup message has no type byte; every
        // later one is a type byte and a length that counts itself.
        let mut first = true;
        loop {
            let mut header = [0u8; 5];
            let header = if first {
                &mut header[..4]
            } else {
                &mut header[..]
            };
            if client_read.read_exact(header).await.is_err() {
                break;
            }
            let length_bytes: [u8; 4] = header[header.len() - 4..].try_into().expect("4 bytes");
            let length = u32::from_be_bytes(length_bytes) as usize;
            let mut body = vec![0u8; length.saturating_sub(4)];
            if client_read.read_exact(&mut body).await.is_err() {
                break;
            }
            let is_commit = !first
                && header[0] == b'Q'
                && body
                    .strip_suffix(b"\0")
                    .is_some_and(|query| query.trim_ascii().eq_ignore_ascii_case(b"COMMIT"));
            let is_claim = header[0] == b'Q'
                && body
                    .windows(b"pg_try_advisory_xact_lock".len())
                    .any(|w| w == b"pg_try_advisory_xact_lock");
            first = false;
            if is_commit && self.armed.swap(false, Ordering::SeqCst) {
                cutting.store(true, Ordering::SeqCst);
            }
            // Set before the query goes on: its answer cannot arrive first.
            if is_claim && self.hold_armed.swap(false, Ordering::SeqCst) {
                holding.store(true, Ordering::SeqCst);
            }
            if server_write.write_all(header).await.is_err()
                || server_write.write_all(&body).await.is_err()
            {
                break;
            }
            if cutting.load(Ordering::SeqCst) {
                // Wait for the server's answer to be dropped, then close both sides.
                let _ = answers.await;
                return;
            }
        }
        answers.abort();
    }
}
