//! What each `#[idempotent]` handler promises its clients, as its attribute says, and the
//! retention policy a service publishes from them.
//!
//! Every handler the attribute expands registers its [`HandlerPolicy`] at link time (through
//! `inventory`), so [`handlers`] lists all of them without a list kept by hand. The same value
//! drives the handler at run time, so the published policy cannot drift from the behaviour.
//! [`RetentionPolicy`] renders the policy document of a set of routes; the crate
//! `idem-openapi` builds it from an OpenAPI document (`idem_openapi::retention_policy`).

use std::fmt;
use std::time::Duration;

use idem_key::BodyFields;

use crate::{attribute::Options, key_source::KeySource};

/// How an `#[idempotent]` handler runs, as its signature chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The handler takes the transaction: its writes and the stored outcome commit together,
    /// and an interrupted request leaves nothing behind.
    Transactional,
    /// No transaction: the claim is committed first, with a lease, and the outcome is stored
    /// after the body (a call to another system) ran.
    External,
    /// External, with recovery points (`Steps`): a retry after an interruption resumes after
    /// the last recorded step.
    Steps,
}

/// Whose keys a handler's keys are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyScope {
    /// Keys are separate for each caller, identified by the handler parameter of this name.
    Parameter(&'static str),
    /// Keys are shared by all callers (`global`).
    Global,
}

/// One `#[idempotent]` handler's settings, exactly as its attribute gave them (defaults
/// filled in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandlerPolicy {
    name: &'static str,
    module: &'static str,
    scope: KeyScope,
    mode: Mode,
    retention_secs: u64,
    replay_5xx: bool,
    lease_secs: u64,
    timeout_secs: Option<u64>,
    wait_secs: Option<u64>,
    body_fields: BodyFields,
    grpc: Option<GrpcMethod>,
    key_source: KeySource,
    key_optional: bool,
}

/// The gRPC method an `#[idempotent]` tonic method serves: its service's full name and its own
/// name, as the `.proto` spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcMethod {
    service: &'static str,
    method: &'static str,
}

impl GrpcMethod {
    /// The service's full name (`idem.example.v1.Payments`).
    pub fn service(&self) -> &'static str {
        self.service
    }

    /// The method's name (`CreatePayment`).
    pub fn method(&self) -> &'static str {
        self.method
    }

    /// The method's full name as gRPC sends it, the request's HTTP/2 path
    /// (`/idem.example.v1.Payments/CreatePayment`): what its keys' fingerprints cover and its
    /// metrics are labelled with.
    pub fn path(&self) -> String {
        format!("/{}/{}", self.service, self.method)
    }
}

