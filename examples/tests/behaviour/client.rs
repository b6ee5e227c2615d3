//! idem's client (`idem-client`) against the example's payments service, through a proxy that
//! drops connections after forwarding, answers 503, 409 and 429 with `Retry-After`, or delays:
//! each logical request makes exactly one payment whatever the proxy does; final answers are not
//! retried; the time budget holds; a key file outlives a killed `pay` process; a key never goes
//! with another body. On every database.

use crate::service;

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use idem_client::{
    Action, Attempt, FileKeyStore, IdempotencyKey, IdempotentRetry, RetryPolicy,
    reqwest_middleware::{ClientBuilder, ClientWithMiddleware},
};
use idem_tests::{App, Fault, FaultProxy, backend_tests};
use reqwest::StatusCode;
use serde_json::{Value, json};

/// A middleware inside the retrying one: notes when each attempt started, as the retrying
/// middleware dated it ([`Attempt`]) with the clock reading its budget check used, so that no
/// scheduling delay between that check and this middleware counts.
#[derive(Clone, Default)]
struct Attempts(std::sync::Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>);

#[async_trait::async_trait]
impl idem_client::reqwest_middleware::Middleware for Attempts {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut http::Extensions,
        next: idem_client::reqwest_middleware::Next<'_>,
    ) -> idem_client::reqwest_middleware::Result<reqwest::Response> {
        let attempt = extensions
            .get::<Attempt>()
            .copied()
            .expect("the retrying middleware dates each attempt");
        self.0.lock().unwrap().push(attempt.started);
        next.run(request, extensions).await
    }
}

/// Retries that come quickly: the tests wait for outcomes, not for backoffs.
fn quick() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(10)
        .with_backoff(Duration::from_millis(5), Duration::from_millis(50))
}

fn client(policy: RetryPolicy) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(IdempotentRetry::new(policy))
        .build()
}

async fn proxied(app: &App) -> FaultProxy {
    FaultProxy::start(format!("http://{}", app.serve().await)).await
}

async fn pay(client: &ClientWithMiddleware, proxy: &FaultProxy, body: &Value) -> reqwest::Response {
    client
        .post(format!("{}/v1/payments", proxy.url()))
        .bearer_auth("t1")
        .json(body)
        .send()
        .await
        .expect("an answer")
}

async fn payments(app: &App) -> i64 {
    app.count("payments").await
}

