//! `#[idempotent]` tonic methods over real gRPC (a tonic server on a loopback socket), on
//! PostgreSQL, SQLite and MySQL: in external mode and in steps, a side effect made once, a call
//! in flight answered `ABORTED`, a retry that resumes after its last recorded step; a method's
//! own status stored or not by its code and `replay_5xx`; a store that cannot be reached; and a
//! gRPC key as the background tasks and the `idem` command's queries see it (purged, released by
//! the recovery, parked and abandoned). (The example's transactional service is tested in its
//! own process: `examples/tests/behaviour/grpc.rs`.)

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use idem_runtime::{
    Backend, IdempotencyContext, Steps, Store,
    admin::Unparked,
    idempotent,
    tasks::{
        AbandonedClaim, PurgeOptions, RecoveryHook, RecoveryOptions, ReleaseAbandoned, Verdict,
    },
};
use idem_tests::{App, Db, wait_until};
use sqlx::{MySql, Postgres, Sqlite, Transaction};
use tonic::{Code, Request, Response, Status, transport::Channel};

/// The code tonic-prost-build generated from `proto/idem/test/v1/jobs.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
mod proto {
    tonic::include_proto!("idem.test.v1");
}

use proto::{
    CreateJob, Job, Receipt,
    jobs_client::JobsClient,
    jobs_server::{Jobs, JobsServer},
};

/// What the methods share with the test.
#[derive(Default)]
struct Counters {
    /// Calls to the "other system" of `Send`.
    sent: AtomicU64,
    /// Runs of `Ship`'s `reserve` step, and of its `ship` step.
    reserved: AtomicU64,
    shipped: AtomicU64,
    /// Attempts at `Ship`.
    ship_attempts: AtomicU64,
    /// Runs of `Answer` and `AnswerKept`.
    answered: AtomicU64,
    /// Runs of `Create`.
    created: AtomicU64,
}

struct JobsApi<DB: Backend> {
    store: Store<DB>,
    counters: Arc<Counters>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl<DB: Backend> axum::extract::FromRef<JobsApi<DB>> for Store<DB> {
    fn from_ref(api: &JobsApi<DB>) -> Self {
        api.store.clone()
    }
}

#[idem_runtime::grpc]
#[tonic::async_trait]
impl<DB: Backend> Jobs for JobsApi<DB> {
    #[idempotent(global, external, lease = "30s", backend = DB)]
    async fn send(
        &self,
        ctx: IdempotencyContext,
        request: Request<Job>,
    ) -> Result<Response<Receipt>, Status> {
        let job = request.into_inner();
        let _downstream_key = ctx.derive("send");
        let calls = self.counters.sent.fetch_add(1, Ordering::SeqCst) + 1;
        if job.name == "gated" {
            let _permit = self.gate.acquire().await.expect("the gate stays open");
        }
        let mut response = Response::new(Receipt {
            name: job.name,
            calls,
        });
        // The method's own metadata, which the first answer carries and a replay does not.
        response
            .metadata_mut()
            .insert("x-receipt", "first".parse().expect("a value"));
        Ok(response)
    }

    #[idempotent(global, external, lease = "30s")]
    async fn ship(
        &self,
        steps: Steps<DB>,
        request: Request<Job>,
    ) -> Result<Response<Receipt>, Status> {
        let job = request.into_inner();
        let attempt = self.counters.ship_attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let counters = &self.counters;
        let reserved: u64 = steps
            .call("reserve", async |_key| {
                Ok::<_, Status>(counters.reserved.fetch_add(1, Ordering::SeqCst) + 1)
            })
            .await?;
        if job.fail_after_reserve && attempt == 1 {
            return Err(Status::unavailable("the carrier did not answer"));
        }
        let shipped: u64 = steps
            .call("ship", async |_key| {
                Ok::<_, Status>(counters.shipped.fetch_add(1, Ordering::SeqCst) + 1)
            })
            .await?;
        Ok(Response::new(Receipt {
            name: job.name,
            calls: reserved * 100 + shipped,
        }))
    }

    #[idempotent(global)]
    async fn answer(
        &self,
        tx: &mut Transaction<'_, DB>,
        request: Request<Job>,
    ) -> Result<Response<Receipt>, Status> {
        answer_with_its_code(&self.counters, tx, request.into_inner())
    }