impl HandlerPolicy {
    /// What the macro writes; not an API.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub const fn __new(
        name: &'static str,
        module: &'static str,
        scope: KeyScope,
        mode: Mode,
        retention_secs: u64,
        replay_5xx: bool,
        lease_secs: u64,
        timeout_secs: Option<u64>,
        wait_secs: Option<u64>,
        body_fields: BodyFields,
    ) -> Self {
        Self {
            name,
            module,
            scope,
            mode,
            retention_secs,
            replay_5xx,
            lease_secs,
            timeout_secs,
            wait_secs,
            body_fields,
            grpc: None,
            key_source: KeySource::Standard,
            key_optional: false,
        }
    }

    /// What the macro writes for a handler whose key is elsewhere than `Idempotency-Key` or
    /// optional; not an API.
    #[doc(hidden)]
    pub const fn __key(mut self, source: KeySource, optional: bool) -> Self {
        self.key_source = source;
        self.key_optional = optional;
        self
    }

    /// Where the handler takes its key from (`key_header`, `key_pointer`, `key_field`).
    pub fn key_source(&self) -> KeySource {
        self.key_source
    }

    /// Whether a request without a key runs once, unprotected, storing nothing
    /// (`key_optional`), instead of being refused.
    pub fn key_optional(&self) -> bool {
        self.key_optional
    }

    /// Where the key is and whether it is required, in a few words for the policy table;
    /// `None` for the `Idempotency-Key` header, required.
    fn key_cell(&self) -> Option<String> {
        let source = (self.key_source != KeySource::Standard)
            .then(|| format!("the key is {}", self.key_source.describe()));
        let optional = self
            .key_optional
            .then_some("optional: a request without one runs unprotected, nothing kept");
        match (source, optional) {
            (None, None) => None,
            (Some(source), None) => Some(source),
            (None, Some(optional)) => Some(format!("the key is {optional}")),
            (Some(source), Some(optional)) => Some(format!("{source}, {optional}")),
        }
    }

    /// What the macro writes for a tonic method; not an API.
    #[doc(hidden)]
    pub const fn __grpc(mut self, service: &'static str, method: &'static str) -> Self {
        self.grpc = Some(GrpcMethod { service, method });
        self
    }

    /// The gRPC method this is the policy of, for a tonic service method; `None` for an Axum
    /// handler.
    pub fn grpc(&self) -> Option<GrpcMethod> {
        self.grpc
    }

    /// The handler function's name, which is also the default `operationId` of utoipa's
    /// `#[utoipa::path]`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The module the handler is defined in (`module_path!()`).
    pub fn module(&self) -> &'static str {
        self.module
    }

    /// Whose keys these are.
    pub fn scope(&self) -> KeyScope {
        self.scope
    }

    /// How the handler runs.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// How long an outcome is replayed at least, counted from the first request
    /// (`retention`).
    pub fn retention(&self) -> Duration {
        Duration::from_secs(self.retention_secs)
    }

    /// Whether a 5xx outcome is stored and replayed (`replay_5xx`).
    pub fn replay_5xx(&self) -> bool {
        self.replay_5xx
    }

    /// External and multi-step handlers: how long a claim is exclusive before a retry may take
    /// it over (`lease`). `None` for a transactional handler, whose claim ends with its
    /// transaction.
    pub fn lease(&self) -> Option<Duration> {
        (self.mode != Mode::Transactional).then(|| Duration::from_secs(self.lease_secs))
    }

    /// How long the body may run before it is stopped (`timeout`), if bounded.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout_secs.map(Duration::from_secs)
    }

    /// The most a duplicate may wait for the first request's outcome when it asks to
    /// (`Prefer: wait=<seconds>`), if the handler lets duplicates wait (`wait`).
    pub fn wait(&self) -> Option<Duration> {
        self.wait_secs.map(Duration::from_secs)
    }

    /// Which fields of a JSON body make two requests the same request
    /// (`fingerprint_only`, `fingerprint_except`; the whole body by default).
    pub fn body_fields(&self) -> BodyFields {
        self.body_fields
    }

    /// The settings the request flow runs with.
    #[doc(hidden)]
    pub fn __options(&self) -> Options {
        Options {
            retention: self.retention(),
            replay_5xx: self.replay_5xx,
            lease: Duration::from_secs(self.lease_secs),
            timeout: self.timeout(),
            wait: self.wait(),
            body_fields: self.body_fields,
        }
    }

    /// One paragraph for an API's users: what a retry with the same key gets from this
    /// handler, and for how long (Markdown).
    pub fn describe(&self) -> String {
        format!(
            "**Idempotent.** {} A retry with the same key and the same request gets \
             the first outcome again, marked `Idempotent-Replayed: true`, for at least {} after \
             the first request; later the key may be forgotten, and reusing it then starts a \
             new request.{} {} {} {} {}",
            self.send_the_key(),
            human(self.retention_secs),
            same_request(self.body_fields),
            self.in_flight(),
            self.server_errors(),
            self.interrupted(),
            match self.scope {
                KeyScope::Parameter(_) => "Keys are separate for each caller.",
                KeyScope::Global => "Keys are shared by all callers.",
            }
        )
    }

    /// Where the client puts the key, and whether it must (a sentence or two).
    fn send_the_key(&self) -> String {
        let send = match self.key_source {
            KeySource::Standard => "Send an `Idempotency-Key` header: a new UUID for each \
                                    operation, the same on each retry of it."
                .to_owned(),
            source => format!(
                "The idempotency key is {}: a unique value for each operation, the same on \
                 each retry of it.",
                source.describe()
            ),
        };
        if self.key_optional {
            format!(
                "{send} The key is optional: a request without one runs once, unprotected, and \
                 nothing is kept."
            )
        } else {
            send
        }
    }

    /// What a retry sent while the first request runs gets (a sentence).
    fn in_flight(&self) -> String {
        match self.wait_secs {
            None => "A retry sent while the first request is still running gets 409 with \
                     `Retry-After`."
                .to_owned(),
            Some(wait) => format!(
                "A retry sent while the first request is still running gets 409 with \
                 `Retry-After`, or, with `Prefer: wait=<seconds>`, waits for its outcome (at \
                 most {}) and gets it marked `Preference-Applied`.",
                human(wait)
            ),
        }
    }

    /// What a retry in flight gets, for the policy's table.
    fn in_flight_cell(&self) -> String {
        let (conflict, prefer) = match self.grpc {
            None => ("409 with `Retry-After`", "`Prefer: wait`"),
            Some(_) => (
                "`ABORTED` with `retry-after` and `grpc-retry-pushback-ms`",
                "`prefer: wait`",
            ),
        };
        match self.wait_secs {
            None => conflict.to_owned(),
            Some(wait) => format!(
                "{conflict}; with {prefer}, waits up to {} for the outcome",
                human(wait)
            ),
        }
    }

    /// What a retry after a 5xx gets (a sentence).
    fn server_errors(&self) -> String {
        if self.replay_5xx {
            "A 5xx outcome is kept and replayed too.".to_owned()
        } else {
            format!(
                "A 5xx outcome is not kept: a retry with the same key {}.",
                self.runs_again()
            )
        }
    }

    /// What a retry of a request that was not finished does.
    fn runs_again(&self) -> &'static str {
        match self.mode {
            Mode::Transactional | Mode::External => "runs the request again",
            Mode::Steps => "continues the request after its last completed step",
        }
    }

    /// What a retry gets when the service died during the request (a sentence).
    fn interrupted(&self) -> String {
        match self.mode {
            Mode::Transactional => "If the service dies during a request, the request either \
                                    committed with its outcome, which a retry gets, or left \
                                    nothing behind, and a retry runs it."
                .to_owned(),
            Mode::External | Mode::Steps => format!(
                "If the service dies during a request, a retry with the same key gets 409 at \
                 least until the request's lease of {} has run out, then {} (unless the service \
                 settled the abandoned request first: the retry then gets the outcome it stored, \
                 or runs the request anew). A request still running when its lease runs out can \
                 be taken over by a retry the same way.",
                human(self.lease_secs),
                self.runs_again()
            ),
        }
    }
}

