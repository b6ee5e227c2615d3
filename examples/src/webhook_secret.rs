//! The secret the simulated processor signs its webhooks with and the payments service verifies
//! them with, as Standard Webhooks v1 specifies (`whsec_<base64>`, HMAC-SHA256 over
//! `"{webhook-id}.{webhook-timestamp}.{body}"`), through the `standardwebhooks` crate.

use std::sync::Arc;

use axum::http::HeaderMap;
use standardwebhooks::{Webhook, WebhookError};

/// The secret both binaries use unless `$WEBHOOK_SECRET` says otherwise: `whsec_` and the
/// base64 of `idem-example-webhook-secret`.
pub const DEFAULT_SECRET: &str = "whsec_aWRlbS1leGFtcGxlLXdlYmhvb2stc2VjcmV0";

/// The environment variable that holds the secret.
pub const SECRET_VARIABLE: &str = "WEBHOOK_SECRET";

const PREFIX: &str = "whsec_";

/// A webhook signing secret, ready to sign and verify. Its `Debug` shows no key.
#[derive(Clone)]
pub struct WebhookSecret(Arc<Webhook>);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(..)")
    }
}

impl Default for WebhookSecret {
    fn default() -> Self {
        Self::parse(DEFAULT_SECRET).expect("the default secret is well-formed")
    }
}

impl WebhookSecret {
    /// The secret written as `whsec_<base64 of the key>`.
    ///
    /// # Errors
    ///
    /// A message for a person when `value` lacks the `whsec_` prefix, its key is empty, or
    /// the key is not base64.
    pub fn parse(value: &str) -> Result<Self, String> {
        let Some(key) = value.strip_prefix(PREFIX) else {
            return Err(format!(
                "{SECRET_VARIABLE} must be `whsec_` followed by the base64 of the key, got a value \
                 without the `whsec_` prefix"
            ));
        };
        if key.is_empty() {
            return Err(format!(
                "{SECRET_VARIABLE} must be `whsec_` followed by the base64 of the key, got no key \
                 after `whsec_`"
            ));
        }
        let webhook = Webhook::new(value).map_err(|error| {
            format!(
                "{SECRET_VARIABLE} must be `whsec_` followed by the base64 of the key; what \
                 follows `whsec_` is not base64 ({error})"
            )
        })?;
        Ok(Self(Arc::new(webhook)))
    }

    /// `$WEBHOOK_SECRET`, or [`DEFAULT_SECRET`] when it is not set.
    ///
    /// # Errors
    ///
    /// As [`WebhookSecret::parse`], and when the variable is not Unicode.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(SECRET_VARIABLE) {
            Ok(value) => Self::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!(
                "{SECRET_VARIABLE} must be `whsec_` followed by the base64 of the key, got a value \
                 that is not text"
            )),
        }
    }

    /// The `webhook-signature` value of `body` sent as the message `id` at `timestamp` (Unix
    /// seconds): `v1,<base64 of the HMAC>`.
    ///
    /// # Errors
    ///
    /// When `body` is not UTF-8, which Standard Webhooks payloads (JSON) always are.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> Result<String, WebhookError> {
        self.0.sign(id, timestamp, body)
    }

    /// Checks that `headers` (`webhook-id`, `webhook-timestamp`, `webhook-signature`) sign
    /// `body` with this secret, at a timestamp within 5 minutes of this machine's clock.
    ///
    /// # Errors
    ///
    /// What is wrong: a header missing or not text, a timestamp too old, too far ahead or not
    /// a number, no signature that matches.
    pub fn verify(&self, body: &[u8], headers: &HeaderMap) -> Result<(), WebhookError> {
        self.0.verify(body, headers)
    }
}

#[cfg(test)]
mod tests {
    use super::{DEFAULT_SECRET, WebhookSecret};

    #[test]
    fn the_default_secret_signs_the_key_it_names() {
        // The HMAC of the spec's input with the key `idem-example-webhook-secret`, computed
        // apart (`openssl dgst -sha256 -hmac idem-example-webhook-secret -binary | base64`).
        let signed = WebhookSecret::parse(DEFAULT_SECRET)
            .unwrap()
            .sign("msg_1", 1_700_000_000, br#"{"a":1}"#)
            .unwrap();
        assert_eq!(signed, "v1,NHuJWWyIPJ0sGPr1t/psvVYfEyEYJOBY4egIGxKVn8w=");
    }

    #[test]
    fn a_secret_without_prefix_or_key_or_base64_is_refused_with_the_variable_named() {
        for (value, says) in [
            ("aWRlbQ==", "without the `whsec_` prefix"),
            ("whsec_", "no key"),
            ("whsec_not base64!", "not base64"),
        ] {
            let error = WebhookSecret::parse(value).unwrap_err();
            assert!(
                error.contains("WEBHOOK_SECRET") && error.contains(says),
                "{value}: {error}"
            );
        }
    }
}