    #[idempotent(global, replay_5xx = true)]
    async fn answer_kept(
        &self,
        tx: &mut Transaction<'_, DB>,
        request: Request<Job>,
    ) -> Result<Response<Receipt>, Status> {
        answer_with_its_code(&self.counters, tx, request.into_inner())
    }

    #[idempotent(global, rpc = "GetHTTPReceipt")]
    async fn get_http_receipt(
        &self,
        tx: &mut Transaction<'_, DB>,
        request: Request<Job>,
    ) -> Result<Response<Receipt>, Status> {
        answer_with_its_code(&self.counters, tx, request.into_inner())
    }

    #[idempotent(global, key_field = "request_id")]
    async fn create(
        &self,
        tx: &mut Transaction<'_, DB>,
        request: Request<CreateJob>,
    ) -> Result<Response<Receipt>, Status> {
        let _ = tx;
        let calls = self.counters.created.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Response::new(Receipt {
            name: request.into_inner().name,
            calls,
        }))
    }
}

/// `Answer`'s body: counts the run, and answers the status of the job's code (a receipt for
/// `OK`).
fn answer_with_its_code<DB: Backend>(
    counters: &Counters,
    _: &mut Transaction<'_, DB>,
    job: Job,
) -> Result<Response<Receipt>, Status> {
    let calls = counters.answered.fetch_add(1, Ordering::SeqCst) + 1;
    match Code::from_i32(job.code) {
        Code::Ok => Ok(Response::new(Receipt {
            name: job.name,
            calls,
        })),
        code => Err(Status::new(code, format!("run {calls}"))),
    }
}

/// The service on `store`, served on a loopback port, and a client of it.
struct Served {
    client: JobsClient<Channel>,
    counters: Arc<Counters>,
    gate: Arc<tokio::sync::Semaphore>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn serve<DB: Backend>(store: Store<DB>) -> Served {
    let counters = Arc::new(Counters::default());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let api = JobsApi {
        store,
        counters: Arc::clone(&counters),
        gate: Arc::clone(&gate),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    let server = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(JobsServer::new(api))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
    });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a URI")
        .connect()
        .await
        .expect("connect to the test service");
    Served {
        client: JobsClient::new(channel),
        counters,
        gate,
        server,
    }
}

fn job(name: &str, key: &str, fail_after_reserve: bool) -> Request<Job> {
    keyed(
        Job {
            name: name.to_owned(),
            fail_after_reserve,
            code: 0,
        },
        key,
    )
}

/// A job for `Answer`: answer `code`.
fn coded(code: Code, key: &str) -> Request<Job> {
    keyed(
        Job {
            name: format!("{code:?}"),
            fail_after_reserve: false,
            code: code as i32,
        },
        key,
    )
}

fn keyed(job: Job, key: &str) -> Request<Job> {
    let mut request = Request::new(job);
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("a key"));
    request
}

fn replayed<T>(response: &Response<T>) -> bool {
    response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true")
}

/// Runs `test` on a store of each database.
macro_rules! on_every_database {
    ($($test:ident),* $(,)?) => {
        idem_tests::backend_tests! {
            $(
                async fn $test(db) {
                    // The suite's app gives the database's probes (leases, expiry) and its
                    // tasks; the gRPC service has a store of its own on the same pool.
                    let app = App::new(db).await;
                    match &app.db {
                        Db::Postgres(pool) => {
                            super::$test::<Postgres>(Store::new(pool.clone()), &app).await;
                        }
                        Db::Sqlite(pool) => {
                            super::$test::<Sqlite>(Store::new(pool.clone()), &app).await;
                        }
                        Db::MySql(pool) => {
                            super::$test::<MySql>(Store::new(pool.clone()), &app).await;
                        }
                    }
                }
            )*
        }
    };
}

