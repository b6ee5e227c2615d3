//! `cargo run --bin pay -- --amount 4200 --currency usd --customer cus_123 [--key-file F]`:
//! one payment, posted to `$PAYMENTS_URL` (default `http://127.0.0.1:3000`) as the tenant
//! `$TENANT` (default `tenant_1`) through idem's client, which retries safely.
//!
//! Prints the payment and whether the answer was a replay, and exits 0 on success; otherwise
//! prints the problem's title and detail and exits 1 (2 when no answer came at all). With
//! `--key-file`, the payment's key is read from the file if it exists (an earlier run that did
//! not get a final answer), written there before the first attempt, and removed after a final
//! answer: run the same command again after a crash, and the payment is made once.
//!
//! With `--grpc`, the payment is `CreatePayment` of `idem.example.v1.Payments` on
//! `$PAYMENTS_GRPC_URL` (default `http://127.0.0.1:50051`), through idem's gRPC caller
//! (`idem_client::grpc`), with the same output and exit codes: 0 for the payment, 1 for a
//! status (its code and message are printed), 2 when no answer came at all. `--key-file` works
//! as over HTTP; a key kept by an HTTP run is not sent over gRPC (another request).

use std::{path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use clap::Parser;
use idem_client::{
    Action, FileKeyStore, IdempotentRetry, KeyReused, KeyStore, RetryPolicy, StoredKey,
    grpc::GrpcRetry, reqwest_middleware::ClientBuilder,
};
use idem_examples::grpc::proto::{CreatePaymentRequest, payments_client::PaymentsClient};
use prost::Message;
use tonic::{metadata::MetadataMap, transport::Endpoint};

/// One payment, retried safely.
#[derive(Debug, Parser)]
#[command(name = "pay")]
struct Args {
    /// The amount, in minor units (4200 is 42.00). A negative or zero amount is sent as it is,
    /// for the service to refuse (400).
    #[arg(long, allow_negative_numbers = true)]
    amount: i64,
    /// The currency (three letters).
    #[arg(long)]
    currency: String,
    /// The customer to charge (`cus_declined` is declined: 402).
    #[arg(long)]
    customer: String,
    /// Keep the payment's key in this file until the payment has a final answer.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Give up after this many seconds of retries.
    #[arg(long, default_value_t = 30)]
    budget_secs: u64,
    /// Pay over gRPC (`CreatePayment` on `$PAYMENTS_GRPC_URL`) instead of HTTP.
    #[arg(long)]
    grpc: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if args.grpc {
        return pay_over_grpc(&args).await;
    }
    let base = std::env::var("PAYMENTS_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".into());
    let tenant = std::env::var("TENANT").unwrap_or_else(|_| "tenant_1".into());
    // The key is forgotten here, once the answer's body is read: a connection cut in the
    // middle of it leaves the key for the next run.
    let mut retry = IdempotentRetry::new(
        RetryPolicy::default().with_budget(Duration::from_secs(args.budget_secs)),
    )
    .with_forget_on_final(false);
    let store: Option<Arc<dyn KeyStore>> = args
        .key_file
        .as_ref()
        .map(|path| Arc::new(FileKeyStore::new(path)) as Arc<dyn KeyStore>);
    if let Some(store) = &store {
        retry = retry.with_shared_store(Arc::clone(store));
    }
    let http = match reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
    {
        Ok(http) => http,
        Err(error) => {
            eprintln!("pay: {error}");
            return ExitCode::FAILURE;
        }
    };
    let client = ClientBuilder::new(http).with(retry).build();
    let mut request = client
        .post(format!("{}/v1/payments", base.trim_end_matches('/')))
        .bearer_auth(&tenant)
        .json(&serde_json::json!({
            "amount": args.amount,
            "currency": args.currency,
            "customer": args.customer,
        }));
    if store.is_some() {
        request = request.with_extension(Action("pay".into()));
    }
    let answer = match request.send().await {
        Ok(answer) => answer,
        Err(error) => {
            if let idem_client::reqwest_middleware::Error::Middleware(cause) = &error
                && cause.downcast_ref::<KeyReused>().is_some()
            {
                eprintln!("pay: {error}");
                return ExitCode::FAILURE;
            }
            eprintln!("pay: no answer: {error}");
            return ExitCode::from(2);
        }
    };
    let replayed = idem_client::replayed(&answer);
    let forget = || {
        if let Some(store) = &store
            && let Err(error) = store.remove("pay")
        {
            eprintln!("pay: the answer is final, but the key file could not be removed: {error}");
        }
    };
    match idem_client::check(answer).await {
        Ok(answer) if !answer.status().is_success() => {
            forget();
            eprintln!("pay: unexpected answer {}", answer.status());
            ExitCode::FAILURE
        }
        Ok(answer) => match answer.json::<serde_json::Value>().await {
            Ok(payment) => {
                forget();
                println!("{payment}");
                println!("replayed: {replayed}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!(
                    "pay: the answer could not be read ({error}); run the same command again: the key is kept"
                );
                ExitCode::FAILURE
            }
        },
        Err(idem_client::Error::Problem { status, problem }) => {
            forget();
            eprintln!(
                "pay: {status} {}: {}",
                problem.title.as_deref().unwrap_or("error"),
                problem.detail.as_deref().unwrap_or("no detail")
            );
            ExitCode::FAILURE
        }
        Err(error @ idem_client::Error::Status { .. }) => {
            forget();
            eprintln!("pay: {error}");
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("pay: {error}; run the same command again: the key is kept");
            ExitCode::FAILURE
        }
    }
}

/// The payment as `CreatePayment`, through [`GrpcRetry`]: one key for all its attempts, kept in
/// the key file (if any) until a final answer.
async fn pay_over_grpc(args: &Args) -> ExitCode {
    let url =
        std::env::var("PAYMENTS_GRPC_URL").unwrap_or_else(|_| "http://127.0.0.1:50051".into());
    let tenant = std::env::var("TENANT").unwrap_or_else(|_| "tenant_1".into());
    let endpoint = match Endpoint::from_shared(url.clone()) {
        // Each attempt is bounded; the budget bounds when the last may start.
        Ok(endpoint) => endpoint
            .timeout(Duration::from_secs(30))
            .connect_timeout(Duration::from_secs(5)),
        Err(error) => {
            eprintln!("pay: PAYMENTS_GRPC_URL={url}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let payments = PaymentsClient::new(endpoint.connect_lazy());
    let mut metadata = MetadataMap::new();
    match format!("Bearer {tenant}").parse() {
        Ok(value) => metadata.insert("authorization", value),
        Err(_) => {
            eprintln!("pay: TENANT must be visible ASCII to be sent as metadata");
            return ExitCode::FAILURE;
        }
    };
    let retry =
        GrpcRetry::new(RetryPolicy::default().with_budget(Duration::from_secs(args.budget_secs)))
            .with_metadata(metadata);
    let message = CreatePaymentRequest {
        amount: args.amount,
        currency: args.currency.clone(),
        customer: args.customer.clone(),
        metadata: Default::default(),
    };
    let mut call = retry.prepare(message.clone());
    let store = args.key_file.as_ref().map(FileKeyStore::new);
    if let Some(store) = &store {
        // The message as it goes on the wire, and where: a key kept for another payment (or
        // for an HTTP one) is never sent with this one.
        let fingerprint = format!(
            "grpc {}/idem.example.v1.Payments/CreatePayment {}",
            url.trim_end_matches('/'),
            message
                .encode_to_vec()
                .iter()
                .map(|byte| format!("{byte:02x}"))
                .collect::<String>()
        );
        let candidate = StoredKey {
            key: call.key().to_owned(),
            fingerprint,
        };
        match store.load_or_save("pay", &candidate) {
            Ok(kept) if kept.fingerprint == candidate.fingerprint => {
                call = match call.with_key(&kept.key) {
                    Ok(call) => call,
                    Err(error) => {
                        eprintln!("pay: the key file holds a key that cannot be sent: {error}");
                        return ExitCode::FAILURE;
                    }
                };
            }
            Ok(_) => {
                eprintln!(
                    "pay: the key kept in the key file was made for another payment (or over \
                     HTTP); a key is never sent with another request: finish or forget that \
                     payment first"
                );
                return ExitCode::FAILURE;
            }
            Err(error) => {
                eprintln!("pay: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    let outcome = call
        .send(|request| {
            let mut payments = payments.clone();
            async move { payments.create_payment(request).await }
        })
        .await;
    let forget = || {
        if let Some(store) = &store
            && let Err(error) = store.remove("pay")
        {
            eprintln!("pay: the answer is final, but the key file could not be removed: {error}");
        }
    };
    match outcome {
        Ok(answer) => {
            forget();
            let replayed = idem_client::grpc::replayed(answer.metadata());
            let payment = answer.into_inner();
            println!(
                "{}",
                serde_json::json!({
                    "id": payment.id,
                    "amount": payment.amount,
                    "currency": payment.currency,
                    "customer": payment.customer,
                    "status": payment.status,
                })
            );
            println!("replayed: {replayed}");
            ExitCode::SUCCESS
        }
        Err(status)
            if idem_client::grpc::retryable(&status)
                && idem_client::grpc::is_transport_error(&status) =>
        {
            eprintln!(
                "pay: no answer: {}; run the same command again: the key is kept",
                status.message()
            );
            ExitCode::from(2)
        }
        Err(status) if idem_client::grpc::retryable(&status) => {
            eprintln!(
                "pay: {:?}: {}; run the same command again: the key is kept",
                status.code(),
                status.message()
            );
            ExitCode::FAILURE
        }
        Err(status) => {
            forget();
            eprintln!("pay: {:?}: {}", status.code(), status.message());
            ExitCode::FAILURE
        }
    }
}
