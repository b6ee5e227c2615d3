//! The mode, chosen by the signature and confirmed by the attribute (transactional with a
//! transaction parameter, external without one, with `Steps` or not), and the arguments that
//! belong to one mode only: `backend`, `lease`, and a `timeout` shorter than the lease.

use syn::{Block, Ident, Pat, Signature, visit::Visit};

use super::params::Params;
use crate::args::Args;

/// Every error of the mode and of the arguments that belong to one mode.
pub fn check(sig: &Signature, block: &Block, params: &Params, args: &Args) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    errors.extend(check_mode_confirmed(sig, params, args));
    errors.extend(check_backend_named(params, args));
    errors.extend(check_steps_without_transaction(params));
    errors.extend(check_step_names(params, block));
    errors.extend(check_backend_with_steps(params, args));
    errors.extend(check_backend_with_transaction(params, args));
    errors.extend(check_lease_with_transaction(params, args));
    errors.extend(check_timeout_within_lease(params, args));
    errors
}

/// The mode is chosen by the signature and confirmed by the attribute, so that a handler that
/// loses its transaction parameter does not become an external one unnoticed.
fn check_mode_confirmed(sig: &Signature, params: &Params, args: &Args) -> Option<syn::Error> {
    let ident = &sig.ident;
    match (&params.tx, args.external) {
        (Some(_), Some(span)) => Some(syn::Error::new(
            span,
            "`external` is for handlers without a transaction parameter; this one's writes commit together with its key: drop `external`",
        )),
        // A parameter meant as the transaction was refused, with its own fix.
        (None, None) if params.tx_attempted => None,
        (None, None) if params.steps_attempted => Some(syn::Error::new_spanned(
            ident,
            format!(
                "`{ident}` takes `Steps`, which run without a transaction parameter: write `external` in the attribute (`#[idempotent(external, ...)]`)"
            ),
        )),
        (None, None) => Some(syn::Error::new_spanned(
            ident,
            format!(
                "`{ident}` has no transaction parameter: add `tx: &mut sqlx::Transaction<'_, DB>` so that its writes commit together with its key, or, if its side effect is outside the database, write `external` in the attribute (`#[idempotent(external, ...)]`): the key is then claimed with a lease before the body runs"
            ),
        )),
        _ => None,
    }
}

/// The database features idem-runtime has on (it sets this crate's features of the same
/// names), each with the type a handler names it by.
const DATABASES: &[(&str, &str)] = &[
    #[cfg(feature = "postgres")]
    ("postgres", "sqlx::Postgres"),
    #[cfg(feature = "sqlite")]
    ("sqlite", "sqlx::Sqlite"),
    #[cfg(feature = "mysql")]
    ("mysql", "sqlx::MySql"),
];

/// An `external` handler names its database (`backend`) when no transaction or `Steps` does
/// and idem-runtime has several on.
fn check_backend_named(params: &Params, args: &Args) -> Option<syn::Error> {
    let span = args.external?;
    if params.tx.is_some()
        || args.backend.is_some()
        || params.steps_attempted
        || DATABASES.len() <= 1
    {
        return None;
    }
    let names: Vec<String> = DATABASES
        .iter()
        .map(|(feature, _)| format!("`{feature}`"))
        .collect();
    let choices: Vec<String> = DATABASES
        .iter()
        .map(|(_, ty)| format!("`backend = {ty}`"))
        .collect();
    Some(syn::Error::new(
        span,
        format!(
            "this handler has no transaction to name its database, and idem-runtime has {} on: add {}",
            listed(&names, "and"),
            listed(&choices, "or")
        ),
    ))
}

/// `items` as a sentence lists them: `a`, `a and b`, `a, b and c`.
fn listed(items: &[String], last: &str) -> String {
    match items {
        [] => String::new(),
        [only] => only.clone(),
        [init @ .., tail] => format!("{} {last} {tail}", init.join(", ")),
    }
}

