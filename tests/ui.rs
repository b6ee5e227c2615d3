//! Compile-time behaviour of `#[idempotent]`, checked with trybuild.
//!
//! - `ui/fail/*.rs`: one misuse per file; each must be refused with the error recorded in the
//!   `.stderr` file next to it, spanned on the offending token.
//! - `ui/pass/*.rs`: supported handler shapes; each must compile and be accepted by
//!   `axum::routing::post`, so that the generated function really is an Axum `Handler`.
//!
//! Regenerate the expected output with `TRYBUILD=overwrite cargo test -p idem-tests --test ui`,
//! then read every changed `.stderr` before committing it.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/fail/*.rs");
    t.pass("ui/pass/*.rs");
}
