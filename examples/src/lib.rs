//! The example services of idem: the payments API and the card processor the guide describes.
//!
//! - `cargo run --bin payments` serves [`payments::router`] over PostgreSQL, SQLite or MySQL: payments
//!   and payouts (transactional mode), refunds (external mode, calling the processor) and
//!   orders (external mode in steps: stock, a charge at the processor, shipping).
//! - `cargo run --bin processor` serves [`processor::router`]: a simulated card processor in its
//!   own process, so that it outlives a crash of the payments service. Given `$WEBHOOK_URL`, it
//!   sends signed webhooks of what it settles ([`processor_webhooks`]), which the payments
//!   service receives at `POST /v1/webhooks/processor` ([`webhooks`]).

pub mod api_doc;
pub mod auth;
pub mod balance;
pub mod bounded;
pub mod card;
pub mod error;
pub mod grpc;
pub mod ledger;
pub mod orders;
pub mod payments;
pub mod processor;
pub mod processor_client;
pub mod processor_webhooks;
pub mod refunds;
pub mod schema;
pub mod server;
pub mod setup;
pub mod sql;
pub mod telemetry;
pub mod webhook_secret;
pub mod webhooks;
