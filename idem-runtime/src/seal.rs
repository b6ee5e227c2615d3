//! Stored answers sealed at rest: [`EncryptionKeys`] given to a store
//! ([`StoreOptions::with_encryption_keys`](crate::store::StoreOptions::with_encryption_keys))
//! seal every answer it stores, and what a multi-step handler records at its recovery points,
//! with AES-256-GCM (RustCrypto's `aes-gcm`): a fresh random nonce each time, the row's scope and
//! key (and the answer's status, or the step's name) as associated data, so that a sealed answer
//! copied to another key does not open. The first key seals; every key opens (rotation).
//!
//! A sealed answer keeps its status in the clear (the purge, the metrics and the `idem` command
//! read it) and in its headers only [`SEALED_WITH`], the id of the key that sealed it; its
//! headers and body are in its body, sealed: the nonce, then the ciphertext and its tag. A
//! sealed step's output is `{"idem-sealed": "<key id>", "data": "<base64 of nonce, ciphertext
//! and tag>"}`.

use std::fmt;

use aes_gcm::{
    Aes256Gcm, KeyInit, Nonce,
    aead::{Aead, Generate, Payload},
};
use base64::Engine as _;
use zeroize::Zeroizing;

pub use crate::error::Unopened;
use crate::record::{KeyRef, RecordedStep, StoredResponse};

/// The header a sealed answer keeps in the clear: the id of the key that sealed it.
pub const SEALED_WITH: &str = "idem-sealed";

/// The field of a sealed step's output that names its key.
const STEP_SEALED_WITH: &str = "idem-sealed";

/// The field of a sealed step's output that holds it, sealed.
const STEP_DATA: &str = "data";

/// Bytes of an AES-GCM nonce.
const NONCE_LEN: usize = 12;

/// The longest key id: it is stored with every sealed answer.
pub const MAX_KEY_ID_LEN: usize = 64;

/// The keys a store seals and opens stored answers with: the first seals, every one opens.
///
/// Key material never shows: `Debug` prints the ids alone, and each key's cipher state is
/// zeroed when dropped.
#[derive(Clone)]
pub struct EncryptionKeys {
    keys: Vec<(String, Aes256Gcm)>,
}

impl fmt::Debug for EncryptionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncryptionKeys")
            .field("ids", &self.ids().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Why a set of keys was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    /// No key at all.
    #[error("no key is given: give at least one, `<id>:<base64 of 32 bytes>`")]
    Empty,
    /// An entry is not `<id>:<key>`.
    #[error("entry {position} is not `<id>:<base64 of 32 bytes>`")]
    NotAnEntry {
        /// Its place in the list, from 1.
        position: usize,
    },
    /// An id is empty, too long, or has a character it may not have.
    #[error(
        "key id {id:?} is not 1 to {MAX_KEY_ID_LEN} visible ASCII characters without `:` or `,`"
    )]
    BadId {
        /// The id as given.
        id: String,
    },
    /// An id that is itself a key (`<key>:<id>`, the two swapped): named by its place only, so
    /// that the refusal does not print the key.
    #[error("entry {position} is `<key>:<id>`, the two swapped: write `<id>:<base64 of 32 bytes>`")]
    IdIsAKey {
        /// Its place in the list, from 1.
        position: usize,
    },
    /// Two keys have one id.
    #[error("key id {id:?} is given twice")]
    RepeatedId {
        /// The id.
        id: String,
    },
    /// A key is not base64.
    #[error("the key of id {id:?} is not base64 (standard alphabet, padded)")]
    NotBase64 {
        /// Its id.
        id: String,
    },
    /// A key is not 32 bytes long.
    #[error("the key of id {id:?} is {len} bytes long; an AES-256 key is 32 bytes")]
    WrongLength {
        /// Its id.
        id: String,
        /// Its length once decoded.
        len: usize,
    },
}

