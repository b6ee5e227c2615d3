//! The library's behaviour suite, as one test binary: each file of this directory is a module
//! named for its subject, so a test's path reads `<subject>::<database>::<name>` (for instance
//! `contract::postgres::a_retry_replays`). One binary links sqlx, axum, lapin, redis and
//! utoipa once instead of once per subject. nextest still runs every test in a process of its
//! own; what a test registers at link time (`#[idempotent]` handlers) is seen by every test of
//! the binary, so no test here counts the handlers of the whole program.

mod contract;
mod cross_instance;
mod docs;
mod e2e;
mod events;
mod events_partitions;
mod external;
mod faults;
mod galera;
mod grpc;
mod key_sources;
mod openapi;
mod partitions;
mod pooler;
mod sealing;
mod sessions;
mod steps;
mod tasks;
mod timeout;
mod wait;
