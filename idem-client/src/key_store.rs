//! Keys kept across a restart of the client: a user action keeps its key until it definitely
//! succeeded or failed.

use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
    sync::Mutex,
};

use serde::{Deserialize, Serialize};

/// A persisted key, with the fingerprint of the request it was made for: a key is never sent
/// with another request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredKey {
    /// The `Idempotency-Key`.
    pub key: String,
    /// SHA-256 of the request's method, URL and body, in hex.
    pub fingerprint: String,
}

/// Why a [`KeyStore`] failed.
#[derive(Debug, thiserror::Error)]
#[error("the key store failed")]
pub struct KeyStoreError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// Where keys of user actions are kept between attempts, across restarts of the client.
///
/// The middleware loads the action's key before the first attempt (or makes one and saves it
/// before sending anything), and removes it once the action has a final answer. A key whose
/// action ended without one (the process died, the attempts ran out) stays, so that the next
/// run sends the same key.
pub trait KeyStore: Send + Sync + 'static {
    /// The key saved for `action`, if any.
    ///
    /// # Errors
    ///
    /// When the store cannot be read.
    fn load(&self, action: &str) -> Result<Option<StoredKey>, KeyStoreError>;

    /// Saves `key` for `action`, durably, before the request goes out.
    ///
    /// # Errors
    ///
    /// When the store cannot be written; the request is then not sent.
    fn save(&self, action: &str, key: &StoredKey) -> Result<(), KeyStoreError>;

    /// Forgets the key of `action`.
    ///
    /// # Errors
    ///
    /// When the store cannot be written.
    fn remove(&self, action: &str) -> Result<(), KeyStoreError>;

    /// The key saved for `action`, or else `candidate`, saved durably: what the middleware
    /// calls before an action's first attempt. A store shared by several processes makes this
    /// atomic, so that they all send one key; the default, [`load`](Self::load) then
    /// [`save`](Self::save), is not.
    ///
    /// # Errors
    ///
    /// When the store cannot be read or written; the request is then not sent.
    fn load_or_save(
        &self,
        action: &str,
        candidate: &StoredKey,
    ) -> Result<StoredKey, KeyStoreError> {
        if let Some(kept) = self.load(action)? {
            return Ok(kept);
        }
        self.save(action, candidate)?;
        Ok(candidate.clone())
    }
}

/// A [`KeyStore`] in one JSON file, which several processes may share: every read-modify-write
/// holds an exclusive lock on `<file>.lock` (created beside it and left there), so processes
/// that start the same action at once all send the key the first of them saved.
///
/// Stored as `{"<action>": {"key": ..., "fingerprint": ...}}`, written to a temporary file,
/// synced and renamed into place (the directory synced after); removed when empty. The lock is
/// advisory (`flock` on Unix, `LockFileEx` on Windows): it holds between processes that use
/// `FileKeyStore`, not against other writers of the file.
#[derive(Debug)]
pub struct FileKeyStore {
    path: PathBuf,
    lock: Mutex<()>,
}

impl FileKeyStore {
    /// The store at `path` (created on the first save).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            lock: Mutex::new(()),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` holding this store's lock in this process and the lock file's between
    /// processes.
    fn exclusive<T>(
        &self,
        f: impl FnOnce() -> Result<T, KeyStoreError>,
    ) -> Result<T, KeyStoreError> {
        let _guard = self
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut lock_path = self.path.clone().into_os_string();
        lock_path.push(".lock");
        let lock_file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|error| {
                KeyStoreError(
                    format!(
                        "cannot open the lock file {}: {error}",
                        Path::new(&lock_path).display()
                    )
                    .into(),
                )
            })?;
        lock_file
            .lock()
            .map_err(|error| KeyStoreError(Box::new(error)))?;
        // Closing the file releases the lock, also when `f` fails.
        f()
    }

    fn read(&self) -> Result<BTreeMap<String, StoredKey>, KeyStoreError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|error| {
                KeyStoreError(format!("{} is not a key file: {error}", self.path.display()).into())
            }),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(error) => Err(KeyStoreError(Box::new(error))),
        }
    }

    fn write(&self, keys: &BTreeMap<String, StoredKey>) -> Result<(), KeyStoreError> {
        let io = |error: std::io::Error| KeyStoreError(Box::new(error));
        if keys.is_empty() {
            return match std::fs::remove_file(&self.path) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(io(error)),
                _ => Ok(()),
            };
        }
        let mut temporary = self.path.clone().into_os_string();
        temporary.push(format!(".{}.tmp", uuid::Uuid::new_v4().simple()));
        let temporary = PathBuf::from(temporary);
        let mut file = std::fs::File::create(&temporary).map_err(io)?;
        file.write_all(&serde_json::to_vec_pretty(keys).map_err(|e| KeyStoreError(Box::new(e)))?)
            .map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&temporary, &self.path).map_err(io)?;
        // The rename is durable once the directory is synced.
        if let Some(directory) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::File::open(directory)
                .and_then(|directory| directory.sync_all())
                .map_err(io)?;
        }
        Ok(())
    }
}

