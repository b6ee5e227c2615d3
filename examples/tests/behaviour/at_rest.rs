//! The key table read as an attacker who can read the database would: after the
//! example service, started with `IDEM_ENCRYPTION_KEYS`, has answered payments, a refund, an
//! order in steps (its steps recorded at each recovery point, then completed) and gRPC
//! payments, all for one distinctive customer, no column of any row of `idem_keys` holds that
//! customer or any id the answers named (payments, refund, order, charge), on PostgreSQL, SQLite
//! and MySQL. Every column is read, its list taken from the database's catalog (so a column
//! added later is read too), as bytes: a text column's text, a bytes column's bytes; each
//! searched as it is and with its runs of base64 decoded (a sealed step's output is base64 in
//! its JSON). The ids are looked for whole and by their random part. Nor do two sealed values
//! (answers, steps' outputs) begin with one nonce, which would give away the XOR of the two.
//! And an attacker who can write the table and moves a sealed answer onto another key (over
//! HTTP, over gRPC) gets no replay of it there: the seal is bound to its row.
//!
//! The same traffic without keys finds the customer and every id in the table: the probe can
//! fail, and would if sealing stopped.

use crate::support::{self, Database, Processor, free_addr, start_payments_with, wait_until};

use idem_examples::grpc::proto::{CreatePaymentRequest, Payment, payments_client::PaymentsClient};
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::Row;
use tonic::{Request, transport::Channel};

/// The key that seals (`k1`, the bytes 0 to 31).
const KEYS: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// The customer of every request: what the key table must not show.
const CUSTOMER: &str = "cus_attacker_5f3a";

/// Bytes of an AES-GCM nonce, at the head of every sealed value.
const NONCE_LEN: usize = 12;

/// The tenant of every request (its id is the rows' scope, in the clear by design).
const TENANT: &str = "t1";

/// The traffic's keys, each of a request whose answer is stored: two payments over HTTP, a
/// refund (external mode), an order (external mode, in steps), two payments over gRPC.
const KEYS_STORED: [&str; 6] = [
    "attacker-pay-1",
    "attacker-pay-2",
    "attacker-refund-1",
    "attacker-order-1",
    "attacker-grpc-1",
    "attacker-grpc-2",
];

support::on_every_database!(
    with_keys_no_column_of_the_key_table_shows_a_customer_or_a_payment,
    without_keys_the_key_table_shows_the_customer_and_the_payments,
    with_keys_no_two_sealed_values_of_the_key_table_share_a_nonce,
    with_keys_an_answer_moved_to_another_key_is_not_replayed_there,
);

async fn with_keys_no_column_of_the_key_table_shows_a_customer_or_a_payment(database: Database) {
    let table = traffic_then_key_table(&database, Some(KEYS)).await;
    let shown = table.showing_any_needle();
    assert!(
        shown.is_empty(),
        "sealed, yet the key table shows in the clear:\n{}",
        shown.join("\n")
    );
    assert!(
        table.shows("idem-sealed"),
        "the rows name the key that sealed them"
    );
}

/// A nonce used twice under one key gives away the XOR of the two answers (and GCM's
/// authentication key): an attacker who reads the table sees it at the head of each value.
async fn with_keys_no_two_sealed_values_of_the_key_table_share_a_nonce(database: Database) {
    let table = traffic_then_key_table(&database, Some(KEYS)).await;
    let mut sealed: Vec<(String, &str, Vec<u8>)> = Vec::new();
    for (key, column, bytes) in &table.cells {
        match column.as_str() {
            "response_body" => sealed.push((key.clone(), "response_body", bytes.clone())),
            "steps" => {
                let steps: Vec<Value> = serde_json::from_slice(bytes).expect("steps are JSON");
                for step in steps {
                    let data = step["output"]["data"].as_str().unwrap_or_default();
                    let name = step["step"].as_str().unwrap_or_default();
                    sealed.push((
                        format!("{key} step {name}"),
                        "steps",
                        base64_decoded(data.as_bytes()),
                    ));
                }
            }
            _ => {}
        }
    }
    // Six answers and the order's three steps.
    assert!(sealed.len() >= KEYS_STORED.len() + 3, "{sealed:?}");
    let mut seen: std::collections::BTreeMap<&[u8], &str> = std::collections::BTreeMap::new();
    for (what, column, value) in &sealed {
        assert!(
            value.len() > NONCE_LEN,
            "{what} ({column}): too short to be sealed"
        );
        if let Some(earlier) = seen.insert(&value[..NONCE_LEN], what) {
            panic!(
                "{what} ({column}) and {earlier} are sealed with one nonce, {:?}",
                &value[..NONCE_LEN]
            );
        }
    }
}

