//! RFC 9457 problem details (`application/problem+json`) for every answer the layer itself
//! gives, and a small builder that applications can use for their own errors.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

/// The media type of a problem details document.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Where the problem types of idem's own answers are documented: the repository's
/// `docs/problems.md` as of the tag `v0.1.0`, one section per kind; a kind's `type` is this
/// base and the kind's fixed slug (`…#keyreused`). [`StoreOptions::with_problem_type_base`] replaces
/// it.
///
/// The base names a tag, not a branch: a problem `type` is an identifier that clients compare
/// and may store, so it must keep both its value and what it points at. A branch (`main`) moves,
/// and its page may lose or change a section under URIs already answered; a tag names one
/// commit, so each URI keeps resolving to the section published with it, and releases that keep
/// the set of kinds keep the URIs. A release that adds a kind (its section is not at the old
/// tag) moves the base to its own tag, which changes every URI: a breaking release.
///
/// [`StoreOptions::with_problem_type_base`]: crate::store::StoreOptions::with_problem_type_base
pub const DEFAULT_PROBLEM_TYPE_BASE: &str =
    "https://github.com/idem-rs/idem/blob/v0.1.0/docs/problems.md#";

/// The kinds of problem the idempotency layer answers with. Each has a stable `type` URI that
/// points at its documentation here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProblemKind {
    /// 400: the route requires an `Idempotency-Key` header and the request has none.
    MissingKey,
    /// 400: the `Idempotency-Key` header is malformed (empty, over 255 characters, not visible
    /// ASCII, a bad Structured Field String, or sent twice).
    MalformedKey,
    /// 409: a request with this key is still being processed; retry after `Retry-After` seconds.
    /// Also the answer when the database refused the handler's commit because it lost a
    /// conflict with another transaction (a serialization failure or a deadlock, as a
    /// multi-primary cluster answers the loser of two duplicates at different nodes): nothing was
    /// stored, and the retry gets the winner's outcome or runs again.
    InProgress,
    /// 422: the key was first used with a different request (method, path, query or body).
    KeyReused,
    /// 413: the request body is larger than the store's configured limit; nothing was stored.
    BodyTooLarge,
    /// 500: the handler's response is larger than the store's configured limit, so it could not
    /// be stored; its writes were rolled back.
    ResponseTooLarge,
    /// 400: the value of the handler's scope parameter cannot scope keys: it is empty, holds
    /// U+0000 (NUL), or is longer than [`MAX_SCOPE_LEN`](crate::scope::MAX_SCOPE_LEN) bytes. It comes
    /// from the request (a path segment, a token), so the request is refused; nothing is stored.
    InvalidScope,
    /// 503: the idempotency store could not be reached or failed; nothing was stored.
    StoreUnavailable,
    /// 500: the idempotency store is not set up: its key table does not exist (the service did
    /// not run [`migrate`](crate::backend::migrate) on its database). Nothing ran and nothing was
    /// stored; no retry succeeds until the service is fixed, so it carries no `Retry-After`.
    StoreNotSetUp,
    /// 500: the database refused to commit the handler's writes (a deferred constraint), or the
    /// handler ended its transaction itself; nothing was stored.
    CommitRefused,
    /// 503: the connection failed during the commit, so whether the handler's writes and the
    /// key were committed is unknown; a retry with the same key finds out.
    OutcomeUnknown,
    /// 503: the handler ran longer than its `timeout` and was stopped: its writes were rolled
    /// back (or, in external mode, its claim released) and nothing was stored; a retry with the
    /// same key runs it again.
    HandlerTimedOut,
    /// 500: a step of a multi-step handler could not run or be recorded because of a mistake in
    /// the handler: a step name used twice, steps run at the same time, or an output that does
    /// not serialize to JSON (or no longer reads back as the handler's type).
    StepFailed,
    /// 500: the first request with this key was abandoned (its process died mid-request), and
    /// the recovery gave up on settling it after
    /// [`RecoveryOptions::max_attempts`](crate::tasks::RecoveryOptions::max_attempts) rounds.
    /// Whether its side effect happened is unknown until a person looks (`idem dead`), so no
    /// retry runs the handler: the answer is not stored, and it has no `Retry-After`. Once an
    /// operator resumes the claim (the recovery settles it) or abandons it (the next retry
    /// runs), retries get the outcome.
    ClaimParked,
    /// 500: this key's answer is stored sealed (encryption at rest), and it cannot be opened:
    /// it was sealed with a key the service does not have (the key was rotated out too soon,
    /// or lost), or its bytes were altered. The handler does not run (its first run happened),
    /// nothing is stored, and no retry gets past it until the key is given back: no
    /// `Retry-After`.
    AnswerUnreadable,
}

