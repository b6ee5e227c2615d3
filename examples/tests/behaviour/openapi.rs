//! `GET /openapi.json` and `GET /idempotency-policy` of the real `payments` binary: a valid
//! OpenAPI 3.1 document that describes every route the service serves, with the idempotency
//! part on exactly the `#[idempotent]` operations; and a policy generated from the handlers'
//! attributes, as the guide's Operations chapter quotes it.
//!
//! The document is validated against the OpenAPI Initiative's JSON Schema for OpenAPI 3.1
//! (`tests/data/openapi-3.1.schema.json`, published at
//! <https://spec.openapis.org/oas/3.1/schema/2022-10-07>), its component schemas against JSON
//! Schema 2020-12, and every `$ref` is resolved.

use crate::support;

use std::collections::BTreeSet;

use idem_examples::api_doc::{self, ApiDoc};
use reqwest::{Client, StatusCode};
use serde_json::Value;
use support::{Process, start_payments};
use utoipa::OpenApi;

/// Every route `cargo run --bin payments` serves, as the guide lists them.
const ROUTES: &[&str] = &[
    "POST /v1/payments",
    "GET /v1/payments",
    "GET /v1/payments/{id}",
    "POST /v1/payouts",
    "GET /v1/payouts",
    "GET /v1/payouts/{id}",
    "POST /v1/refunds",
    "GET /v1/refunds",
    "GET /v1/refunds/{id}",
    "POST /v1/orders",
    "GET /v1/orders",
    "GET /v1/orders/{id}",
    "GET /v1/inventory/{sku}",
    "POST /v1/webhooks/processor",
    "GET /v1/balance",
    "GET /metrics",
    "GET /openapi.json",
    "GET /idempotency-policy",
];

/// The routes whose handlers are `#[idempotent]`.
const IDEMPOTENT: &[&str] = &[
    "POST /v1/payments",
    "POST /v1/payouts",
    "POST /v1/refunds",
    "POST /v1/orders",
    "POST /v1/webhooks/processor",
];

/// The header each idempotent route takes its key from: `Idempotency-Key` but for the webhook
/// receiver, whose key is the delivery's `webhook-id` (`key_header`).
fn key_header(route: &str) -> &'static str {
    match route {
        "POST /v1/webhooks/processor" => "webhook-id",
        _ => "Idempotency-Key",
    }
}

/// The layer's own problem answers, documented on every idempotent route.
const LAYER_PROBLEMS: &[&str] = &["400", "409", "413", "422", "500", "503"];

struct Service {
    _process: Process,
    _dir: tempfile::TempDir,
    base: String,
    client: Client,
}

async fn service() -> Service {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let database = support::sqlite(&dir).await;
    let client = Client::new();
    let (process, base) = start_payments(&client, &database, "http://127.0.0.1:9").await;
    Service {
        _process: process,
        _dir: dir,
        base,
        client,
    }
}

async fn document(service: &Service) -> Value {
    let answer = service
        .client
        .get(format!("{}/openapi.json", service.base))
        .send()
        .await
        .expect("GET /openapi.json");
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(
        answer.headers()["content-type"],
        "application/json",
        "the document's media type"
    );
    answer.json().await.expect("a JSON document")
}

/// `(route, operation)` for every operation of the document, as `"POST /v1/payments"`.
fn operations(document: &Value) -> Vec<(String, &Value)> {
    let paths = document["paths"].as_object().expect("paths");
    paths
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .expect("a path item")
                .iter()
                .filter(|(method, _)| {
                    ["get", "put", "post", "delete", "patch", "head", "options"]
                        .contains(&method.as_str())
                })
                .map(move |(method, op)| (format!("{} {path}", method.to_uppercase()), op))
        })
        .collect()
}

/// Every `$ref` anywhere in `value`.
fn refs<'a>(value: &'a Value, found: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(target)) = map.get("$ref") {
                found.push(target);
            }
            map.values().for_each(|v| refs(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, found)),
        _ => {}
    }
}

/// Every Schema Object of the document (component schemas, and the `schema` of parameters,
/// headers and media types), with where it is.
fn schema_objects<'a>(value: &'a Value, at: &str, found: &mut Vec<(String, &'a Value)>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let here = format!("{at}/{key}");
                if key == "schema" && child.is_object() {
                    found.push((here.clone(), child));
                } else if at == "/components/schemas" {
                    found.push((here.clone(), child));
                    continue;
                }
                schema_objects(child, &here, found);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                schema_objects(child, &format!("{at}/{i}"), found);
            }
        }
        _ => {}
    }
}

