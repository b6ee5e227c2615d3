//! The idempotency part of an OpenAPI document, contributed by the library (feature `openapi`,
//! with `utoipa`).
//!
//! Add [`Idempotency`] to a document's modifiers. Every operation whose `operationId` is the
//! name of an `#[idempotent]` handler (utoipa's default for `#[utoipa::path]`) then gets:
//!
//! - the required `Idempotency-Key` header parameter;
//! - the problem responses of the idempotency layer: 400 (key missing or malformed), 409 (a
//!   request with this key is in progress, with `Retry-After`), 413 (body over the limit), 422
//!   (key reused with another request) and 503 (store unavailable, retry with the same key);
//!   a response the operation declares already keeps its description and gains a sentence;
//! - the `Idempotent-Replayed` header on its 2xx responses;
//! - a paragraph of its description saying what a retry gets, and for how long, from the
//!   handler's attribute ([`HandlerPolicy::describe`]).
//!
//! The document's description gains the service's [`RetentionPolicy`]; [`retention_policy`]
//! gives the same for serving elsewhere.
//!
//! ```
//! use idem_runtime::openapi::Idempotency;
//! use utoipa::OpenApi;
//!
//! #[derive(OpenApi)]
//! #[openapi(paths(/* your handlers */), modifiers(&Idempotency))]
//! struct ApiDoc;
//!
//! let json = ApiDoc::openapi().to_json().unwrap();
//! # assert!(json.contains("\"openapi\":\"3.1.0\""));
//! ```

use std::collections::BTreeMap;

use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, HeaderBuilder, ObjectBuilder, OpenApi, Ref, RefOr, Required,
    ResponseBuilder, Type,
    path::{Operation, ParameterBuilder, ParameterIn, PathItem},
    response::Response,
};

use crate::ProblemKind;
use crate::policy::{HandlerPolicy, RetentionPolicy, handlers};
use crate::problem::PROBLEM_JSON;

/// The name of the problem details schema this modifier adds to `components.schemas`.
pub const PROBLEM_SCHEMA: &str = "IdempotencyProblem";

/// A `utoipa::Modify` that documents the idempotency of every `#[idempotent]` handler's
/// operation; see the [module documentation](self).
///
/// # Panics
///
/// When an operation's id names two `#[idempotent]` handlers (in different modules) whose
/// attributes differ: which one serves the route cannot be told. Give them distinct
/// function names.
#[derive(Debug, Clone, Copy, Default)]
pub struct Idempotency;

impl utoipa::Modify for Idempotency {
    fn modify(&self, openapi: &mut OpenApi) {
        let registry = Registry::collect();
        let mut documented = false;
        for (_, item) in openapi.paths.paths.iter_mut() {
            for (_, operation) in operations_mut(item) {
                if let Some(policy) = registry.policy_of(operation) {
                    document(operation, &policy);
                    documented = true;
                }
            }
        }
        if !documented {
            return;
        }
        let components = openapi
            .components
            .get_or_insert_with(|| ComponentsBuilder::new().build());
        components
            .schemas
            .entry(PROBLEM_SCHEMA.to_owned())
            .or_insert_with(problem_schema);
        let policy = retention_policy(openapi);
        let info = &mut openapi.info;
        let mut description = info.description.take().unwrap_or_default();
        if !description.is_empty() {
            description.push_str("\n\n");
        }
        description.push_str("## Idempotency\n\n");
        description.push_str(&policy.to_string());
        info.description = Some(description);
    }
}

/// The retention policy of the idempotent operations of `openapi`, in the document's order:
/// what [`Idempotency`] adds to the document's description.
///
/// # Panics
///
/// As [`Idempotency`] does, when an operation id names two differing handlers.
pub fn retention_policy(openapi: &OpenApi) -> RetentionPolicy {
    let registry = Registry::collect();
    let mut policy = RetentionPolicy::new();
    for (path, item) in &openapi.paths.paths {
        for (method, operation) in operations(item) {
            if let Some(handler) = registry.policy_of(operation) {
                policy = policy.with(format!("{method} {path}"), handler);
            }
        }
    }
    policy
}