impl ProblemKind {
    /// The HTTP status this kind is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::MalformedKey | Self::InvalidScope => StatusCode::BAD_REQUEST,
            Self::InProgress => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::ResponseTooLarge
            | Self::StoreNotSetUp
            | Self::CommitRefused
            | Self::StepFailed
            | Self::ClaimParked
            | Self::AnswerUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
            Self::StoreUnavailable | Self::OutcomeUnknown | Self::HandlerTimedOut => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The stable `type` URI of this kind under [`DEFAULT_PROBLEM_TYPE_BASE`]: the base and the
    /// kind's slug (`…/docs/problems.md#keyreused`).
    pub fn type_uri(self) -> String {
        self.type_uri_under(DEFAULT_PROBLEM_TYPE_BASE)
    }

    /// The `type` URI of this kind under `base` (see [`StoreOptions::problem_type_base`]): the base
    /// and the kind's slug.
    ///
    /// [`StoreOptions::problem_type_base`]: crate::store::StoreOptions::problem_type_base
    pub fn type_uri_under(self, base: &str) -> String {
        format!("{base}{}", self.slug())
    }

    /// The fixed part of this kind's `type` URI, appended to the base: the kind's name in lower
    /// case when it was introduced, which is the anchor of its section of `docs/problems.md`.
    /// Written out, not derived from the variant's name, so that renaming a variant does not
    /// change a published URI.
    fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missingkey",
            Self::MalformedKey => "malformedkey",
            Self::InProgress => "inprogress",
            Self::KeyReused => "keyreused",
            Self::BodyTooLarge => "bodytoolarge",
            Self::ResponseTooLarge => "responsetoolarge",
            Self::InvalidScope => "invalidscope",
            Self::StoreUnavailable => "storeunavailable",
            Self::StoreNotSetUp => "storenotsetup",
            Self::CommitRefused => "commitrefused",
            Self::OutcomeUnknown => "outcomeunknown",
            Self::HandlerTimedOut => "handlertimedout",
            Self::StepFailed => "stepfailed",
            Self::ClaimParked => "claimparked",
            Self::AnswerUnreadable => "answerunreadable",
        }
    }

    /// A problem of this kind with the given detail, its `type` under `base`.
    pub fn problem_under(self, base: &str, detail: impl Into<String>) -> Problem {
        Problem::new(self.status(), self.title())
            .with_type(self.type_uri_under(base))
            .with_detail(detail)
    }

    /// A short, human-readable summary that does not change from occurrence to occurrence.
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header is missing",
            Self::MalformedKey => "Idempotency-Key header is malformed",
            Self::InProgress => "A request with this idempotency key is in progress",
            Self::KeyReused => "Idempotency key reused with a different request",
            Self::BodyTooLarge => "Request body too large",
            Self::ResponseTooLarge => "Response too large to store",
            Self::InvalidScope => "Idempotency scope is invalid",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::StoreNotSetUp => "Idempotency store not set up",
            Self::CommitRefused => "The handler's writes could not be committed",
            Self::OutcomeUnknown => "The outcome of the commit is unknown",
            Self::HandlerTimedOut => "The handler did not finish in time",
            Self::StepFailed => "A step of the handler could not be recorded",
            Self::ClaimParked => "The first request with this key needs a person",
            Self::AnswerUnreadable => "The stored answer of this key cannot be opened",
        }
    }

    /// A problem of this kind with the given detail, its `type` under
    /// [`DEFAULT_PROBLEM_TYPE_BASE`].
    pub fn with_detail(self, detail: impl Into<String>) -> Problem {
        self.problem_under(DEFAULT_PROBLEM_TYPE_BASE, detail)
    }
}