/// An attacker who can write the table moves a sealed answer onto another key of the same
/// request, over HTTP and over gRPC: the other key's retry must not be answered another
/// payment (the seal is bound to its row's scope and key), but refused, with nothing run.
async fn with_keys_an_answer_moved_to_another_key_is_not_replayed_there(database: Database) {
    let table = traffic_then_key_table(&database, Some(KEYS)).await;
    let (http_paid, grpc_paid) = (&table.answered[1], &table.answered[6]);
    assert!(
        http_paid.starts_with("pay_") && grpc_paid.starts_with("pay_"),
        "{:?}",
        table.answered
    );
    move_answer(&database, KEYS_STORED[0], KEYS_STORED[1]).await;
    move_answer(&database, KEYS_STORED[4], KEYS_STORED[5]).await;
    let payments = database.count("payments").await;

    let client = Client::new();
    let grpc = free_addr();
    let env = [("GRPC_ADDR", grpc.as_str()), ("IDEM_ENCRYPTION_KEYS", KEYS)];
    let (_service, base) =
        start_payments_with(&client, &database, "http://127.0.0.1:9", &env).await;
    let reply = client
        .post(format!("{base}/v1/payments"))
        .bearer_auth(TENANT)
        .header("Idempotency-Key", KEYS_STORED[1])
        .json(&json!({"amount": 4200, "currency": "usd", "customer": CUSTOMER}))
        .send()
        .await
        .expect("the service answers");
    let status = reply.status();
    let body = reply.text().await.expect("a body");
    assert!(
        !body.contains(http_paid.as_str()),
        "{}: the moved answer was replayed: {status} {body}",
        KEYS_STORED[1]
    );
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    let problem: Value = serde_json::from_str(&body).expect("a problem");
    assert_eq!(
        problem["type"],
        idem_runtime::ProblemKind::AnswerUnreadable.type_uri(),
        "{body}"
    );

    let grpc_client = grpc_client(&grpc).await;
    match try_grpc_pay(&grpc_client, KEYS_STORED[5]).await {
        Ok((payment, replayed)) => panic!(
            "{}: answered the payment {payment:?} (replayed: {replayed}), the moved answer's \
             was {grpc_paid}",
            KEYS_STORED[5]
        ),
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
            assert!(!status.message().contains(grpc_paid.as_str()), "{status:?}");
        }
    }
    assert_eq!(
        database.count("payments").await,
        payments,
        "nothing ran again"
    );
}

/// Copies `from`'s stored answer (status, headers, body) onto `to`'s row, as someone who can
/// write the table might.
async fn move_answer(database: &Database, from: &str, to: &str) {
    let moved = match database {
        Database::Postgres { pool, .. } => sqlx::query(
            "UPDATE idem_keys t SET response_status = s.response_status, \
             response_headers = s.response_headers, response_body = s.response_body \
             FROM idem_keys s WHERE s.key = $1 AND t.key = $2",
        )
        .bind(from)
        .bind(to)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()),
        Database::Sqlite { pool, .. } => sqlx::query(
            "UPDATE idem_keys SET \
             (response_status, response_headers, response_body) = \
             (SELECT response_status, response_headers, response_body \
              FROM idem_keys WHERE key = $1) \
             WHERE key = $2",
        )
        .bind(from)
        .bind(to)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()),
        Database::MySql { pool, .. } => sqlx::query(
            "UPDATE idem_keys t JOIN idem_keys s ON s.`key` = ? \
             SET t.response_status = s.response_status, \
             t.response_headers = s.response_headers, t.response_body = s.response_body \
             WHERE t.`key` = ?",
        )
        .bind(from.as_bytes())
        .bind(to.as_bytes())
        .execute(pool)
        .await
        .map(|done| done.rows_affected()),
    }
    .expect("move the answer");
    assert_eq!(moved, 1, "{from}'s answer onto {to}");
}

async fn without_keys_the_key_table_shows_the_customer_and_the_payments(database: Database) {
    let table = traffic_then_key_table(&database, None).await;
    let missed: Vec<&String> = table
        .needles
        .iter()
        .filter(|needle| !table.shows(needle))
        .collect();
    assert!(
        missed.is_empty(),
        "stored in the clear, yet the probe misses {missed:?} among {:?}",
        table.needles
    );
    assert!(
        !table.shows("idem-sealed"),
        "nothing is sealed without keys"
    );
}