/// The `#[idempotent]` handlers linked into this program that no operation of `openapi`
/// describes: for a test that every idempotent route is documented.
pub fn undocumented_handlers(openapi: &OpenApi) -> Vec<&'static HandlerPolicy> {
    let ids: Vec<&str> = openapi
        .paths
        .paths
        .values()
        .flat_map(operations)
        .filter_map(|(_, operation)| operation.operation_id.as_deref())
        .collect();
    handlers()
        .filter(|handler| !ids.contains(&handler.name()))
        .collect()
}

/// The registered handlers by name.
struct Registry(BTreeMap<&'static str, Vec<&'static HandlerPolicy>>);

impl Registry {
    fn collect() -> Self {
        let mut by_name: BTreeMap<&'static str, Vec<&'static HandlerPolicy>> = BTreeMap::new();
        for handler in handlers() {
            by_name.entry(handler.name()).or_default().push(handler);
        }
        Self(by_name)
    }

    fn policy_of(&self, operation: &Operation) -> Option<HandlerPolicy> {
        let id = operation.operation_id.as_deref()?;
        let candidates = self.0.get(id)?;
        let first = *candidates.first()?;
        let differing: Vec<&str> = candidates
            .iter()
            .filter(|other| !same_settings(first, other))
            .map(|other| other.module())
            .collect();
        assert!(
            differing.is_empty(),
            "the operation `{id}` names #[idempotent] handlers with different settings, in `{}` \
             and in {differing:?}; give the handlers distinct names",
            first.module(),
        );
        Some(*first)
    }
}

fn same_settings(a: &HandlerPolicy, b: &HandlerPolicy) -> bool {
    (
        a.scope(),
        a.mode(),
        a.retention(),
        a.replay_5xx(),
        a.lease(),
        a.timeout(),
    ) == (
        b.scope(),
        b.mode(),
        b.retention(),
        b.replay_5xx(),
        b.lease(),
        b.timeout(),
    )
}

fn document(operation: &mut Operation, policy: &HandlerPolicy) {
    let parameters = operation.parameters.get_or_insert_with(Vec::new);
    let has_key = parameters.iter().any(|p| {
        matches!(p, RefOr::T(p) if p.name.eq_ignore_ascii_case("Idempotency-Key")
            && p.parameter_in == ParameterIn::Header)
    });
    if !has_key {
        parameters.push(RefOr::T(key_parameter()));
    }

    let paragraph = policy.describe();
    operation.description = Some(match operation.description.take() {
        Some(text) if !text.is_empty() => format!("{text}\n\n{paragraph}"),
        _ => paragraph,
    });

    for (status, response) in &mut operation.responses.responses {
        if status.starts_with('2')
            && let RefOr::T(response) = response
        {
            response
                .headers
                .entry("Idempotent-Replayed".to_owned())
                .or_insert_with(|| RefOr::T(replayed_header()));
        }
    }
    for (status, description, retry_after) in problem_responses() {
        let entry = operation.responses.responses.entry(status.to_owned());
        match entry {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(RefOr::T(problem_response(description, retry_after)));
            }
            std::collections::btree_map::Entry::Occupied(mut slot) => {
                if let RefOr::T(existing) = slot.get_mut() {
                    merge_problem(existing, description, retry_after);
                }
            }
        }
    }
}

/// `(status, description, has Retry-After)` of the layer's own answers.
fn problem_responses() -> [(&'static str, String, bool); 5] {
    let kinds = |kinds: &[ProblemKind]| {
        kinds
            .iter()
            .map(|kind| kind.title())
            .collect::<Vec<_>>()
            .join("; ")
    };
    [
        (
            "400",
            format!(
                "{}. Nothing ran; send a valid key.",
                kinds(&[
                    ProblemKind::MissingKey,
                    ProblemKind::MalformedKey,
                    ProblemKind::InvalidScope
                ])
            ),
            false,
        ),
        (
            "409",
            format!(
                "{}. Nothing ran; retry with the same key after `Retry-After` seconds.",
                kinds(&[ProblemKind::InProgress])
            ),
            true,
        ),
        (
            "413",
            format!(
                "{}. Nothing ran or was stored.",
                kinds(&[ProblemKind::BodyTooLarge])
            ),
            false,
        ),
        (
            "422",
            format!(
                "{}. Nothing ran: the key was first used with another method, path, query or \
                 body; a new operation needs a new key.",
                kinds(&[ProblemKind::KeyReused])
            ),
            false,
        ),
        (
            "503",
            format!(
                "{}. Nothing was stored (or whether it was is unknown); retry with the same key.",
                kinds(&[
                    ProblemKind::StoreUnavailable,
                    ProblemKind::OutcomeUnknown,
                    ProblemKind::HandlerTimedOut
                ])
            ),
            false,
        ),
    ]
}

fn key_parameter() -> utoipa::openapi::path::Parameter {
    ParameterBuilder::new()
        .name("Idempotency-Key")
        .parameter_in(ParameterIn::Header)
        .required(Required::True)
        .description(Some(
            "A key unique to this operation, sent unchanged on every retry of it: 1 to 255 \
             visible ASCII characters, bare or as a Structured Field String (`\"…\"`). A new \
             UUID for each operation is best.",
        ))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
                .max_length(Some(257))
                .pattern(Some("^[!-~]+$")),
        ))
        .example(Some(serde_json::json!(
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        )))
        .build()
}