on_every_database!(
    an_external_method_calls_once_and_a_retry_gets_the_receipt_again,
    a_call_while_an_external_method_runs_is_aborted_with_its_pushback,
    a_method_in_steps_resumes_after_its_last_recorded_step,
    the_idem_commands_queries_show_a_grpc_key_by_its_method,
    a_methods_status_a_retry_may_change_is_stored_only_with_replay_5xx,
    a_grpc_key_past_its_retention_is_purged_and_its_next_call_runs,
    a_grpc_claim_left_by_a_dead_call_is_released_by_the_recovery_and_its_retry_runs,
    a_parked_grpc_claim_is_internal_without_running_until_abandoned,
    a_grpc_calls_log_line_names_its_code_never_the_http_status_it_is_stored_under,
    a_method_keyed_by_its_request_id_field_runs_once_and_ignores_the_metadata_key,
    a_missing_or_malformed_request_id_field_is_invalid_argument_and_nothing_runs,
    a_methods_answer_and_status_are_sealed_and_their_replays_open,
);

async fn a_methods_answer_and_status_are_sealed_and_their_replays_open<DB: Backend>(
    store: Store<DB>,
    app: &App,
) {
    let keys =
        idem_runtime::seal::EncryptionKeys::new([("k1".to_owned(), [9u8; 32])]).expect("a key");
    let store =
        store.with_options(idem_runtime::StoreOptions::default().with_encryption_keys(keys));
    let served = serve(store).await;
    let mut client = served.client.clone();
    let first = client
        .create(create_call("receipt-cus_9sealed", "req-1", None))
        .await
        .expect("the first call");
    let replay = client
        .create(create_call("receipt-cus_9sealed", "req-1", None))
        .await
        .expect("the replay");
    assert!(replayed(&replay));
    assert_eq!(replay.get_ref(), first.get_ref());
    // A final status is stored too, and sealed with its message.
    let status = coded(Code::AlreadyExists, "k-status");
    let refused = client
        .answer(status)
        .await
        .expect_err("the method's status");
    let again = client
        .answer(coded(Code::AlreadyExists, "k-status"))
        .await
        .expect_err("its replay");
    assert_eq!(
        (again.code(), again.message()),
        (refused.code(), refused.message())
    );
    for (text, body) in app.key_table_contents().await {
        let shown = format!("{text} {}", String::from_utf8_lossy(&body));
        assert!(!shown.contains("cus_9sealed"), "{shown}");
        assert!(!shown.contains(refused.message()), "{shown}");
    }
    assert_eq!(served.counters.created.load(Ordering::SeqCst), 1);
}

/// A `Create` call of job `name` under `request_id`, with `metadata_key` as `idempotency-key`
/// metadata when given.
fn create_call(name: &str, request_id: &str, metadata_key: Option<&str>) -> Request<CreateJob> {
    let job = CreateJob {
        name: name.to_owned(),
        request_id: request_id.to_owned(),
    };
    let mut request = Request::new(job);
    if let Some(key) = metadata_key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().expect("a key"));
    }
    request
}

async fn a_method_keyed_by_its_request_id_field_runs_once_and_ignores_the_metadata_key<
    DB: Backend,
>(
    store: Store<DB>,
    app: &App,
) {
    let served = serve(store).await;
    let mut client = served.client.clone();
    let first = client
        .create(create_call("a", "req-1", None))
        .await
        .expect("the first call");
    assert!(!replayed(&first));
    // Another metadata key does not make it another operation: the field is the key.
    let retry = client
        .create(create_call("a", "req-1", Some("other")))
        .await
        .expect("the retry");
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref(), first.get_ref());
    let other = client
        .create(create_call("b", "req-1", None))
        .await
        .expect_err("another message under the request id");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    let second = client
        .create(create_call("a", "req-2", Some("req-1")))
        .await
        .expect("another request id");
    assert!(!replayed(&second));
    assert_eq!(served.counters.created.load(Ordering::SeqCst), 2);
    assert_eq!(app.count("idem_keys").await, 2);
}

async fn a_missing_or_malformed_request_id_field_is_invalid_argument_and_nothing_runs<
    DB: Backend,
>(
    store: Store<DB>,
    app: &App,
) {
    let served = serve(store).await;
    let mut client = served.client.clone();
    for (request_id, says) in [
        ("", "requires the request's `request_id` field"),
        ("a b", "not a valid key"),
    ] {
        let refused = client
            .create(create_call("a", request_id, Some("k1")))
            .await
            .expect_err("no valid request id");
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains(says), "{refused:?}");
    }
    assert_eq!(served.counters.created.load(Ordering::SeqCst), 0);
    assert_eq!(app.count("idem_keys").await, 0);
}

