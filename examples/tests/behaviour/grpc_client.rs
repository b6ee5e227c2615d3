//! idem's gRPC caller (`idem_client::grpc`) over real gRPC (HTTP/2 on sockets): against the
//! example's service in a process of its own, through a proxy that drops answers after the
//! service gave them, and while a duplicate is still running; against a small tonic server of
//! the test that answers as it is told, to count attempts and read the waits asked; and `pay
//! --grpc`. Each logical call sends one key, retried until an answer, and makes one payment.
//!
//! The tests against the example's service run on PostgreSQL, SQLite and MySQL; the caller's
//! rules against the test's own server do not depend on a store.

use std::{
    collections::VecDeque,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::support::{
    Database, Process, free_addr, on_every_database, spawn_payments_with, wait_until,
};

use idem_client::{
    Attempt, RetryPolicy,
    grpc::{GrpcRetry, is_transport_error, replayed},
};
use idem_examples::grpc::proto::{
    CreatePaymentRequest, GetPaymentRequest, Payment,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use idem_tests::AnswerDropper;
use tonic::{
    Code, Request, Response, Status,
    metadata::MetadataMap,
    transport::{Channel, Endpoint},
};

on_every_database!(
    answers_dropped_after_the_service_ran_are_retried_with_the_same_key_and_pay_once,
    a_first_attempt_that_meets_its_duplicate_running_is_retried_after_the_pushback,
    pay_over_grpc_pays_replays_after_a_lost_answer_and_says_why_it_fails,
);

/// Retries that come quickly: the tests wait for outcomes, not for backoffs.
fn quick() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(10)
        .with_backoff(Duration::from_millis(5), Duration::from_millis(50))
}

/// Backoffs of at most a millisecond: the wait before a retry is the server's, to the
/// millisecond, when it asks for one.
fn asked_waits_only() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(10)
        .with_budget(Duration::from_secs(10))
        .with_backoff(Duration::from_millis(1), Duration::from_millis(1))
}

fn authorized(tenant: &str) -> MetadataMap {
    let mut metadata = MetadataMap::new();
    metadata.insert("authorization", format!("Bearer {tenant}").parse().unwrap());
    metadata
}

fn payment(amount: i64, customer: &str) -> CreatePaymentRequest {
    CreatePaymentRequest {
        amount,
        currency: "usd".to_owned(),
        customer: customer.to_owned(),
        metadata: Default::default(),
    }
}

/// A channel to `url` that connects on first use, and again after a connection is lost.
fn channel(url: &str) -> Channel {
    Endpoint::from_shared(url.to_owned())
        .expect("a URI")
        .timeout(Duration::from_secs(30))
        .connect_lazy()
}

/// One attempt as the caller's closure saw it: its key, its [`Attempt`], and its outcome.
#[derive(Debug, Clone)]
struct Sent {
    key: String,
    attempt: Attempt,
    outcome: Result<(), (Code, bool)>,
}

/// The attempts of the calls made through [`pay`].
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<Sent>>>);

impl Log {
    fn sent(&self) -> Vec<Sent> {
        self.0.lock().unwrap().clone()
    }
}

/// `CreatePayment` of `message` as one logical call through `retry`, on `channel`, each attempt
/// noted in `log`.
async fn pay(
    retry: &GrpcRetry,
    channel: &Channel,
    message: CreatePaymentRequest,
    key: Option<&str>,
    log: &Log,
) -> Result<Response<Payment>, Status> {
    let mut call = retry.prepare(message);
    if let Some(key) = key {
        call = call.with_key(key).expect("a valid key");
    }
    call.send(|request| {
        let key = request
            .metadata()
            .get("idempotency-key")
            .expect("every attempt carries the key")
            .to_str()
            .unwrap()
            .to_owned();
        let attempt = *request
            .extensions()
            .get::<Attempt>()
            .expect("every attempt is numbered");
        let mut client = PaymentsClient::new(channel.clone());
        let log = log.clone();
        async move {
            let outcome = client.create_payment(request).await;
            log.0.lock().unwrap().push(Sent {
                key,
                attempt,
                outcome: outcome
                    .as_ref()
                    .map(|_| ())
                    .map_err(|status| (status.code(), is_transport_error(status))),
            });
            outcome
        }
    })
    .await
}

/// The example's payments service in a process of its own.
struct Service {
    _process: Process,
    grpc: String,
    database: Database,
}

