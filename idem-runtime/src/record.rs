//! The values that travel between the request flow and a storage backend.

use std::time::Duration;

use sha2::{Digest, Sha256};

use idem_key::Fingerprint;

/// Which `(scope, key)` a request is about, and the 64-bit lock id derived from it.
#[derive(Debug, Clone)]
pub struct KeyRef {
    /// The caller's scope (`""` for global keys).
    pub scope: String,
    /// The client's key.
    pub key: String,
    /// The first 8 bytes of SHA-256 over the length-prefixed scope and key.
    pub lock_id: i64,
}

impl KeyRef {
    /// Derives the lock id of `(scope, key)`.
    pub fn new(scope: String, key: String) -> Self {
        let mut hasher = Sha256::new();
        hasher.update((scope.len() as u64).to_be_bytes());
        hasher.update(scope.as_bytes());
        hasher.update(key.as_bytes());
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Self {
            scope,
            key,
            lock_id: i64::from_be_bytes(first),
        }
    }

    /// A short identifier of the key that is safe to log: it does not reveal the key.
    pub fn log_id(&self) -> String {
        format!("{:016x}", self.lock_id)
    }
}

/// Where a stored key stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    /// A claim taken by the external mode; the handler may still be running.
    Started,
    /// The response is stored and final.
    Completed,
    /// A claim the recovery gave up on: it waits for an operator (`idem resume`, `idem
    /// abandon`), and no retry takes it over.
    Parked,
}

/// A response as stored: status, the replayable headers, and the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// `(name, value)` pairs of the headers worth replaying (`Content-Type`, `Location`).
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

/// A live (unexpired) row of the key table.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    /// Started, completed or parked.
    pub status: KeyStatus,
    /// Method of the first request.
    pub method: String,
    /// Path and query of the first request.
    pub path: String,
    /// Fingerprint of the first request.
    pub fingerprint: Fingerprint,
    /// The stored response, once completed.
    pub response: Option<StoredResponse>,
}

/// The columns of a key row, as read by a backend, before they are checked.
#[derive(Debug)]
pub struct RawRecord {
    /// `started`, `completed`, or `parked` (a `started` row with `parked_at`, as the statements
    /// that read records spell it).
    pub status: String,
    /// Method of the first request.
    pub method: String,
    /// Path and query of the first request.
    pub path: String,
    /// 32 bytes.
    pub fingerprint: Vec<u8>,
    /// The stored status, once completed.
    pub response_status: Option<i64>,
    /// The stored headers.
    pub response_headers: Option<Vec<(String, String)>>,
    /// The stored body.
    pub response_body: Option<Vec<u8>>,
}

impl RawRecord {
    /// Checks the columns and builds the record.
    ///
    /// # Errors
    ///
    /// [`Error::CorruptRow`](crate::error::Error::CorruptRow) for an unknown status, a fingerprint that is not 32 bytes, or a
    /// status code out of range: the row was not written by idem.
    pub fn check(self) -> Result<KeyRecord, crate::error::Error> {
        let status = match self.status.as_str() {
            "completed" => KeyStatus::Completed,
            "started" => KeyStatus::Started,
            "parked" => KeyStatus::Parked,
            other => {
                return Err(crate::error::Error::corrupt(format!(
                    "unknown idem_keys.status {other:?}"
                )));
            }
        };
        let response = match self.response_status {
            Some(code) => Some(StoredResponse {
                status: u16::try_from(code)
                    .map_err(|_| crate::error::Error::corrupt(format!("response_status {code}")))?,
                headers: self.response_headers.unwrap_or_default(),
                body: self.response_body.unwrap_or_default(),
            }),
            None => None,
        };
        Ok(KeyRecord {
            status,
            method: self.method,
            path: self.path,
            fingerprint: checked_fingerprint(&self.fingerprint)?,
            response,
        })
    }
}

