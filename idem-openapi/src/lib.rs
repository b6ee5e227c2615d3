//! # idem-openapi: the idempotency part of an OpenAPI document
//!
//! For services built with `idem-runtime`'s `#[idempotent]` handlers and documented with
//! `utoipa`. It reads what each handler's attribute registered (`idem_runtime::policy`), so the
//! document says exactly what the runtime does. A crate of its own, so that `utoipa`'s major
//! versions are not part of `idem-runtime`'s, and a service that publishes no document compiles
//! none of it.
//!
//! Add [`Idempotency`] to a document's modifiers. Every operation whose `operationId` is the
//! name of an `#[idempotent]` handler (utoipa's default for `#[utoipa::path]`) then gets:
//!
//! - the header parameter that carries the key: `Idempotency-Key`, or the one the handler names
//!   (`key_header`), required unless the key is optional (`key_optional`); one the operation
//!   declares, inline or through `components`, is kept and given that requirement. A key in a
//!   field of the JSON body (`key_pointer`) is said in the description and in the operation's
//!   `x-idempotency-key` extension (`{"in": "body", "pointer": "/id", "required": true}`),
//!   as a header key is too;
//! - the problem responses of the idempotency layer that its mode and settings can give: 400
//!   (key missing or malformed, scope invalid, body unreadable), 409 (in progress, with
//!   `Retry-After`), 413 (body over the limit), 422 (key reused with another request), 500
//!   (outcome not stored: too large, commit refused, step not recorded, body failed; the store
//!   not set up; a stored answer that cannot be opened; in external mode, a claim parked for a
//!   person) and 503
//!   (store unavailable, commit outcome unknown, timed out: retry with the same key, after
//!   `Retry-After`). A
//!   response the operation declares inline keeps its description and gains the layer's case;
//!   one it takes from `components` is left alone;
//! - the `Idempotent-Replayed` header on each response it declares inline that can be a
//!   replay (all but 5xx, which only with `replay_5xx`);
//! - where the handler lets duplicates wait (`wait`), the optional `Prefer` header parameter
//!   (`wait=<seconds>`, RFC 7240) and the `Preference-Applied` header on those responses;
//! - a paragraph of its description saying what a retry gets, and for how long, from the
//!   handler's attribute ([`HandlerPolicy::describe`]).
//!
//! Operation ids are unique within a document, but the modifier knows handlers only by
//! function name: an operation whose id is the name of any `#[idempotent]` handler linked into
//! the program is documented as that handler. Give a non-idempotent operation of the same name
//! another `operation_id`, and keep the default id on idempotent ones (a renamed one is not
//! recognised; [`undocumented_handlers`] finds it in a test).
//!
//! The document's description gains the service's [`RetentionPolicy`]; [`retention_policy`]
//! gives the same for serving elsewhere.
//!
//! ```
//! use idem_openapi::Idempotency;
//! use utoipa::OpenApi;
//!
//! #[derive(OpenApi)]
//! #[openapi(paths(/* your handlers */), modifiers(&Idempotency))]
//! struct ApiDoc;
//!
//! let json = ApiDoc::openapi().to_json().unwrap();
//! # assert!(json.contains("\"openapi\":\"3.1.0\""));
//! ```

use std::collections::{BTreeMap, btree_map::Entry};

use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, HeaderBuilder, ObjectBuilder, OpenApi, Ref, RefOr, Required,
    ResponseBuilder, Type,
    extensions::ExtensionsBuilder,
    path::{Operation, Parameter, ParameterBuilder, ParameterIn, PathItem},
    response::Response,
};