fn replayed_header() -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["true"])),
        ))
        .description(Some(
            "`true` when this is the stored outcome of an earlier request with the same key, \
             not a new execution; absent otherwise.",
        ))
        .build()
}

fn retry_after_header() -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(0)),
        ))
        .description(Some("Seconds to wait before retrying with the same key."))
        .build()
}

fn problem_response(description: String, retry_after: bool) -> Response {
    let mut response = ResponseBuilder::new().description(description).content(
        PROBLEM_JSON,
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name(PROBLEM_SCHEMA)))
            .build(),
    );
    if retry_after {
        response = response.header("Retry-After", retry_after_header());
    }
    response.build()
}

/// A response the operation declares itself (its own 400, say) stays, with the layer's case
/// added to its description, and a problem+json content if it has none.
fn merge_problem(existing: &mut Response, description: String, retry_after: bool) {
    existing.description = if existing.description.is_empty() {
        description
    } else {
        format!("{} Or: {description}", existing.description)
    };
    existing
        .content
        .entry(PROBLEM_JSON.to_owned())
        .or_insert_with(|| {
            RefOr::T(
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name(PROBLEM_SCHEMA)))
                    .build(),
            )
        });
    if retry_after {
        existing
            .headers
            .entry("Retry-After".to_owned())
            .or_insert_with(|| RefOr::T(retry_after_header()));
    }
}

fn problem_schema() -> RefOr<utoipa::openapi::Schema> {
    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description))
    };
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "An RFC 9457 problem details document (`application/problem+json`).",
        ))
        .property(
            "type",
            string("A URI identifying the kind of problem; its documentation."),
        )
        .required("type")
        .property("title", string("A short summary of the kind of problem."))
        .required("title")
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .description(Some("The HTTP status code.")),
        )
        .required("status")
        .property(
            "detail",
            string("What went wrong with this particular request."),
        )
        .into()
}

fn operations(item: &PathItem) -> Vec<(&str, &Operation)> {
    let fixed = [
        ("GET", &item.get),
        ("PUT", &item.put),
        ("POST", &item.post),
        ("DELETE", &item.delete),
        ("OPTIONS", &item.options),
        ("HEAD", &item.head),
        ("PATCH", &item.patch),
        ("TRACE", &item.trace),
        ("QUERY", &item.query),
    ];
    fixed
        .into_iter()
        .filter_map(|(method, op)| op.as_ref().map(|op| (method, op)))
        .chain(
            item.additional_operations
                .iter()
                .map(|(method, op)| (method.as_str(), op)),
        )
        .collect()
}

fn operations_mut(item: &mut PathItem) -> Vec<(&str, &mut Operation)> {
    let fixed = [
        ("GET", &mut item.get),
        ("PUT", &mut item.put),
        ("POST", &mut item.post),
        ("DELETE", &mut item.delete),
        ("OPTIONS", &mut item.options),
        ("HEAD", &mut item.head),
        ("PATCH", &mut item.patch),
        ("TRACE", &mut item.trace),
        ("QUERY", &mut item.query),
    ];
    fixed
        .into_iter()
        .filter_map(|(method, op)| op.as_mut().map(|op| (method, op)))
        .chain(
            item.additional_operations
                .iter_mut()
                .map(|(method, op)| (method.as_str(), op)),
        )
        .collect()
}
