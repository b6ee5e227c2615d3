//! This crate enables several of idem-runtime's databases, so an `external` handler, which has
//! no transaction to name its database, must name it: no silent default.
use idem_runtime::idempotent;

#[idempotent(external, global)]
async fn ping() -> String {
    String::from("pong")
}

fn main() {}