impl KeyStore for FileKeyStore {
    fn load(&self, action: &str) -> Result<Option<StoredKey>, KeyStoreError> {
        self.exclusive(|| Ok(self.read()?.remove(action)))
    }

    fn save(&self, action: &str, key: &StoredKey) -> Result<(), KeyStoreError> {
        self.exclusive(|| {
            let mut keys = self.read()?;
            keys.insert(action.to_owned(), key.clone());
            self.write(&keys)
        })
    }

    fn remove(&self, action: &str) -> Result<(), KeyStoreError> {
        self.exclusive(|| {
            let mut keys = self.read()?;
            if keys.remove(action).is_some() {
                self.write(&keys)?;
            }
            Ok(())
        })
    }

    fn load_or_save(
        &self,
        action: &str,
        candidate: &StoredKey,
    ) -> Result<StoredKey, KeyStoreError> {
        self.exclusive(|| {
            let mut keys = self.read()?;
            if let Some(kept) = keys.get(action) {
                return Ok(kept.clone());
            }
            keys.insert(action.to_owned(), candidate.clone());
            self.write(&keys)?;
            Ok(candidate.clone())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_saved_loaded_and_removed_with_the_file_when_none_is_left() {
        let dir = std::env::temp_dir().join(format!("idem-client-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = FileKeyStore::new(dir.join("keys.json"));
        let key = StoredKey {
            key: "k1".into(),
            fingerprint: "f1".into(),
        };
        assert_eq!(store.load("pay").unwrap(), None);
        store.save("pay", &key).unwrap();
        store.save("refund", &key).unwrap();
        assert_eq!(
            FileKeyStore::new(store.path()).load("pay").unwrap(),
            Some(key)
        );
        store.remove("pay").unwrap();
        assert!(store.path().exists(), "refund's key is still there");
        store.remove("refund").unwrap();
        assert!(!store.path().exists(), "an empty store leaves no file");
        std::fs::write(store.path(), "not json").unwrap();
        assert!(
            store.load("pay").is_err(),
            "a damaged file is an error, not an empty store"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Stores of one file in several threads stand for several processes: `flock` locks
    /// belong to each open file, so only the lock file keeps them apart, as between processes.
    #[test]
    fn stores_sharing_a_file_starting_one_action_at_once_all_get_one_key() {
        let dir = std::env::temp_dir().join(format!("idem-client-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        const STORES: usize = 4;
        for round in 0..50 {
            let path = dir.join(format!("keys-{round}.json"));
            let start = std::sync::Arc::new(std::sync::Barrier::new(STORES));
            let keys: Vec<String> = (0..STORES)
                .map(|i| {
                    let (path, start) = (path.clone(), std::sync::Arc::clone(&start));
                    std::thread::spawn(move || {
                        let store = FileKeyStore::new(path);
                        let candidate = StoredKey {
                            key: format!("key-of-store-{i}"),
                            fingerprint: "f".into(),
                        };
                        start.wait();
                        store.load_or_save("pay", &candidate).unwrap().key
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|thread| thread.join().unwrap())
                .collect();
            assert!(
                keys.iter().all(|key| *key == keys[0]),
                "round {round}: the stores sent different keys for one action: {keys:?}"
            );
            let saved = FileKeyStore::new(&path).load("pay").unwrap().unwrap();
            assert_eq!(
                saved.key, keys[0],
                "round {round}: the key sent is the key kept"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