/// Linked in by each expansion of `#[idempotent]`; see [`handlers`].
#[doc(hidden)]
pub struct Registered(pub &'static HandlerPolicy);

inventory::collect!(Registered);

/// Every `#[idempotent]` handler linked into this program, in no particular order.
///
/// A handler in a library crate is listed once the program calls it or routes to it (which
/// links its code in).
pub fn handlers() -> impl Iterator<Item = &'static HandlerPolicy> {
    inventory::iter::<Registered>.into_iter().map(|r| r.0)
}

/// The idempotency policy of a service: one row per idempotent operation. Its `Display` is
/// the Markdown document to publish (the IETF draft asks servers to publish how long keys
/// live).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    operations: Vec<(String, HandlerPolicy)>,
}

impl RetentionPolicy {
    /// An empty policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an operation, `"POST /v1/payments"` say, served by a handler with `policy`.
    #[must_use]
    pub fn with(mut self, operation: impl Into<String>, policy: HandlerPolicy) -> Self {
        self.operations.push((operation.into(), policy));
        self
    }

    /// Adds every `#[idempotent]` tonic method linked into this program ([`handlers`] with a
    /// [`GrpcMethod`]), by its full name (`gRPC /idem.example.v1.Payments/CreatePayment`), in
    /// the order of their names.
    #[must_use]
    pub fn with_grpc_methods(mut self) -> Self {
        let mut methods: Vec<(String, HandlerPolicy)> = handlers()
            .filter_map(|policy| Some((format!("gRPC {}", policy.grpc()?.path()), *policy)))
            .collect();
        methods.sort_by(|a, b| a.0.cmp(&b.0));
        methods.dedup_by(|a, b| a.0 == b.0);
        self.operations.extend(methods);
        self
    }

