//! The idempotency context a handler can ask for: stable keys for downstream calls.

/// What a handler knows about its own idempotency key, without the key itself.
///
/// Take it as a handler parameter (`ctx: IdempotencyContext`) and pass
/// [`derive`](Self::derive) to a downstream API's `Idempotency-Key`: the value is the same on
/// every retry and every takeover of the same (scope, key), so the downstream service executes
/// the side effect once even if this handler runs twice (after a crash, for instance).
///
/// ```
/// # use idem_runtime::IdempotencyContext;
/// let ctx = IdempotencyContext::new("tenant_1", "8e03978e");
/// assert_eq!(ctx.derive("charge"), IdempotencyContext::new("tenant_1", "8e03978e").derive("charge"));
/// assert_ne!(ctx.derive("charge"), ctx.derive("email"));
/// assert_ne!(ctx.derive("charge"), IdempotencyContext::new("tenant_2", "8e03978e").derive("charge"));
/// assert!(!ctx.derive("charge").contains("8e03978e"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct IdempotencyContext {
    scope: String,
    key: String,
}

impl IdempotencyContext {
    /// The context of `key` in `scope` (`""` for global keys).
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            scope: scope.into(),
            key: key.into(),
        }
    }

    /// The context of a request with `key`; without one (the handler's key is optional), a
    /// key of its own, made up once, so that the keys it derives are its own (the request is
    /// not protected, and must not share downstream keys with another).
    pub(crate) fn of(key: Option<&crate::record::KeyRef>) -> Self {
        match key {
            Some(key) => Self::new(&key.scope, &key.key),
            None => Self::unprotected(),
        }
    }

    fn unprotected() -> Self {
        let (high, low) = (
            crate::record::fresh_token() as u64,
            crate::record::fresh_token() as u64,
        );
        Self::new("", format!("unprotected-{high:016x}{low:016x}"))
    }

    /// A key for a downstream call, stable per (scope, key, label): `idem_` and 40 hex digits of
    /// SHA-256 over the three. It does not reveal the client's key, and differs per label (one
    /// per downstream call) and per scope. [`idem_key::derive_key`] computes the same value
    /// outside a handler.
    pub fn derive(&self, label: &str) -> String {
        idem_key::derive_key(&self.scope, &self.key, label)
    }

    /// The caller's scope (`""` for global keys).
    pub fn scope(&self) -> &str {
        &self.scope
    }
}

impl std::fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyContext")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}
