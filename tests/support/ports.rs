//! Loopback ports for servers that a test starts in another process (the example's binaries, a
//! `redis-server` it kills and restarts), and for addresses where nothing must listen.
//!
//! A port learnt by binding port 0 and closing the socket is free only for a moment: before the
//! child binds it, another test may take it the same way, or the kernel may hand it to an
//! outbound connection as its ephemeral port (the overload test alone opens two thousand). So a
//! reserved port comes from `RANGE` (20000-25999), below Linux's ephemeral range (32768-60999
//! by default, read from `/proc/sys/net/ipv4/ip_local_port_range`), where no outbound
//! connection is given a port, and it is held with an exclusive lock on
//! `$TMPDIR/idem-ports/<port>.lock` until the test process ends: no other test process of this
//! run or of another run on the machine is handed it meanwhile. The lock dies with the process, however it ends. `scripts/galera` and
//! `scripts/nats-cluster` take their ports from 26000-32767, never from this range.

use std::{
    fs::{File, OpenOptions},
    net::TcpListener,
    ops::RangeInclusive,
    path::PathBuf,
    sync::Mutex,
};

/// The ports the harness hands out.
pub const RANGE: RangeInclusive<u16> = 20000..=25999;

/// The locks of the ports this process reserved, held until it ends.
static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());

/// A loopback port that this test process alone may listen on, free when reserved.
///
/// # Panics
///
/// If the lock directory cannot be made, or every port of `RANGE` (20000-25999) is reserved or
/// in use.
pub fn reserve_port() -> u16 {
    let dir = lock_dir();
    std::fs::create_dir_all(&dir).unwrap_or_else(|error| {
        panic!("create the port lock directory {}: {error}", dir.display())
    });
    let ephemeral = ephemeral_range();
    let (low, high) = (*RANGE.start(), *RANGE.end());
    let span = u32::from(high - low) + 1;
    // Start where other processes are unlikely to: most reservations then take one try.
    let offset = std::process::id().wrapping_mul(2_654_435_761) % span;
    for step in 0..span {
        let port = low + u16::try_from((offset + step) % span).expect("within the range");
        if ephemeral.contains(&port) {
            continue;
        }
        let path = dir.join(format!("{port}.lock"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap_or_else(|error| panic!("open {}: {error}", path.display()));
        if file.try_lock().is_err() {
            continue;
        }
        // Locked by no test, but something else may listen there.
        if TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        HELD.lock().expect("the held port locks").push(file);
        return port;
    }
    panic!(
        "no loopback port of {low}-{high} is free: each is reserved by a test process (locks in {}) or in use",
        dir.display()
    );
}

/// `127.0.0.1:<port>` of a [`reserve_port`].
///
/// # Panics
///
/// As [`reserve_port`].
pub fn reserve_addr() -> String {
    format!("127.0.0.1:{}", reserve_port())
}

fn lock_dir() -> PathBuf {
    std::env::temp_dir().join("idem-ports")
}

/// The ports the kernel gives outbound connections; a range wholly inside it is refused.
fn ephemeral_range() -> RangeInclusive<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut bounds = text.split_whitespace().map(str::parse::<u16>);
            Some(bounds.next()?.ok()?..=bounds.next()?.ok()?)
        })
        // The IANA range, which BSD and macOS use.
        .unwrap_or(49152..=65535);
    assert!(
        !(range.contains(RANGE.start()) && range.contains(RANGE.end())),
        "the kernel's ephemeral port range {range:?} covers the test ports {RANGE:?}: raise its low end (sysctl net.ipv4.ip_local_port_range)"
    );
    range
}