/// Every cell of the key table after the traffic, and what must not show in it.
struct KeyTable {
    /// The customer, and every id an answer named.
    needles: Vec<String>,
    /// The customer, then the ids in the order the traffic got them: the HTTP payments, the
    /// refund, the order and its charge, the gRPC payments.
    answered: Vec<String>,
    /// `(row's key, column, bytes)`: a NULL cell is left out.
    cells: Vec<(String, String, Vec<u8>)>,
}

impl KeyTable {
    fn shows(&self, needle: &str) -> bool {
        self.cells
            .iter()
            .any(|(_, _, bytes)| shows(bytes, needle.as_bytes()))
    }

    /// `row key / column: needle` for each needle shown in a cell, with the cell's bytes.
    fn showing_any_needle(&self) -> Vec<String> {
        let mut shown = Vec::new();
        for (key, column, bytes) in &self.cells {
            for needle in &self.needles {
                if shows(bytes, needle.as_bytes()) {
                    shown.push(format!(
                        "  row {key:?}, column {column}: {needle:?} in {:?}",
                        String::from_utf8_lossy(bytes)
                    ));
                }
            }
        }
        shown
    }
}

/// Whether `cell` holds `needle`, as it is or in a run of base64 in it (a sealed step's output
/// is base64 in its JSON: an attacker decodes it).
fn shows(cell: &[u8], needle: &[u8]) -> bool {
    contains(cell, needle)
        || cell
            .split(|byte| !(byte.is_ascii_alphanumeric() || matches!(byte, b'+' | b'/' | b'=')))
            .filter(|run| run.len() >= 8)
            .any(|run| contains(&base64_decoded(run), needle))
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

/// `run` decoded as base64 (standard alphabet), however it is padded, a last digit that makes
/// no byte left out.
fn base64_decoded(run: &[u8]) -> Vec<u8> {
    use base64::{
        Engine as _, alphabet,
        engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig},
    };
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &alphabet::STANDARD,
        GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::RequireNone)
            .with_decode_allow_trailing_bits(true),
    );
    let digits: Vec<u8> = run.iter().copied().filter(|byte| *byte != b'=').collect();
    let whole = digits.len() - usize::from(digits.len() % 4 == 1);
    LENIENT.decode(&digits[..whole]).unwrap_or_default()
}