/// Follows `target` (`#/components/...`) in `document`.
fn resolve<'a>(document: &'a Value, target: &str) -> Option<&'a Value> {
    document.pointer(target.strip_prefix('#')?)
}

#[tokio::test]
async fn openapi_json_is_a_valid_openapi_3_1_document() {
    let service = service().await;
    let document = document(&service).await;
    let validator = assert_valid_openapi(&document);
    // The validator does refuse what is not OpenAPI: a response that is not an object, a
    // parameter in the body (OpenAPI 2).
    let mut broken = document.clone();
    broken["paths"]["/v1/payments"]["post"]["responses"]["201"] = Value::from("created");
    assert!(!validator.is_valid(&broken), "a response must be an object");
    let mut broken = document.clone();
    broken["paths"]["/v1/payments"]["post"]["parameters"][0]["in"] = Value::from("body");
    assert!(
        !validator.is_valid(&broken),
        "`in: body` is not OpenAPI 3.1"
    );
}

/// The ledger, the example's other service, describes its routes too (none idempotent).
#[tokio::test]
async fn the_ledgers_document_is_valid_and_describes_its_routes() {
    use tower::ServiceExt;
    let router = api_doc::ledger_router().expect("the ledger's document renders");
    let answer = router
        .oneshot(
            axum::http::Request::get("/openapi.json")
                .body(axum::body::Body::empty())
                .expect("a request"),
        )
        .await
        .expect("the router answers");
    assert_eq!(answer.status(), StatusCode::OK);
    let bytes = axum::body::to_bytes(answer.into_body(), usize::MAX)
        .await
        .expect("a body");
    let document: Value = serde_json::from_slice(&bytes).expect("JSON");
    assert_valid_openapi(&document);
    let routes: BTreeSet<String> = operations(&document)
        .into_iter()
        .map(|(route, _)| route)
        .collect();
    let expected: BTreeSet<String> = ["GET /v1/ledger", "GET /metrics", "GET /openapi.json"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(routes, expected);
    for (route, operation) in operations(&document) {
        assert!(
            operation["parameters"]
                .as_array()
                .is_none_or(|parameters| parameters.iter().all(|p| p["name"] != "Idempotency-Key")),
            "{route} is not idempotent"
        );
    }
}

/// Checks `document` against the OpenAPI 3.1 schema, each Schema Object against JSON Schema
/// 2020-12, and every `$ref`; returns the validator.
fn assert_valid_openapi(document: &Value) -> jsonschema::Validator {
    assert_eq!(document["openapi"], "3.1.0");
    let schema: Value =
        serde_json::from_str(include_str!("../data/openapi-3.1.schema.json")).expect("the schema");
    let validator = jsonschema::validator_for(&schema).expect("the OpenAPI 3.1 schema compiles");
    let errors: Vec<String> = validator
        .iter_errors(document)
        .map(|error| format!("{} at {}", error, error.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "not a valid OpenAPI 3.1 document:\n{}",
        errors.join("\n")
    );

    // The OpenAPI schema leaves Schema Objects to JSON Schema: each, in the components and
    // inline, against the 2020-12 meta-schema.
    let mut schemas = Vec::new();
    schema_objects(document, "", &mut schemas);
    assert!(!schemas.is_empty(), "the document has schemas");
    for (at, schema) in schemas {
        if let Err(error) = jsonschema::meta::validate(schema) {
            panic!("the schema at {at} is not valid JSON Schema: {error}");
        }
    }

    let mut found = Vec::new();
    refs(document, &mut found);
    assert!(!found.is_empty(), "the document uses references");
    for target in found {
        assert!(
            resolve(document, target).is_some(),
            "{target} refers to nothing"
        );
    }
    validator
}

#[tokio::test]
async fn every_route_is_documented_and_every_documented_route_is_served() {
    let service = service().await;
    let document = document(&service).await;
    let documented: BTreeSet<String> = operations(&document)
        .into_iter()
        .map(|(route, _)| route)
        .collect();
    let served: BTreeSet<String> = ROUTES.iter().map(|r| (*r).to_owned()).collect();
    assert_eq!(documented, served, "documented routes against served ones");

    let mut ids = BTreeSet::new();
    for (route, operation) in operations(&document) {
        let id = operation["operationId"].as_str().expect("an operationId");
        assert!(ids.insert(id.to_owned()), "operationId {id} used twice");

        // The router answers each documented route itself: not its fallback's empty 404,
        // not 405 (wrong method).
        let (method, path) = route.split_once(' ').expect("method and path");
        let url = format!(
            "{}{}",
            service.base,
            path.replace("{id}", "x_1").replace("{sku}", "sku-1")
        );
        let request = match method {
            "GET" => service.client.get(&url),
            "POST" => service
                .client
                .post(&url)
                .header("Idempotency-Key", format!("probe-{id}"))
                .json(&serde_json::json!({})),
            other => panic!("no method {other} expected"),
        };
        let answer = request
            .bearer_auth("tenant-doc")
            .send()
            .await
            .expect(&route);
        let status = answer.status();
        let body = answer.bytes().await.expect("a body");
        assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{route}");
        assert!(
            !(status == StatusCode::NOT_FOUND && body.is_empty()),
            "{route} is documented but not routed"
        );
    }
}

#[tokio::test]
async fn idempotent_operations_document_the_key_header_and_the_layer_problems() {
    let service = service().await;
    let document = document(&service).await;
    for (route, operation) in operations(&document) {
        let parameters = operation["parameters"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let key = parameters.iter().find(|p| {
            p["in"] == "header"
                && p["name"]
                    .as_str()
                    .is_some_and(|name| name.eq_ignore_ascii_case(key_header(&route)))
        });
        let asks_for_another_key = parameters.iter().any(|p| {
            p["in"] == "header"
                && p["name"] == "Idempotency-Key"
                && key_header(&route) != "Idempotency-Key"
        });
        assert!(
            !asks_for_another_key,
            "{route} takes its key from `{}`, yet documents `Idempotency-Key`",
            key_header(&route)
        );
        let responses = operation["responses"].as_object().expect("responses");
        if !IDEMPOTENT.contains(&route.as_str()) {
            assert!(
                key.is_none(),
                "{route} is not idempotent but asks for a key"
            );
            for status in ["409", "413"] {
                assert!(
                    !responses.contains_key(status),
                    "{route} is not idempotent but documents {status}"
                );
            }
            continue;
        }
        let key =
            key.unwrap_or_else(|| panic!("{route} documents no {} header", key_header(&route)));
        assert_eq!(key["required"], true, "{route}: the key is required");
        assert_eq!(key["schema"]["type"], "string");

        for status in LAYER_PROBLEMS {
            let response = &responses
                .get(*status)
                .unwrap_or_else(|| panic!("{route} does not document {status}"));
            let schema = &response["content"]["application/problem+json"]["schema"];
            let target = schema["$ref"]
                .as_str()
                .unwrap_or_else(|| panic!("{route} {status}: no problem+json schema"));
            let problem = resolve(&document, target).expect("the problem schema");
            for field in ["type", "title", "status"] {
                assert!(
                    problem["required"]
                        .as_array()
                        .is_some_and(|r| r.contains(&Value::from(field))),
                    "{route} {status}: the problem schema requires {field}"
                );
            }
        }
        for status in ["409", "503"] {
            assert!(
                responses[status]["headers"].get("Retry-After").is_some(),
                "{route}: {status} documents Retry-After"
            );
        }
        // The webhook receiver answers 200; the others create.
        let success = if route == "POST /v1/webhooks/processor" {
            "200"
        } else {
            "201"
        };
        assert!(
            responses[success]["headers"]
                .get("Idempotent-Replayed")
                .is_some(),
            "{route}: {success} documents Idempotent-Replayed"
        );
        // The handler's own 503 is replayed only where 5xx outcomes are kept.
        let replayed_503 = responses["503"]["headers"]
            .get("Idempotent-Replayed")
            .is_some();
        assert_eq!(
            replayed_503,
            route == "POST /v1/payouts",
            "{route}: only payouts (replay_5xx = true) replay a 503"
        );

        // What the document says is what the service does: no key, the documented 400.
        let path = route.split_once(' ').expect("method and path").1;
        let answer = service
            .client
            .post(format!("{}{path}", service.base))
            .bearer_auth("tenant-doc")
            .json(&serde_json::json!({"amount": 1, "currency": "usd", "customer": "c"}))
            .send()
            .await
            .expect(&route);
        assert_eq!(answer.status(), StatusCode::BAD_REQUEST, "{route}");
        assert_eq!(
            answer.headers()["content-type"],
            "application/problem+json",
            "{route}"
        );
    }
}

#[tokio::test]
async fn each_operation_states_the_retention_of_its_attribute() {
    let service = service().await;
    let document = document(&service).await;
    let description = |route: &str| {
        operations(&document)
            .into_iter()
            .find(|(r, _)| r == route)
            .and_then(|(_, op)| op["description"].as_str().map(str::to_owned))
            .unwrap_or_else(|| panic!("{route} has a description"))
    };
    // retention = "24h", replay_5xx = false
    let payments = description("POST /v1/payments");
    assert!(
        payments.contains("for at least 24 hours after"),
        "{payments}"
    );
    assert!(payments.contains("A 5xx outcome is not kept"), "{payments}");
    // retention = "7d", replay_5xx = true
    let payouts = description("POST /v1/payouts");
    assert!(payouts.contains("for at least 7 days after"), "{payouts}");
    assert!(payouts.contains("A 5xx outcome is kept"), "{payouts}");
    // External mode, lease = "5s"
    let refunds = description("POST /v1/refunds");
    assert!(refunds.contains("lease of 5 seconds"), "{refunds}");
    // Steps, lease = "5s"
    // retention = "7d", the key from `webhook-id`
    let webhooks = description("POST /v1/webhooks/processor");
    assert!(webhooks.contains("for at least 7 days after"), "{webhooks}");
    let orders = description("POST /v1/orders");
    assert!(orders.contains("after its last completed step"), "{orders}");
    assert!(
        document["info"]["description"].as_str().is_some_and(
            |d| d.contains("## Idempotency") && d.contains("`POST /v1/payouts` | 7 days")
        ),
        "the document's description carries the policy"
    );
}

#[tokio::test]
async fn the_published_policy_comes_from_the_attributes_and_the_readme_quotes_it() {
    let service = service().await;
    let answer = service
        .client
        .get(format!("{}/idempotency-policy", service.base))
        .send()
        .await
        .expect("GET /idempotency-policy");
    assert_eq!(answer.status(), StatusCode::OK);
    let served = answer.text().await.expect("text");
    let generated = api_doc::policy();
    assert_eq!(served, generated, "the service serves the generated policy");
    for row in [
        "| `POST /v1/payments` | 24 hours | 409 with `Retry-After`; with `Prefer: wait`, waits up \
         to 10 seconds for the outcome | not kept",
        "| `POST /v1/payouts` | 7 days | 409 with `Retry-After` | kept and replayed",
        "| `POST /v1/refunds` | 24 hours | 409 with `Retry-After` | not kept: a retry runs the \
         request again | 409 at least until its lease of 5 seconds has run out, then a retry runs \
         the request again |",
        "| `POST /v1/orders` | 24 hours | 409 with `Retry-After` | not kept: a retry continues the \
         request after its last completed step |",
        "| `POST /v1/orders` | 24 hours |",
        "| `POST /v1/webhooks/processor` | 7 days | 409 with `Retry-After` | not kept: a retry \
         runs the request again | committed with its outcome, or nothing kept |",
        "the key is the `webhook-id` header |",
        "| `gRPC /idem.example.v1.Payments/CreatePayment` | 24 hours | `ABORTED` with \
         `retry-after` and `grpc-retry-pushback-ms`; with `prefer: wait`, waits up to 10 seconds \
         for the outcome | not kept (statuses such as `UNAVAILABLE`, `INTERNAL`): a retry runs \
         the request again |",
    ] {
        assert!(generated.contains(row), "{row} in:\n{generated}");
    }

    let chapter = include_str!("../../../docs/guide/operations.md");
    assert!(
        chapter.contains(&generated),
        "the guide's \"The published retention policy\" (docs/guide/operations.md) is not the \
         generated policy; paste `curl localhost:3000/idempotency-policy` into it:\n{generated}"
    );
}

#[test]
fn every_idempotent_handler_linked_in_is_documented() {
    let document = ApiDoc::openapi();
    let names: BTreeSet<&str> = idem_runtime::policy::handlers().map(|h| h.name()).collect();
    for name in [
        "create_payment",
        "create_payout",
        "create_refund",
        "create_order",
    ] {
        assert!(names.contains(name), "{name} is registered: {names:?}");
    }
    // The example's own: the harness of idem-tests, linked in beside it, has test handlers.
    let missing: Vec<_> = idem_openapi::undocumented_handlers(&document)
        .iter()
        .filter(|h| h.module().starts_with("idem_examples"))
        .map(|h| format!("{}::{}", h.module(), h.name()))
        .collect();
    assert!(missing.is_empty(), "undocumented: {missing:?}");
}