    /// The operations, in the order given.
    pub fn operations(&self) -> impl Iterator<Item = (&str, &HandlerPolicy)> {
        self.operations
            .iter()
            .map(|(op, policy)| (op.as_str(), policy))
    }
}

impl fmt::Display for RetentionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "The operations below accept an `Idempotency-Key` header: at most 255 visible ASCII \
             characters, best a new UUID for each operation, sent again unchanged on each retry \
             of it. A retry with the same key and the same request gets the first outcome \
             again, marked `Idempotent-Replayed: true`, instead of running the operation twice."
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "| Operation | Outcome kept for at least | A retry in flight | 5xx outcome | If the \
             service dies mid-request | Keys |"
        )?;
        writeln!(f, "|---|---|---|---|---|---|")?;
        for (operation, policy) in &self.operations {
            let server_errors = match (policy.replay_5xx, policy.grpc) {
                (true, None) => "kept and replayed".to_owned(),
                (true, Some(_)) => "kept and replayed (statuses such as `UNAVAILABLE`, \
                                   `INTERNAL`)"
                    .to_owned(),
                (false, None) => format!("not kept: a retry {}", policy.runs_again()),
                (false, Some(_)) => format!(
                    "not kept (statuses such as `UNAVAILABLE`, `INTERNAL`): a retry {}",
                    policy.runs_again()
                ),
            };
            let conflict = match policy.grpc {
                None => "409",
                Some(_) => "`ABORTED`",
            };
            let interrupted = match policy.mode {
                Mode::Transactional => "committed with its outcome, or nothing kept".to_owned(),
                Mode::External | Mode::Steps => format!(
                    "{conflict} at least until its lease of {} has run out, then a retry {}",
                    human(policy.lease_secs),
                    policy.runs_again()
                ),
            };
            let keys = match policy.scope {
                KeyScope::Parameter(_) => "per caller",
                KeyScope::Global => "shared by all callers",
            };
            let keys = match fields_counted(policy.body_fields) {
                Some(fields) => format!("{keys}; the same request: {fields}"),
                None => keys.to_owned(),
            };
            let keys = match policy.key_cell() {
                Some(key) => format!("{keys}; {key}"),
                None => keys,
            };
            writeln!(
                f,
                "| `{operation}` | {} | {} | {server_errors} | {interrupted} | {keys} |",
                human(policy.retention_secs),
                policy.in_flight_cell()
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "- An outcome is kept for at least the time given, counted from the first request. \
             Later the key may be forgotten: a request that reuses it then is a new request."
        )?;
        writeln!(
            f,
            "- A retry while the first request is still running gets 409 with `Retry-After`: \
             wait that long and retry with the same key. Where the table gives a lease, only \
             while it lasts: a request still running past its lease can be taken over by a \
             retry, so a lease is set longer than the slowest request. Where the table says \
             so, a retry may instead ask to wait for the outcome with `Prefer: wait=<seconds>` \
             (RFC 7240): it gets the first request's outcome as a replay, marked \
             `Preference-Applied: wait=<seconds>`, or runs the operation itself if the first \
             ended without one, or gets the 409 when the wait is over."
        )?;
        writeln!(
            f,
            "- A key reused with a different request (method, path, query or body) gets 422: \
             a new operation needs a new key."
        )?;
        write!(
            f,
            "- A missing or malformed key gets 400, and a request body over the service's \
             limit 413; neither runs the operation."
        )?;
        if self.operations.iter().any(|(_, p)| p.key_cell().is_some()) {
            write!(
                f,
                "\n- Where the Keys column says so, the key is elsewhere than the \
                 `Idempotency-Key` header (another header, such as a webhook's delivery id, a \
                 field of the JSON body, which then counts in the request like the rest of the \
                 body, or a field of the gRPC request message), with the same rules; or it is \
                 optional, and a request without one runs once, unprotected."
            )?;
        }
        if self.operations.iter().any(|(_, p)| p.grpc.is_some()) {
            write!(
                f,
                "\n- gRPC methods take the key as `idempotency-key` metadata and answer by the \
                 same rules in gRPC's codes: `INVALID_ARGUMENT` for a missing or malformed key, \
                 `FAILED_PRECONDITION` for a key reused with another request (another method \
                 or message, or an HTTP request), `UNAVAILABLE` with `retry-after` when the \
                 store fails; a replay carries `idempotent-replayed: true`."
            )?;
        }
        if self
            .operations
            .iter()
            .any(|(_, p)| p.mode != Mode::Transactional)
        {
            write!(
                f,
                "\n- After a crash, the service may settle an abandoned request before its retry \
                 comes: the retry then gets the outcome the service stored, or runs the request \
                 anew."
            )?;
        }
        Ok(())
    }
}