/// Starts the service on `database` (sealing with `keys` when given), sends it the traffic
/// ([`KEYS_STORED`]), checks its answers and replays, and reads back every cell of the key
/// table.
async fn traffic_then_key_table(database: &Database, keys: Option<&str>) -> KeyTable {
    let client = Client::new();
    let processor = Processor::start(None).await;
    let grpc = free_addr();
    let mut env = vec![("GRPC_ADDR", grpc.as_str())];
    if let Some(keys) = keys {
        env.push(("IDEM_ENCRYPTION_KEYS", keys));
    }
    let (service, base) = start_payments_with(&client, database, &processor.url, &env).await;
    let mut needles = vec![CUSTOMER.to_owned()];

    // Payments over HTTP, each replayed.
    for key in &KEYS_STORED[..2] {
        let body = json!({"amount": 4200, "currency": "usd", "customer": CUSTOMER});
        let payment = post_answered_and_replayed(&client, &base, "/v1/payments", key, &body).await;
        assert_eq!(payment["customer"], CUSTOMER, "{payment}");
        needles.push(id_of(&payment, "id", "pay_"));
    }
    // A refund of the first payment.
    let refunded = needles[1].clone();
    let body = json!({"payment": refunded, "amount": 1000});
    let refund =
        post_answered_and_replayed(&client, &base, "/v1/refunds", KEYS_STORED[2], &body).await;
    assert_eq!(refund["payment"], refunded.as_str(), "{refund}");
    needles.push(id_of(&refund, "id", "re_"));
    // An order: reserve, charge, ship, each recorded on the key as it completes.
    let body = json!({"sku": "sku-attacker", "quantity": 2, "customer": CUSTOMER});
    let order =
        post_answered_and_replayed(&client, &base, "/v1/orders", KEYS_STORED[3], &body).await;
    assert_eq!(
        (order["customer"].as_str(), order["status"].as_str()),
        (Some(CUSTOMER), Some("confirmed")),
        "{order}"
    );
    needles.push(id_of(&order, "id", "ord_"));
    needles.push(id_of(&order, "charge", "ch_"));
    // Payments over gRPC, each replayed.
    let grpc_client = grpc_client(&grpc).await;
    for key in &KEYS_STORED[4..] {
        let (first, replayed) = grpc_pay(&grpc_client, key).await;
        assert!(!replayed, "{key}: the first call ran");
        let (again, replayed) = grpc_pay(&grpc_client, key).await;
        assert!(replayed, "{key}: the retry is a replay");
        assert_eq!(again, first, "{key}: the replay is the payment");
        assert_eq!(
            (first.customer.as_str(), first.status.as_str()),
            (CUSTOMER, "succeeded")
        );
        assert!(first.id.starts_with("pay_"), "{first:?}");
        needles.push(first.id);
    }
    // The table at rest: nothing in flight.
    drop(service);

    let cells = key_table(database).await;
    let keys_seen: Vec<&str> = cells
        .iter()
        .map(|(key, _, _)| key.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for key in KEYS_STORED {
        assert!(
            keys_seen.contains(&key),
            "no row of {key} in the key table: {keys_seen:?}"
        );
    }
    assert!(keys_seen.len() >= KEYS_STORED.len(), "{keys_seen:?}");
    for (key, column, bytes) in &cells {
        if column == "status" && KEYS_STORED.contains(&key.as_str()) {
            assert_eq!(bytes.as_slice(), b"completed", "{key}");
        }
    }
    // The order's steps were recorded at its recovery points (their names stay readable).
    let steps = cells
        .iter()
        .find(|(key, column, _)| key == KEYS_STORED[3] && column == "steps")
        .map(|(_, _, bytes)| String::from_utf8_lossy(bytes).into_owned())
        .expect("the order's steps are recorded");
    for step in ["reserve", "charge", "ship"] {
        assert!(
            steps.contains(&format!("\"{step}\"")),
            "{step} in the steps: {steps}"
        );
    }
    KeyTable {
        needles: with_random_parts(needles.clone()),
        answered: needles,
        cells,
    }
}

/// `POST {path}` of `body` as the tenant under `key`: a 201, and a retry answered the same,
/// marked replayed. The answer, as JSON.
async fn post_answered_and_replayed(
    client: &Client,
    base: &str,
    path: &str,
    key: &str,
    body: &Value,
) -> Value {
    let send = || async {
        let reply = client
            .post(format!("{base}{path}"))
            .bearer_auth(TENANT)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .expect("the service answers");
        let status = reply.status();
        let replayed = reply.headers().contains_key("idempotent-replayed");
        (status, replayed, reply.text().await.expect("a body"))
    };
    let (status, replayed, first) = send().await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, false),
        "{key}: {first}"
    );
    let again = send().await;
    assert_eq!(again, (StatusCode::CREATED, true, first.clone()), "{key}");
    serde_json::from_str(&first).expect("a JSON answer")
}

/// `field` of `answer`, an id that starts with `prefix`.
fn id_of(answer: &Value, field: &str, prefix: &str) -> String {
    let id = answer[field].as_str().unwrap_or_default();
    assert!(id.starts_with(prefix), "{field} of {answer}");
    id.to_owned()
}

/// `ids`, each followed by its part after the prefix (`pay_`, `re_`…): a row that kept only the
/// random part would show the record as well.
fn with_random_parts(ids: Vec<String>) -> Vec<String> {
    ids.into_iter()
        .flat_map(|id| {
            let random = id.split_once('_').map(|(_, random)| random.to_owned());
            std::iter::once(id).chain(random)
        })
        .collect()
}

/// A client of the gRPC service at `addr`, once it accepts.
async fn grpc_client(addr: &str) -> PaymentsClient<Channel> {
    wait_until(&format!("the gRPC service at {addr} to accept"), || async {
        tokio::net::TcpStream::connect(addr).await.is_ok()
    })
    .await;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a URI")
        .connect()
        .await
        .expect("connect to the gRPC service");
    PaymentsClient::new(channel)
}

/// `CreatePayment` for [`CUSTOMER`] as the tenant under `key`: the payment, and whether it was
/// a replay.
async fn grpc_pay(client: &PaymentsClient<Channel>, key: &str) -> (Payment, bool) {
    try_grpc_pay(client, key)
        .await
        .unwrap_or_else(|status| panic!("{key}: {status:?}"))
}

/// [`grpc_pay`], its refusal returned.
async fn try_grpc_pay(
    client: &PaymentsClient<Channel>,
    key: &str,
) -> Result<(Payment, bool), tonic::Status> {
    let mut request = Request::new(CreatePaymentRequest {
        amount: 4200,
        currency: "usd".to_owned(),
        customer: CUSTOMER.to_owned(),
        metadata: Default::default(),
    });
    let metadata = request.metadata_mut();
    metadata.insert(
        "authorization",
        format!("Bearer {TENANT}").parse().expect("a value"),
    );
    metadata.insert("idempotency-key", key.parse().expect("a value"));
    let response = client.clone().create_payment(request).await?;
    let replayed = response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true");
    Ok((response.into_inner(), replayed))
}

