//! Compile-time errors of `#[idempotent]`, checked with trybuild: `fail/*.rs` holds one misuse
//! per file, each of which must be refused with the error recorded in the `.stderr` file next to
//! it, spanned on the offending token. The shapes the attribute accepts are `pass/*.rs`, built
//! as modules of the `pass` test (no trybuild case builds code, so trybuild only runs
//! `cargo check`, once for all the files).
//!
//! Regenerate the expected output with `TRYBUILD=overwrite cargo test -p idem-ui-tests --test ui`,
//! then read every changed `.stderr` before committing it.

#[test]
fn each_misuse_is_refused_with_its_recorded_error() {
    trybuild::TestCases::new().compile_fail("fail/*.rs");
}
