#[allow(unused)]
struct CreatePayment {
    amount: i64,
}
::core::compile_error! {
    "`#[idempotent]` applies to an `async fn` handler"
}
