//! The handler shapes `#[idempotent]` accepts, one per file under `pass/`: each must compile and
//! its router must take the rewritten handlers (`axum::routing::post`), so that the generated
//! function really is an Axum `Handler`. Each file is a module with a `main` that names its
//! routers; the test calls them all.
//!
//! They are compiled with the rest of the suite rather than by trybuild, which would build and
//! run each file as a crate of its own. rustfmt leaves them as written (`pass/readme.rs` is the
//! README's example).

#![allow(
    dead_code,
    reason = "a case declares what a handler may carry, as user code does, without reading all of it"
)]

#[rustfmt::skip]
#[path = "pass/attributes_survive.rs"]
mod attributes_survive;
#[rustfmt::skip]
#[path = "pass/custom_error.rs"]
mod custom_error;
#[rustfmt::skip]
#[path = "pass/external_mode.rs"]
mod external_mode;
#[rustfmt::skip]
#[path = "pass/generic_over_the_database.rs"]
mod generic_over_the_database;
#[rustfmt::skip]
#[path = "pass/global_and_minimal.rs"]
mod global_and_minimal;
#[rustfmt::skip]
#[path = "pass/grpc_service.rs"]
mod grpc_service;
#[rustfmt::skip]
#[path = "pass/impl_into_response.rs"]
mod impl_into_response;
#[rustfmt::skip]
#[path = "pass/key_sources.rs"]
mod key_sources;
#[rustfmt::skip]
#[path = "pass/path_and_json.rs"]
mod path_and_json;
#[rustfmt::skip]
#[path = "pass/readme.rs"]
mod readme;
#[rustfmt::skip]
#[path = "pass/result_with_question_mark.rs"]
mod result_with_question_mark;
#[rustfmt::skip]
#[path = "pass/scope_in_pattern.rs"]
mod scope_in_pattern;
#[rustfmt::skip]
#[path = "pass/state_and_scope.rs"]
mod state_and_scope;
#[rustfmt::skip]
#[path = "pass/state_checks_in_generic_and_associated_handlers.rs"]
mod state_checks_in_generic_and_associated_handlers;
#[rustfmt::skip]
#[path = "pass/steps.rs"]
mod steps;
#[rustfmt::skip]
#[path = "pass/timeout.rs"]
mod timeout;

#[test]
fn each_accepted_shape_compiles_and_is_routed() {
    attributes_survive::main();
    custom_error::main();
    external_mode::main();
    generic_over_the_database::main();
    global_and_minimal::main();
    grpc_service::main();
    impl_into_response::main();
    key_sources::main();
    path_and_json::main();
    readme::main();
    result_with_question_mark::main();
    scope_in_pattern::main();
    state_and_scope::main();
    state_checks_in_generic_and_associated_handlers::main();
    steps::main();
    timeout::main();
}
