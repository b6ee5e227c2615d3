//! The payments service's process under connections that hold it without asking anything:
//! 2,000 idle keep-alive connections and 50 clients sending their request's head one byte a
//! second. Other clients are still answered, and a connection whose head does not arrive, or
//! that stays idle, is closed by the server after its header-read timeout.

use crate::support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use idem_examples::server::HEADER_READ_TIMEOUT;
use idem_tests::DEADLINE;
use reqwest::{Client, StatusCode};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

use support::wait_until;

/// Idle keep-alive connections held open during the flood.
const IDLE: usize = 2_000;
/// Clients sending their request's head one byte a second.
const SLOW: usize = 50;
/// Ordinary payments sent while they are held.
const PAYMENTS: usize = 50;
/// Open files the test process and the service each need: a descriptor per connection, and
/// room for the pools, the binary's files and the test harness.
const OPEN_FILES: u64 = 4_096;

/// A request whose head never ends: one header line that grows forever.
const ENDLESS_HEAD: &[u8] = b"GET /v1/payments HTTP/1.1\r\nHost: payments\r\nX-Slow: ";

/// A whole request, answered without the database (401: no credentials).
const SHORT_REQUEST: &[u8] = b"GET /v1/payments HTTP/1.1\r\nHost: payments\r\n\r\n";

/// Raises this process's soft limit on open files to `needed` if it is lower (the service's
/// process inherits it), or fails saying what the test needs.
fn allow_open_files(needed: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current.is_none_or(|current| current >= needed) {
        return;
    }
    assert!(
        limit.maximum.is_none_or(|maximum| maximum >= needed),
        "the test needs {needed} open files per process, the hard limit is {:?}: raise it \
         (`ulimit -Hn {needed}` as root, or LimitNOFILE)",
        limit.maximum
    );
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(needed),
            maximum: limit.maximum,
        },
    )
    .expect("raise the soft limit on open files");
}

/// Reads one answer from `stream`, its body included (it has a `Content-Length`), and returns
/// its status.
async fn read_answer(stream: &mut TcpStream) -> u16 {
    let mut received = Vec::new();
    let mut chunk = [0; 4096];
    loop {
        if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&received[..end]).expect("a text head");
            let status = head
                .split(' ')
                .nth(1)
                .and_then(|status| status.parse().ok())
                .expect("a status line");
            let length: usize = head
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .expect("a Content-Length");
            while received.len() < end + 4 + length {
                let n = stream.read(&mut chunk).await.expect("read the body");
                assert!(n > 0, "the service closed the connection within an answer");
                received.extend_from_slice(&chunk[..n]);
            }
            return status;
        }
        let n = stream.read(&mut chunk).await.expect("read the answer");
        assert!(n > 0, "the service closed the connection before answering");
        received.extend_from_slice(&chunk[..n]);
    }
}

/// Waits until the server closes `stream` (end of stream or a reset), failing if it sends
/// anything.
async fn closed_by_server(stream: &mut TcpStream) {
    let mut chunk = [0; 1024];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!(
            "the service sent {:?} on a connection that asked nothing",
            String::from_utf8_lossy(&chunk[..n])
        ),
    }
}

/// One idle keep-alive connection, until `stop`: it sends a request, reads the answer and then
/// sends nothing; when the server closes it (its header-read timeout), it connects again.
/// `connected` counts the clients that had their first answer.
async fn hold_idle(addr: String, connected: Arc<AtomicUsize>, stop: CancellationToken) {
    let mut first = true;
    while !stop.is_cancelled() {
        let mut stream = TcpStream::connect(&addr)
            .await
            .expect("connect to the service");
        stream
            .write_all(SHORT_REQUEST)
            .await
            .expect("send a request");
        assert_eq!(
            read_answer(&mut stream).await,
            401,
            "an unauthenticated GET"
        );
        if first {
            connected.fetch_add(1, Ordering::SeqCst);
            first = false;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = closed_by_server(&mut stream) => {}
        }
    }
}

/// Sends the head of a request that never ends, one byte a second, until `stop` or the server
/// closes the connection. Returns whether the server closed it.
async fn send_head_slowly(stream: &mut TcpStream, stop: &CancellationToken) -> bool {
    let (mut reader, mut writer) = stream.split();
    let mut every_second = tokio::time::interval(Duration::from_secs(1));
    let mut chunk = [0; 1024];
    for sent in 0.. {
        tokio::select! {
            () = stop.cancelled() => return false,
            _ = every_second.tick() => {
                let byte = ENDLESS_HEAD.get(sent).copied().unwrap_or(b'a');
                if writer.write_all(&[byte]).await.is_err() {
                    return true;
                }
            }
            read = reader.read(&mut chunk) => match read {
                Ok(0) | Err(_) => return true,
                Ok(n) => panic!(
                    "the service answered a request whose head never ended: {:?}",
                    String::from_utf8_lossy(&chunk[..n])
                ),
            },
        }
    }
    unreachable!("the head never ends")
}

