//! The producing side: an event written in the same transaction as the writes it tells about.

use std::fmt;

use sqlx::Transaction;

use crate::backend::Backend;

/// The longest topic, in bytes: what a RabbitMQ routing key holds.
pub const MAX_TOPIC_LEN: usize = 255;

/// The id of an outbox event: a random UUID, which the relay publishes as the message id and
/// consumers deduplicate on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct EventId(uuid::Uuid);

impl EventId {
    /// A new random id.
    pub fn new() -> Self {
        Self(uuid::Uuid::new_v4())
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl From<uuid::Uuid> for EventId {
    fn from(id: uuid::Uuid) -> Self {
        Self(id)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Adds an event to the outbox in `tx`, so that it exists exactly when `tx` commits; returns
/// its id.
///
/// Any handler may call it with its transaction, idempotent or not; the relay
/// ([`Relay`](crate::relay::Relay)) publishes the event after the commit.
///
/// ```no_run
/// # async fn demo(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), idem_events::Error> {
/// use idem_events as events;
///
/// sqlx::query("UPDATE payments SET status = 'succeeded' WHERE id = 'pay_1'")
///     .execute(&mut **tx)
///     .await?;
/// events::enqueue(tx, "payment.succeeded", &serde_json::json!({"payment": "pay_1"}))
///     .await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidEvent`](crate::error::Error::InvalidEvent) for an empty topic, one longer than
/// [`MAX_TOPIC_LEN`], or a payload that does not serialize; [`Error::Database`](crate::error::Error)
/// when the insert fails (the transaction should then be rolled back, as after any failed
/// write).
pub async fn enqueue<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    topic: &str,
    payload: &impl serde::Serialize,
) -> Result<EventId, crate::error::Error> {
    let id = EventId::new();
    enqueue_with_id(tx, id, topic, payload).await?;
    Ok(id)
}

/// [`enqueue`] with an id chosen beforehand, for a payload that carries its own id.
///
/// # Errors
///
/// As [`enqueue`].
pub async fn enqueue_with_id<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    id: EventId,
    topic: &str,
    payload: &impl serde::Serialize,
) -> Result<(), crate::error::Error> {
    check_topic(topic)?;
    let payload =
        serde_json::to_string(payload).map_err(|error| crate::error::Error::InvalidEvent {
            reason: format!("the payload does not serialize to JSON: {error}"),
        })?;
    DB::enqueue(tx, &id.to_string(), topic, &payload).await
}

fn check_topic(topic: &str) -> Result<(), crate::error::Error> {
    let reason = if topic.is_empty() {
        "the topic is empty".to_owned()
    } else if topic.len() > MAX_TOPIC_LEN {
        format!(
            "the topic is {} bytes long; at most {MAX_TOPIC_LEN} are allowed",
            topic.len()
        )
    } else {
        return Ok(());
    };
    Err(crate::error::Error::InvalidEvent { reason })
}
