//! The attribute's arguments, each declared once in [`ARGUMENTS`]: `scope`, `global`,
//! `retention`, `replay_5xx`, `external`, `lease`, `timeout`, `wait`, `backend`, `state`,
//! `fingerprint_only`, `fingerprint_except`, `rpc`, `key_header`, `key_pointer`, `key_field`,
//! `key_optional` (and `lock_timeout`, the old name of `lease`, refused
//! with an error that names the new one).

use proc_macro2::{Span, TokenStream};
use syn::{Expr, ExprLit, Lit, LitStr, meta::ParseNestedMeta, parse::Parser};

use crate::{
    duration,
    fields::{self, BodyFields},
    key::{self, KeyArg},
};

/// Old names, still recognised so that the error can name the new one; not offered in the
/// list of arguments.
const RENAMED: &[&str] = &["lock_timeout"];

/// Reads one argument into [`Raw`], or says what is wrong with it.
type ParseArgument = fn(&ParseNestedMeta<'_>, &mut Raw) -> syn::Result<()>;

/// Every argument the attribute accepts, with its parser; the "unknown argument" error lists
/// these names.
const ARGUMENTS: &[(&str, ParseArgument)] = &[
    ("scope", parse_scope),
    ("global", parse_global),
    ("retention", parse_retention),
    ("replay_5xx", parse_replay_5xx),
    ("external", parse_external),
    ("lease", parse_lease),
    ("lock_timeout", parse_lock_timeout),
    ("timeout", parse_timeout),
    ("wait", parse_wait),
    ("backend", parse_backend),
    ("state", parse_state),
    ("fingerprint_only", parse_fingerprint_only),
    ("fingerprint_except", parse_fingerprint_except),
    ("rpc", parse_rpc),
    ("key_header", parse_key_header),
    ("key_pointer", parse_key_pointer),
    ("key_field", parse_key_field),
    ("key_optional", parse_key_optional),
];

/// Seconds in the default lease of external mode.
const DEFAULT_LOCK_TIMEOUT: u64 = 30;

/// Seconds in the default retention, 24 hours (Stripe's).
const DEFAULT_RETENTION: u64 = 86_400;

/// Whose keys these are.
pub enum ScopeArg {
    /// `scope = "<param>"`.
    Param(LitStr),
    /// `global`.
    Global,
}

/// The arguments, as far as they could be understood.
pub struct Args {
    /// `None` when the scope could not be determined (an error says why).
    pub scope: Option<ScopeArg>,
    pub retention_secs: u64,
    pub replay_5xx: bool,
    /// `external` was written, and where: the handler has no transaction on purpose.
    pub external: Option<Span>,
    /// The lease of external mode, and where it was written (an error in transactional mode).
    pub lease_secs: u64,
    pub lease_span: Option<Span>,
    /// How long the handler body may run (`None`: unbounded), and where it was written.
    pub timeout: Option<(u64, Span)>,
    /// The most a duplicate may wait for the first request's answer (`Prefer: wait`).
    pub wait: Option<u64>,
    /// External mode: the database, when it is not the default one.
    pub backend: Option<syn::Type>,
    /// The router's state, to check the handler against at its definition.
    pub state: Option<syn::Type>,
    /// Which fields of a JSON body count in the fingerprint.
    pub body_fields: BodyFields,
    /// A tonic method's name in the `.proto`, when it is not the Rust name in upper camel case.
    pub rpc: Option<LitStr>,
    /// Where the key is.
    pub key: KeyArg,
    /// `key_optional` was written, and where: a request without a key runs unprotected.
    pub key_optional: Option<Span>,
}

#[derive(Default)]
struct Raw {
    scope: Option<LitStr>,
    global: Option<Span>,
    /// `scope` or `global` was written, even if with an error.
    scope_attempted: bool,
    retention: Option<u64>,
    replay_5xx: Option<bool>,
    external: Option<Span>,
    lease: Option<(u64, Span)>,
    timeout: Option<(u64, Span)>,
    wait: Option<u64>,
    backend: Option<syn::Type>,
    state: Option<syn::Type>,
    body_fields: Option<BodyFields>,
    rpc: Option<LitStr>,
    key: Option<KeyArg>,
    key_optional: Option<Span>,
}

/// Parses the arguments, collecting every error; the values that could be read are returned
/// beside the errors, so that the signature can still be checked against them.
pub fn parse(attr: TokenStream) -> (Args, Vec<syn::Error>) {
    let (raw, mut errors) = parse_raw(attr);
    errors.extend(check_scope_or_global(&raw));
    let scope = scope(&raw, &mut errors);
    errors.extend(check_lease_within_retention(&raw));
    let args = Args {
        scope,
        retention_secs: raw.retention.unwrap_or(DEFAULT_RETENTION),
        replay_5xx: raw.replay_5xx.unwrap_or(false),
        external: raw.external,
        lease_secs: raw.lease.map_or(DEFAULT_LOCK_TIMEOUT, |(secs, _)| secs),
        lease_span: raw.lease.map(|(_, span)| span),
        timeout: raw.timeout,
        wait: raw.wait,
        backend: raw.backend,
        state: raw.state,
        body_fields: raw.body_fields.unwrap_or_default(),
        rpc: raw.rpc,
        key: raw.key.unwrap_or_default(),
        key_optional: raw.key_optional,
    };
    (args, errors)
}

/// Each argument read on its own; after an error the next one is still read.
fn parse_raw(attr: TokenStream) -> (Raw, Vec<syn::Error>) {
    let mut raw = Raw::default();
    let mut errors: Vec<syn::Error> = Vec::new();
    let parser = syn::meta::parser(|meta| {
        if let Err(error) = parse_one(&meta, &mut raw) {
            errors.push(error);
            skip_value(&meta)?;
        }
        Ok(())
    });
    if let Err(error) = parser.parse2(attr) {
        errors.push(error);
    }
    (raw, errors)
}

/// Keys are per caller (`scope`) or shared (`global`), not both.
fn check_scope_or_global(raw: &Raw) -> Option<syn::Error> {
    let (Some(_), Some(global)) = (&raw.scope, raw.global) else {
        return None;
    };
    Some(syn::Error::new(
        global,
        "`global` and `scope` cannot be used together: keys are either shared by all callers or kept per caller",
    ))
}

/// Whose keys these are: `None` when `scope` or `global` was written with an error (reported
/// already), or when neither was (reported here).
fn scope(raw: &Raw, errors: &mut Vec<syn::Error>) -> Option<ScopeArg> {
    match (&raw.scope, raw.global) {
        (Some(lit), _) => Some(ScopeArg::Param(lit.clone())),
        (None, Some(_)) => Some(ScopeArg::Global),
        (None, None) if raw.scope_attempted => None,
        (None, None) => {
            errors.push(syn::Error::new(
                Span::call_site(),
                "missing `scope`: name the parameter that identifies the caller, e.g. `#[idempotent(scope = \"tenant\")]`, or write `#[idempotent(global)]` to share keys between all callers",
            ));
            None
        }
    }
}

/// A claim cannot outlive its record: the lease is at most the retention.
fn check_lease_within_retention(raw: &Raw) -> Option<syn::Error> {
    let (lease, span) = raw.lease?;
    (lease > raw.retention.unwrap_or(DEFAULT_RETENTION)).then(|| {
        syn::Error::new(
            span,
            "`lease` is longer than `retention`: a claim would expire before its lease ends; shorten the lease",
        )
    })
}

fn parse_one(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    let name = meta
        .path
        .get_ident()
        .map(ToString::to_string)
        .unwrap_or_default();
    match ARGUMENTS.iter().find(|(known, _)| *known == name) {
        Some((_, parse)) => parse(meta, raw),
        None => {
            let expected: Vec<String> = ARGUMENTS
                .iter()
                .filter(|(known, _)| !RENAMED.contains(known))
                .map(|(known, _)| format!("`{known}`"))
                .collect();
            Err(syn::Error::new_spanned(
                &meta.path,
                format!(
                    "unknown argument `{}`; expected one of {}",
                    quote::ToTokens::to_token_stream(&meta.path),
                    expected.join(", ")
                ),
            ))
        }
    }
}

fn repeated(meta: &ParseNestedMeta<'_>, name: &str) -> syn::Error {
    meta.error(format!("`{name}` is specified more than once"))
}

fn parse_scope(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    raw.scope_attempted = true;
    if raw.scope.is_some() {
        return Err(repeated(meta, "scope"));
    }
    match value(meta, "scope = \"<parameter name>\"")? {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) if !lit.value().is_empty() => {
            raw.scope = Some(lit);
            Ok(())
        }
        other => Err(syn::Error::new_spanned(
            other,
            "expected the name of a handler parameter as a string, e.g. `scope = \"tenant\"`",
        )),
    }
}

