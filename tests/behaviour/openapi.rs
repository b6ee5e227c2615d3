//! `idem_openapi::Idempotency` on documents of its own: what it adds to an idempotent
//! operation (and merges with what the operation says itself), what it leaves alone, and the
//! policy text it derives from each handler's attribute.

use axum::{extract::Path, http::StatusCode};
use idem_openapi::{Idempotency, PROBLEM_SCHEMA, retention_policy, undocumented_handlers};
use idem_runtime::{
    idempotent,
    policy::{KeyScope, Mode, handlers},
};
use serde_json::Value;
use sqlx::{Sqlite, Transaction};
use utoipa::OpenApi;

/// Creates a thing.
///
/// The handler's own words come first.
#[utoipa::path(
    post,
    path = "/things/{account}",
    params(("account" = String, Path)),
    responses(
        (status = 201, description = "Created."),
        (status = 400, description = "The thing is invalid."),
    )
)]
#[idempotent(scope = "account", retention = "90m", replay_5xx = true, wait = "10s")]
async fn create_thing(
    Path(account): Path<String>,
    _tx: &mut Transaction<'_, Sqlite>,
) -> StatusCode {
    let _ = account;
    StatusCode::CREATED
}

/// Keys shared by everyone, in external mode.
#[utoipa::path(post, path = "/global", responses((status = 202, description = "Accepted.")))]
#[idempotent(external, global, retention = "7d", lease = "45s", backend = Sqlite)]
async fn global_job() -> StatusCode {
    StatusCode::ACCEPTED
}

/// Renamed in the document: not recognised (the guide says to keep the default id).
#[utoipa::path(post, path = "/renamed", operation_id = "somethingElse",
    responses((status = 201, description = "Created.")))]
#[idempotent(global, retention = "1h")]
async fn renamed(_tx: &mut Transaction<'_, Sqlite>) -> StatusCode {
    StatusCode::CREATED
}

/// Receives a webhook.
#[utoipa::path(post, path = "/hooks", responses((status = 200, description = "Received.")))]
#[idempotent(global, key_header = "Webhook-Id", retention = "3d")]
async fn receive_hook(_tx: &mut Transaction<'_, Sqlite>) -> StatusCode {
    StatusCode::OK
}

/// Takes its key from the body, or runs without one.
#[utoipa::path(post, path = "/forms", responses((status = 201, description = "Created.")))]
#[idempotent(global, key_pointer = "/request_id", key_optional)]
async fn submit_form(_tx: &mut Transaction<'_, Sqlite>) -> StatusCode {
    StatusCode::CREATED
}

/// Not idempotent.
#[utoipa::path(get, path = "/things", responses((status = 200, description = "The things.")))]
#[allow(dead_code)]
async fn list_things() -> StatusCode {
    StatusCode::OK
}

mod elsewhere {
    use super::*;

    /// Same name as the one below, other settings.
    #[idempotent(global, retention = "2h")]
    pub async fn clash(_tx: &mut Transaction<'_, Sqlite>) -> StatusCode {
        StatusCode::CREATED
    }

    /// Same name and settings as `same_settings::twin`.
    #[idempotent(global, retention = "3h")]
    pub async fn twin(_tx: &mut Transaction<'_, Sqlite>) -> StatusCode {
        StatusCode::CREATED
    }
}

mod elsewhere_too {
    use super::*;

    /// Same name as the one above, other settings.
    #[idempotent(global, retention = "4h")]
    pub async fn clash(_tx: &mut Transaction<'_, Sqlite>) -> StatusCode {
        StatusCode::CREATED
    }

    /// Same name and settings as `elsewhere::twin`.
    #[idempotent(global, retention = "3h")]
    pub async fn twin(_tx: &mut Transaction<'_, Sqlite>) -> StatusCode {
        StatusCode::CREATED
    }
}

#[utoipa::path(post, path = "/clash", responses((status = 201, description = "Created.")))]
#[allow(dead_code)]
fn clash() {}

#[utoipa::path(post, path = "/twin", responses((status = 201, description = "Created.")))]
#[allow(dead_code)]
fn twin() {}

#[derive(OpenApi)]
#[openapi(
    paths(create_thing, global_job, renamed, list_things),
    modifiers(&Idempotency)
)]
struct Doc;