async fn an_external_method_calls_once_and_a_retry_gets_the_receipt_again<DB: Backend>(
    store: Store<DB>,
    _: &App,
) {
    let served = serve(store).await;
    let first = served
        .client
        .clone()
        .send(job("a", "k1", false))
        .await
        .expect("the first call");
    assert!(!replayed(&first));
    assert_eq!(
        first
            .metadata()
            .get("x-receipt")
            .map(|v| v.to_str().unwrap()),
        Some("first"),
        "the method's metadata reaches the client with the first answer"
    );
    let retry = served
        .client
        .clone()
        .send(job("a", "k1", false))
        .await
        .expect("the retry");
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref(), first.get_ref());
    assert!(
        !retry.metadata().contains_key("x-receipt"),
        "the method's metadata is not stored"
    );
    assert_eq!(served.counters.sent.load(Ordering::SeqCst), 1);
    let other = served
        .client
        .clone()
        .send(job("b", "k1", false))
        .await
        .expect_err("another message under the key");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    assert_eq!(served.counters.sent.load(Ordering::SeqCst), 1);
}

async fn a_call_while_an_external_method_runs_is_aborted_with_its_pushback<DB: Backend>(
    store: Store<DB>,
    _: &App,
) {
    let served = serve(store).await;
    let mut client = served.client.clone();
    let first = tokio::spawn(async move { client.send(job("gated", "k1", false)).await });
    let counters = Arc::clone(&served.counters);
    wait_until("the first call to reach the other system", || {
        let counters = Arc::clone(&counters);
        async move { counters.sent.load(Ordering::SeqCst) == 1 }
    })
    .await;
    let busy = served
        .client
        .clone()
        .send(job("gated", "k1", false))
        .await
        .expect_err("the key is held");
    assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
    assert!(busy.metadata().get("retry-after").is_some(), "{busy:?}");
    assert!(
        busy.metadata().get("grpc-retry-pushback-ms").is_some(),
        "{busy:?}"
    );
    served.gate.add_permits(1);
    let done = first.await.expect("the task").expect("the first call");
    assert_eq!(done.get_ref().calls, 1);
    assert_eq!(served.counters.sent.load(Ordering::SeqCst), 1);
}

