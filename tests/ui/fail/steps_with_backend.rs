use idem_runtime::{StepError, Steps, idempotent};
use sqlx::Postgres;

#[idempotent(external, global, backend = sqlx::Sqlite)]
async fn create(steps: Steps<Postgres>) -> Result<String, StepError> {
    steps
        .call("charge", async |key| Ok::<_, StepError>(key.to_owned()))
        .await
}

fn main() {}
