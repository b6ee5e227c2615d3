//! Property tests of the two request parsers every request goes through: the `Idempotency-Key`
//! header ([`idem_key::parse_key`], in `header`) and the request fingerprint
//! ([`idem_key::Fingerprint::of`], in `fingerprint`).
//!
//! Each property compares the code with a small model written here from the documentation, not
//! from the implementation. The fuzz targets in `fuzz/` check the same properties on raw bytes.
//! Known disagreements are reported in the module of their subject, ignored until the code or
//! its docs change.

mod fingerprint;
mod header;
