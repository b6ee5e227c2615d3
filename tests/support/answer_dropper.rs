//! A TCP proxy in front of an HTTP/2 server (a gRPC service) that drops answers on cue: it
//! passes each call to the server and reads the server's answer to its end (the frame that
//! ends the stream), then, for as many calls as the test asked, closes the client's connection
//! instead of passing the answer on. The service ran the call; the client cannot know.
//!
//! It reads the server's side frame by frame (RFC 9113, section 4.1): frames of the connection
//! (stream 0: settings, pings) go through at once; from a stream's first frame on, everything is
//! held, in order, until a frame ends a stream (`END_STREAM` on `HEADERS` or `DATA`, or
//! `RST_STREAM`). One call at a time per connection, as a retrying client makes them.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const END_STREAM: u8 = 0x1;

#[derive(Debug, Default)]
struct State {
    to_drop: AtomicUsize,
    dropped: AtomicUsize,
    passed: AtomicUsize,
}

impl State {
    /// Takes one of the answers left to drop, if any.
    fn take_drop(&self) -> bool {
        self.to_drop
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .is_ok()
    }
}

/// The proxy: connections to [`AnswerDropper::url`] reach the upstream server.
#[derive(Debug, Clone)]
pub struct AnswerDropper {
    url: String,
    state: Arc<State>,
}

impl AnswerDropper {
    /// Listens on a loopback port and forwards every connection to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let state = Arc::new(State::default());
        let shared = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let state = Arc::clone(&shared);
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        relay(state, client, server).await;
                    }
                });
            }
        });
        Self { url, state }
    }

    /// The URL to call (`http://127.0.0.1:<port>`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The next `calls` answers are dropped (added to those still to drop).
    pub fn drop_next(&self, calls: usize) {
        self.state.to_drop.fetch_add(calls, Ordering::SeqCst);
    }

    /// No more answers are dropped.
    pub fn pass_all(&self) {
        self.state.to_drop.store(0, Ordering::SeqCst);
    }

    /// Answers the server gave that the proxy dropped.
    pub fn dropped(&self) -> usize {
        self.state.dropped.load(Ordering::SeqCst)
    }

    /// Answers the proxy passed on.
    pub fn passed(&self) -> usize {
        self.state.passed.load(Ordering::SeqCst)
    }
}

async fn relay(state: Arc<State>, mut client: TcpStream, mut server: TcpStream) {
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let upstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut pending = Vec::new();
        let mut held = Vec::new();
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.extend_from_slice(&buf[..n]);
            while let Some(frame) = next_frame(&mut pending) {
                let (kind, flags, stream) = (frame[3], frame[4], stream_of(&frame));
                if stream == 0 && held.is_empty() {
                    if client_write.write_all(&frame).await.is_err() {
                        return;
                    }
                    continue;
                }
                held.extend_from_slice(&frame);
                let ends = stream != 0
                    && (kind == RST_STREAM
                        || ((kind == HEADERS || kind == DATA) && flags & END_STREAM != 0));
                if !ends {
                    continue;
                }
                if kind != RST_STREAM && state.take_drop() {
                    // The answer is complete here; the client never sees it.
                    state.dropped.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                if kind != RST_STREAM {
                    state.passed.fetch_add(1, Ordering::SeqCst);
                }
                if client_write.write_all(&held).await.is_err() {
                    return;
                }
                held.clear();
            }
        }
    };
    // Either side ending ends both: dropping the sockets closes them.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

/// The first complete frame of `pending`, taken out of it. The client's connection preface is
/// on the other side: the server's side is frames only.
fn next_frame(pending: &mut Vec<u8>) -> Option<Vec<u8>> {
    if pending.len() < 9 {
        return None;
    }
    let length =
        usize::from(pending[0]) << 16 | usize::from(pending[1]) << 8 | usize::from(pending[2]);
    if pending.len() < 9 + length {
        return None;
    }
    Some(pending.drain(..9 + length).collect())
}

fn stream_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff
}