async fn a_method_in_steps_resumes_after_its_last_recorded_step<DB: Backend>(
    store: Store<DB>,
    _: &App,
) {
    let served = serve(store).await;
    let failed = served
        .client
        .clone()
        .ship(job("parcel", "k1", true))
        .await
        .expect_err("the carrier was away");
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert!(!failed.metadata().contains_key("idempotent-replayed"));
    let retry = served
        .client
        .clone()
        .ship(job("parcel", "k1", true))
        .await
        .expect("the retry ships");
    assert!(!replayed(&retry), "an UNAVAILABLE is not stored");
    // `reserve` ran once (its recorded output came back on the retry), `ship` once.
    assert_eq!(retry.get_ref().calls, 101);
    assert_eq!(served.counters.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(served.counters.shipped.load(Ordering::SeqCst), 1);
    let replay = served
        .client
        .clone()
        .ship(job("parcel", "k1", true))
        .await
        .expect("the replay");
    assert!(replayed(&replay));
    assert_eq!(served.counters.ship_attempts.load(Ordering::SeqCst), 2);
}

async fn the_idem_commands_queries_show_a_grpc_key_by_its_method<DB: Backend>(
    store: Store<DB>,
    _: &App,
) {
    let served = serve(store.clone()).await;
    let mut client = served.client.clone();
    let first = tokio::spawn(async move { client.send(job("gated", "k1", false)).await });
    let counters = Arc::clone(&served.counters);
    wait_until("the first call to reach the other system", || {
        let counters = Arc::clone(&counters);
        async move { counters.sent.load(Ordering::SeqCst) == 1 }
    })
    .await;
    let in_flight = store
        .in_flight(std::time::Duration::ZERO)
        .await
        .expect("the claims in flight");
    assert_eq!(in_flight.len(), 1, "{in_flight:?}");
    assert_eq!(
        (in_flight[0].method.as_str(), in_flight[0].path.as_str()),
        ("GRPC", "/idem.test.v1.Jobs/Send")
    );
    served.gate.add_permits(1);
    first.await.expect("the task").expect("the first call");
    let key = store
        .inspect("", "k1", true)
        .await
        .expect("inspect")
        .expect("the key");
    assert_eq!(key.status, "completed");
    assert_eq!(key.path, "/idem.test.v1.Jobs/Send");
    assert_eq!(key.response_status, Some(200));

    // A method whose name in the `.proto` is not its Rust name in upper camel case, as `rpc`
    // gives it.
    served
        .client
        .clone()
        .get_http_receipt(coded(Code::Ok, "k2"))
        .await
        .expect("the call");
    let key = store
        .inspect("", "k2", false)
        .await
        .expect("inspect")
        .expect("the key");
    assert_eq!(key.path, "/idem.test.v1.Jobs/GetHTTPReceipt");
}

/// The codes of a method's status that a retry may change: not stored (a retry runs the method
/// again) unless the method says `replay_5xx = true`.
const RETRIED: [Code; 7] = [
    Code::Unknown,
    Code::Internal,
    Code::Unavailable,
    Code::DeadlineExceeded,
    Code::DataLoss,
    Code::ResourceExhausted,
    Code::Aborted,
];

async fn a_methods_status_a_retry_may_change_is_stored_only_with_replay_5xx<DB: Backend>(
    store: Store<DB>,
    _: &App,
) {
    let served = serve(store).await;
    for code in RETRIED {
        let key = format!("plain-{code:?}");
        for attempt in 1..=2 {
            let before = served.counters.answered.load(Ordering::SeqCst);
            let status = answer(&served, Replay5xx::No, coded(code, &key))
                .await
                .expect_err("the method's status");
            assert_eq!(status.code(), code, "{status:?}");
            assert!(
                !status.metadata().contains_key("idempotent-replayed"),
                "{code:?}, attempt {attempt}: not stored, so never replayed"
            );
            assert_eq!(
                served.counters.answered.load(Ordering::SeqCst),
                before + 1,
                "{code:?}, attempt {attempt}: the method ran"
            );
        }
        stored_and_replayed(&served, Replay5xx::Yes, code).await;
    }
    // Any other code is the method's final answer: stored and replayed without replay_5xx.
    for code in [
        Code::NotFound,
        Code::AlreadyExists,
        Code::Cancelled,
        Code::OutOfRange,
    ] {
        stored_and_replayed(&served, Replay5xx::No, code).await;
    }
}

/// A call's one `info` line says its gRPC code, first run and replay alike: not the HTTP status
/// its answer is kept under, which an operator would read as the call's.
async fn a_grpc_calls_log_line_names_its_code_never_the_http_status_it_is_stored_under<
    DB: Backend,
>(
    store: Store<DB>,
    _: &App,
) {
    let log = idem_tests::CapturedLog::default();
    // The server's tasks run on this test's thread, under this subscriber.
    let _guard = tracing::subscriber::set_default(log.subscriber());
    let served = serve(store).await;
    for attempt in ["first", "replay"] {
        let status = answer(&served, Replay5xx::No, coded(Code::NotFound, "logged"))
            .await
            .expect_err("the method's status");
        assert_eq!(status.code(), Code::NotFound, "{attempt}");
    }
    let text = log.text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("idempotent request"))
        .collect();
    assert_eq!(lines.len(), 2, "one line a call: {text}");
    for line in lines {
        assert!(line.contains("grpc_status=NOT_FOUND"), "{line}");
        assert!(!line.contains(" status="), "an HTTP status: {line}");
    }
}

/// Which of the two `Answer` methods: `AnswerKept` says `replay_5xx = true`.
#[derive(Debug, Clone, Copy)]
enum Replay5xx {
    No,
    Yes,
}

async fn answer(
    served: &Served,
    replay_5xx: Replay5xx,
    request: Request<Job>,
) -> Result<Response<Receipt>, Status> {
    let mut client = served.client.clone();
    match replay_5xx {
        Replay5xx::No => client.answer(request).await,
        Replay5xx::Yes => client.answer_kept(request).await,
    }
}