/// A slow client until `stop`: whenever the server closes its connection, it starts again on a
/// new one. `started` counts the clients that have connected.
async fn keep_sending_slowly(addr: String, started: Arc<AtomicUsize>, stop: CancellationToken) {
    let mut first = true;
    while !stop.is_cancelled() {
        let mut stream = TcpStream::connect(&addr)
            .await
            .expect("connect to the service");
        if first {
            started.fetch_add(1, Ordering::SeqCst);
            first = false;
        }
        send_head_slowly(&mut stream, &stop).await;
    }
}

#[sqlx::test(migrations = false)]
async fn postgres_payments_are_answered_during_a_flood_of_idle_and_slow_connections(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    answered_during_a_flood(support::postgres(connect).await).await;
}

#[tokio::test]
async fn mysql_payments_are_answered_during_a_flood_of_idle_and_slow_connections() {
    support::on_mysql(answered_during_a_flood).await;
}

async fn answered_during_a_flood(database: support::Database) {
    allow_open_files(OPEN_FILES);
    let client = Client::new();
    let (mut service, base) =
        support::start_payments(&client, &database, "http://127.0.0.1:9").await;
    let addr = base.trim_start_matches("http://").to_owned();

    let stop = CancellationToken::new();
    let (connected, started) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut flood = JoinSet::new();
    for _ in 0..IDLE {
        flood.spawn(hold_idle(
            addr.clone(),
            Arc::clone(&connected),
            stop.clone(),
        ));
    }
    for _ in 0..SLOW {
        flood.spawn(keep_sending_slowly(
            addr.clone(),
            Arc::clone(&started),
            stop.clone(),
        ));
    }
    wait_until(
        &format!("{IDLE} idle keep-alive connections to be answered"),
        || async { connected.load(Ordering::SeqCst) >= IDLE },
    )
    .await;
    wait_until(&format!("{SLOW} slow clients to connect"), || async {
        started.load(Ordering::SeqCst) >= SLOW
    })
    .await;

    // Each payment on a connection of its own, as a client arriving during the flood.
    let fresh = Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("a client");
    let mut payments = JoinSet::new();
    for n in 0..PAYMENTS {
        let (fresh, base) = (fresh.clone(), base.clone());
        payments.spawn(async move {
            fresh
                .post(format!("{base}/v1/payments"))
                .bearer_auth("t1")
                .header("Idempotency-Key", format!("flood-{n}"))
                .json(&json!({"amount": 100 + n, "currency": "usd", "customer": "cus_1"}))
                .send()
                .await
                .map(|answer| answer.status())
        });
    }
    let answered = tokio::time::timeout(DEADLINE, payments.join_all())
        .await
        .unwrap_or_else(|_| {
            panic!("{PAYMENTS} payments were not all answered within {DEADLINE:?} of the flood")
        });
    for status in answered {
        assert_eq!(status.expect("an answer"), StatusCode::CREATED);
    }
    assert_eq!(database.count("payments").await, PAYMENTS as i64);
    assert!(
        service.0.try_wait().expect("try_wait").is_none(),
        "the service is still running"
    );

    stop.cancel();
    tokio::time::timeout(DEADLINE, async {
        while let Some(client) = flood.join_next().await {
            client.expect("a flood client failed");
        }
    })
    .await
    .expect("the flood clients stop");
}

#[tokio::test]
async fn a_connection_whose_head_does_not_arrive_is_closed_after_the_header_read_timeout() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let client = Client::new();
    let (_service, base) = support::start_payments(&client, &database, "http://127.0.0.1:9").await;
    let addr = base.trim_start_matches("http://");

    // Before the connection exists, so before the server starts waiting for its head.
    let connecting = Instant::now();
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    let stop = CancellationToken::new();
    let closed = tokio::time::timeout(DEADLINE, send_head_slowly(&mut slow, &stop))
        .await
        .unwrap_or_else(|_| {
            panic!("a head sent one byte a second was still read after {DEADLINE:?}")
        });
    assert!(closed, "the server closed the connection");
    assert!(
        connecting.elapsed() >= HEADER_READ_TIMEOUT,
        "closed after the client had {:?}, less than the header-read timeout",
        connecting.elapsed()
    );
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_header_read_timeout() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let client = Client::new();
    let (_service, base) = support::start_payments(&client, &database, "http://127.0.0.1:9").await;

    let mut idle = TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .expect("connect");
    idle.write_all(SHORT_REQUEST).await.expect("send a request");
    assert_eq!(read_answer(&mut idle).await, 401, "an unauthenticated GET");
    tokio::time::timeout(DEADLINE, closed_by_server(&mut idle))
        .await
        .unwrap_or_else(|_| panic!("an idle connection was still open after {DEADLINE:?}"));
}
