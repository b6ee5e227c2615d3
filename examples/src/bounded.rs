//! The database work the idempotency layer does not run itself (the `GET` routes, the ledger's,
//! the statements of an external-mode handler), bounded by the store's database deadline as the
//! layer bounds its own.
//!
//! A database that stops answering (packets dropped, not refused) leaves a statement waiting
//! forever, and a request for a pooled connection waiting for sqlx's own timeout (30 s by
//! default). [`within_deadline`] gives the whole of it, the wait for a connection included, the
//! store's deadline; past it the route answers 503 with `Retry-After`, and the connection the
//! statement was sent on is closed rather than returned to the pool, where sqlx would ping it
//! (a ping that waits as long as the database does) before another request could use it.

use idem_runtime::StoreOptions;
use sqlx::{Database, Pool};
use tokio::time::{Instant, timeout_at};

use crate::error::ApiError;

/// Runs `query` on a connection of its own from `pool`, the wait for that connection included,
/// within `options`' [`database_timeout`](StoreOptions::database_timeout), as the layer bounds a
/// request's own.
///
/// # Errors
///
/// [`ApiError::DatabaseUnavailable`] (503, `Retry-After` from `options`) past the deadline or
/// when no connection could be had, the connection (if one was had) closed; what `query`
/// returns otherwise.
pub async fn within_deadline<DB, T>(
    pool: &Pool<DB>,
    options: &StoreOptions,
    query: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, sqlx::Error>,
) -> Result<T, ApiError>
where
    DB: Database,
{
    let limit = options.database_timeout();
    let deadline = Instant::now() + limit;
    let unavailable = |detail: String| ApiError::DatabaseUnavailable {
        detail,
        retry_after: options.retry_after(),
    };
    let mut conn = match timeout_at(deadline, pool.acquire()).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(error)) => {
            tracing::warn!(%error, "no database connection");
            return Err(unavailable(
                "the database cannot be reached; retry later".to_owned(),
            ));
        }
        Err(_) => {
            return Err(unavailable(format!(
                "no database connection came within {limit:?}; retry later"
            )));
        }
    };
    match timeout_at(deadline, query(&mut conn)).await {
        Ok(Err(error)) if idem_runtime::is_transient(&error) => {
            tracing::warn!(%error, "the database connection failed");
            Err(unavailable(
                "the connection to the database failed; retry later".to_owned(),
            ))
        }
        Ok(result) => Ok(result?),
        Err(_) => {
            // Its statement may still be waiting for an answer: no other request gets it.
            conn.close_on_drop();
            Err(unavailable(format!(
                "the database did not answer within {limit:?}; retry later"
            )))
        }
    }
}