/// Asserts that the method's status of `code` is stored: a second call under its key gets it
/// again, marked replayed, without running the method.
async fn stored_and_replayed(served: &Served, replay_5xx: Replay5xx, code: Code) {
    let key = format!("{replay_5xx:?}-{code:?}");
    let first = answer(served, replay_5xx, coded(code, &key))
        .await
        .expect_err("the method's status");
    let before = served.counters.answered.load(Ordering::SeqCst);
    let replay = answer(served, replay_5xx, coded(code, &key))
        .await
        .expect_err("the stored status");
    assert_eq!((replay.code(), replay.message()), (code, first.message()));
    assert!(
        replay
            .metadata()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true"),
        "{code:?}, replay_5xx {replay_5xx:?}: stored and replayed: {replay:?}"
    );
    assert_eq!(
        served.counters.answered.load(Ordering::SeqCst),
        before,
        "{code:?}, replay_5xx {replay_5xx:?}: replayed, not run again"
    );
}

async fn a_grpc_key_past_its_retention_is_purged_and_its_next_call_runs<DB: Backend>(
    store: Store<DB>,
    app: &App,
) {
    let served = serve(store).await;
    let first = served
        .client
        .clone()
        .answer(coded(Code::Ok, "k1"))
        .await
        .expect("the first call");
    let replay = served
        .client
        .clone()
        .answer(coded(Code::Ok, "k1"))
        .await
        .expect("the replay");
    assert!(replayed(&replay));

    app.expire_all_keys().await;
    assert_eq!(app.purge(PurgeOptions::default()).await.rows, 1);
    let again = served
        .client
        .clone()
        .answer(coded(Code::Ok, "k1"))
        .await
        .expect("a call after the purge");
    assert!(!replayed(&again), "the key was purged: the call ran");
    assert_eq!(again.get_ref().calls, first.get_ref().calls + 1);
}

/// Leaves `Send`'s claim of `key` as a process that died mid-call leaves it: a first call is
/// made, then its row is set back to a claim in flight (answer gone, the claim's owner a token
/// no live process holds) whose lease has ended. (A process SIGKILLed mid-call, for real, is the
/// example's test: `examples/tests/behaviour/grpc.rs`.) In-process, a call cut off releases its
/// claim as it is dropped, so it cannot leave one behind.
async fn a_dead_call(served: &Served, app: &App, key: &str) {
    served
        .client
        .clone()
        .send(job("dead", key, false))
        .await
        .expect("the first call");
    app.execute(
        "UPDATE idem_keys SET status = 'started', response_status = NULL, \
           response_headers = NULL, response_body = NULL, locked_at = created_at, \
           claim_token = 42",
    )
    .await;
    app.lapse_lease(key).await;
}

/// Checks that the hook is handed the gRPC claim by its method, then releases it.
struct ReleaseTheGrpcClaim;

impl<DB: Backend> RecoveryHook<DB> for ReleaseTheGrpcClaim {
    async fn recover(&self, claim: AbandonedClaim<DB>) -> Verdict {
        assert_eq!(
            (claim.method.as_str(), claim.path.as_str()),
            ("GRPC", "/idem.test.v1.Jobs/Send")
        );
        ReleaseAbandoned.recover(claim).await
    }
}

async fn a_grpc_claim_left_by_a_dead_call_is_released_by_the_recovery_and_its_retry_runs<
    DB: Backend,
>(
    store: Store<DB>,
    app: &App,
) {
    let served = serve(store).await;
    a_dead_call(&served, app, "k1").await;
    let report = app.recover(&ReleaseTheGrpcClaim).await;
    assert_eq!((report.found, report.released), (1, 1), "{report:?}");

    let retry = served
        .client
        .clone()
        .send(job("dead", "k1", false))
        .await
        .expect("the retry runs");
    assert!(!replayed(&retry));
    assert_eq!(
        retry.get_ref().calls,
        2,
        "the released claim's retry ran the method"
    );
}

/// Never settles a claim, as a hook whose other system never answers.
struct FailEveryTime;

impl<DB: Backend> RecoveryHook<DB> for FailEveryTime {
    async fn recover(&self, _: AbandonedClaim<DB>) -> Verdict {
        Verdict::Failed("the other system did not answer".into())
    }
}