use idem_runtime::{
    KeySource, PROBLEM_JSON, ProblemKind,
    policy::{HandlerPolicy, KeyScope, Mode, RetentionPolicy, handlers},
};

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
        let shared_parameters = openapi
            .components
            .as_ref()
            .map(|c| c.parameters.clone())
            .unwrap_or_default();
        let mut documented = false;
        for (_, item) in openapi.paths.paths.iter_mut() {
            for (_, operation) in operations_mut(item) {
                if let Some(policy) = registry.policy_of(operation) {
                    document(operation, &policy, &shared_parameters);
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
        let section = format!("## Idempotency\n\n{policy}");
        // Applied twice, the modifier adds nothing the second time.
        if !description.contains(&section) {
            if !description.is_empty() {
                description.push_str("\n\n");
            }
            description.push_str(&section);
        }
        info.description = Some(description);
    }
}

/// The retention policy of the idempotent operations of `openapi`, in the document's order,
/// then the program's idempotent gRPC methods ([`RetentionPolicy::with_grpc_methods`]): what
/// [`Idempotency`] adds to the document's description.
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
    policy.with_grpc_methods()
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
        .filter(|handler| handler.grpc().is_none() && !ids.contains(&handler.name()))
        .collect()
}

/// The registered handlers by name.
struct Registry(BTreeMap<&'static str, Vec<&'static HandlerPolicy>>);

