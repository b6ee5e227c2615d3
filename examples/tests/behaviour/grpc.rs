//! The example's gRPC service over real gRPC (HTTP/2 on a socket, the service in a process of
//! its own), on PostgreSQL, SQLite and MySQL: every answer of the contract's table for
//! `CreatePayment`, a message's encodings, duplicates in flight and across processes, a process
//! killed mid-call.

use std::time::Duration;

use crate::support::{
    Database, Process, free_addr, on_every_database, spawn_payments_with, wait_until,
};

use idem_examples::grpc::proto::{
    CreatePaymentRequest, GetPaymentRequest, Payment, payments_client::PaymentsClient,
};
use prost::Message;
use tonic::{Code, Request, Status, metadata::MetadataMap, transport::Channel};

on_every_database!(
    a_payment_runs_once_and_a_retry_gets_it_back_marked_replayed,
    a_call_without_a_valid_key_is_invalid_argument_and_runs_nothing,
    a_call_without_authorization_is_unauthenticated_and_runs_nothing,
    a_key_reused_with_another_message_or_over_http_is_failed_precondition,
    a_declined_payment_is_failed_precondition_recorded_and_replayed,
    an_unavailable_processor_is_unavailable_not_stored_and_a_retry_runs_again,
    an_invalid_amount_or_currency_is_the_methods_invalid_argument_stored_and_replayed,
    get_payment_reads_only_the_callers_payments_and_needs_to_know_the_caller,
    a_retry_while_the_first_runs_is_aborted_at_once_with_retry_after_and_pushback,
    a_retry_that_prefers_to_wait_gets_the_outcome_with_preference_applied,
    two_encodings_of_one_message_are_the_same_request,
    duplicates_over_two_processes_make_one_payment,
    a_process_killed_mid_call_leaves_nothing_and_the_retry_pays_once,
);

/// The example's payments service, in a process of its own, and a gRPC client of it.
struct Service {
    process: Process,
    http: String,
    grpc: String,
    caller: Caller,
}

/// A gRPC client of the service, which a test can hand to another task.
#[derive(Clone)]
struct Caller {
    client: PaymentsClient<Channel>,
}

impl Service {
    /// Starts the service on `database` and waits until its gRPC port answers.
    async fn start(database: &Database) -> Self {
        let grpc = free_addr();
        let (process, http) =
            spawn_payments_with(database, "http://127.0.0.1:9", &[("GRPC_ADDR", &grpc)]);
        wait_until(&format!("the gRPC service at {grpc} to accept"), || async {
            tokio::net::TcpStream::connect(&grpc).await.is_ok()
        })
        .await;
        let channel = Channel::from_shared(format!("http://{grpc}"))
            .expect("a URI")
            .connect()
            .await
            .expect("connect to the gRPC service");
        Self {
            process,
            http,
            grpc,
            caller: Caller {
                client: PaymentsClient::new(channel),
            },
        }
    }