fn parse_global(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    raw.scope_attempted = true;
    if raw.global.is_some() {
        return Err(repeated(meta, "global"));
    }
    if !meta.input.is_empty() && !meta.input.peek(syn::Token![,]) {
        return Err(meta.error("`global` takes no value: write `#[idempotent(global)]`"));
    }
    raw.global = Some(path_span(meta));
    Ok(())
}

fn parse_external(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.external.is_some() {
        return Err(repeated(meta, "external"));
    }
    // Recorded even when refused below, so that the mode it meant is not reported missing too.
    raw.external = Some(path_span(meta));
    if !meta.input.is_empty() && !meta.input.peek(syn::Token![,]) {
        return Err(meta.error("`external` takes no value: write `#[idempotent(external, ...)]`"));
    }
    Ok(())
}

fn parse_retention(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.retention.is_some() {
        return Err(repeated(meta, "retention"));
    }
    raw.retention = Some(duration_value(meta, "retention", "24h")?);
    Ok(())
}

fn parse_lease(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.lease.is_some() {
        return Err(repeated(meta, "lease"));
    }
    let span = path_span(meta);
    raw.lease = Some((duration_value(meta, "lease", "30s")?, span));
    Ok(())
}

/// `lock_timeout` was the first name of `lease`; PostgreSQL's `lock_timeout` means something
/// else (how long to wait for a lock), so the old spelling is refused with the new one.
fn parse_lock_timeout(meta: &ParseNestedMeta<'_>, _: &mut Raw) -> syn::Result<()> {
    Err(syn::Error::new(
        path_span(meta),
        "`lock_timeout` is now `lease`: write `lease = \"30s\"` (the time a claim of an `external` handler is exclusive before a retry may take it over)",
    ))
}

