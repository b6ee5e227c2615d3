//! The in-process card network that payments and payouts consult: it reacts to magic customer
//! ids, the way Stripe's test mode does.

use std::time::Duration;

/// The processor's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The money moved.
    Approved,
    /// A final business refusal (`cus_declined`).
    Declined,
    /// The processor is down (`cus_unavailable`).
    Unavailable,
}

/// Asks the processor about a charge or payout for `customer`.
pub async fn decide(customer: &str) -> Decision {
    match customer {
        "cus_declined" => Decision::Declined,
        "cus_unavailable" => Decision::Unavailable,
        "cus_slow" => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Decision::Approved
        }
        "cus_slower" => {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Decision::Approved
        }
        _ => Decision::Approved,
    }
}