#[derive(OpenApi)]
#[openapi(paths(list_things), modifiers(&Idempotency))]
struct PlainDoc;

#[derive(OpenApi)]
#[openapi(paths(receive_hook, submit_form), modifiers(&Idempotency))]
struct KeySourcesDoc;

/// The same operations, before the modifier.
#[derive(OpenApi)]
#[openapi(paths(create_thing, global_job))]
struct RawDoc;

#[derive(OpenApi)]
#[openapi(paths(clash), modifiers(&Idempotency))]
struct ClashDoc;

#[derive(OpenApi)]
#[openapi(paths(twin), modifiers(&Idempotency))]
struct TwinDoc;

fn json(doc: &utoipa::openapi::OpenApi) -> Value {
    serde_json::to_value(doc).expect("the document serializes")
}

#[test]
fn a_key_in_another_header_or_the_body_is_where_the_document_says() {
    let doc = json(&KeySourcesDoc::openapi());
    let hook = &doc["paths"]["/hooks"]["post"];
    let names: Vec<&str> = hook["parameters"]
        .as_array()
        .expect("parameters")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(
        names,
        ["webhook-id"],
        "the key's header, and no Idempotency-Key"
    );
    assert_eq!(hook["parameters"][0]["in"], "header");
    assert_eq!(hook["parameters"][0]["required"], true);
    assert_eq!(
        hook["x-idempotency-key"],
        serde_json::json!({"in": "header", "name": "webhook-id", "required": true})
    );
    let text = hook["description"].as_str().expect("a description");
    assert!(text.contains("the `webhook-id` header"), "{text}");

    let form = &doc["paths"]["/forms"]["post"];
    assert!(
        form["parameters"].as_array().is_none_or(Vec::is_empty),
        "a key in the body is no header parameter: {form}"
    );
    assert_eq!(
        form["x-idempotency-key"],
        serde_json::json!({"in": "body", "pointer": "/request_id", "required": false})
    );
    let text = form["description"].as_str().expect("a description");
    assert!(text.contains("the body's `/request_id` field"), "{text}");
    assert!(text.contains("The key is optional"), "{text}");

    let policy = retention_policy(&KeySourcesDoc::openapi()).to_string();
    assert!(
        policy.contains("the key is the `webhook-id` header"),
        "{policy}"
    );
    assert!(
        policy.contains("the key is the body's `/request_id` field, optional"),
        "{policy}"
    );
}

#[test]
fn the_attribute_registers_its_settings() {
    let thing = handlers()
        .find(|h| h.name() == "create_thing")
        .expect("create_thing is registered");
    assert_eq!(thing.scope(), KeyScope::Parameter("account"));
    assert_eq!(thing.mode(), Mode::Transactional);
    assert_eq!(thing.retention().as_secs(), 90 * 60);
    assert!(thing.replay_5xx());
    assert_eq!(thing.lease(), None, "a transactional claim has no lease");
    assert!(thing.module().ends_with("openapi"), "{}", thing.module());

    let job = handlers()
        .find(|h| h.name() == "global_job")
        .expect("global_job is registered");
    assert_eq!(job.scope(), KeyScope::Global);
    assert_eq!(job.mode(), Mode::External);
    assert_eq!(job.lease().map(|l| l.as_secs()), Some(45));
    assert!(!job.replay_5xx(), "the default");
}

