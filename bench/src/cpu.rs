//! CPU time spent by the service under test and by its database, from the kernel's per-thread
//! and per-process counters (`/proc/<pid>/task/<tid>/schedstat`, `/proc/<pid>/schedstat`: time
//! on a CPU, in nanoseconds). The service runs on threads of its own ([`SERVER_THREADS`]), apart
//! from the load generator, so that each side's time is its own; SQLite runs in the service's
//! process, on sqlx's worker threads (one per connection), counted apart as its database.

use std::{fs, time::Duration};

/// The name of the service's runtime threads.
pub const SERVER_THREADS: &str = "idem-server";

/// How sqlx names the thread of each SQLite connection (`sqlx-sqlite-worker-<n>`, of which the
/// kernel keeps 15 bytes).
const SQLITE_THREADS: &str = "sqlx-sqlite-";

/// CPU time used so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    /// By the service's threads.
    pub service: Duration,
    /// By every process named `postgres` on this machine (backends and background workers),
    /// including those that have ended (the server's children it has reaped).
    pub postgres: Duration,
    /// By this process's SQLite connection threads.
    pub sqlite: Duration,
    /// By the MySQL server's process (`mariadbd` or `mysqld`, every thread).
    pub mysql: Duration,
}

impl Sample {
    /// The counters now. On a system without `/proc` both are zero.
    pub fn now() -> Self {
        Self {
            service: threads_named(SERVER_THREADS),
            postgres: processes_named("postgres"),
            sqlite: threads_named(SQLITE_THREADS),
            mysql: threads_of_processes_named("mariadbd") + threads_of_processes_named("mysqld"),
        }
    }

    /// The time used since `earlier`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            service: self.service.saturating_sub(earlier.service),
            postgres: self.postgres.saturating_sub(earlier.postgres),
            sqlite: self.sqlite.saturating_sub(earlier.sqlite),
            mysql: self.mysql.saturating_sub(earlier.mysql),
        }
    }

    /// Per request, in microseconds: (service, database), the database being `database`'s
    /// processes or threads.
    pub fn per_request(self, requests: u64, database: Server) -> (f64, f64) {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / requests.max(1) as f64;
        (per(self.service), per(self.of(database)))
    }

    /// The time of `database`'s processes or threads.
    pub fn of(self, database: Server) -> Duration {
        match database {
            Server::Postgres => self.postgres,
            Server::Sqlite => self.sqlite,
            Server::Mysql => self.mysql,
        }
    }
}

/// Whose CPU time is the database's.
#[derive(Clone, Copy, Debug)]
pub enum Server {
    /// The processes named `postgres`.
    Postgres,
    /// This process's SQLite connection threads.
    Sqlite,
    /// The MySQL server's process, whose threads its `stat` counts together.
    Mysql,
}

/// The first field of a `schedstat` file: nanoseconds on a CPU.
fn on_cpu(path: &std::path::Path) -> Option<Duration> {
    let text = fs::read_to_string(path).ok()?;
    let nanos: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

fn comm(dir: &std::path::Path) -> Option<String> {
    Some(fs::read_to_string(dir.join("comm")).ok()?.trim().to_owned())
}

fn threads_named(prefix: &str) -> Duration {
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    tasks
        .flatten()
        .map(|task| task.path())
        .filter(|dir| comm(dir).is_some_and(|name| name.starts_with(prefix)))
        .filter_map(|dir| on_cpu(&dir.join("schedstat")))
        .sum()
}

/// The CPU time of every thread of the processes named `name` (a server that runs a thread per
/// connection, in one process: its own `schedstat` counts its main thread only).
fn threads_of_processes_named(name: &str) -> Duration {
    let Ok(processes) = fs::read_dir("/proc") else {
        return Duration::ZERO;
    };
    processes
        .flatten()
        .map(|process| process.path())
        .filter(|dir| comm(dir).as_deref() == Some(name))
        .filter_map(|dir| fs::read_dir(dir.join("task")).ok())
        .flat_map(|tasks| tasks.flatten().map(|task| task.path()))
        .filter_map(|task| on_cpu(&task.join("schedstat")))
        .sum()
}

/// The CPU time of the live processes named `name`, plus what their ancestors among them have
/// reaped from children that ended (an autovacuum worker, a closed connection's backend): a
/// process that ends between two samples would otherwise take its time out of the sum.
fn processes_named(name: &str) -> Duration {
    let Ok(processes) = fs::read_dir("/proc") else {
        return Duration::ZERO;
    };
    let named: Vec<(std::path::PathBuf, Option<String>)> = processes
        .flatten()
        .map(|process| process.path())
        .filter(|dir| {
            dir.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|dir| comm(dir).as_deref() == Some(name))
        .map(|dir| {
            let stat = fs::read_to_string(dir.join("stat")).ok();
            (dir, stat)
        })
        .collect();
    let pids: Vec<&str> = named
        .iter()
        .filter_map(|(dir, _)| dir.file_name()?.to_str())
        .collect();
    named
        .iter()
        .map(|(dir, stat)| {
            let live = on_cpu(&dir.join("schedstat")).unwrap_or_default();
            // A root of the group (its parent has another name) has reaped the group's ended
            // processes: their time is in its `cutime` and `cstime`.
            let reaped = stat.as_deref().and_then(|stat| {
                let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
                let parent = fields.get(1)?;
                if pids.contains(parent) {
                    return None;
                }
                let ticks: u64 =
                    fields.get(13)?.parse::<u64>().ok()? + fields.get(14)?.parse::<u64>().ok()?;
                Some(Duration::from_millis(ticks * 1000 / USER_HZ))
            });
            live + reaped.unwrap_or_default()
        })
        .sum()
}

/// The unit of the times in `/proc/<pid>/stat`: Linux reports them in 1/100 s whatever the
/// kernel's own tick.
const USER_HZ: u64 = 100;
