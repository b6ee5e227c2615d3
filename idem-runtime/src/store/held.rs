//! The keys this process's requests hold right now: the in-process registry that answers a
//! duplicate of a running key without the database, and lets a duplicate that may wait wait
//! for the key to be let go.

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
};

use idem_key::Fingerprint;
use tokio::{
    sync::{Notify, futures::OwnedNotified},
    time::Instant,
};

/// The keys this process's transactional handlers hold right now, and whether each one's
/// handler is running (its claim is taken) or the key is still being looked up. A duplicate of
/// a running key is answered 409 from here, without a database connection: SQLite has a single
/// writer, and an exhausted pool would make the duplicate wait for a connection. A duplicate
/// that may wait (`Prefer: wait`) waits here for the key to be let go, without a connection
/// either: the waiters of one key share one watch.
#[derive(Debug, Default)]
pub(crate) struct HeldKeys(Mutex<HashMap<i64, Holder>>);

/// The request of this process holding a key.
#[derive(Debug)]
struct Holder {
    /// Its handler is running (its claim is taken), rather than the key being looked up.
    running: bool,
    /// Its request's fingerprint: a duplicate that is another request is never made to wait.
    fingerprint: Fingerprint,
    /// Notified when the key is let go; made by the first duplicate that waits for it, so
    /// that a request nobody waits for allocates none.
    released: Option<Arc<Notify>>,
}

impl HeldKeys {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Holder>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many keys are held.
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Holds `lock_id` for this process, unless a request here holds it already.
    pub(super) fn hold(keys: &Arc<Self>, lock_id: i64, fingerprint: &Fingerprint) -> Hold {
        let mut held = keys.lock();
        match held.get_mut(&lock_id) {
            Some(holder) => {
                let notify = holder
                    .released
                    .get_or_insert_with(|| Arc::new(Notify::new()));
                let mut released = Box::pin(Arc::clone(notify).notified_owned());
                // Registered now, under the map's lock: a release after this is seen.
                released.as_mut().enable();
                let holding = Holding {
                    same_request: holder.fingerprint == *fingerprint,
                    released,
                };
                if holder.running {
                    Hold::Running(holding)
                } else {
                    Hold::Claiming(holding)
                }
            }
            None => {
                held.insert(
                    lock_id,
                    Holder {
                        running: false,
                        fingerprint: *fingerprint,
                        released: None,
                    },
                );
                Hold::Taken(HeldKey {
                    keys: Arc::clone(keys),
                    lock_id,
                })
            }
        }
    }
}

/// What [`HeldKeys::hold`] found.
#[derive(Debug)]
pub(crate) enum Hold {
    /// This request holds the key now.
    Taken(HeldKey),
    /// A handler of this process is running with the key.
    Running(Holding),
    /// Another request of this process is claiming the key, replaying it, or waiting for it.
    Claiming(Holding),
}

/// Another request of this process holds the key.
#[derive(Debug)]
pub(crate) struct Holding {
    /// That request has this one's fingerprint (it is a duplicate, not another request).
    pub(crate) same_request: bool,
    /// Registered while the key was found held, so that a release in between is not missed.
    released: Pin<Box<OwnedNotified>>,
}

impl Holding {
    /// Waits until the key is let go, or until `until`; whether it was let go.
    pub(crate) async fn released(self, until: Instant) -> bool {
        tokio::time::timeout_at(until, self.released).await.is_ok()
    }
}

/// Releases a held key when dropped.
#[derive(Debug)]
pub(crate) struct HeldKey {
    keys: Arc<HeldKeys>,
    lock_id: i64,
}

impl HeldKey {
    /// Marks the key's handler as running: duplicates are refused without the database.
    pub(crate) fn running(&self) {
        if let Some(holder) = self.keys.lock().get_mut(&self.lock_id) {
            holder.running = true;
        }
    }
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        if let Some(released) = self
            .keys
            .lock()
            .remove(&self.lock_id)
            .and_then(|holder| holder.released)
        {
            released.notify_waiters();
        }
    }
}