/// Marks a response as a problem of the layer made where the store's settings cannot be seen
/// (a [`StepError`](crate::steps::StepError) the handler returns): the request flow answers it with
/// its `type` under the store's [`StoreOptions::problem_type_base`](crate::store::StoreOptions).
#[derive(Debug, Clone)]
pub(crate) struct Rebasable {
    pub(crate) kind: ProblemKind,
    pub(crate) detail: String,
}

/// An RFC 9457 problem details document, answered as `application/problem+json`.
///
/// # Examples
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idem_runtime::Problem;
///
/// let response = Problem::new(StatusCode::PAYMENT_REQUIRED, "Card declined")
///     .with_type("https://example.com/problems/card-declined")
///     .with_detail("the card issuer declined the payment")
///     .into_response();
/// assert_eq!(response.status(), StatusCode::PAYMENT_REQUIRED);
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    type_uri: String,
    title: String,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    #[serde(skip)]
    retry_after: Option<u64>,
}

impl Problem {
    /// A problem with a status and title, of type `about:blank`.
    pub fn new(status: StatusCode, title: impl Into<String>) -> Self {
        Self {
            type_uri: "about:blank".to_owned(),
            title: title.into(),
            status: status.as_u16(),
            detail: None,
            retry_after: None,
        }
    }

    /// Sets the `type` URI.
    pub fn with_type(mut self, type_uri: impl Into<String>) -> Self {
        self.type_uri = type_uri.into();
        self
    }

