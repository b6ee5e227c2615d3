use idem_runtime::idempotent;

#[idempotent(external = true, global, backend = sqlx::Postgres)]
async fn ping() -> String {
    String::from("pong")
}

fn main() {}