#[test]
fn an_idempotent_operation_gets_the_header_the_problems_and_its_policy() {
    let doc = json(&Doc::openapi());
    let op = &doc["paths"]["/things/{account}"]["post"];

    let key = op["parameters"]
        .as_array()
        .expect("parameters")
        .iter()
        .find(|p| p["name"] == "Idempotency-Key")
        .expect("the key parameter");
    assert_eq!(key["in"], "header");
    assert_eq!(key["required"], true);

    let description = op["description"].as_str().expect("a description");
    assert!(
        description.starts_with("The handler's own words come first."),
        "{description}"
    );
    assert!(
        description.contains("for at least 1 hour 30 minutes after"),
        "{description}"
    );
    assert!(
        description.contains("A 5xx outcome is kept"),
        "{description}"
    );
    assert!(
        description.contains("separate for each caller"),
        "{description}"
    );

    let problem = format!("#/components/schemas/{PROBLEM_SCHEMA}");
    for status in ["409", "413", "422", "500", "503"] {
        let response = &op["responses"][status];
        assert_eq!(
            response["content"]["application/problem+json"]["schema"]["$ref"], problem,
            "{status}"
        );
    }
    assert!(op["responses"]["409"]["headers"]["Retry-After"].is_object());
    assert!(op["responses"]["503"]["headers"]["Retry-After"].is_object());
    // The operation's own 400 keeps its words and gains the layer's case.
    let bad = &op["responses"]["400"];
    let text = bad["description"].as_str().expect("a description");
    assert!(text.starts_with("The thing is invalid."), "{text}");
    assert!(text.contains("Idempotency-Key header is missing"), "{text}");
    assert!(bad["content"]["application/problem+json"].is_object());
    assert!(op["responses"]["201"]["headers"]["Idempotent-Replayed"].is_object());
    assert!(doc["components"]["schemas"][PROBLEM_SCHEMA].is_object());

    // `wait = "10s"`: the `Prefer` parameter, the marked replay, and the policy say so.
    let prefer = op["parameters"]
        .as_array()
        .expect("parameters")
        .iter()
        .find(|p| p["name"] == "Prefer")
        .expect("the Prefer parameter");
    assert_eq!(prefer["in"], "header");
    assert_eq!(prefer["required"], false);
    let words = prefer["description"].as_str().expect("a description");
    assert!(words.contains("at most 10"), "{words}");
    assert!(op["responses"]["201"]["headers"]["Preference-Applied"].is_object());
    assert!(
        description.contains("waits for its outcome (at most 10 seconds)"),
        "{description}"
    );
    let global_params = doc["paths"]["/global"]["post"]["parameters"]
        .as_array()
        .expect("parameters");
    assert!(
        global_params.iter().all(|p| p["name"] != "Prefer"),
        "a handler without `wait` takes no Prefer"
    );

    let global = &doc["paths"]["/global"]["post"]["description"];
    let global = global.as_str().expect("a description");
    assert!(global.contains("shared by all callers"), "{global}");
    assert!(global.contains("lease of 45 seconds"), "{global}");
}

#[test]
fn other_operations_are_left_alone() {
    let doc = json(&Doc::openapi());
    let list = &doc["paths"]["/things"]["get"];
    assert!(list["parameters"].is_null(), "{list}");
    assert!(list["responses"]["409"].is_null(), "{list}");
    assert!(
        list["description"]
            .as_str()
            .is_none_or(|d| !d.contains("Idempotent"))
    );

    // A renamed operation is not recognised, and the check for tests says so.
    let renamed = &doc["paths"]["/renamed"]["post"];
    assert!(renamed["parameters"].is_null(), "{renamed}");
    let missing: Vec<&str> = undocumented_handlers(&Doc::openapi())
        .iter()
        .map(|h| h.name())
        .collect();
    assert!(missing.contains(&"renamed"), "{missing:?}");
    assert!(!missing.contains(&"create_thing"), "{missing:?}");

    // A document with no idempotent operation is not touched at all.
    let plain = json(&PlainDoc::openapi());
    assert!(plain["components"]["schemas"][PROBLEM_SCHEMA].is_null());
    assert!(
        plain["info"]["description"]
            .as_str()
            .is_none_or(|d| !d.contains("Idempotency"))
    );
}

#[test]
fn the_policy_lists_each_idempotent_operation_with_its_attribute() {
    let policy = retention_policy(&Doc::openapi()).to_string();
    assert!(
        policy.contains(
            "| `POST /things/{account}` | 1 hour 30 minutes | 409 with `Retry-After`; with \
             `Prefer: wait`, waits up to 10 seconds for the outcome | kept and replayed | \
             committed with its outcome, or nothing kept | per caller |"
        ),
        "{policy}"
    );
    assert!(
        policy.contains(
            "| `POST /global` | 7 days | 409 with `Retry-After` | not kept: a retry runs the \
             request again | 409 at least \
             until its lease of 45 seconds has run out, then a retry runs the request again | \
             shared by all callers |"
        ),
        "{policy}"
    );
    assert!(
        !policy.contains("/things` |"),
        "GET /things is not idempotent:\n{policy}"
    );
    let info = Doc::openapi().info.description.unwrap_or_default();
    assert!(
        info.contains(&policy),
        "the document's description holds it"
    );
}

