use idem_runtime::idempotent;
use sqlx::{Postgres, Transaction};

struct Payments;

impl Payments {
    #[idempotent(scope = "tenant")]
    async fn create(&self, tenant: String, tx: &mut Transaction<'_, Postgres>) {
        let _ = (self, tenant, tx);
    }
}

fn main() {}