impl Registry {
    fn collect() -> Self {
        let mut by_name: BTreeMap<&'static str, Vec<&'static HandlerPolicy>> = BTreeMap::new();
        // HTTP handlers only: a tonic method is no operation of the document.
        for handler in handlers().filter(|handler| handler.grpc().is_none()) {
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
        a.wait(),
        a.key_source(),
        a.key_optional(),
    ) == (
        b.scope(),
        b.mode(),
        b.retention(),
        b.replay_5xx(),
        b.lease(),
        b.timeout(),
        b.wait(),
        b.key_source(),
        b.key_optional(),
    )
}

fn document(
    operation: &mut Operation,
    policy: &HandlerPolicy,
    shared_parameters: &BTreeMap<String, RefOr<Parameter>>,
) {
    let required = !policy.key_optional();
    let (place, name) = match policy.key_source() {
        KeySource::Standard => ("header", Some("Idempotency-Key")),
        KeySource::Header(name) => ("header", Some(name)),
        KeySource::BodyField(pointer) => ("body", Some(pointer)),
        KeySource::MessageField(_) => ("message", None),
    };
    if let (Some(name), "header") = (name, place) {
        require_key(
            operation.parameters.get_or_insert_with(Vec::new),
            shared_parameters,
            name,
            required,
        );
    }
    if let Some(name) = name {
        let field = if place == "header" { "name" } else { "pointer" };
        operation
            .extensions
            .get_or_insert_with(Default::default)
            .merge(
                ExtensionsBuilder::new()
                    .add(
                        "x-idempotency-key",
                        serde_json::json!({"in": place, field: name, "required": required}),
                    )
                    .build(),
            );
    }
    if let Some(wait) = policy.wait() {
        let parameters = operation.parameters.get_or_insert_with(Vec::new);
        let declared = parameters.iter().any(|p| {
            matches!(p, RefOr::T(p) if p.name.eq_ignore_ascii_case("Prefer")
                && p.parameter_in == ParameterIn::Header)
        });
        if !declared {
            parameters.push(RefOr::T(prefer_parameter(wait.as_secs())));
        }
    }

    let paragraph = policy.describe();
    if operation
        .description
        .as_deref()
        .is_some_and(|text| text.contains(&paragraph))
    {
        // Documented already, by an earlier application of the modifier.
        return;
    }
    operation.description = Some(match operation.description.take() {
        Some(text) if !text.is_empty() => format!("{text}\n\n{paragraph}"),
        _ => paragraph,
    });

    // Any outcome the handler answers may come back as a replay; a 5xx only when it is kept.
    for (status, response) in &mut operation.responses.responses {
        let kept = !status.starts_with('5') || policy.replay_5xx();
        if kept && let RefOr::T(response) = response {
            response
                .headers
                .entry("Idempotent-Replayed".to_owned())
                .or_insert_with(|| RefOr::T(replayed_header()));
            if policy.wait().is_some() {
                response
                    .headers
                    .entry("Preference-Applied".to_owned())
                    .or_insert_with(|| RefOr::T(preference_applied_header()));
            }
        }
    }
    for problem in layer_problems(policy) {
        match operation
            .responses
            .responses
            .entry(problem.status.to_owned())
        {
            Entry::Vacant(slot) => {
                slot.insert(RefOr::T(problem_response(&problem)));
            }
            // A response shared through `components` is left as it is: changing it would
            // change every operation that refers to it.
            Entry::Occupied(mut slot) => {
                if let RefOr::T(existing) = slot.get_mut() {
                    merge_problem(existing, &problem);
                }
            }
        }
    }
}

/// Adds the header parameter `name` that carries the key, or gives the one the operation
/// declares (inline or through `components`) the key's requirement.
fn require_key(
    parameters: &mut Vec<RefOr<Parameter>>,
    shared: &BTreeMap<String, RefOr<Parameter>>,
    name: &str,
    required: bool,
) {
    let required = if required {
        Required::True
    } else {
        Required::False
    };
    let is_key =
        |p: &Parameter| p.name.eq_ignore_ascii_case(name) && p.parameter_in == ParameterIn::Header;
    for parameter in parameters.iter_mut() {
        let resolved = match parameter {
            RefOr::T(inline) => Some(inline.clone()),
            RefOr::Ref(reference) => reference
                .ref_location
                .strip_prefix("#/components/parameters/")
                .and_then(|name| shared.get(name))
                .and_then(|target| match target {
                    RefOr::T(target) => Some(target.clone()),
                    RefOr::Ref(_) => None,
                }),
        };
        if let Some(mut declared) = resolved.filter(|p| is_key(p)) {
            if declared.required != required {
                declared.required = required;
            }
            *parameter = RefOr::T(declared);
            return;
        }
    }
    parameters.push(RefOr::T(key_parameter(name, required)));
}

/// One of the layer's own answers, as documented on an idempotent operation.
struct LayerProblem {
    status: &'static str,
    /// The titles of the problems answered with this status, and what the client should do.
    description: String,
    retry_after: bool,
}

/// The layer's own answers on an operation of `policy`: only those its mode and settings can
/// give.
fn layer_problems(policy: &HandlerPolicy) -> Vec<LayerProblem> {
    let titles = |kinds: &[ProblemKind]| {
        kinds
            .iter()
            .map(|kind| kind.title())
            .collect::<Vec<_>>()
            .join("; ")
    };
    let transactional = policy.mode() == Mode::Transactional;
    let mut bad_request = vec![ProblemKind::MissingKey, ProblemKind::MalformedKey];
    if matches!(policy.scope(), KeyScope::Parameter(_)) {
        bad_request.push(ProblemKind::InvalidScope);
    }
    // A stored answer that does not open (a store sealing answers, its key gone) can meet any
    // operation; a parked claim, one whose claim outlives its transaction.
    let mut failed = vec![
        ProblemKind::ResponseTooLarge,
        ProblemKind::StoreNotSetUp,
        ProblemKind::AnswerUnreadable,
    ];
    if transactional {
        failed.push(ProblemKind::CommitRefused);
    } else {
        failed.push(ProblemKind::ClaimParked);
    }
    if policy.mode() == Mode::Steps {
        failed.push(ProblemKind::StepFailed);
    }
    let mut unavailable = vec![ProblemKind::StoreUnavailable];
    if transactional {
        unavailable.push(ProblemKind::OutcomeUnknown);
    }
    if policy.timeout().is_some() {
        unavailable.push(ProblemKind::HandlerTimedOut);
    }
    let problem = |status, kinds: &[ProblemKind], advice: &str, retry_after| LayerProblem {
        status,
        description: format!("{}: {advice}", titles(kinds)),
        retry_after,
    };
    let in_progress = if policy.mode() == Mode::Steps {
        "another request with this key is running (or, to a request whose lease ran out, took \
         it over); retry with the same key, after `Retry-After` seconds when given."
    } else {
        "another request with this key is running, and nothing ran; retry with the same key \
         after `Retry-After` seconds."
    };
    vec![
        problem(
            "400",
            &bad_request,
            "nothing ran; send a valid key (also: Request body could not be read).",
            false,
        ),
        problem("409", &[ProblemKind::InProgress], in_progress, true),
        problem(
            "413",
            &[ProblemKind::BodyTooLarge],
            "nothing ran or was stored.",
            false,
        ),
        problem(
            "422",
            &[ProblemKind::KeyReused],
            "nothing ran: the key was first used with another method, path, query or body; a \
             new operation needs a new key.",
            false,
        ),
        problem(
            "500",
            &failed,
            "the outcome was not stored (also: Response body failed).",
            false,
        ),
        problem(
            "503",
            &unavailable,
            "nothing was stored (or whether it was is unknown); retry with the same key, after \
             `Retry-After` seconds.",
            true,
        ),
    ]
}

fn key_parameter(name: &str, required: Required) -> utoipa::openapi::path::Parameter {
    let optional = if required == Required::True {
        ""
    } else {
        " Optional: a request without it runs once, unprotected."
    };
    let chosen_by = if name.eq_ignore_ascii_case("Idempotency-Key") {
        "A new UUID for each operation is best."
    } else {
        "The sender's id of the delivery or operation, the same on every redelivery of it."
    };
    ParameterBuilder::new()
        .name(name)
        .parameter_in(ParameterIn::Header)
        .required(required)
        .description(Some(format!(
            "A key unique to this operation, sent unchanged on every retry of it: 1 to 255 \
             visible ASCII characters, bare or as a Structured Field String (`\"…\"`). \
             {chosen_by} (Quoted, with `\\\"` and `\\\\` escapes, it may be up to 512 characters \
             long.){optional}",
        )))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
                .max_length(Some(512))
                .pattern(Some("^[!-~]+$")),
        ))
        .example(Some(serde_json::json!(
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        )))
        .build()
}