    /// `CreatePayment`, as [`Caller::pay`].
    async fn pay(
        &self,
        tenant: &str,
        key: Option<&str>,
        message: CreatePaymentRequest,
        metadata: &[(&'static str, &str)],
    ) -> Result<tonic::Response<Payment>, Status> {
        self.caller.pay(tenant, key, message, metadata).await
    }

    /// A client for another task.
    fn caller(&self) -> Caller {
        self.caller.clone()
    }
}

impl Caller {
    /// `CreatePayment` as `tenant`, with `key` (none: no key) and `metadata`.
    async fn pay(
        &self,
        tenant: &str,
        key: Option<&str>,
        message: CreatePaymentRequest,
        metadata: &[(&'static str, &str)],
    ) -> Result<tonic::Response<Payment>, Status> {
        let mut request = Request::new(message);
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {tenant}").parse().unwrap());
        if let Some(key) = key {
            request
                .metadata_mut()
                .insert("idempotency-key", key.parse().unwrap());
        }
        for (name, value) in metadata {
            request.metadata_mut().insert(*name, value.parse().unwrap());
        }
        self.client.clone().create_payment(request).await
    }
}

fn payment(amount: i64, customer: &str) -> CreatePaymentRequest {
    CreatePaymentRequest {
        amount,
        currency: "usd".to_owned(),
        customer: customer.to_owned(),
        metadata: Default::default(),
    }
}

fn replayed(metadata: &MetadataMap) -> bool {
    metadata
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true")
}

fn expect_status(outcome: Result<tonic::Response<Payment>, Status>, code: Code) -> Status {
    match outcome {
        Ok(response) => panic!(
            "expected {code:?}, got the payment {:?}",
            response.get_ref()
        ),
        Err(status) => {
            assert_eq!(status.code(), code, "{status:?}");
            status
        }
    }
}

async fn a_payment_runs_once_and_a_retry_gets_it_back_marked_replayed(database: Database) {
    let service = Service::start(&database).await;
    let first = service
        .pay("t1", Some("k1"), payment(4200, "cus_1"), &[])
        .await
        .expect("the payment");
    assert!(!replayed(first.metadata()));
    let paid = first.into_inner();
    assert_eq!((paid.amount, paid.status.as_str()), (4200, "succeeded"));
    let retry = service
        .pay("t1", Some("k1"), payment(4200, "cus_1"), &[])
        .await
        .expect("the replay");
    assert!(replayed(retry.metadata()), "{:?}", retry.metadata());
    assert_eq!(retry.into_inner(), paid);
    assert_eq!(database.count("payments").await, 1);
    // One store for both protocols: the payment is listed over HTTP, and read over gRPC.
    let listed: serde_json::Value = reqwest::Client::new()
        .get(format!("{}/v1/payments", service.http))
        .bearer_auth("t1")
        .send()
        .await
        .expect("the list")
        .json()
        .await
        .expect("JSON");
    assert_eq!(listed[0]["id"], paid.id.as_str());
    let mut read = Request::new(GetPaymentRequest {
        id: paid.id.clone(),
    });
    read.metadata_mut()
        .insert("authorization", "Bearer t1".parse().unwrap());
    let fetched = service
        .caller
        .client
        .clone()
        .get_payment(read)
        .await
        .expect("read");
    assert_eq!(fetched.into_inner(), paid);
    // Metrics count the calls by method, never by key.
    let metrics = reqwest::Client::new()
        .get(format!("{}/metrics", service.http))
        .send()
        .await
        .expect("the metrics")
        .text()
        .await
        .expect("text");
    for outcome in ["executed", "replayed"] {
        let series = format!(
            "idem_requests_total{{route=\"/idem.example.v1.Payments/CreatePayment\",outcome=\"{outcome}\"}} 1"
        );
        assert!(metrics.contains(&series), "{series} in:\n{metrics}");
    }
    assert!(!metrics.contains("k1"), "a key in the metrics:\n{metrics}");
}

async fn a_call_without_a_valid_key_is_invalid_argument_and_runs_nothing(database: Database) {
    let service = Service::start(&database).await;
    let missing = expect_status(
        service.pay("t1", None, payment(100, "cus_1"), &[]).await,
        Code::InvalidArgument,
    );
    assert!(
        missing.message().contains("`idempotency-key` metadata"),
        "{missing:?}"
    );
    expect_status(
        service
            .pay("t1", Some(&"k".repeat(300)), payment(100, "cus_1"), &[])
            .await,
        Code::InvalidArgument,
    );
    assert_eq!(database.count("payments").await, 0);
    assert_eq!(database.count("idem_keys").await, 0);
}

async fn a_call_without_authorization_is_unauthenticated_and_runs_nothing(database: Database) {
    let service = Service::start(&database).await;
    let mut request = Request::new(payment(100, "cus_1"));
    request
        .metadata_mut()
        .insert("idempotency-key", "k1".parse().unwrap());
    let outcome = service.caller.client.clone().create_payment(request).await;
    expect_status(outcome, Code::Unauthenticated);
    assert_eq!(database.count("payments").await, 0);
    assert_eq!(database.count("idem_keys").await, 0);
}

async fn a_key_reused_with_another_message_or_over_http_is_failed_precondition(database: Database) {
    let service = Service::start(&database).await;
    service
        .pay("t1", Some("k1"), payment(100, "cus_1"), &[])
        .await
        .expect("the payment");
    let other = expect_status(
        service
            .pay("t1", Some("k1"), payment(101, "cus_1"), &[])
            .await,
        Code::FailedPrecondition,
    );
    assert!(other.message().contains("different request"), "{other:?}");
    // The key of an HTTP payment, sent again over gRPC with the same values: another request.
    let http = reqwest::Client::new()
        .post(format!("{}/v1/payments", service.http))
        .bearer_auth("t1")
        .header("idempotency-key", "k2")
        .json(&serde_json::json!({"amount": 100, "currency": "usd", "customer": "cus_1"}))
        .send()
        .await
        .expect("the HTTP payment");
    assert_eq!(http.status(), 201);
    expect_status(
        service
            .pay("t1", Some("k2"), payment(100, "cus_1"), &[])
            .await,
        Code::FailedPrecondition,
    );
    // And the other way: a gRPC payment's key, sent again over HTTP with the same values.
    let http = reqwest::Client::new()
        .post(format!("{}/v1/payments", service.http))
        .bearer_auth("t1")
        .header("idempotency-key", "k1")
        .json(&serde_json::json!({"amount": 100, "currency": "usd", "customer": "cus_1"}))
        .send()
        .await
        .expect("the HTTP payment");
    assert_eq!(http.status(), 422);
    assert_eq!(database.count("payments").await, 2);
}

async fn a_declined_payment_is_failed_precondition_recorded_and_replayed(database: Database) {
    let service = Service::start(&database).await;
    let first = expect_status(
        service
            .pay("t1", Some("k1"), payment(100, "cus_declined"), &[])
            .await,
        Code::FailedPrecondition,
    );
    assert!(!replayed(first.metadata()));
    let retry = expect_status(
        service
            .pay("t1", Some("k1"), payment(100, "cus_declined"), &[])
            .await,
        Code::FailedPrecondition,
    );
    assert!(replayed(retry.metadata()), "{retry:?}");
    assert_eq!(retry.message(), first.message());
    assert_eq!(database.count("payments").await, 1);
}

async fn an_unavailable_processor_is_unavailable_not_stored_and_a_retry_runs_again(
    database: Database,
) {
    let service = Service::start(&database).await;
    for _ in 0..2 {
        let status = expect_status(
            service
                .pay("t1", Some("k1"), payment(100, "cus_unavailable"), &[])
                .await,
            Code::Unavailable,
        );
        assert!(!replayed(status.metadata()), "ran again: {status:?}");
    }
    assert_eq!(database.count("payments").await, 0);
    assert_eq!(database.count("idem_keys").await, 0);
}

async fn an_invalid_amount_or_currency_is_the_methods_invalid_argument_stored_and_replayed(
    database: Database,
) {
    let service = Service::start(&database).await;
    let first = expect_status(
        service
            .pay("t1", Some("k1"), payment(0, "cus_1"), &[])
            .await,
        Code::InvalidArgument,
    );
    assert!(first.message().contains("amount"), "{first:?}");
    let retry = expect_status(
        service
            .pay("t1", Some("k1"), payment(0, "cus_1"), &[])
            .await,
        Code::InvalidArgument,
    );
    assert!(replayed(retry.metadata()), "{retry:?}");
    assert_eq!(database.key_status("k1").await, "completed");
    let mut currency = payment(100, "cus_1");
    currency.currency = "us".to_owned();
    let refused = expect_status(
        service.pay("t1", Some("k2"), currency, &[]).await,
        Code::InvalidArgument,
    );
    assert!(refused.message().contains("currency"), "{refused:?}");
    assert_eq!(database.count("payments").await, 0);
}

async fn get_payment_reads_only_the_callers_payments_and_needs_to_know_the_caller(
    database: Database,
) {
    let service = Service::start(&database).await;
    let paid = service
        .pay("t1", Some("k1"), payment(100, "cus_1"), &[])
        .await
        .expect("the payment")
        .into_inner();
    let read = |tenant: Option<&str>, id: &str| {
        let mut request = Request::new(GetPaymentRequest { id: id.to_owned() });
        if let Some(tenant) = tenant {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {tenant}").parse().unwrap());
        }
        let mut client = service.caller.client.clone();
        async move { client.get_payment(request).await }
    };
    assert_eq!(
        read(Some("t1"), &paid.id).await.expect("read").into_inner(),
        paid
    );
    expect_status(read(Some("t1"), "pay_unknown").await, Code::NotFound);
    expect_status(read(Some("t2"), &paid.id).await, Code::NotFound);
    expect_status(read(None, &paid.id).await, Code::Unauthenticated);
}

async fn a_retry_while_the_first_runs_is_aborted_at_once_with_retry_after_and_pushback(
    database: Database,
) {
    let service = Service::start(&database).await;
    let first = first_call(&service, &database, "cus_slower").await;
    let retry = expect_status(
        service
            .pay("t1", Some("k1"), payment(100, "cus_slower"), &[])
            .await,
        Code::Aborted,
    );
    // At once: the first call (five seconds at the processor) still holds the key.
    assert!(
        !first.is_finished(),
        "the retry was answered only after the first call finished"
    );
    assert_eq!(
        retry
            .metadata()
            .get("retry-after")
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );
    assert_eq!(
        retry
            .metadata()
            .get("grpc-retry-pushback-ms")
            .map(|v| v.to_str().unwrap()),
        Some("1000")
    );
    first.await.unwrap().expect("the first payment");
    assert_eq!(database.count("payments").await, 1);
}

async fn a_retry_that_prefers_to_wait_gets_the_outcome_with_preference_applied(database: Database) {
    let service = Service::start(&database).await;
    let first = first_call(&service, &database, "cus_slow").await;
    let waited = service
        .pay(
            "t1",
            Some("k1"),
            payment(100, "cus_slow"),
            &[("prefer", "wait=10")],
        )
        .await
        .expect("the first payment's outcome");
    assert!(replayed(waited.metadata()));
    assert_eq!(
        waited
            .metadata()
            .get("preference-applied")
            .map(|v| v.to_str().unwrap()),
        Some("wait=10")
    );
    let first = first.await.unwrap().expect("the first payment");
    assert_eq!(waited.into_inner(), first.into_inner());
    assert_eq!(database.count("payments").await, 1);
}

async fn two_encodings_of_one_message_are_the_same_request(database: Database) {
    let service = Service::start(&database).await;
    // Fields in order, the metadata's six entries in order, each entry's value written (`f`'s
    // empty). Six, so that a map kept in an order of its own (a `HashMap`) re-encodes two
    // decodings alike once in 720 tries.
    let entries: [(&[u8], &[u8]); 6] = [
        (b"a", b"1"),
        (b"b", b"2"),
        (b"c", b"3"),
        (b"d", b"4"),
        (b"e", b"5"),
        (b"f", b""),
    ];
    let mut in_order = Vec::new();
    field_varint(&mut in_order, 1, 700);
    field_bytes(&mut in_order, 2, b"usd");
    field_bytes(&mut in_order, 3, b"cus_1");
    for (key, value) in entries {
        field_bytes(&mut in_order, 4, &entry(Some(key), Some(value)));
    }
    // The same message: the fields and the entries in another order, `f`'s empty value (a
    // default) left out, and an unknown field the service does not read.
    let mut shuffled = Vec::new();
    field_varint(&mut shuffled, 9, 1);
    field_bytes(&mut shuffled, 4, &entry(Some(b"f"), None));
    field_bytes(&mut shuffled, 3, b"cus_1");
    for (key, value) in entries[..5].iter().rev() {
        field_bytes(&mut shuffled, 4, &entry(Some(key), Some(value)));
    }
    field_bytes(&mut shuffled, 2, b"usd");
    field_varint(&mut shuffled, 1, 700);
    assert_ne!(in_order, shuffled);
    let first = raw_pay(&service, "k1", in_order)
        .await
        .expect("the payment");
    assert!(!replayed(first.metadata()));
    let second = raw_pay(&service, "k1", shuffled).await.expect("the replay");
    assert!(
        replayed(second.metadata()),
        "the second encoding ran again: {:?}",
        second.metadata()
    );
    assert_eq!(second.into_inner(), first.into_inner());
    // A message that differs (another entry) is another request.
    let mut other = Vec::new();
    field_varint(&mut other, 1, 700);
    field_bytes(&mut other, 2, b"usd");
    field_bytes(&mut other, 3, b"cus_1");
    field_bytes(&mut other, 4, &entry(Some(b"a"), Some(b"2")));
    let status = raw_pay(&service, "k1", other)
        .await
        .expect_err("another request");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(database.count("payments").await, 1);
}

async fn duplicates_over_two_processes_make_one_payment(database: Database) {
    let one = Service::start(&database).await;
    let two = Service::start(&database).await;
    let first = first_call(&one, &database, "cus_slow").await;
    let other = two
        .pay("t1", Some("k1"), payment(100, "cus_slow"), &[])
        .await;
    let first = first
        .await
        .unwrap()
        .expect("the first payment")
        .into_inner();
    match other {
        // The other process saw the key held and said so at once.
        Err(status) => assert_eq!(status.code(), Code::Aborted, "{status:?}"),
        // SQLite's writers queue for the file's lock: the other process waited, and replays.
        Ok(replay) => {
            assert!(replayed(replay.metadata()));
            assert_eq!(replay.into_inner(), first);
        }
    }
    let again = two
        .pay("t1", Some("k1"), payment(100, "cus_slow"), &[])
        .await
        .expect("the replay");
    assert!(replayed(again.metadata()));
    assert_eq!(again.into_inner(), first);
    assert_eq!(database.count("payments").await, 1);
}

async fn a_process_killed_mid_call_leaves_nothing_and_the_retry_pays_once(database: Database) {
    let mut service = Service::start(&database).await;
    let call = first_call(&service, &database, "cus_slower").await;
    // SIGKILL: the process ends without a chance to answer or clean up.
    service.process.0.kill().expect("SIGKILL the service");
    service.process.0.wait().expect("the killed service");
    let lost = call.await.unwrap();
    assert!(
        lost.is_err(),
        "the call got an answer from a killed process"
    );
    assert_eq!(database.count("payments").await, 0);
    service = Service::start(&database).await;
    let retried = service
        .pay("t1", Some("k1"), payment(100, "cus_slower"), &[])
        .await
        .expect("the retry runs the payment");
    assert!(
        !replayed(retried.metadata()),
        "nothing was stored to replay"
    );
    assert_eq!(retried.get_ref().status, "succeeded");
    assert_eq!(database.count("payments").await, 1);
}

/// Sends `CreatePayment` for `customer` with the key `k1` in a task of its own, and returns
/// once its transaction is open: the call holds its key, and runs for as long as `customer`
/// makes it.
async fn first_call(
    service: &Service,
    database: &Database,
    customer: &'static str,
) -> tokio::task::JoinHandle<Result<tonic::Response<Payment>, Status>> {
    let client = service.caller();
    let first = tokio::spawn(async move {
        client
            .pay("t1", Some("k1"), payment(100, customer), &[])
            .await
    });
    writing_a_payment(database).await;
    first
}

/// Waits until a payment's transaction is open in the database: the first call has its key.
pub(crate) async fn writing_a_payment(database: &Database) {
    wait_until("a payment's transaction to be open", || async {
        match database {
            Database::Postgres { pool, .. } => {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM pg_locks \
                     WHERE relation = 'payments'::regclass AND mode = 'RowExclusiveLock' \
                     AND granted",
                )
                .fetch_one(pool)
                .await
                .unwrap()
                    > 0
            }
            Database::MySql { pool, .. } => {
                // The claim's row, not committed yet, read without taking a lock (a locking
                // read would hold up the claim itself).
                let mut connection = pool.acquire().await.unwrap();
                sqlx::query("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
                    .execute(&mut *connection)
                    .await
                    .unwrap();
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem_keys")
                    .fetch_one(&mut *connection)
                    .await
                    .unwrap()
                    > 0
            }
            Database::Sqlite { path, .. } => {
                // The writer holds the file's write lock until it commits.
                let options = sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(path)
                    .busy_timeout(Duration::ZERO);
                let mut connection = sqlx::ConnectOptions::connect(&options)
                    .await
                    .expect("open the file");
                let busy = sqlx::query("BEGIN IMMEDIATE")
                    .execute(&mut connection)
                    .await
                    .is_err();
                if !busy {
                    sqlx::query("ROLLBACK")
                        .execute(&mut connection)
                        .await
                        .unwrap();
                }
                busy
            }
        }
    })
    .await;
}

/// `CreatePayment` with the message as `bytes`, encoded by hand.
async fn raw_pay(
    service: &Service,
    key: &str,
    bytes: Vec<u8>,
) -> Result<tonic::Response<Payment>, Status> {
    let channel = Channel::from_shared(format!("http://{}", service.grpc))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let mut request = Request::new(Raw(bytes));
    request
        .metadata_mut()
        .insert("authorization", "Bearer t1".parse().unwrap());
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    grpc.unary(
        request,
        http::uri::PathAndQuery::from_static("/idem.example.v1.Payments/CreatePayment"),
        tonic_prost::ProstCodec::<Raw, Payment>::default(),
    )
    .await
}

/// A message already encoded, sent as it is.
#[derive(Debug, Clone, Default)]
struct Raw(Vec<u8>);

impl Message for Raw {
    fn encode_raw(&self, buf: &mut impl prost::bytes::BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        _tag: u32,
        _wire_type: prost::encoding::WireType,
        _buf: &mut impl prost::bytes::Buf,
        _ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        unreachable!("only sent")
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

fn field_varint(out: &mut Vec<u8>, field: u32, value: u64) {
    prost::encoding::encode_key(field, prost::encoding::WireType::Varint, out);
    prost::encoding::encode_varint(value, out);
}

fn field_bytes(out: &mut Vec<u8>, field: u32, value: &[u8]) {
    prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, out);
    prost::encoding::encode_varint(value.len() as u64, out);
    out.extend_from_slice(value);
}

/// A map entry: key (field 1) and value (field 2), each left out when `None`.
fn entry(key: Option<&[u8]>, value: Option<&[u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(key) = key {
        field_bytes(&mut out, 1, key);
    }
    if let Some(value) = value {
        field_bytes(&mut out, 2, value);
    }
    out
}
