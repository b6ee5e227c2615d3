//! The example services of idem: the payments API of `CONTRACT.md` §3.
//!
//! `cargo run --bin payments` serves [`payments::router`]; the tests drive the same router.

pub mod auth;
pub mod error;
pub mod payments;
pub mod processor;
pub mod schema;
