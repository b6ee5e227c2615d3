//! The example services of idem: the payments API and the card processor the guide describes.
//!
//! - `cargo run --bin payments` serves [`payments::router`] over PostgreSQL, SQLite or MySQL: payments
//!   and payouts (transactional mode), refunds (external mode, calling the processor) and
//!   orders (external mode in steps: stock, a charge at the processor, shipping).
//! - `cargo run --bin processor` serves [`processor::router`]: a simulated card processor in its
//!   own process, so that it outlives a crash of the payments service.

pub mod api_doc;
pub mod auth;
pub mod bounded;
pub mod card;
pub mod error;
pub mod grpc;
pub mod ledger;
pub mod orders;
pub mod payments;
pub mod processor;
pub mod processor_client;
pub mod refunds;
pub mod schema;
pub mod server;
pub mod setup;
pub mod sql;
pub mod telemetry;