impl Service {
    async fn start(database: Database) -> Self {
        let grpc = free_addr();
        let (process, _) =
            spawn_payments_with(&database, "http://127.0.0.1:9", &[("GRPC_ADDR", &grpc)]);
        wait_until(&format!("the gRPC service at {grpc} to accept"), || async {
            tokio::net::TcpStream::connect(&grpc).await.is_ok()
        })
        .await;
        Self {
            _process: process,
            grpc,
            database,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

async fn answers_dropped_after_the_service_ran_are_retried_with_the_same_key_and_pay_once(
    database: Database,
) {
    let service = Service::start(database).await;
    let proxy = AnswerDropper::start(service.grpc.clone()).await;
    let channel = channel(proxy.url());
    let retry = GrpcRetry::new(quick()).with_metadata(authorized("t1"));
    let log = Log::default();
    // The service runs the payment; its answer, and the replays of the next attempt, are lost.
    proxy.drop_next(2);
    let answer = pay(&retry, &channel, payment(4200, "cus_1"), None, &log)
        .await
        .expect("the payment, at last");
    assert!(
        replayed(answer.metadata()),
        "the payment was made once, then replayed"
    );
    let paid = answer.into_inner();
    let sent = log.sent();
    assert_eq!(sent.len(), 3, "two answers dropped, then one: {sent:?}");
    let key = &sent[0].key;
    assert!(
        sent.iter().all(|s| &s.key == key),
        "one key for every attempt: {sent:?}"
    );
    for lost in &sent[..2] {
        // tonic says UNKNOWN (hyper: the connection closed before the message completed), a
        // code retried for its transport source only.
        assert!(
            matches!(lost.outcome, Err((_, true))),
            "a dropped answer is a transport failure: {lost:?}"
        );
    }
    assert_eq!(
        sent.iter().map(|s| s.attempt.number).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!((proxy.dropped(), proxy.passed()), (2, 1));
    assert_eq!(service.database.count("payments").await, 1, "one payment");
    assert_eq!(service.database.count("idem_keys").await, 1, "one key");
    // The payment is the one stored.
    let mut read = Request::new(GetPaymentRequest {
        id: paid.id.clone(),
    });
    *read.metadata_mut() = authorized("t1");
    let stored = PaymentsClient::new(channel.clone())
        .get_payment(read)
        .await
        .expect("read the payment")
        .into_inner();
    assert_eq!(stored, paid);

    // The next logical call has a key of its own, and pays again.
    let answer = pay(&retry, &channel, payment(4200, "cus_1"), None, &log)
        .await
        .expect("another payment");
    assert!(!replayed(answer.metadata()));
    let sent = log.sent();
    assert_eq!(sent.len(), 4);
    assert_ne!(&sent[3].key, key, "a new logical call, a new key");
    assert_eq!(service.database.count("payments").await, 2);
}

async fn a_first_attempt_that_meets_its_duplicate_running_is_retried_after_the_pushback(
    database: Database,
) {
    let service = Service::start(database).await;
    let channel = channel(&service.url());
    // Another client's attempt of the same call (same key, same message) is running: the
    // payment of `cus_slow` takes a second.
    let first = {
        let mut client = PaymentsClient::new(channel.clone());
        tokio::spawn(async move {
            let mut request = Request::new(payment(100, "cus_slow"));
            *request.metadata_mut() = authorized("t1");
            request
                .metadata_mut()
                .insert("idempotency-key", "k1".parse().unwrap());
            client.create_payment(request).await
        })
    };
    crate::grpc::writing_a_payment(&service.database).await;
    let retry = GrpcRetry::new(quick()).with_metadata(authorized("t1"));
    let log = Log::default();
    let answer = pay(&retry, &channel, payment(100, "cus_slow"), Some("k1"), &log)
        .await
        .expect("the first attempt's payment");
    let sent = log.sent();
    assert_eq!(
        sent[0].outcome,
        Err((Code::Aborted, false)),
        "the duplicate was running: {sent:?}"
    );
    assert_eq!(
        sent[1].attempt.waited,
        Duration::from_millis(1000),
        "the server's pushback, longer than any backoff of the policy"
    );
    assert!(sent.iter().all(|s| s.key == "k1"), "{sent:?}");
    assert!(replayed(answer.metadata()));
    let first = first.await.unwrap().expect("the first payment");
    assert_eq!(answer.into_inner(), first.into_inner());
    assert_eq!(service.database.count("payments").await, 1);
}

/// What the test's server answers to one call.
#[derive(Debug, Clone)]
enum Reply {
    /// A payment.
    Pay,
    /// A status, with metadata.
    Fail(Code, Vec<(&'static str, &'static str)>),
}

/// A payments server of the test's: answers each `CreatePayment` with the next [`Reply`] of
/// its script (a payment once it is used up), and notes each call's key.
#[derive(Clone, Default)]
struct Scripted {
    script: Arc<Mutex<VecDeque<Reply>>>,
    keys: Arc<Mutex<Vec<Option<String>>>>,
}

#[tonic::async_trait]
impl Payments for Scripted {
    async fn create_payment(
        &self,
        request: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let key = request
            .metadata()
            .get("idempotency-key")
            .map(|key| key.to_str().unwrap().to_owned());
        self.keys.lock().unwrap().push(key);
        let reply = self.script.lock().unwrap().pop_front();
        match reply.unwrap_or(Reply::Pay) {
            Reply::Pay => {
                let message = request.into_inner();
                Ok(Response::new(Payment {
                    id: "pay_1".to_owned(),
                    amount: message.amount,
                    currency: message.currency,
                    customer: message.customer,
                    status: "succeeded".to_owned(),
                }))
            }
            Reply::Fail(code, metadata) => {
                let mut map = MetadataMap::new();
                for (name, value) in metadata {
                    map.insert(name, value.parse().unwrap());
                }
                Err(Status::with_metadata(code, "as scripted", map))
            }
        }
    }

    async fn get_payment(
        &self,
        _request: Request<GetPaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

impl Scripted {
    /// Serves on a loopback port; returns its URL.
    async fn serve(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tonic::transport::Server::builder()
            .add_service(PaymentsServer::new(self.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
        tokio::spawn(server);
        url
    }

    fn script(&self, replies: impl IntoIterator<Item = Reply>) {
        self.script.lock().unwrap().extend(replies);
    }

    /// The keys of the calls received so far, and forgets them.
    fn take_keys(&self) -> Vec<Option<String>> {
        std::mem::take(&mut *self.keys.lock().unwrap())
    }
}

#[tokio::test]
async fn final_statuses_are_never_retried_aborted_and_unavailable_are() {
    let server = Scripted::default();
    let channel = channel(&server.serve().await);
    let retry = GrpcRetry::new(quick());
    let log = Log::default();
    // A wait asked with a final status changes nothing: it is final.
    let asked = vec![("retry-after", "0"), ("grpc-retry-pushback-ms", "0")];
    for code in [
        Code::InvalidArgument,
        Code::FailedPrecondition,
        Code::NotFound,
        Code::Unauthenticated,
        Code::PermissionDenied,
        Code::Internal,
        Code::Unknown,
        Code::DeadlineExceeded,
        Code::ResourceExhausted,
    ] {
        server.script([Reply::Fail(code, asked.clone())]);
        let status = pay(&retry, &channel, payment(100, "cus_1"), None, &log)
            .await
            .expect_err("the scripted status");
        assert_eq!(status.code(), code);
        assert_eq!(server.take_keys().len(), 1, "{code:?} was sent once");
    }
    server.script([
        Reply::Fail(Code::Aborted, vec![]),
        Reply::Fail(Code::Unavailable, vec![]),
        Reply::Fail(Code::Aborted, asked.clone()),
    ]);
    pay(&retry, &channel, payment(100, "cus_1"), None, &log)
        .await
        .expect("the payment after three retries");
    let keys = server.take_keys();
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert!(
        keys[0].is_some() && keys.iter().all(|key| key == &keys[0]),
        "{keys:?}"
    );
}

#[tokio::test]
async fn the_pushback_is_waited_first_then_retry_after_and_a_pushback_that_is_no_wait_stops() {
    let server = Scripted::default();
    let channel = channel(&server.serve().await);
    let retry = GrpcRetry::new(asked_waits_only());
    let log = Log::default();
    server.script([
        // Both: the pushback wins (60 s would be past the budget: no retry at all).
        Reply::Fail(
            Code::Aborted,
            vec![("grpc-retry-pushback-ms", "300"), ("retry-after", "60")],
        ),
        // `retry-after` alone.
        Reply::Fail(Code::Unavailable, vec![("retry-after", "1")]),
    ]);
    pay(&retry, &channel, payment(100, "cus_1"), None, &log)
        .await
        .expect("the payment");
    let waited: Vec<_> = log.sent().iter().map(|s| s.attempt.waited).collect();
    assert_eq!(
        waited,
        [
            Duration::ZERO,
            Duration::from_millis(300),
            Duration::from_secs(1)
        ]
    );
    assert_eq!(server.take_keys().len(), 3);

    // gRFC A6: a pushback that is not a non-negative number says "do not retry".
    server.script([Reply::Fail(
        Code::Unavailable,
        vec![("grpc-retry-pushback-ms", "-1")],
    )]);
    let status = pay(&retry, &channel, payment(100, "cus_1"), None, &log)
        .await
        .expect_err("no retry");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.take_keys().len(), 1);

    // A wait that would end past the budget is not made: the status is the answer.
    server.script([Reply::Fail(
        Code::Unavailable,
        vec![("grpc-retry-pushback-ms", "60000")],
    )]);
    let status = pay(&retry, &channel, payment(100, "cus_1"), None, &log)
        .await
        .expect_err("no retry");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.take_keys().len(), 1);
}

#[tokio::test]
async fn a_server_that_cannot_be_reached_is_retried_until_the_attempts_run_out() {
    // A reserved port nobody listens on: each connection is refused.
    let channel = channel(&format!("http://{}", free_addr()));
    let retry = GrpcRetry::new(quick().with_max_attempts(3));
    let log = Log::default();
    let status = pay(&retry, &channel, payment(100, "cus_1"), None, &log)
        .await
        .expect_err("no server");
    assert!(is_transport_error(&status), "{status:?}");
    let sent = log.sent();
    assert_eq!(sent.len(), 3, "{sent:?}");
    assert!(sent.iter().all(|s| s.key == sent[0].key));
}

async fn pay_over_grpc_pays_replays_after_a_lost_answer_and_says_why_it_fails(database: Database) {
    let service = Service::start(database).await;
    let proxy = AnswerDropper::start(service.grpc.clone()).await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let key_file = dir.path().join("pay.key");
    // Every answer lost for a second of retries: no answer at all (2), the key kept.
    proxy.drop_next(1000);
    let lost = run(pay_grpc(proxy.url(), "cus_1", Some(&key_file), 1)).await;
    assert_eq!(lost.status.code(), Some(2), "{}", stderr(&lost));
    assert!(stderr(&lost).contains("no answer"), "{}", stderr(&lost));
    assert!(key_file.exists(), "the key is kept for the next run");
    assert!(proxy.dropped() >= 1);
    assert_eq!(
        service.database.count("payments").await,
        1,
        "the service paid"
    );
    // The same command again, answers passed: the payment comes back as a replay.
    proxy.pass_all();
    let rerun = run(pay_grpc(proxy.url(), "cus_1", Some(&key_file), 30)).await;
    assert!(rerun.status.success(), "{}", stderr(&rerun));
    let stdout = String::from_utf8_lossy(&rerun.stdout);
    assert!(stdout.contains("replayed: true"), "{stdout}");
    assert!(stdout.contains("\"status\":\"succeeded\""), "{stdout}");
    assert!(!key_file.exists(), "removed after the final answer");
    assert_eq!(service.database.count("payments").await, 1, "one payment");
    // A declined payment is a final status: 1, the code said.
    let declined = run(pay_grpc(&service.url(), "cus_declined", None, 30)).await;
    assert_eq!(declined.status.code(), Some(1));
    assert!(
        stderr(&declined).contains("FailedPrecondition"),
        "{}",
        stderr(&declined)
    );
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs `command` to its end off the test's runtime.
async fn run(mut command: Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || command.output().expect("run pay"))
        .await
        .expect("the blocking task")
}

/// `pay --grpc` against `url` for `customer`, with a key file if given, giving up after
/// `budget_secs` of retries.
fn pay_grpc(
    url: &str,
    customer: &str,
    key_file: Option<&std::path::Path>,
    budget_secs: u64,
) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_pay"));
    command
        .env("PAYMENTS_GRPC_URL", url)
        .env("TENANT", "t1")
        .args(["--grpc", "--amount", "4200", "--currency", "usd"])
        .args(["--customer", customer])
        .args(["--budget-secs", &budget_secs.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(key_file) = key_file {
        command.arg("--key-file").arg(key_file);
    }
    command
}