impl EncryptionKeys {
    /// The keys, each an id and 32 bytes; the first seals.
    ///
    /// # Errors
    ///
    /// [`KeysError`] for an empty list, a bad or repeated id, or a key that is not 32 bytes.
    pub fn new<I, K>(keys: I) -> Result<Self, KeysError>
    where
        I: IntoIterator<Item = (String, K)>,
        K: AsRef<[u8]>,
    {
        let mut sealed: Vec<(String, Aes256Gcm)> = Vec::new();
        for (id, key) in keys {
            check_id(&id)?;
            if sealed.iter().any(|(known, _)| *known == id) {
                return Err(KeysError::RepeatedId { id });
            }
            let key = key.as_ref();
            let cipher = Aes256Gcm::new_from_slice(key).map_err(|_| KeysError::WrongLength {
                id: id.clone(),
                len: key.len(),
            })?;
            sealed.push((id, cipher));
        }
        if sealed.is_empty() {
            return Err(KeysError::Empty);
        }
        Ok(Self { keys: sealed })
    }

    /// The keys written as `<id>:<base64 of 32 bytes>`, apart by commas, the first sealing: the
    /// form of the example's `IDEM_ENCRYPTION_KEYS` and of the `idem` command's.
    ///
    /// # Errors
    ///
    /// [`KeysError`] naming the entry at fault.
    pub fn parse(text: &str) -> Result<Self, KeysError> {
        let mut keys = Vec::new();
        for (index, entry) in text.split(',').enumerate() {
            let entry = entry.trim();
            if entry.is_empty() && text.trim().is_empty() {
                break;
            }
            let (id, key) = entry.split_once(':').ok_or(KeysError::NotAnEntry {
                position: index + 1,
            })?;
            let (id, key) = (id.trim().to_owned(), key.trim());
            let decodes_to_a_key = base64::engine::general_purpose::STANDARD
                .decode(&id)
                .is_ok_and(|bytes| Zeroizing::new(bytes).len() == 32);
            if decodes_to_a_key {
                return Err(KeysError::IdIsAKey {
                    position: index + 1,
                });
            }
            check_id(&id)?;
            let bytes = Zeroizing::new(
                base64::engine::general_purpose::STANDARD
                    .decode(key)
                    .map_err(|_| KeysError::NotBase64 { id: id.clone() })?,
            );
            keys.push((id, bytes));
        }
        Self::new(keys)
    }

    /// The ids, the sealing one first.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|(id, _)| id.as_str())
    }

    /// The id of the key that seals.
    pub fn sealing_id(&self) -> &str {
        &self.keys[0].0
    }

    fn sealing(&self) -> &(String, Aes256Gcm) {
        &self.keys[0]
    }

    fn cipher(&self, id: &str) -> Result<&Aes256Gcm, Unopened> {
        self.keys
            .iter()
            .find(|(known, _)| known == id)
            .map(|(_, cipher)| cipher)
            .ok_or_else(|| Unopened::KeyNotConfigured {
                id: id.to_owned(),
                have: self.ids().collect::<Vec<_>>().join(", "),
            })
    }

    /// `response`, stored under `key`, sealed with the first key.
    pub(crate) fn seal_response(&self, response: &StoredResponse, key: &KeyRef) -> StoredResponse {
        let headers =
            Zeroizing::new(serde_json::to_vec(&response.headers).expect("headers serialize"));
        let mut plain = Zeroizing::new(Vec::with_capacity(4 + headers.len() + response.body.len()));
        plain.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        plain.extend_from_slice(&headers);
        plain.extend_from_slice(&response.body);
        let (id, cipher) = self.sealing();
        let aad = answer_aad(key, response.status);
        StoredResponse {
            status: response.status,
            headers: vec![(SEALED_WITH.to_owned(), id.clone())],
            body: seal(cipher, &plain, &aad),
        }
    }

    /// The step outputs of `steps`, recorded under `key`, sealed with the first key.
    pub(crate) fn seal_steps(&self, steps: &[RecordedStep], key: &KeyRef) -> Vec<RecordedStep> {
        let (id, cipher) = self.sealing();
        steps
            .iter()
            .map(|step| {
                let plain = Zeroizing::new(
                    serde_json::to_vec(&step.output).expect("a JSON value serializes"),
                );
                let sealed = seal(cipher, &plain, &step_aad(key, &step.step));
                RecordedStep {
                    step: step.step.clone(),
                    output: serde_json::json!({
                        STEP_SEALED_WITH: id,
                        STEP_DATA: base64::engine::general_purpose::STANDARD.encode(sealed),
                    }),
                }
            })
            .collect()
    }
}

