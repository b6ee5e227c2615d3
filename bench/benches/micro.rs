//! Micro-benchmarks of the CPU work idem does on every idempotent request, without a database:
//!
//! - `header/parse`: reading and validating the `Idempotency-Key` header
//!   (`parse_key`) in its bare, RFC 8941 quoted and longest forms;
//! - `fingerprint`: hashing a request (`Fingerprint::of`), with
//!   JSON bodies of 1 KiB and 64 KiB (parsed and canonicalised with RFC 8785 first) and the same
//!   64 KiB as `application/octet-stream` (hashed byte for byte), to show what canonicalisation
//!   costs;
//! - `replay/capture`: reading a handler's `201 Created` response into memory
//!   and turning it into its stored form (`StoredResponse::from_response`);
//! - `replay/build`: rebuilding a replayed response from its stored form
//!   (`StoredResponse::replay`).
//!
//! Run with:
//!
//! ```sh
//! cargo bench -p idem-bench --bench micro
//! ```
//!
//! Criterion keeps the last results under `target/criterion` and reports the change against
//! them on the next run; the group and benchmark names are stable so that runs stay comparable.
//! Arguments after `--` filter benchmarks by name, e.g.
//! `cargo bench -p idem-bench --bench micro -- fingerprint`.

use std::{hint::black_box, time::Duration};

use axum::{
    body::{Body, Bytes},
    http::{
        HeaderMap, HeaderValue, Method, Response, StatusCode,
        header::{CONTENT_TYPE, LOCATION},
    },
};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use idem_key::{Fingerprint, IDEMPOTENCY_KEY, MAX_KEY_LEN, parse_key};
use idem_runtime::tasks::StoredResponse;
use serde_json::{Value, json};

/// A UUID v4, the key most clients send.
const UUID_KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

/// The path fingerprinted with every body.
const PATH: &str = "/v1/payments?expand=customer";

/// The body limit `replay/capture` reads with (1 MiB).
const CAPTURE_LIMIT: usize = 1 << 20;

/// The size of the small JSON bodies (request and response), in bytes.
const SMALL_BODY: usize = 1024;

/// The size of the large JSON request body, in bytes.
const LARGE_BODY: usize = 64 * 1024;

/// A header map holding only `Idempotency-Key: <value>`.
fn key_headers(value: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        IDEMPOTENCY_KEY,
        HeaderValue::from_str(value).expect("a valid header value"),
    );
    headers
}

/// A key of exactly [`MAX_KEY_LEN`] visible ASCII characters, the longest accepted.
fn longest_key() -> String {
    let alphabet = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_.~";
    (0..MAX_KEY_LEN)
        .map(|i| char::from(alphabet[(i * 7 + 3) % alphabet.len()]))
        .collect()
}

/// `header/parse`: the bare UUID, the same UUID as a quoted Structured Field String, and the
/// longest key.
fn header_parse(c: &mut Criterion) {
    let longest = longest_key();
    let cases = [
        ("bare_uuid", key_headers(UUID_KEY), UUID_KEY),
        (
            "quoted_uuid",
            key_headers(&format!("\"{UUID_KEY}\"")),
            UUID_KEY,
        ),
        ("bare_255", key_headers(&longest), longest.as_str()),
    ];
    let mut group = c.benchmark_group("header/parse");
    for (name, headers, expected) in &cases {
        let key = parse_key(headers).expect("a valid key");
        assert_eq!(key.as_str(), *expected, "{name} parses to the key");
        group.bench_function(*name, |b| b.iter(|| parse_key(black_box(headers))));
    }
    group.finish();
}

/// A small deterministic pseudo-random generator (64-bit LCG), so that every run benchmarks the
/// same bytes without a `rand` dependency.
struct Lcg(u64);

impl Lcg {
    /// The next number below `bound`.
    fn below(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % bound
    }

    /// A lowercase alphanumeric identifier of `len` characters.
    fn ident(&mut self, len: usize) -> String {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        (0..len)
            .map(|_| char::from(ALPHABET[self.below(ALPHABET.len() as u64) as usize]))
            .collect()
    }
}

/// One order line: a nested object with strings, integers, a boolean, an array and metadata.
fn line_item(rng: &mut Lcg, index: usize) -> Value {
    json!({
        "id": format!("li_{}", rng.ident(14)),
        "position": index,
        "sku": format!("SKU-{:05}", rng.below(100_000)),
        "description": format!("Item {index}: {} {}", rng.ident(8), rng.ident(6)),
        "quantity": 1 + rng.below(9),
        "unit_amount": 100 + rng.below(99_900),
        "taxable": rng.below(2) == 0,
        "tax_rates": [rng.below(2_500), rng.below(2_500)],
        "metadata": {
            "warehouse": format!("wh_{}", rng.ident(4)),
            "batch": rng.below(1_000_000),
        },
    })
}

