::core::compile_error! {
    "invalid duration `1.5h`: fractions are not supported; use a smaller unit, e.g. \"90m\" for 1.5 hours"
}
::core::compile_error! {
    "expected `true` or `false`, e.g. `replay_5xx = true`"
}
::core::compile_error! {
    "`#[idempotent]` handlers must be `async fn`: the macro awaits the claim and the commit"
}
::core::compile_error! {
    "`create` has no transaction parameter: add `tx: &mut sqlx::Transaction<'_, DB>` so that its writes commit together with its key, or, if its side effect is outside the database, write `external` in the attribute (`#[idempotent(external, ...)]`): the key is then claimed with a lease before the body runs"
}
::core::compile_error! {
    "`Json` consumes the request body, so it must be the last extractor of the handler"
}
#[allow(unused, dead_code, non_snake_case)]
fn __idem_refused_create(Json(body): Json<serde_json::Value>, tenant: String) {
    let _ = (body, tenant);
}
#[allow(unused, dead_code)]
async fn create() -> ::idem_runtime::__private::Response {
    ::core::unreachable!("`#[idempotent]` refused this handler at compile time")
}