async fn a_parked_grpc_claim_is_internal_without_running_until_abandoned<DB: Backend>(
    store: Store<DB>,
    app: &App,
) {
    let served = serve(store).await;
    a_dead_call(&served, app, "k1").await;
    let report = app
        .recover_with(
            &FailEveryTime,
            &RecoveryOptions::default().with_max_attempts(1),
        )
        .await;
    assert_eq!(report.parked, 1, "{report:?}");
    let parked = app.store().parked().await.expect("idem dead");
    assert_eq!(
        (parked[0].method.as_str(), parked[0].path.as_str()),
        ("GRPC", "/idem.test.v1.Jobs/Send"),
        "{parked:?}"
    );

    let refused = served
        .client
        .clone()
        .send(job("dead", "k1", false))
        .await
        .expect_err("a parked claim");
    assert_eq!(refused.code(), Code::Internal, "{refused:?}");
    assert!(refused.message().contains("operator"), "{refused:?}");
    assert!(
        !refused.metadata().contains_key("retry-after")
            && !refused.metadata().contains_key("grpc-retry-pushback-ms"),
        "no retry gets another answer before a person acts: {refused:?}"
    );
    assert_eq!(served.counters.sent.load(Ordering::SeqCst), 1, "not run");

    assert_eq!(
        app.store().abandon_parked("", "k1").await.unwrap(),
        Unparked::Done
    );
    let retry = served
        .client
        .clone()
        .send(job("dead", "k1", false))
        .await
        .expect("the retry after the abandon runs");
    assert_eq!(retry.get_ref().calls, 2);
}

/// A store that cannot be reached answers `UNAVAILABLE` with both `retry-after` and gRFC A6's
/// pushback, at the store's own acquire timeout (the pools here would wait an hour), in both
/// modes, and runs nothing.
async fn an_unreachable_store_is_unavailable_with_retry_after_and_pushback<DB: Backend>(
    store: Store<DB>,
) {
    let served = serve(store).await;
    let (mut one, mut other) = (served.client.clone(), served.client.clone());
    // The pools would wait an hour: the store's own limit answers first, or the test fails.
    let (transactional, external) = tokio::time::timeout(idem_tests::DEADLINE, async {
        tokio::join!(
            one.answer(coded(Code::Ok, "k1")),
            other.send(job("a", "k2", false)),
        )
    })
    .await
    .expect("an answer within the test's deadline, not the pool's hour");
    for outcome in [transactional, external] {
        let status = outcome.expect_err("no store");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(
            status
                .metadata()
                .get("retry-after")
                .map(|v| v.to_str().unwrap()),
            Some("1"),
            "the store's retry_after: {status:?}"
        );
        assert_eq!(
            status
                .metadata()
                .get("grpc-retry-pushback-ms")
                .map(|v| v.to_str().unwrap()),
            Some("1000"),
            "{status:?}"
        );
    }
    assert_eq!(served.counters.answered.load(Ordering::SeqCst), 0);
    assert_eq!(served.counters.sent.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_unreachable_postgres_is_unavailable_with_retry_after_and_pushback() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(3600))
        .connect_lazy_with(
            sqlx::postgres::PgConnectOptions::new()
                .host("127.0.0.1")
                .port(idem_tests::reserve_port())
                .username("postgres"),
        );
    an_unreachable_store_is_unavailable_with_retry_after_and_pushback(Store::new(pool)).await;
}

#[tokio::test]
async fn an_unopenable_sqlite_file_is_unavailable_with_retry_after_and_pushback() {
    let dir = tempfile::tempdir().unwrap();
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(3600))
        .connect_lazy_with(
            sqlx::sqlite::SqliteConnectOptions::new().filename(dir.path().join("missing/dir/x.db")),
        );
    an_unreachable_store_is_unavailable_with_retry_after_and_pushback(Store::new(pool)).await;
}

#[tokio::test]
async fn an_unreachable_mysql_is_unavailable_with_retry_after_and_pushback() {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(3600))
        .connect_lazy_with(
            sqlx::mysql::MySqlConnectOptions::new()
                .host("127.0.0.1")
                .port(idem_tests::reserve_port())
                .username("root"),
        );
    an_unreachable_store_is_unavailable_with_retry_after_and_pushback(Store::new(pool)).await;
}
