use idem_runtime::idempotent;

// `lock_timeout` was renamed `lease`: the old spelling is an error that names the new one.
#[idempotent(scope = "tenant", lock_timeout = "5s")]
async fn refund(tenant: String) {
    let _ = tenant;
}

fn main() {}
