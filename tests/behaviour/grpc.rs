//! `#[idempotent]` tonic methods in external mode and in steps, over real gRPC (a tonic server on
//! a loopback socket), on PostgreSQL, SQLite and MySQL: a side effect made once, a call in
//! flight answered `ABORTED`, a retry that resumes after its last recorded step, and the keys as
//! the `idem` command's queries see them. (The transactional mode is tested on the example's
//! service, in its own process: `examples/tests/behaviour/grpc.rs`.)

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use idem_runtime::{Backend, IdempotencyContext, Steps, Store, idempotent};
use idem_tests::{TestDb, wait_until};
use sqlx::{MySql, Postgres, Sqlite};
use tonic::{Code, Request, Response, Status, transport::Channel};

/// The code tonic-prost-build generated from `proto/idem/test/v1/jobs.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
mod proto {
    tonic::include_proto!("idem.test.v1");
}

use proto::{
    Job, Receipt,
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
    let mut request = Request::new(Job {
        name: name.to_owned(),
        fail_after_reserve,
    });
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
                    match db {
                        TestDb::Postgres(connect) => {
                            let pool = sqlx::PgPool::connect_with(*connect).await.expect("connect");
                            idem_runtime::migrate(&pool).await.expect("migrate");
                            super::$test::<Postgres>(Store::new(pool)).await;
                        }
                        TestDb::Sqlite(dir) => {
                            let pool = idem_runtime::sqlite::connect(dir.path().join("jobs.db"))
                                .await
                                .expect("open the file");
                            idem_runtime::migrate(&pool).await.expect("migrate");
                            super::$test::<Sqlite>(Store::new(pool)).await;
                        }
                        TestDb::MySql(database) => {
                            let pool = sqlx::MySqlPool::connect_with(database.options().clone())
                                .await
                                .expect("connect");
                            idem_runtime::migrate(&pool).await.expect("migrate");
                            super::$test::<MySql>(Store::new(pool.clone())).await;
                            pool.close().await;
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
);

async fn an_external_method_calls_once_and_a_retry_gets_the_receipt_again<DB: Backend>(
    store: Store<DB>,
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

async fn a_method_in_steps_resumes_after_its_last_recorded_step<DB: Backend>(store: Store<DB>) {
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

async fn the_idem_commands_queries_show_a_grpc_key_by_its_method<DB: Backend>(store: Store<DB>) {
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
}
