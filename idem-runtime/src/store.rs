//! The store handed to idempotent handlers through router state: a pool and its settings.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use sqlx::Pool;

use crate::backend::Backend;

/// Limits and answers of the idempotency layer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settings {
    /// The largest request body the layer buffers and fingerprints; larger bodies get 413 and
    /// nothing is stored. Default: 1 MiB.
    pub max_request_body: usize,
    /// The largest response body the layer stores; a larger one is rolled back and answered
    /// with a 500 problem. Default: 1 MiB.
    pub max_response_body: usize,
    /// The `Retry-After` sent with a 409 while the key is held by another request. Default: 1 s.
    pub retry_after: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_request_body: 1 << 20,
            max_response_body: 1 << 20,
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The idempotency store: the database pool the handlers' transactions come from, and the
/// [`Settings`] of the layer. Put it in your router state and implement
/// [`FromRef`](axum::extract::FromRef) for it (or use the store itself as the state).
///
/// Cloning is cheap: the pool and the settings are shared.
///
/// # Examples
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::Store;
/// use sqlx::PgPool;
///
/// let pool = PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
/// idem_runtime::migrate(&pool).await?;
/// let store = Store::new(pool).max_request_body(64 * 1024);
/// # Ok(()) }
/// ```
pub struct Store<DB: Backend> {
    pool: Pool<DB>,
    settings: Arc<Settings>,
    held: Arc<HeldKeys>,
    writers: Arc<tokio::sync::Semaphore>,
}

impl<DB: Backend> Clone for Store<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            settings: Arc::clone(&self.settings),
            held: Arc::clone(&self.held),
            writers: Arc::clone(&self.writers),
        }
    }
}

/// The keys this process's transactional handlers hold right now. A duplicate within the
/// process is answered 409 from here, without waiting on the database (SQLite has a single
/// writer, so waiting there would mean waiting for the whole handler).
#[derive(Debug, Default)]
pub(crate) struct HeldKeys(Mutex<HashSet<i64>>);

/// Releases a held key when dropped.
#[derive(Debug)]
pub(crate) struct HeldKey {
    keys: Arc<HeldKeys>,
    lock_id: i64,
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        self.keys
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.lock_id);
    }
}

impl<DB: Backend> std::fmt::Debug for Store<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &<DB as Backend>::NAME)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Store<DB> {
    /// A store over `pool` with default [`Settings`].
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_settings(pool, Settings::default())
    }

    /// A store over `pool` with the given settings.
    pub fn with_settings(pool: Pool<DB>, settings: Settings) -> Self {
        Self {
            pool,
            settings: Arc::new(settings),
            held: Arc::default(),
            writers: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }

    /// Sets [`Settings::max_request_body`].
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.map_settings(|s| s.max_request_body = bytes)
    }

    /// Sets [`Settings::max_response_body`].
    pub fn max_response_body(self, bytes: usize) -> Self {
        self.map_settings(|s| s.max_response_body = bytes)
    }

    /// Sets [`Settings::retry_after`].
    pub fn retry_after(self, after: Duration) -> Self {
        self.map_settings(|s| s.retry_after = after)
    }

    /// The pool the handlers' transactions are taken from.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The layer's settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// How many keys this process's transactional handlers hold right now (in flight).
    pub fn keys_in_flight(&self) -> usize {
        self.held
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Holds `lock_id` for this process, or `None` if a handler here holds it already.
    pub(crate) fn hold(&self, lock_id: i64) -> Option<HeldKey> {
        let mut held = self.held.0.lock().unwrap_or_else(PoisonError::into_inner);
        held.insert(lock_id).then(|| HeldKey {
            keys: Arc::clone(&self.held),
            lock_id,
        })
    }

    /// On a single-writer database, this process's turn to write; `None` elsewhere.
    pub(crate) async fn write_permit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        if !DB::SINGLE_WRITER {
            return None;
        }
        Arc::clone(&self.writers).acquire_owned().await.ok()
    }

    fn map_settings(mut self, change: impl FnOnce(&mut Settings)) -> Self {
        change(Arc::make_mut(&mut self.settings));
        self
    }
}
