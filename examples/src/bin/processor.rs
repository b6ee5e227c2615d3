//! `cargo run --bin processor`: the simulated card processor the README describes, on
//! `$PROCESSOR_ADDR` (default `127.0.0.1:3001`).
//!
//! With `$WEBHOOK_URL` set (e.g. `http://127.0.0.1:3000/v1/webhooks/processor`, the payments
//! service's receiver), it sends a webhook of what it settles, signed as Standard Webhooks v1
//! specifies with `$WEBHOOK_SECRET` (`whsec_<base64 of the key>`, default the payments
//! service's default): `balance.credited` for each charge it executes for a tenant (an order's
//! charge credits the ordering tenant's balance, `GET /v1/balance`), `refund.succeeded` for each
//! refund (which the payments service acknowledges and ignores). A delivery that gets no 2xx is
//! made again, under the same `webhook-id`, after a pause that doubles (100 ms up to 5 s, 8
//! attempts). `WEBHOOK_DELIVER_TWICE=1` delivers each event once more after its first 2xx, on
//! purpose: the payments service replays its answer (`Idempotent-Replayed: true`) and credits
//! once. `GET /v1/webhooks/deliveries` lists each webhook with its attempts' statuses. Without
//! `$WEBHOOK_URL` it sends none. A malformed `$WEBHOOK_SECRET` or `$WEBHOOK_DELIVER_TWICE`
//! stops it at start, naming the variable.

use std::process::ExitCode;

use idem_examples::processor_webhooks::WebhookSender;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().init();
    let webhooks = match WebhookSender::from_env() {
        Ok(webhooks) => webhooks,
        Err(error) => {
            eprintln!("processor: {error}");
            return ExitCode::FAILURE;
        }
    };
    let addr = std::env::var("PROCESSOR_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".to_owned());
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("processor: cannot listen on {addr}: {error}");
            return ExitCode::FAILURE;
        }
    };
    if webhooks.is_on() {
        tracing::info!("sending webhooks (WEBHOOK_URL)");
    }
    tracing::info!(%addr, "processor listening");
    match axum::serve(listener, idem_examples::processor::router_with(webhooks)).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("processor: {error}");
            ExitCode::FAILURE
        }
    }
}