/// The fields that make two requests the same request, for the policy's table; `None` for
/// the whole body.
fn fields_counted(fields: BodyFields) -> Option<String> {
    let listed = |pointers: &[&str]| {
        pointers
            .iter()
            .map(|p| format!("`{p}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match fields {
        BodyFields::All => None,
        BodyFields::Only(pointers) => Some(format!("only the body's {}", listed(pointers))),
        BodyFields::Except(pointers) => Some(format!("the body but {}", listed(pointers))),
    }
}

/// The sentence that says which fields of the body count, with its leading space; empty for
/// the whole body.
fn same_request(fields: BodyFields) -> String {
    match fields_counted(fields) {
        None => String::new(),
        Some(fields) => format!(
            " The same request is the same method and path with {fields} equal (JSON Pointers); \
             a retry that changes them gets 422."
        ),
    }
}

/// `90061` → `"1 day 1 hour 1 minute 1 second"`; `86400` → `"24 hours"` (whole days under
/// two are said in hours, as retention periods usually are).
pub(crate) fn human(secs: u64) -> String {
    if secs == 0 {
        return "0 seconds".to_owned();
    }
    let (days, hours) = if secs.is_multiple_of(86_400) && secs < 2 * 86_400 {
        (0, secs / 3600)
    } else {
        (secs / 86_400, secs % 86_400 / 3600)
    };
    let parts = [
        (days, "day"),
        (hours, "hour"),
        (secs % 3600 / 60, "minute"),
        (secs % 60, "second"),
    ];
    parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n} {unit}{}", if *n == 1 { "" } else { "s" }))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::{BodyFields, HandlerPolicy, KeyScope, Mode, RetentionPolicy, human};

    fn counting(fields: BodyFields) -> HandlerPolicy {
        HandlerPolicy::__new(
            "pay",
            "app",
            KeyScope::Parameter("tenant"),
            Mode::Transactional,
            86_400,
            false,
            30,
            None,
            None,
            fields,
        )
    }

    #[test]
    fn the_published_policy_says_which_fields_of_the_body_count() {
        let only = counting(BodyFields::Only(&["/amount", "/currency"]));
        assert!(
            only.describe()
                .contains("with only the body's `/amount`, `/currency` equal"),
            "{}",
            only.describe()
        );
        let table = RetentionPolicy::new()
            .with("POST /v1/payments", only)
            .with("POST /v1/logs", counting(BodyFields::Except(&["/sent_at"])))
            .with("POST /v1/refunds", counting(BodyFields::All))
            .to_string();
        assert!(
            table
                .contains("per caller; the same request: only the body's `/amount`, `/currency` |"),
            "{table}"
        );
        assert!(
            table.contains("per caller; the same request: the body but `/sent_at` |"),
            "{table}"
        );
        assert!(table.contains("| per caller |"), "{table}");
        assert!(
            !counting(BodyFields::All)
                .describe()
                .contains("same request is")
        );
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human(5), "5 seconds");
        assert_eq!(human(90 * 60), "1 hour 30 minutes");
        assert_eq!(human(86_400), "24 hours");
        assert_eq!(human(7 * 86_400), "7 days");
        assert_eq!(human(2 * 86_400 + 3600), "2 days 1 hour");
        assert_eq!(human(90_061), "1 day 1 hour 1 minute 1 second");
        assert_eq!(human(60), "1 minute");
    }
}