/// A stored fingerprint, checked to be 32 bytes.
///
/// # Errors
///
/// [`Error::CorruptRow`](crate::error::Error::CorruptRow) when it is not.
pub fn checked_fingerprint(bytes: &[u8]) -> Result<Fingerprint, crate::error::Error> {
    Fingerprint::from_slice(bytes)
        .ok_or_else(|| crate::error::Error::corrupt("idem_keys.fingerprint is not 32 bytes"))
}

/// The request a key's row is written for: its key, and what tells it from another request
/// under that key.
#[derive(Debug, Clone, Copy)]
pub struct RowOf<'a> {
    /// The key.
    pub key: &'a KeyRef,
    /// Method of the request.
    pub method: &'a str,
    /// Path and query of the request.
    pub path: &'a str,
    /// Fingerprint of the request.
    pub fingerprint: &'a Fingerprint,
}

/// A completed response to store.
#[derive(Debug, Clone)]
pub struct Completion<'a> {
    /// The request.
    pub row: RowOf<'a>,
    /// The response.
    pub response: &'a StoredResponse,
    /// What the claim gave to identify its transaction, where the database gives something
    /// ([`Begun::Acquired`](crate::backend::Begun::Acquired)): the completion writes only in
    /// that same transaction.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        expect(
            dead_code,
            reason = "only PostgreSQL and MySQL mark the claiming transaction"
        )
    )]
    pub mark: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_separate_scope_from_key() {
        let a = KeyRef::new("ab".into(), "c".into());
        let b = KeyRef::new("a".into(), "bc".into());
        assert_ne!(a.lock_id, b.lock_id);
        assert_eq!(a.lock_id, KeyRef::new("ab".into(), "c".into()).lock_id);
    }

    #[test]
    fn log_ids_are_the_lock_id_in_hex_and_do_not_show_the_key() {
        let key = KeyRef::new("tenant".into(), "8e03978e-40d5-43e8".into());
        let id = key.log_id();
        assert_eq!(id.len(), 16);
        assert_eq!(u64::from_str_radix(&id, 16).unwrap(), key.lock_id as u64);
        assert!(!id.contains("8e03978e"), "{id}");
        assert!(!format!("{key:?}").is_empty());
    }
}

/// An external-mode claim to take: a `started` row with a lease, owned by `token`.
#[derive(Debug, Clone)]
pub struct Start<'a> {
    /// The request.
    pub row: RowOf<'a>,
    /// How long the claim is exclusive.
    pub lease: Duration,
    /// How long the row lives, from now.
    pub retention: Duration,
    /// The owner of the claim; completion and release must present it.
    pub token: i64,
}

/// What taking an external-mode claim found.
#[derive(Debug, Clone)]
pub enum Started {
    /// The caller owns the key.
    Acquired {
        /// An abandoned claim (lapsed lease) or an expired row was replaced.
        taken_over: bool,
    },
    /// A live row is in the way.
    Found {
        /// The row.
        record: KeyRecord,
        /// For a started row, how long its lease still runs.
        lease_left: Option<Duration>,
    },
    /// Another request is claiming the key this instant.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        expect(
            dead_code,
            reason = "SQLite's writers queue: a claim there never meets another"
        )
    )]
    Busy,
}

/// An external-mode claim whose lease ran out, reclaimed by the recovery task.
#[derive(Debug, Clone)]
pub struct Abandoned {
    /// The key.
    pub key: KeyRef,
    /// Method of the request that claimed it.
    pub method: String,
    /// Path and query of that request.
    pub path: String,
    /// Its fingerprint.
    pub fingerprint: Fingerprint,
    /// Time since the claim was taken.
    pub age: Duration,
    /// The steps it recorded, in order.
    pub steps: Vec<RecordedStep>,
    /// How many times the recovery has taken it, this time included.
    pub attempts: u64,
}

/// A step of a multi-step handler, as recorded on its key: its name and its output.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RecordedStep {
    /// The step's name, unique within the handler.
    pub step: String,
    /// What the step returned, as JSON.
    pub output: serde_json::Value,
}

/// A fresh claim token: unique per call within the process, unpredictable across processes.
pub fn fresh_token() -> i64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // `RandomState` is seeded randomly per process; the counter makes every call distinct.
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish() as i64
}
