::core::compile_error! {
    "missing `scope`: name the parameter that identifies the caller, e.g. `#[idempotent(scope = \"tenant\")]`, or write `#[idempotent(global)]` to share keys between all callers"
}
#[allow(unused, dead_code, non_snake_case)]
async fn __idem_refused_create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
    let _ = (tenant, tx);
}
#[allow(unused, dead_code)]
async fn create() -> ::idem_runtime::__private::Response {
    ::core::unreachable!("`#[idempotent]` refused this handler at compile time")
}
