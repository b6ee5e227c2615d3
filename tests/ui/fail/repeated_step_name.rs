use idem_runtime::{StepError, Steps, idempotent};
use sqlx::Postgres;

#[idempotent(external, global)]
async fn create(steps: Steps<Postgres>) -> Result<String, StepError> {
    let first: String = steps
        .call("charge", async |key| Ok::<_, StepError>(key.to_owned()))
        .await?;
    let second: String = steps
        .call("charge", async |key| Ok::<_, StepError>(key.to_owned()))
        .await?;
    Ok(first + &second)
}

fn main() {}