/// `Steps` commit each step on their own, so a handler with a transaction cannot take them.
fn check_steps_without_transaction(params: &Params) -> Option<syn::Error> {
    let (Some(_), Some((arg, _))) = (&params.tx, &params.steps) else {
        return None;
    };
    Some(syn::Error::new_spanned(
        &arg.ty,
        "`Steps` are for `external` handlers, without a transaction parameter: each step commits on its own, and a retry resumes after the last one; drop the `&mut Transaction` parameter",
    ))
}

/// Each step's output is recorded under its name, so no two steps of a handler share one.
fn check_step_names(params: &Params, block: &Block) -> Vec<syn::Error> {
    match &params.steps {
        Some((arg, _)) => repeated_step_names(&arg.pat, block),
        None => Vec::new(),
    }
}

/// Every `steps.step("name", ..)` or `steps.call("name", ..)` in `block` whose name (a string
/// literal) an earlier one already used; `steps` is the parameter's binding.
fn repeated_step_names(pat: &Pat, block: &Block) -> Vec<syn::Error> {
    let Pat::Ident(binding) = pat else {
        return Vec::new();
    };
    let mut find = FindRepeatedSteps {
        steps: &binding.ident,
        seen: Vec::new(),
        errors: Vec::new(),
    };
    find.visit_block(block);
    find.errors
}

/// The visitor of [`repeated_step_names`].
struct FindRepeatedSteps<'a> {
    steps: &'a Ident,
    seen: Vec<String>,
    errors: Vec<syn::Error>,
}

impl<'ast> Visit<'ast> for FindRepeatedSteps<'_> {
    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        let on_steps =
            matches!(&*call.receiver, syn::Expr::Path(path) if path.path.is_ident(self.steps));
        if on_steps
            && (call.method == "step" || call.method == "call")
            && let Some(syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(name),
                ..
            })) = call.args.first()
        {
            let value = name.value();
            if self.seen.contains(&value) {
                self.errors.push(syn::Error::new(
                    name.span(),
                    format!("the step name {value:?} is already used by an earlier step of this handler; each step needs its own name, under which its output is recorded"),
                ));
            } else {
                self.seen.push(value);
            }
        }
        syn::visit::visit_expr_method_call(self, call);
    }
}

/// `Steps<DB>` names the database already.
fn check_backend_with_steps(params: &Params, args: &Args) -> Option<syn::Error> {
    let (Some(_), Some(backend)) = (&params.steps, &args.backend) else {
        return None;
    };
    Some(syn::Error::new_spanned(
        backend,
        "`backend` is not needed with a `Steps<DB>` parameter, whose `DB` names the database; drop `backend`",
    ))
}

/// The transaction names the database already.
fn check_backend_with_transaction(params: &Params, args: &Args) -> Option<syn::Error> {
    let (Some(_), Some(backend)) = (&params.tx, &args.backend) else {
        return None;
    };
    Some(syn::Error::new_spanned(
        backend,
        "`backend` is for handlers without a transaction parameter; this handler's database is its transaction's",
    ))
}

/// A transaction holds its key until it ends; there is no lease to set.
fn check_lease_with_transaction(params: &Params, args: &Args) -> Option<syn::Error> {
    let (Some(_), Some(span)) = (&params.tx, args.lease_span) else {
        return None;
    };
    Some(syn::Error::new(
        span,
        "`lease` applies only to `external` handlers; with a transaction the key is held by the transaction itself and freed by its end",
    ))
}

/// External mode: the lease is counted from the claim, before the body starts, so a body
/// allowed to run as long as the lease could still be running when a retry takes it over.
fn check_timeout_within_lease(params: &Params, args: &Args) -> Option<syn::Error> {
    let (None, Some((timeout, span))) = (&params.tx, args.timeout) else {
        return None;
    };
    if timeout < args.lease_secs {
        return None;
    }
    let lease = match args.lease_span {
        Some(_) => format!("`lease`, {}s", args.lease_secs),
        None => format!("the default `lease`, {}s", args.lease_secs),
    };
    Some(syn::Error::new(
        span,
        format!(
            "`timeout` must be shorter than the lease ({lease}): a handler still running when its lease ends can be taken over by a retry and run twice at once; shorten `timeout` or lengthen `lease`"
        ),
    ))
}