/// Whether `response` is sealed, and with which key id.
pub fn sealed_with(response: &StoredResponse) -> Option<&str> {
    match response.headers.as_slice() {
        [(name, id)] if name == SEALED_WITH => Some(id),
        _ => None,
    }
}

/// `response`, stored under `key`, opened with `keys`; as it is when it is not sealed.
///
/// # Errors
///
/// [`Unopened`] when it is sealed and `keys` lack its key, or it does not open.
pub(crate) fn open_response(
    keys: Option<&EncryptionKeys>,
    response: StoredResponse,
    key: &KeyRef,
) -> Result<StoredResponse, Unopened> {
    let Some(id) = sealed_with(&response).map(str::to_owned) else {
        return Ok(response);
    };
    let cipher = cipher_of(keys, &id)?;
    let plain = open(cipher, &response.body, &answer_aad(key, response.status))
        .ok_or_else(|| Unopened::Altered { id: id.clone() })?;
    let altered = || Unopened::Altered { id: id.clone() };
    let len = plain
        .get(..4)
        .map(|bytes| u32::from_be_bytes(bytes.try_into().expect("four bytes")) as usize)
        .ok_or_else(altered)?;
    let headers = plain.get(4..4 + len).ok_or_else(altered)?;
    let headers: Vec<(String, String)> = serde_json::from_slice(headers).map_err(|_| altered())?;
    Ok(StoredResponse {
        status: response.status,
        headers,
        body: plain[4 + len..].to_vec(),
    })
}

/// `steps`, recorded under `key`, their outputs opened with `keys`; those not sealed as they
/// are.
///
/// # Errors
///
/// [`Unopened`] for the first sealed output that does not open.
pub(crate) fn open_steps(
    keys: Option<&EncryptionKeys>,
    steps: Vec<RecordedStep>,
    key: &KeyRef,
) -> Result<Vec<RecordedStep>, Unopened> {
    steps
        .into_iter()
        .map(|step| {
            let Some((id, data)) = sealed_step(&step.output) else {
                return Ok(step);
            };
            let altered = || Unopened::Altered { id: id.to_owned() };
            let cipher = cipher_of(keys, id)?;
            let sealed = base64::engine::general_purpose::STANDARD
                .decode(data)
                .map_err(|_| altered())?;
            let plain = open(cipher, &sealed, &step_aad(key, &step.step)).ok_or_else(altered)?;
            let output = serde_json::from_slice(&plain).map_err(|_| altered())?;
            Ok(RecordedStep {
                step: step.step,
                output,
            })
        })
        .collect()
}

/// Whether every one of `steps` is sealed with the key `id`.
pub(crate) fn steps_sealed_with(steps: &[RecordedStep], id: &str) -> bool {
    steps
        .iter()
        .all(|step| sealed_step(&step.output).is_some_and(|(sealed, _)| sealed == id))
}

/// Whether every one of `steps` is sealed, with whichever key.
pub(crate) fn steps_all_sealed(steps: &[RecordedStep]) -> bool {
    steps.iter().all(|step| sealed_step(&step.output).is_some())
}

/// The key id and data of a sealed step output.
fn sealed_step(output: &serde_json::Value) -> Option<(&str, &str)> {
    let object = output.as_object()?;
    if object.len() != 2 {
        return None;
    }
    Some((
        object.get(STEP_SEALED_WITH)?.as_str()?,
        object.get(STEP_DATA)?.as_str()?,
    ))
}