#[test]
#[should_panic(expected = "give the handlers distinct names")]
fn two_handlers_of_one_name_with_different_settings_are_refused() {
    let _ = ClashDoc::openapi();
}

#[test]
fn two_handlers_of_one_name_with_the_same_settings_are_one_policy() {
    let doc = json(&TwinDoc::openapi());
    let description = doc["paths"]["/twin"]["post"]["description"]
        .as_str()
        .expect("documented");
    assert!(
        description.contains("for at least 3 hours after"),
        "{description}"
    );
}

#[test]
fn handlers_that_are_never_routed_still_register() {
    // Nothing in this test binary calls `elsewhere::clash`: it is listed all the same.
    let modules: Vec<&str> = handlers()
        .filter(|h| h.name() == "clash")
        .map(|h| h.module())
        .collect();
    assert_eq!(modules.len(), 2, "{modules:?}");
}

#[test]
fn each_operation_documents_only_the_problems_its_mode_can_answer() {
    let doc = json(&Doc::openapi());
    let text = |path: &str, status: &str| {
        doc["paths"][path]["post"]["responses"][status]["description"]
            .as_str()
            .unwrap_or_else(|| panic!("{path} documents {status}"))
            .to_owned()
    };
    // Transactional: the commit can be refused or its outcome unknown.
    assert!(text("/things/{account}", "500").contains("could not be committed"));
    // Any: a stored answer sealed with a key the service no longer has.
    assert!(text("/things/{account}", "500").contains("cannot be opened"));
    assert!(text("/global", "500").contains("cannot be opened"));
    // External: a claim the recovery gave up on; never a transactional one.
    assert!(text("/global", "500").contains("needs a person"));
    assert!(!text("/things/{account}", "500").contains("needs a person"));
    assert!(text("/things/{account}", "503").contains("outcome of the commit is unknown"));
    assert!(text("/things/{account}", "400").contains("scope is invalid"));
    // External, global keys: neither of those, and no scope to be invalid.
    assert!(!text("/global", "500").contains("could not be committed"));
    assert!(!text("/global", "503").contains("outcome of the commit is unknown"));
    assert!(!text("/global", "400").contains("scope is invalid"));
    // No `timeout`: never timed out.
    assert!(!text("/global", "503").contains("did not finish in time"));
    // A 5xx is replayed only with `replay_5xx`: the header is on the handler's own answers.
    let created = &doc["paths"]["/things/{account}"]["post"]["responses"]["201"];
    assert!(created["headers"]["Idempotent-Replayed"].is_object());
}

#[test]
fn a_key_parameter_declared_through_components_is_required_and_not_repeated() {
    use utoipa::Modify;
    use utoipa::openapi::{
        Ref, RefOr,
        path::{ParameterBuilder, ParameterIn},
    };
    let mut doc = RawDoc::openapi();
    let components = doc.components.get_or_insert_with(Default::default);
    components.parameters.insert(
        "Key".to_owned(),
        RefOr::T(
            ParameterBuilder::new()
                .name("Idempotency-Key")
                .parameter_in(ParameterIn::Header)
                .build(),
        ),
    );
    let op = doc
        .paths
        .paths
        .get_mut("/global")
        .and_then(|item| item.post.as_mut())
        .expect("POST /global");
    op.parameters = Some(vec![RefOr::Ref(Ref::new("#/components/parameters/Key"))]);
    Idempotency.modify(&mut doc);

    let value = json(&doc);
    let parameters = value["paths"]["/global"]["post"]["parameters"]
        .as_array()
        .expect("parameters");
    let keys: Vec<&Value> = parameters
        .iter()
        .filter(|p| p["name"] == "Idempotency-Key")
        .collect();
    assert_eq!(keys.len(), 1, "{parameters:?}");
    assert_eq!(keys[0]["required"], true, "{parameters:?}");
}

#[test]
fn applying_the_modifier_twice_changes_nothing_more() {
    use utoipa::Modify;
    let mut doc = Doc::openapi();
    let once = json(&doc);
    Idempotency.modify(&mut doc);
    assert_eq!(json(&doc), once);
}
