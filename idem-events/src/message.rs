//! The unit that travels: an event as the outbox stores it and a broker carries it.

use bytes::Bytes;

/// One message: its id (the outbox event's id, which consumers deduplicate on), its topic, and
/// its payload (JSON, as [`enqueue`](crate::outbox::enqueue) wrote it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    id: String,
    topic: String,
    payload: Bytes,
}

impl Message {
    /// A message with the given id, topic and payload. Broker adapters build the messages they
    /// receive with it.
    pub fn new(id: impl Into<String>, topic: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            id: id.into(),
            topic: topic.into(),
            payload: payload.into(),
        }
    }

    /// The id consumers deduplicate on: the outbox event's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The topic: the routing key on RabbitMQ, the `topic` field on Redis Streams.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The payload's bytes.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The payload read as JSON.
    ///
    /// # Errors
    ///
    /// When the payload is not JSON of type `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}