/// Every non-NULL cell of `idem_keys` as `(row's key, column, bytes)`: the columns as the
/// database's catalog lists them, each read as bytes (a bytes column as stored, any other as
/// its text).
async fn key_table(database: &Database) -> Vec<(String, String, Vec<u8>)> {
    let (columns, rows) = match database {
        Database::Postgres { pool, .. } => {
            let columns: Vec<(String, String)> = sqlx::query_as(
                "SELECT column_name::text, data_type::text FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name = 'idem_keys' \
                 ORDER BY ordinal_position",
            )
            .fetch_all(pool)
            .await
            .expect("the key table's columns");
            let read: Vec<String> = columns
                .iter()
                .map(|(name, kind)| {
                    let name = format!("\"{}\"", name.replace('"', "\"\""));
                    if kind == "bytea" {
                        name
                    } else {
                        format!("convert_to({name}::text, 'UTF8')")
                    }
                })
                .collect();
            let rows = sqlx::query(sqlx::AssertSqlSafe(select(&read)))
                .fetch_all(pool)
                .await
                .expect("the key table");
            (columns, cells_of(&rows))
        }
        Database::Sqlite { pool, .. } => {
            let columns: Vec<(String, String)> = sqlx::query_as(
                "SELECT name, type FROM pragma_table_info('idem_keys') ORDER BY cid",
            )
            .fetch_all(pool)
            .await
            .expect("the key table's columns");
            let read: Vec<String> = columns
                .iter()
                .map(|(name, _)| format!("CAST(\"{}\" AS BLOB)", name.replace('"', "\"\"")))
                .collect();
            let rows = sqlx::query(sqlx::AssertSqlSafe(select(&read)))
                .fetch_all(pool)
                .await
                .expect("the key table");
            (columns, cells_of(&rows))
        }
        Database::MySql { pool, .. } => {
            let columns: Vec<(String, String)> = sqlx::query_as(
                "SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) \
                 FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name = 'idem_keys' \
                 ORDER BY ordinal_position",
            )
            .fetch_all(pool)
            .await
            .expect("the key table's columns");
            let read: Vec<String> = columns
                .iter()
                .map(|(name, _)| format!("CAST(`{}` AS BINARY)", name.replace('`', "``")))
                .collect();
            let rows = sqlx::query(sqlx::AssertSqlSafe(select(&read)))
                .fetch_all(pool)
                .await
                .expect("the key table");
            (columns, cells_of(&rows))
        }
    };
    let names: Vec<&str> = columns.iter().map(|(name, _)| name.as_str()).collect();
    for expected in ["key", "response_headers", "response_body", "steps"] {
        assert!(
            names.contains(&expected),
            "the catalog lists {names:?}, without {expected}"
        );
    }
    let key_column = names
        .iter()
        .position(|name| *name == "key")
        .expect("a key column");
    let mut cells = Vec::new();
    for row in rows {
        let key = row[key_column]
            .as_deref()
            .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
            .expect("every row has a key");
        for (column, value) in names.iter().zip(row) {
            if let Some(bytes) = value {
                cells.push((key.clone(), (*column).to_owned(), bytes));
            }
        }
    }
    cells
}

fn select(columns: &[String]) -> String {
    format!("SELECT {} FROM idem_keys", columns.join(", "))
}

/// Each row's columns, in order, as bytes (`None` for NULL).
fn cells_of<R>(rows: &[R]) -> Vec<Vec<Option<Vec<u8>>>>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    rows.iter()
        .map(|row| {
            (0..row.len())
                .map(|i| row.try_get(i).expect("a column read as bytes"))
                .collect()
        })
        .collect()
}

#[test]
fn the_probe_finds_a_customer_written_as_base64_in_json() {
    // `{"customer":"cus_attacker_5f3a"}` in base64, as a step's `data` would hold it unsealed.
    let cell = br#"[{"step":"reserve","output":{"data":"eyJjdXN0b21lciI6ImN1c19hdHRhY2tlcl81ZjNhIn0=","idem-sealed":"k1"}}]"#;
    assert!(shows(cell, CUSTOMER.as_bytes()));
    assert!(!shows(cell, b"cus_someone_else"));
}