fn parse_timeout(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.timeout.is_some() {
        return Err(repeated(meta, "timeout"));
    }
    let span = path_span(meta);
    raw.timeout = Some((duration_value(meta, "timeout", "10s")?, span));
    Ok(())
}

fn parse_wait(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.wait.is_some() {
        return Err(repeated(meta, "wait"));
    }
    raw.wait = Some(duration_value(meta, "wait", "10s")?);
    Ok(())
}

fn parse_backend(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.backend.is_some() {
        return Err(repeated(meta, "backend"));
    }
    raw.backend = Some(type_value(meta, "backend = sqlx::Sqlite")?);
    Ok(())
}

fn parse_state(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.state.is_some() {
        return Err(repeated(meta, "state"));
    }
    raw.state = Some(type_value(meta, "state = AppState")?);
    Ok(())
}

fn parse_rpc(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.rpc.is_some() {
        return Err(repeated(meta, "rpc"));
    }
    match value(meta, "rpc = \"GetHTTPStatus\"")? {
        Expr::Lit(ExprLit {
            lit: Lit::Str(name),
            ..
        }) => {
            let text = name.value();
            let mut chars = text.chars();
            let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(syn::Error::new_spanned(
                    &name,
                    format!(
                        "`rpc` is the method's name in the `.proto` (letters, digits and `_`, \
                         a letter first), not {text:?}"
                    ),
                ));
            }
            raw.rpc = Some(name);
            Ok(())
        }
        other => Err(syn::Error::new_spanned(
            other,
            "expected a string: `rpc = \"GetHTTPStatus\"`",
        )),
    }
}

