::core::compile_error! {
    "`#[idempotent]` handlers cannot have lifetime parameters: extractors are owned values, and the transaction's lifetime is written `'_`"
}
::core::compile_error! {
    "`#[idempotent]` handlers cannot return borrowed data: the response outlives the transaction"
}
#[allow(unused, dead_code, non_snake_case)]
pub async fn __idem_refused_create<'a, DB: Backend>(
    tenant: String,
    tx: &mut Transaction<'a, DB>,
) -> &'a str
where
    DB: Send,
{
    let _ = (tenant, tx);
    ""
}
#[allow(unused, dead_code)]
pub async fn create<DB: Backend>() -> ::idem_runtime::__private::Response
where
    DB: Send,
{
    ::core::unreachable!("`#[idempotent]` refused this handler at compile time")
}
