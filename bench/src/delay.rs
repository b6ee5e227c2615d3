//! The database as if it were across a network: a TCP proxy on loopback that holds every byte
//! for a fixed time in each direction before passing it on, so that each round trip to the
//! server takes twice that longer, while bytes in flight still flow (a delay, not a bandwidth
//! limit).
//!
//! `tc netem` would do it in the kernel, but needs the `sch_netem` module, which a container
//! often lacks; a proxy needs nothing. Each direction of each connection has a reader thread
//! that stamps what it reads with the time it is due and a writer thread that sends it then:
//! OS threads, because tokio's timer rounds a sleep up to the millisecond, ten times the delay
//! to add. The cost, a thread wake-up per chunk (tens of µs), is part of what the figures show
//! and is measured with the round trip before each run.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

/// A running proxy; it lives as long as the process (the benchmark's runs are short).
pub struct DelayProxy {
    /// Where clients connect instead of the server.
    pub addr: SocketAddr,
}

impl DelayProxy {
    /// Listens on a loopback port and forwards each connection to `upstream`, `one_way` later in
    /// each direction.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub fn start(upstream: SocketAddr, one_way: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let (Ok(client_reads), Ok(server_reads)) = (client.try_clone(), server.try_clone())
                else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                pipe(client_reads, server, one_way);
                pipe(server_reads, client, one_way);
            }
        });
        Ok(Self { addr })
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read; shuts `to`'s writing side
/// when `from` ends.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (due, chunks) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        let mut buffer = vec![0; 64 * 1024];
        while let Ok(read @ 1..) = from.read(&mut buffer) {
            if due
                .send((Instant::now() + delay, buffer[..read].to_vec()))
                .is_err()
            {
                break;
            }
        }
    });
    thread::spawn(move || {
        for (at, chunk) in chunks {
            if let Some(wait) = at.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// `url` (`scheme://[user@]host[:port]/path`) through a new [`DelayProxy`] that holds each
/// byte `one_way` in each direction: the same URL with the proxy's address for the server's.
///
/// # Errors
///
/// When `url` has no host, the host does not resolve, or no loopback port can be bound.
pub fn delayed(
    url: &str,
    one_way: Duration,
    default_port: u16,
) -> Result<String, crate::db::Error> {
    let (scheme, rest) = url.split_once("://").ok_or("a URL without scheme")?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (user, host) = match authority.rsplit_once('@') {
        Some((user, host)) => (format!("{user}@"), host),
        None => (String::new(), authority),
    };
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:{default_port}")
    };
    let upstream = host
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| format!("{host} resolves to nothing"))?;
    let proxy = DelayProxy::start(upstream, one_way)?;
    Ok(format!("{scheme}://{user}{}/{path}", proxy.addr))
}
