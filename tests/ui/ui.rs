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

/// What the generated code names where an error can show it lives in public, documented places
/// (`idem_runtime::signature`, the public traits), never in the macro's private module.
#[test]
fn no_recorded_error_names_the_private_module() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fail");
    let mut offenders = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("the fail directory") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "stderr") {
            let text = std::fs::read_to_string(&path).expect("a readable .stderr");
            if text.contains("__private") {
                offenders.push(path.display().to_string());
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "errors naming `__private`: {offenders:?}"
    );
}