fn cipher_of<'k>(keys: Option<&'k EncryptionKeys>, id: &str) -> Result<&'k Aes256Gcm, Unopened> {
    match keys {
        Some(keys) => keys.cipher(id),
        None => Err(Unopened::KeyNotConfigured {
            id: id.to_owned(),
            have: "none".to_owned(),
        }),
    }
}

/// The nonce, then `plain` sealed with `aad`.
fn seal(cipher: &Aes256Gcm, plain: &[u8], aad: &[u8]) -> Vec<u8> {
    let nonce = Nonce::generate();
    let sealed = cipher
        .encrypt(&nonce, Payload { msg: plain, aad })
        .expect("AES-GCM seals any message shorter than 64 GiB");
    let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    out
}

/// What `sealed` (nonce first) holds, if it opens with `aad`.
fn open(cipher: &Aes256Gcm, sealed: &[u8], aad: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    let (nonce, sealed) = sealed.split_at_checked(NONCE_LEN)?;
    let nonce = Nonce::try_from(nonce).ok()?;
    cipher
        .decrypt(&nonce, Payload { msg: sealed, aad })
        .ok()
        .map(Zeroizing::new)
}

/// What an answer's seal is bound to: its row's scope and key, and its status. A scope has no
/// NUL and a key is visible ASCII, so the parts cannot run into each other.
fn answer_aad(key: &KeyRef, status: u16) -> Vec<u8> {
    let mut aad = b"idem answer v1\0".to_vec();
    aad.extend_from_slice(key.scope.as_bytes());
    aad.push(0);
    aad.extend_from_slice(key.key.as_bytes());
    aad.push(0);
    aad.extend_from_slice(&status.to_be_bytes());
    aad
}

/// What a step output's seal is bound to: its row's scope and key, and the step's name.
fn step_aad(key: &KeyRef, step: &str) -> Vec<u8> {
    let mut aad = b"idem step v1\0".to_vec();
    aad.extend_from_slice(key.scope.as_bytes());
    aad.push(0);
    aad.extend_from_slice(key.key.as_bytes());
    aad.push(0);
    aad.extend_from_slice(step.as_bytes());
    aad
}