    /// Sets the `detail`: what went wrong with this particular request.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds a `Retry-After` header, in seconds.
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// The status this problem is answered with.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut response = (self.status(), body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_uris_are_stable_and_distinct() {
        assert_eq!(
            ProblemKind::MissingKey.type_uri(),
            "https://github.com/idem-rs/idem/blob/v0.1.0/docs/problems.md#missingkey"
        );
        assert_ne!(
            ProblemKind::InProgress.type_uri(),
            ProblemKind::KeyReused.type_uri()
        );
    }

    /// Every kind, in the order of `docs/problems.md`. Built from an exhaustive `match`, so that
    /// a kind added to the enum does not compile until it is given its place in the list.
    fn every_kind() -> Vec<ProblemKind> {
        use ProblemKind::*;
        let after = |kind: Option<ProblemKind>| match kind {
            None => Some(MissingKey),
            Some(MissingKey) => Some(MalformedKey),
            Some(MalformedKey) => Some(InvalidScope),
            Some(InvalidScope) => Some(InProgress),
            Some(InProgress) => Some(KeyReused),
            Some(KeyReused) => Some(BodyTooLarge),
            Some(BodyTooLarge) => Some(ResponseTooLarge),
            Some(ResponseTooLarge) => Some(StoreUnavailable),
            Some(StoreUnavailable) => Some(StoreNotSetUp),
            Some(StoreNotSetUp) => Some(CommitRefused),
            Some(CommitRefused) => Some(OutcomeUnknown),
            Some(OutcomeUnknown) => Some(HandlerTimedOut),
            Some(HandlerTimedOut) => Some(StepFailed),
            Some(StepFailed) => Some(ClaimParked),
            Some(ClaimParked) => Some(AnswerUnreadable),
            Some(AnswerUnreadable) => None,
        };
        std::iter::successors(after(None), |kind| after(Some(*kind))).collect()
    }

    /// The anchors GitHub gives the headings of a Markdown document, in order: the heading's
    /// text in lower case, without what is neither a letter, a digit, a space, `-` nor `_`,
    /// spaces made `-`, and `-1`, `-2`, … after a repeated one. With each, the heading's level.
    fn github_anchors(markdown: &str) -> Vec<(usize, String)> {
        let mut seen = std::collections::HashMap::<String, usize>::new();
        let mut in_code = false;
        let mut anchors = Vec::new();
        for line in markdown.lines() {
            if line.starts_with("```") {
                in_code = !in_code;
            }
            let level = line.chars().take_while(|&c| c == '#').count();
            let Some(text) = line[level..].strip_prefix(' ') else {
                continue;
            };
            if in_code || level == 0 || level > 6 {
                continue;
            }
            let slug: String = text
                .trim()
                .to_lowercase()
                .chars()
                .filter(|&c| c.is_alphanumeric() || c == ' ' || c == '-' || c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect();
            let repeats = seen.entry(slug.clone()).or_insert(0);
            let anchor = match *repeats {
                0 => slug,
                n => format!("{slug}-{n}"),
            };
            *repeats += 1;
            anchors.push((level, anchor));
        }
        anchors
    }

    /// The document [`DEFAULT_PROBLEM_TYPE_BASE`] points at, as the repository holds it.
    fn problems_md() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/problems.md");
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
    }

    #[test]
    fn the_default_base_names_a_tag_of_docs_problems_md() {
        let base = DEFAULT_PROBLEM_TYPE_BASE;
        let tag = base
            .strip_prefix("https://github.com/idem-rs/idem/blob/")
            .and_then(|rest| rest.strip_suffix("/docs/problems.md#"))
            .unwrap_or_else(|| panic!("{base} is not docs/problems.md of the repository"));
        assert!(
            tag.starts_with('v') && tag[1..].split('.').all(|n| n.parse::<u32>().is_ok()),
            "{base} names {tag}, not a version tag"
        );
    }

    #[test]
    fn every_kind_uri_resolves_to_its_section_of_docs_problems_md() {
        let anchors = github_anchors(&problems_md());
        let sections: Vec<&str> = anchors
            .iter()
            .filter(|(level, _)| *level == 2)
            .map(|(_, anchor)| anchor.as_str())
            .collect();
        let kinds = every_kind();
        for kind in &kinds {
            let uri = kind.type_uri();
            let fragment = uri
                .strip_prefix(DEFAULT_PROBLEM_TYPE_BASE)
                .unwrap_or_else(|| panic!("{uri} is not under the default base"));
            assert!(
                sections.contains(&fragment),
                "{kind:?}'s type {uri} has no section: docs/problems.md has no heading `## …` \
                 whose anchor is `{fragment}` (its sections: {sections:?})"
            );
        }
        for section in &sections {
            assert!(
                kinds.iter().any(|kind| kind.slug() == *section),
                "the section #{section} of docs/problems.md is no kind's"
            );
        }
        assert_eq!(sections.len(), kinds.len(), "a kind has two sections");
    }

    #[test]
    fn a_service_base_takes_the_same_slugs() {
        for kind in every_kind() {
            assert_eq!(
                kind.type_uri_under("https://api.example.com/problems/"),
                format!("https://api.example.com/problems/{}", kind.slug())
            );
        }
    }

    #[test]
    fn problem_serialises_per_rfc_9457() {
        let problem = ProblemKind::InProgress
            .with_detail("busy")
            .with_retry_after(2);
        let response = problem.clone().into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        let json = serde_json::to_value(&problem).unwrap();
        assert_eq!(json["status"], 409);
        assert_eq!(json["detail"], "busy");
        assert_eq!(json["title"], ProblemKind::InProgress.title());
    }
}
