//! The simulated processor's webhooks: each event it sends is signed as Standard Webhooks v1
//! specifies ([`WebhookSecret`]) and delivered to the URL it was given, in the background, under
//! one `webhook-id` for all its attempts. A delivery that gets no 2xx answer (another status,
//! a refused connection, no answer within [`ATTEMPT_TIMEOUT`]) is made again after a pause that
//! doubles, up to [`MAX_ATTEMPTS`] attempts; each attempt is signed anew, with its own
//! timestamp. With `deliver_twice`, each event is delivered once more after its first 2xx, on
//! purpose: the receiver must answer that replay without applying the event again.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::webhook_secret::WebhookSecret;

/// How many attempts one delivery gets before the processor gives it up.
pub const MAX_ATTEMPTS: u32 = 8;

/// How long one attempt waits for its answer, unless [`WebhookSender::with_attempt_timeout`]
/// says otherwise.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// The pause before the second attempt; each later pause is twice the one before, at most
/// [`MAX_PAUSE`].
pub const FIRST_PAUSE: Duration = Duration::from_millis(100);

/// The longest pause between two attempts.
pub const MAX_PAUSE: Duration = Duration::from_secs(5);

/// One event sent to the receiver, and what became of each attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// Its `webhook-id`, the same on every attempt.
    pub id: String,
    /// The event's `type`.
    pub kind: String,
    /// Each attempt's outcome, in order: the answer's status, or `0` for no answer.
    pub attempts: Vec<u16>,
    /// Whether an attempt got a 2xx answer.
    pub delivered: bool,
}

/// Where the processor sends its webhooks, if anywhere, and what it has sent.
#[derive(Debug, Clone)]
pub struct WebhookSender {
    url: Option<String>,
    secret: WebhookSecret,
    deliver_twice: bool,
    attempt_timeout: Duration,
    http: reqwest::Client,
    sent: Arc<Mutex<Vec<Delivery>>>,
}

impl Default for WebhookSender {
    /// Off: no URL.
    fn default() -> Self {
        Self {
            url: None,
            secret: WebhookSecret::default(),
            deliver_twice: false,
            attempt_timeout: ATTEMPT_TIMEOUT,
            http: reqwest::Client::new(),
            sent: Arc::default(),
        }
    }
}

impl WebhookSender {
    /// Sends webhooks to `url`, signed with `secret`.
    pub fn to(url: impl Into<String>, secret: WebhookSecret) -> Self {
        Self {
            url: Some(url.into()),
            secret,
            ..Self::default()
        }
    }

    /// The same sender, delivering each event a second time after its first 2xx.
    #[must_use]
    pub fn delivering_twice(mut self, twice: bool) -> Self {
        self.deliver_twice = twice;
        self
    }

    /// The same sender, giving each attempt `timeout` to be answered (default
    /// [`ATTEMPT_TIMEOUT`]).
    #[must_use]
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// The sender the environment describes: `$WEBHOOK_URL` (none: off), `$WEBHOOK_SECRET`
    /// (default [`crate::webhook_secret::DEFAULT_SECRET`]), and `$WEBHOOK_DELIVER_TWICE`
    /// (`1` delivers each event twice; default `0`).
    ///
    /// # Errors
    ///
    /// A message for a person when the secret is malformed or `$WEBHOOK_DELIVER_TWICE` is
    /// neither `0` nor `1`.
    pub fn from_env() -> Result<Self, String> {
        let secret = WebhookSecret::from_env()?;
        let twice = match std::env::var("WEBHOOK_DELIVER_TWICE").as_deref() {
            Err(_) | Ok("0") => false,
            Ok("1") => true,
            Ok(other) => {
                return Err(format!(
                    "WEBHOOK_DELIVER_TWICE must be 1 (each event delivered twice) or 0, got \
                     {other:?}"
                ));
            }
        };
        let sender = match std::env::var("WEBHOOK_URL") {
            Ok(url) if !url.is_empty() => Self::to(url, secret),
            _ => Self {
                secret,
                ..Self::default()
            },
        };
        Ok(sender.delivering_twice(twice))
    }

    /// Whether events are sent anywhere.
    pub fn is_on(&self) -> bool {
        self.url.is_some()
    }

    /// Every delivery made or under way, in the order the events were sent.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.sent.lock().expect("deliveries lock").clone()
    }

    /// Sends the event `{"type": kind, "data": data}` in the background (nothing when off).
    pub fn send(&self, kind: &str, data: Value) {
        let Some(url) = self.url.clone() else {
            return;
        };
        let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
        // The same bytes on every attempt: the signature and the receiver's fingerprint are
        // over them.
        let body = serde_json::json!({"type": kind, "data": data}).to_string();
        let index = {
            let mut sent = self.sent.lock().expect("deliveries lock");
            sent.push(Delivery {
                id: id.clone(),
                kind: kind.to_owned(),
                attempts: Vec::new(),
                delivered: false,
            });
            sent.len() - 1
        };
        let sender = self.clone();
        tokio::spawn(async move {
            let delivered = sender.deliver(&url, &id, &body, index).await;
            if delivered && sender.deliver_twice {
                sender.deliver(&url, &id, &body, index).await;
            }
        });
    }

    /// Delivers `body` as the message `id` until an attempt gets a 2xx, at most
    /// [`MAX_ATTEMPTS`] times; whether one did.
    async fn deliver(&self, url: &str, id: &str, body: &str, index: usize) -> bool {
        let mut pause = FIRST_PAUSE;
        for attempt in 1..=MAX_ATTEMPTS {
            let status = self.attempt(url, id, body).await;
            let delivered = (200..300).contains(&status);
            {
                let mut sent = self.sent.lock().expect("deliveries lock");
                sent[index].attempts.push(status);
                sent[index].delivered |= delivered;
            }
            if delivered {
                return true;
            }
            tracing::warn!(%id, status, attempt, "webhook not delivered; delivering it again");
            if attempt < MAX_ATTEMPTS {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
        tracing::error!(%id, "webhook given up after {MAX_ATTEMPTS} attempts");
        false
    }

    /// One attempt, signed now: the answer's status, or `0` for none.
    async fn attempt(&self, url: &str, id: &str, body: &str) -> u16 {
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs())
            .try_into()
            .unwrap_or(i64::MAX);
        let signature = match self.secret.sign(id, timestamp, body.as_bytes()) {
            Ok(signature) => signature,
            Err(error) => {
                tracing::error!(%error, "cannot sign a webhook");
                return 0;
            }
        };
        let answer = self
            .http
            .post(url)
            .timeout(self.attempt_timeout)
            .header("content-type", "application/json")
            .header(standardwebhooks::HEADER_WEBHOOK_ID, id)
            .header(
                standardwebhooks::HEADER_WEBHOOK_TIMESTAMP,
                timestamp.to_string(),
            )
            .header(standardwebhooks::HEADER_WEBHOOK_SIGNATURE, signature)
            .body(body.to_owned())
            .send()
            .await;
        match answer {
            Ok(answer) => answer.status().as_u16(),
            Err(error) => {
                tracing::warn!(%error, %id, "webhook attempt got no answer");
                0
            }
        }
    }
}