/// A payment request body of about `target` bytes of compact JSON: a customer object, an address,
/// and as many line items as fit. Integers stay below 2^53 so that the body is canonicalised.
fn json_body(target: usize) -> Vec<u8> {
    let mut rng = Lcg(0x1de7_0000 + target as u64);
    let mut items = Vec::new();
    let mut body = json!({
        "amount": 0,
        "currency": "usd",
        "capture": true,
        "customer": {
            "id": format!("cus_{}", rng.ident(14)),
            "email": format!("{}@example.com", rng.ident(10)),
            "address": {
                "line1": format!("{} Market Street", rng.below(2_000)),
                "city": "San Francisco",
                "postal_code": "94103",
                "country": "US",
            },
        },
        "items": [],
        "description": "Order from the web shop",
    });
    loop {
        let item = line_item(&mut rng, items.len());
        let grown = serde_json::to_vec(&body).expect("serialisable").len()
            + serde_json::to_vec(&item).expect("serialisable").len()
            + 1;
        if grown > target && !items.is_empty() {
            break;
        }
        items.push(item);
        let total: u64 = items
            .iter()
            .map(|i| i["quantity"].as_u64().unwrap_or(0) * i["unit_amount"].as_u64().unwrap_or(0))
            .sum();
        body["amount"] = total.into();
        body["items"] = Value::Array(items.clone());
    }
    let bytes = serde_json::to_vec(&body).expect("serialisable");
    assert_size_near(&bytes, target);
    bytes
}

/// Panics unless `bytes` is within 10% of `target`.
fn assert_size_near(bytes: &[u8], target: usize) {
    let (len, tolerance) = (bytes.len(), target / 10);
    assert!(
        len.abs_diff(target) <= tolerance,
        "body is {len} bytes, wanted {target} ± {tolerance}"
    );
}

/// A header map holding only `Content-Type: <value>`.
fn content_type(value: &'static str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
    headers
}

/// `fingerprint`: 1 KiB and 64 KiB of JSON through the canonicalising path, and the same 64 KiB
/// as `application/octet-stream` through the raw hashing path.
fn fingerprint(c: &mut Criterion) {
    let json = content_type("application/json");
    let octets = content_type("application/octet-stream");
    let small = json_body(SMALL_BODY);
    let large = json_body(LARGE_BODY);

    // The JSON cases must really be canonicalised: the same document spelled differently
    // (pretty-printed) fingerprints the same, whereas as raw bytes it does not.
    for body in [&small, &large] {
        let value: Value = serde_json::from_slice(body).expect("valid JSON");
        let pretty = serde_json::to_vec_pretty(&value).expect("serialisable");
        assert_eq!(
            Fingerprint::of(&Method::POST, PATH, &json, body),
            Fingerprint::of(&Method::POST, PATH, &json, &pretty),
            "the JSON body is canonicalised"
        );
        assert_ne!(
            Fingerprint::of(&Method::POST, PATH, &octets, body),
            Fingerprint::of(&Method::POST, PATH, &octets, &pretty),
            "the octet-stream body is hashed as bytes"
        );
    }

    let cases = [
        ("json_1KiB", &json, &small),
        ("json_64KiB", &json, &large),
        ("octet_stream_64KiB", &octets, &large),
    ];
    let mut group = c.benchmark_group("fingerprint");
    for (name, headers, body) in cases {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                Fingerprint::of(
                    &Method::POST,
                    black_box(PATH),
                    black_box(headers),
                    black_box(body),
                )
            });
        });
    }
    group.finish();
}

/// A ~1 KiB JSON response body, as a handler creating a payment might return.
fn response_body() -> Bytes {
    Bytes::from(json_body(SMALL_BODY))
}

/// The handler's response: `201 Created` with `Location`, `Content-Type` and a JSON body.
fn created_response(body: Bytes) -> Response<Body> {
    Response::builder()
        .status(StatusCode::CREATED)
        .header(LOCATION, "/v1/payments/pay_1de7c0ffee0000000001")
        .header(CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .expect("a valid response")
}

/// `replay/capture`: reading the handler's response (its body a single in-memory chunk, as
/// Axum's `Json` produces) and building the stored form. The response is built outside the
/// measurement; the future runs on a current-thread Tokio runtime created once.
fn replay_capture(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a Tokio runtime");
    let body = response_body();
    let capture = |response| {
        runtime.block_on(async {
            StoredResponse::from_response(response, CAPTURE_LIMIT)
                .await
                .expect("under the limit")
        })
    };
    let stored = capture(created_response(body.clone()));
    assert_eq!(stored.status, 201);
    assert_eq!(stored.headers.len(), 2);
    assert_eq!(stored.body, body);

    let mut group = c.benchmark_group("replay/capture");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("created_json_1KiB", |b| {
        b.iter_batched(
            || created_response(body.clone()),
            |response| capture(black_box(response)),
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

/// `replay/build`: the replayed response from a stored `201` with `Content-Type`, `Location` and
/// a ~1 KiB body. Each iteration gets its own clone of the stored response, made outside the
/// measurement.
fn replay_build(c: &mut Criterion) {
    let stored = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            (
                "location".to_owned(),
                "/v1/payments/pay_1de7c0ffee0000000001".to_owned(),
            ),
        ],
        body: response_body().to_vec(),
    };
    let replayed = stored.clone().replay();
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(replayed.headers()[CONTENT_TYPE], "application/json");
    assert_eq!(
        replayed.headers()[LOCATION],
        "/v1/payments/pay_1de7c0ffee0000000001"
    );
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");

    let mut group = c.benchmark_group("replay/build");
    group.throughput(Throughput::Bytes(stored.body.len() as u64));
    group.bench_function("created_json_1KiB", |b| {
        b.iter_batched(
            || stored.clone(),
            |stored| black_box(stored).replay(),
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

/// Modest settings: the machine running these has two shared cores.
fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50)
}

criterion_group! {
    name = benches;
    config = config();
    targets = header_parse, fingerprint, replay_capture, replay_build
}
criterion_main!(benches);
