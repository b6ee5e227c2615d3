use idem_runtime::idempotent;

#[idempotent(scope = "tenant")]
async fn create(tenant: String) {
    let _ = tenant;
}

fn main() {}
