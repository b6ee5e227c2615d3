use idem_runtime::idempotent;

// `lock_timeout` was renamed `lease`: the old spelling is an error that names the new one.
#[idempotent(external, scope = "tenant", lock_timeout = "5s", backend = sqlx::Postgres)]
async fn refund(tenant: String) {
    let _ = tenant;
}

fn main() {}
