//! Keys for downstream calls, derived from the client's key.

use sha2::{Digest, Sha256};

/// A key for a downstream call, stable per (scope, key, label): `idem_` and 40 hex digits of
/// SHA-256 over the three. It does not reveal the client's key, and differs per label (one per
/// downstream call) and per scope.
///
/// A handler gets it from `IdempotencyContext::derive` (crate `idem-runtime`); a recovery job or
/// a test that knows the scope and the key computes the same value here.
///
/// ```
/// use idem_key::derive_key;
///
/// let charge = derive_key("tenant_1", "8e03978e", "charge");
/// assert_eq!(charge, derive_key("tenant_1", "8e03978e", "charge"));
/// assert_ne!(charge, derive_key("tenant_1", "8e03978e", "email"));
/// assert_ne!(charge, derive_key("tenant_2", "8e03978e", "charge"));
/// assert!(charge.starts_with("idem_") && !charge.contains("8e03978e"));
/// ```
pub fn derive_key(scope: &str, key: &str, label: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"idem-derived-key\0");
    for part in [scope.as_bytes(), key.as_bytes(), label.as_bytes()] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize();
    let mut out = String::with_capacity(45);
    out.push_str("idem_");
    for byte in &digest[..20] {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}
