//! The example's tests, as one test binary: each file of this directory is a module named for
//! its subject (`hostile::postgres::…`, `crash::…`), on the harness of `idem-tests`. One
//! binary links the example, sqlx, axum and the brokers once instead of once per subject;
//! nextest still runs every test in a process of its own.

mod service;
mod support;

mod alerts;
mod at_rest;
mod client;
mod contract;
mod crash;
mod event_crashes;
mod events_without_a_ledger;
mod galera;
mod grpc;
mod grpc_client;
mod hostile;
mod metrics;
mod openapi;
mod order_crashes;
mod orders;
mod overload;
mod partitions;
mod pg_ha;
mod pooler;
mod processes;
mod sealing;
mod start;
mod webhooks;