/// `Prefer: wait=<seconds>`, on an operation whose handler lets duplicates wait `wait` seconds.
fn prefer_parameter(wait: u64) -> utoipa::openapi::path::Parameter {
    ParameterBuilder::new()
        .name("Prefer")
        .parameter_in(ParameterIn::Header)
        .required(Required::False)
        .description(Some(format!(
            "`wait=<seconds>` (RFC 7240): a retry sent while the first request with its key is \
             still running waits for that request's outcome, at most the seconds given and at \
             most {wait}, instead of getting 409 at once. It then gets the outcome as a replay \
             (marked `Preference-Applied`), or runs the operation itself if the first ended \
             without one, or the 409 when the wait is over."
        )))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some("wait=[0-9]+")),
        ))
        .example(Some(serde_json::json!(format!("wait={wait}"))))
        .build()
}

fn preference_applied_header() -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .description(Some(
            "`wait=<seconds>` when this replay is the outcome of a request this one waited for \
             (`Prefer: wait`); absent otherwise.",
        ))
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

fn problem_response(problem: &LayerProblem) -> Response {
    let mut response = ResponseBuilder::new()
        .description(format!(
            "From the idempotency layer: {}",
            problem.description
        ))
        .content(
            PROBLEM_JSON,
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(PROBLEM_SCHEMA)))
                .build(),
        );
    if problem.retry_after {
        response = response.header("Retry-After", retry_after_header());
    }
    response.build()
}

/// A response the operation declares itself (its own 400, say) stays, with the layer's case
/// added to its description, and a problem+json content if it has none.
fn merge_problem(existing: &mut Response, problem: &LayerProblem) {
    let addition = format!("Also from the idempotency layer: {}", problem.description);
    existing.description = if existing.description.is_empty() {
        addition
    } else {
        format!("{} {addition}", existing.description)
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
    if problem.retry_after {
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