backend_tests! {
    async fn every_logical_request_makes_one_payment_whatever_the_proxy_does(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        let client = client(quick());
        let faults = [
            vec![Fault::DropAfterForward],
            vec![Fault::Answer(503, None), Fault::DropAfterForward],
            vec![Fault::Answer(409, Some(0)), Fault::Answer(429, Some(0))],
            vec![Fault::DropAfterForward, Fault::DropAfterForward, Fault::Delay(Duration::from_millis(50))],
            vec![],
        ];
        let mut keys = Vec::new();
        for (n, script) in faults.iter().enumerate() {
            let before = proxy.seen().len();
            proxy.script(script.clone());
            let answer = pay(&client, &proxy, &json!({"amount": 100 + n, "currency": "EUR", "customer": "cus_1"})).await;
            assert_eq!(answer.status(), StatusCode::CREATED, "logical request {n}");
            let seen = &proxy.seen()[before..];
            // Every fault is met; a delay is a slow success, anything else is followed by another
            // attempt.
            let attempts = script.iter().filter(|f| !matches!(f, Fault::Delay(_))).count() + 1;
            assert_eq!(seen.len(), attempts, "every fault met, then one success");
            let key = seen[0].key.clone().expect("a key");
            assert!(seen.iter().all(|s| s.key.as_ref() == Some(&key)), "one key for every attempt");
            let replayed = idem_client::replayed(&answer);
            let forwarded_before = script.iter().any(|f| matches!(f, Fault::DropAfterForward));
            assert_eq!(replayed, forwarded_before, "a replay exactly when an earlier attempt reached the service");
            keys.push(key);
        }
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), faults.len(), "each logical request has its own key");
        assert_eq!(payments(&app).await, faults.len() as i64, "one payment per logical request");
    }

    async fn final_answers_are_not_retried(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        let client = client(quick());
        // 402: declined, final and stored.
        let declined = pay(&client, &proxy, &json!({"amount": 100, "currency": "EUR", "customer": "cus_declined"})).await;
        assert_eq!(declined.status(), StatusCode::PAYMENT_REQUIRED);
        // 400: a value the handler refuses.
        let invalid = pay(&client, &proxy, &json!({"amount": -1, "currency": "EUR", "customer": "cus_1"})).await;
        assert_eq!(invalid.status(), StatusCode::BAD_REQUEST);
        // 422: the same key with another body.
        for amount in [100, 200] {
            let answer = client
                .post(format!("{}/v1/payments", proxy.url()))
                .bearer_auth("t1")
                .json(&json!({"amount": amount, "currency": "EUR", "customer": "cus_1"}))
                .with_extension(IdempotencyKey("chosen-key".into()))
                .send()
                .await
                .expect("an answer");
            let expected = if amount == 100 { StatusCode::CREATED } else { StatusCode::UNPROCESSABLE_ENTITY };
            assert_eq!(answer.status(), expected);
            if amount == 200 {
                let Err(idem_client::Error::Problem { status, problem }) = idem_client::check(answer).await else {
                    panic!("a 422 problem");
                };
                assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
                assert!(problem.title.is_some(), "the problem's title is read: {problem:?}");
            }
        }
        assert_eq!(proxy.seen().len(), 4, "one attempt each");
    }

    async fn the_time_budget_holds(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        proxy.otherwise(Fault::Answer(503, None));
        let budget = Duration::from_millis(400);
        let attempts = Attempts::default();
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(IdempotentRetry::new(
                RetryPolicy::default()
                    .with_max_attempts(1000)
                    .with_budget(budget)
                    .with_backoff(Duration::from_millis(20), Duration::from_millis(100)),
            ))
            .with(attempts.clone())
            .build();
        let answer = client
            .post(format!("{}/v1/payments", proxy.url()))
            .bearer_auth("t1")
            .json(&json!({"amount": 100, "currency": "EUR", "customer": "cus_1"}))
            .send()
            .await;
        if let Ok(answer) = &answer {
            assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE, "the last answer");
        }
        let started = attempts.0.lock().unwrap().clone();
        assert!(started.len() >= 2, "it retried: {} attempts", started.len());
        let last = *started.last().expect("attempts") - started[0];
        assert!(last <= budget, "an attempt started {last:?} after the first, past the {budget:?} budget");
        assert_eq!(payments(&app).await, 0);
    }

    async fn retry_after_is_honoured(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        proxy.script([Fault::Answer(429, Some(1))]);
        let answer = pay(&client(quick()), &proxy, &json!({"amount": 100, "currency": "EUR", "customer": "cus_1"})).await;
        assert_eq!(answer.status(), StatusCode::CREATED);
        let seen = proxy.seen();
        assert_eq!(seen.len(), 2);
        let waited = seen[1].at - seen[0].at;
        assert!(waited >= Duration::from_secs(1), "the retry came {waited:?} after a Retry-After of 1 s");
    }

    async fn a_key_never_goes_with_another_body(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = dir.path().join("keys.json");
        // An action whose first attempt got no answer keeps its key in the store...
        proxy.script([Fault::DropAfterForward]);
        let keeping = ClientBuilder::new(reqwest::Client::new())
            .with(IdempotentRetry::new(quick().with_max_attempts(1)).with_store(FileKeyStore::new(&store)))
            .build();
        let first = keeping
            .post(format!("{}/v1/payments", proxy.url()))
            .bearer_auth("t1")
            .json(&json!({"amount": 100, "currency": "EUR", "customer": "cus_1"}))
            .with_extension(Action("pay".into()))
            .send()
            .await;
        assert!(first.is_err(), "no answer on the only attempt");
        assert!(store.exists(), "the key is kept");
        // ...and the same action with another body is refused before anything is sent.
        let sent = proxy.seen().len();
        let other = keeping
            .post(format!("{}/v1/payments", proxy.url()))
            .bearer_auth("t1")
            .json(&json!({"amount": 999, "currency": "EUR", "customer": "cus_1"}))
            .with_extension(Action("pay".into()))
            .send()
            .await;
        let Err(error) = other else { panic!("refused") };
        assert!(error.to_string().contains("another request"), "{error}");
        assert_eq!(proxy.seen().len(), sent, "nothing was sent");
        // Two logical requests with different bodies never share a key.
        let plain = client(quick());
        pay(&plain, &proxy, &json!({"amount": 1, "currency": "EUR", "customer": "cus_1"})).await;
        pay(&plain, &proxy, &json!({"amount": 2, "currency": "EUR", "customer": "cus_1"})).await;
        let seen = proxy.seen();
        let n = seen.len();
        assert_ne!(seen[n - 1].key, seen[n - 2].key);
    }

    async fn a_key_file_outlives_a_killed_pay_and_the_rerun_replays(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let key_file = dir.path().join("pay.key");
        // The payment is made, and its answer never comes: the process is killed waiting.
        proxy.script([Fault::Hang]);
        let mut killed = pay_command(proxy.url(), &key_file, "cus_1").spawn().expect("start pay");
        idem_tests::wait_until("the payment to reach the service", || {
            let forwarded = proxy.forwarded();
            async move { forwarded == 1 }
        }).await;
        assert!(key_file.exists(), "the key was written before the first attempt");
        killed.kill().expect("SIGKILL pay");
        killed.wait().expect("reap");
        assert_eq!(payments(&app).await, 1);

        let rerun = run(pay_command(proxy.url(), &key_file, "cus_1")).await;
        assert!(rerun.status.success(), "{}", String::from_utf8_lossy(&rerun.stderr));
        let stdout = String::from_utf8_lossy(&rerun.stdout);
        assert!(stdout.contains("replayed: true"), "{stdout}");
        assert!(!key_file.exists(), "removed after the final answer");
        assert_eq!(payments(&app).await, 1, "one payment");
        let keys: Vec<_> = proxy.seen().into_iter().map(|s| s.key).collect();
        assert_eq!(keys[0], keys[1], "the rerun sent the kept key");
    }

    async fn pay_prints_the_problem_and_fails_on_a_final_error(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let key_file = dir.path().join("pay.key");
        let output = run(pay_command(proxy.url(), &key_file, "cus_declined")).await;
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("402"), "{stderr}");
        assert!(!key_file.exists(), "a final answer ends the action");
    }

    async fn pay_sends_a_negative_amount_for_the_service_to_refuse_with_400(db) {
        let app = service::app(db).await;
        let proxy = proxied(&app).await;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let key_file = dir.path().join("pay.key");
        let output = run(pay_command_for(proxy.url(), &key_file, "cus_1", "-5")).await;
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("400"), "the service's answer, not clap's: {stderr}");
        assert_eq!(proxy.forwarded(), 1, "the request reached the service");
        assert_eq!(payments(&app).await, 0);
    }
}

/// Runs `command` to its end off the test's runtime, whose thread serves the service and the
/// proxy meanwhile.
async fn run(mut command: Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || command.output().expect("run pay"))
        .await
        .expect("the blocking task")
}

/// `pay` against `url` with a key file, for `customer`.
fn pay_command(url: &str, key_file: &std::path::Path, customer: &str) -> Command {
    pay_command_for(url, key_file, customer, "4200")
}

/// `pay` against `url` with a key file, for `customer`, of `amount` as typed on the command line.
fn pay_command_for(url: &str, key_file: &std::path::Path, customer: &str, amount: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_pay"));
    command
        .env("PAYMENTS_URL", url)
        .env("TENANT", "t1")
        .args(["--amount", amount, "--currency", "usd", "--key-file"])
        .arg(key_file)
        .args(["--customer", customer])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}