/// `key_header`, `key_pointer` or `key_field`: one source, given once.
fn key_source(
    meta: &ParseNestedMeta<'_>,
    raw: &mut Raw,
    parse: fn(&ParseNestedMeta<'_>) -> syn::Result<KeyArg>,
) -> syn::Result<()> {
    if raw.key.is_some() {
        return Err(meta.error(
            "the key has one source: give one of `key_header`, `key_pointer` and `key_field`, once",
        ));
    }
    raw.key = Some(parse(meta)?);
    Ok(())
}

fn parse_key_header(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    key_source(meta, raw, key::header)
}

fn parse_key_pointer(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    key_source(meta, raw, key::pointer)
}

fn parse_key_field(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    key_source(meta, raw, key::field)
}

fn parse_key_optional(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.key_optional.is_some() {
        return Err(repeated(meta, "key_optional"));
    }
    if meta.input.peek(syn::Token![=]) {
        return Err(meta.error(
            "`key_optional` takes no value: write `key_optional` for a key that may be left out",
        ));
    }
    raw.key_optional = Some(path_span(meta));
    Ok(())
}

fn parse_fingerprint_only(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    let pointers = body_fields(meta, raw, "fingerprint_only")?;
    raw.body_fields = Some(BodyFields::Only(pointers));
    Ok(())
}

fn parse_fingerprint_except(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    let pointers = body_fields(meta, raw, "fingerprint_except")?;
    raw.body_fields = Some(BodyFields::Except(pointers));
    Ok(())
}

/// The pointers of `fingerprint_only` or `fingerprint_except`, of which one may be given, once.
fn body_fields(meta: &ParseNestedMeta<'_>, raw: &Raw, name: &str) -> syn::Result<Vec<String>> {
    if raw.body_fields.is_some() {
        return Err(meta.error(
            "`fingerprint_only` and `fingerprint_except` are given once, and not together: name the fields that count, or those that do not",
        ));
    }
    match value(meta, &format!("{name} = [\"/sent_at\"]"))? {
        Expr::Array(array) => fields::pointers(&array, name),
        other => Err(syn::Error::new_spanned(
            other,
            format!(
                "expected a list of JSON Pointers, e.g. `{name} = [\"/sent_at\", \"/trace/id\"]`"
            ),
        )),
    }
}

fn parse_replay_5xx(meta: &ParseNestedMeta<'_>, raw: &mut Raw) -> syn::Result<()> {
    if raw.replay_5xx.is_some() {
        return Err(repeated(meta, "replay_5xx"));
    }
    match value(meta, "replay_5xx = true")? {
        Expr::Lit(ExprLit {
            lit: Lit::Bool(lit),
            ..
        }) => {
            raw.replay_5xx = Some(lit.value);
            Ok(())
        }
        other => Err(syn::Error::new_spanned(
            other,
            "expected `true` or `false`, e.g. `replay_5xx = true`",
        )),
    }
}

fn type_value(meta: &ParseNestedMeta<'_>, example: &str) -> syn::Result<syn::Type> {
    if !meta.input.peek(syn::Token![=]) {
        return Err(meta.error(format!("expected a type: `{example}`")));
    }
    meta.value()?.parse()
}

fn duration_value(meta: &ParseNestedMeta<'_>, name: &str, example: &str) -> syn::Result<u64> {
    let expr = value(meta, &format!("{name} = \"{example}\""))?;
    match &expr {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) => duration::parse_seconds(&lit.value())
            .map_err(|message| syn::Error::new(lit.span(), message)),
        other => Err(syn::Error::new_spanned(
            other,
            format!(
                "expected a duration string, e.g. `{name} = \"{example}\"` (units `s`, `m`, `h`, `d`)"
            ),
        )),
    }
}

fn path_span(meta: &ParseNestedMeta<'_>) -> Span {
    syn::spanned::Spanned::span(&meta.path)
}

fn value(meta: &ParseNestedMeta<'_>, example: &str) -> syn::Result<Expr> {
    if !meta.input.peek(syn::Token![=]) {
        return Err(meta.error(format!("expected a value: `{example}`")));
    }
    meta.value()?.parse()
}

/// After an error, steps over `= <expr>` so that the next argument is still parsed.
fn skip_value(meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        meta.value()?.parse::<Expr>()?;
    }
    Ok(())
}