fn check_id(id: &str) -> Result<(), KeysError> {
    let fine = !id.is_empty()
        && id.len() <= MAX_KEY_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b':' && b != b',');
    if fine {
        Ok(())
    } else {
        Err(KeysError::BadId { id: id.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(text: &str) -> EncryptionKeys {
        EncryptionKeys::parse(text).expect("valid keys")
    }

    /// `k1`: 32 bytes of 1, `k2`: 32 bytes of 2, in base64.
    const K1: &str = "k1:AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
    const K2: &str = "k2:AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

    fn answer() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("location".to_owned(), "/v1/payments/pay_1".to_owned())],
            body: br#"{"customer":"cus_1"}"#.to_vec(),
        }
    }

    fn key(key: &str) -> KeyRef {
        KeyRef::new("tenant_1".to_owned(), key.to_owned())
    }

    #[test]
    fn a_sealed_answer_opens_to_itself_and_shows_nothing_of_it() {
        let keys = keys(K1);
        let sealed = keys.seal_response(&answer(), &key("a"));
        assert_eq!(sealed_with(&sealed), Some("k1"));
        assert_eq!(sealed.status, 201);
        let shown = String::from_utf8_lossy(&sealed.body);
        assert!(
            !shown.contains("cus_1") && !shown.contains("pay_1"),
            "{shown}"
        );
        let opened = open_response(Some(&keys), sealed, &key("a")).expect("opens");
        assert_eq!(opened, answer());
    }

    #[test]
    fn two_seals_of_one_answer_differ() {
        let keys = keys(K1);
        let one = keys.seal_response(&answer(), &key("a"));
        let two = keys.seal_response(&answer(), &key("a"));
        assert_ne!(
            one.body[..NONCE_LEN],
            two.body[..NONCE_LEN],
            "a fresh nonce each time"
        );
        assert_ne!(one.body, two.body);
    }

    #[test]
    fn a_sealed_answer_opens_only_under_its_own_key_and_status() {
        let keys = keys(K1);
        let sealed = keys.seal_response(&answer(), &key("a"));
        let moved = open_response(Some(&keys), sealed.clone(), &key("b"));
        assert_eq!(
            moved,
            Err(Unopened::Altered {
                id: "k1".to_owned()
            })
        );
        let mut restatused = sealed.clone();
        restatused.status = 200;
        assert!(open_response(Some(&keys), restatused, &key("a")).is_err());
        let mut flipped = sealed;
        let last = flipped.body.len() - 1;
        flipped.body[last] ^= 1;
        assert!(open_response(Some(&keys), flipped, &key("a")).is_err());
    }

    #[test]
    fn the_first_key_seals_and_every_key_opens() {
        let old = keys(K1);
        let sealed_old = old.seal_response(&answer(), &key("a"));
        let rotated = keys(&format!("{K2},{K1}"));
        assert_eq!(rotated.sealing_id(), "k2");
        assert!(open_response(Some(&rotated), sealed_old.clone(), &key("a")).is_ok());
        let sealed_new = rotated.seal_response(&answer(), &key("a"));
        assert_eq!(sealed_with(&sealed_new), Some("k2"));
        let retired = keys(K2);
        assert_eq!(
            open_response(Some(&retired), sealed_old.clone(), &key("a")),
            Err(Unopened::KeyNotConfigured {
                id: "k1".to_owned(),
                have: "k2".to_owned()
            })
        );
        assert!(open_response(None, sealed_old, &key("a")).is_err());
        // An answer stored in the clear is read as it is.
        assert_eq!(
            open_response(Some(&retired), answer(), &key("a")),
            Ok(answer())
        );
    }

    #[test]
    fn a_sealed_step_opens_only_under_its_own_key_and_name() {
        let keys = keys(K1);
        let steps = vec![RecordedStep {
            step: "charge".to_owned(),
            output: serde_json::json!({"card": "4242"}),
        }];
        let sealed = keys.seal_steps(&steps, &key("a"));
        assert!(!sealed[0].output.to_string().contains("4242"));
        assert_eq!(
            open_steps(Some(&keys), sealed.clone(), &key("a")),
            Ok(steps)
        );
        assert!(open_steps(Some(&keys), sealed.clone(), &key("b")).is_err());
        let mut renamed = sealed;
        renamed[0].step = "refund".to_owned();
        assert!(open_steps(Some(&keys), renamed, &key("a")).is_err());
    }

    #[test]
    fn malformed_keys_are_refused_naming_the_fault() {
        let refused = |text: &str| EncryptionKeys::parse(text).map(|_| ()).err();
        assert_eq!(refused(""), Some(KeysError::Empty));
        assert_eq!(refused("AQEB"), Some(KeysError::NotAnEntry { position: 1 }));
        assert_eq!(
            refused(":AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE="),
            Some(KeysError::BadId { id: String::new() })
        );
        assert_eq!(
            refused("k1:not base64!"),
            Some(KeysError::NotBase64 {
                id: "k1".to_owned()
            })
        );
        assert_eq!(
            refused("k1:AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQ=="),
            Some(KeysError::WrongLength {
                id: "k1".to_owned(),
                len: 31
            })
        );
        let swapped = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=:k1";
        assert_eq!(refused(swapped), Some(KeysError::IdIsAKey { position: 1 }));
        assert!(
            !KeysError::IdIsAKey { position: 1 }
                .to_string()
                .contains("AQEB")
        );
        assert_eq!(
            refused(&format!("{K1},{K1}")),
            Some(KeysError::RepeatedId {
                id: "k1".to_owned()
            })
        );
    }

    #[test]
    fn debug_shows_the_ids_and_never_the_key() {
        let shown = format!("{:?}", keys(K1));
        assert!(shown.contains("k1"), "{shown}");
        assert!(
            !shown.contains("AQEB") && !shown.contains("[1, 1"),
            "{shown}"
        );
    }
}
