use idem_runtime::idempotent;

#[idempotent(global)]
struct CreatePayment {
    amount: i64,
}

fn main() {}
