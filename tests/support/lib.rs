//! The harness of the behaviour tests and the suite's own test app.
//!
//! The harness runs a [`Service`] over a store on a fresh database of any of the three kinds ([`App`]),
//! sends it requests ([`Req`], [`Reply`]) and looks into the database ([`App::count`] and the
//! other probes). [`TestApp`] is the service the library's tests drive: a few handlers written
//! for the tests, each once for every database. The example's tests run the example's service
//! on the same harness.
//!
//! Every behaviour test is written once and run on every backend through [`backend_tests!`].

use std::sync::atomic::{AtomicUsize, Ordering};

mod answer_dropper;
mod app;
mod brokers;
mod cluster_dir;
mod downstream;
mod entries;
mod fault_proxy;
mod galera;
mod gated;
mod handlers;
mod http;
pub mod key_sources;
mod log;
pub(crate) mod mysql;
mod nats_cluster;
mod orders;
mod partition;
mod pooler;
mod ports;
mod probes;
mod proxy;
mod redis_server;
mod statements;
mod tcp_proxy;
mod tenant;
mod test_app;

pub use answer_dropper::AnswerDropper;
pub use app::{AnyStore, App, Building, Db, Options, Parts, Service, TestDb};
pub use brokers::{
    AnyDelivery, AnyPublisher, AnySubscriber, AnySubscription, BrokerKind, REDIS_CLAIM_IDLE,
    TestBroker, broker_url,
};
pub use cluster_dir::{ClusterDir, RestartOnDrop};
pub use downstream::{Downstream, unreachable_url};
pub use fault_proxy::{Fault, FaultProxy, Seen};
pub use galera::{GALERA_NODES, GaleraCluster};
pub use gated::Probe;
pub use handlers::{Account, Calls};
pub use http::{Reply, Req, entry};
pub use idem_examples::sql::spelling::{positional, spelled};
pub use log::CapturedLog;
pub use mysql::MySqlDb;
pub use nats_cluster::{CLUSTER_ACK_WAIT, NATS_NODES, NatsCluster};
pub use partition::{Cue, PartitionProxy, PgMessage};
pub use pooler::{assert_nothing_left, pooler_url, release_pooled};
pub use ports::{reserve_addr, reserve_port};
pub use proxy::CommitCutter;
pub use redis_server::RedisServer;
pub use statements::StatementLog;
pub use tcp_proxy::TcpProxy;
pub use tenant::Tenant;
pub use test_app::{
    EventBackend, Param, TestApp, TestBackend, migrate_and_create_tables, run, run_on,
};

/// Runs each test body on PostgreSQL (a fresh database from `#[sqlx::test]`), on SQLite (a
/// fresh file) and on MySQL (a fresh database on the MariaDB server), as `postgres::<name>`,
/// `sqlite::<name>` and `mysql::<name>`.
#[macro_export]
macro_rules! backend_tests {
    ($(async fn $name:ident($db:ident) $body:block)*) => {
        $crate::postgres_and_sqlite_tests! { $(async fn $name($db) $body)* }
        mod mysql {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let database = $crate::MySqlDb::create().await;
                    let name = database.name().to_owned();
                    {
                        let $db = $crate::TestDb::MySql(Box::new(database));
                        $body
                    }
                    $crate::MySqlDb::drop_named(&name).await;
                }
            )*
        }
    };
}

/// [`backend_tests!`] on PostgreSQL and SQLite only: its first half, for a test that cannot
/// run on MySQL.
#[macro_export]
macro_rules! postgres_and_sqlite_tests {
    ($(async fn $name:ident($db:ident) $body:block)*) => {
        mod postgres {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[sqlx::test(migrations = false)]
                async fn $name(
                    _: sqlx::postgres::PgPoolOptions,
                    connect: sqlx::postgres::PgConnectOptions,
                ) {
                    let $db = $crate::TestDb::Postgres(Box::new(connect));
                    $body
                }
            )*
        }
        mod sqlite {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let $db = $crate::TestDb::sqlite();
                    $body
                }
            )*
        }
    };
}

/// How long any wait of the tests may last before it fails: far longer than any condition
/// takes on a loaded machine, so that only a real hang ends there.
pub const DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// Polls `condition` every 10 ms until it holds; panics, saying what it waited for, after
/// [`DEADLINE`]. The one wait of the suites: the library's tests and the example's use it alike.
pub async fn wait_until<F, Fut>(what: &str, condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    wait_within(DEADLINE, what, condition).await;
}

/// [`wait_until`] with a deadline of its own, for a test that must end sooner than
/// [`DEADLINE`] (its failure then says what it waited for).
pub async fn wait_within<F, Fut>(limit: std::time::Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {limit:?} for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Waits until the app's handlers hold `n` keys.
pub async fn until_in_flight(app: &App, n: usize) {
    wait_until(&format!("{n} keys in flight"), || async {
        app.keys_in_flight() >= n
    })
    .await;
}

/// Waits until `n` of the app's writers queue for their turn.
pub async fn until_queued_writers(app: &App, n: usize) {
    wait_until(&format!("{n} queued writers"), || async {
        app.queued_writers() >= n
    })
    .await;
}

/// Waits until `counter` reaches `n` (a handler body has started).
pub async fn until_called(counter: &AtomicUsize, n: usize) {
    wait_until(&format!("{n} calls of the handler"), || async {
        counter.load(Ordering::SeqCst) >= n
    })
    .await;
}
