//! Signature analysis: which parameter is the transaction, which is the scope, which extractor
//! comes last, and everything about the function that the macro cannot support.

use proc_macro2::Span;
use syn::{
    FnArg, GenericArgument, Ident, ItemFn, Pat, PatType, PathArguments, ReturnType, Type,
    spanned::Spanned, visit::Visit,
};

use crate::args::{self, Args, ScopeArg};

/// Extractors that read the request body: Axum needs them last.
const BODY_EXTRACTORS: &[&str] = &[
    "Json",
    "Form",
    "Bytes",
    "String",
    "Body",
    "Request",
    "Multipart",
    "RawForm",
    "BodyStream",
];

/// The handler, understood.
pub struct Handler {
    pub item: ItemFn,
    /// The `&mut Transaction<'_, DB>` parameter; without one the handler is in external mode.
    pub tx: Option<PatType>,
    /// `DB` of the transaction, or `None` for the default backend.
    pub db: Option<Type>,
    /// The `IdempotencyContext` parameter, if any.
    pub context: Option<PatType>,
    /// The `Steps<DB>` parameter, if any (external mode only).
    pub steps: Option<PatType>,
    /// The extractor parameters, in order, without the transaction.
    pub extractors: Vec<PatType>,
    /// How the scope value is computed.
    pub scope: Scope,
}

/// Where the scope comes from.
pub enum Scope {
    Global,
    /// The binding named by `scope`, and the span to report type errors at.
    Binding {
        ident: Ident,
        span: Span,
    },
}

/// Checks the function against the arguments, collecting every error.
pub fn analyse(item: ItemFn, args: &Args) -> Result<Handler, syn::Error> {
    let mut errors = Vec::new();
    let sig = &item.sig;
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span,
            "`#[idempotent]` handlers must be `async fn`: the macro awaits the claim and the commit",
        ));
    }
    if let Some(constness) = &sig.constness {
        errors.push(syn::Error::new(
            constness.span,
            "`#[idempotent]` handlers cannot be `const fn`",
        ));
    }
    if let Some(unsafety) = &sig.unsafety {
        errors.push(syn::Error::new(
            unsafety.span,
            "`#[idempotent]` handlers cannot be `unsafe fn`",
        ));
    }
    if let Some(abi) = &sig.abi {
        errors.push(syn::Error::new_spanned(
            abi,
            "`#[idempotent]` handlers cannot have an `extern` ABI",
        ));
    }
    if let Some(variadic) = &sig.variadic {
        errors.push(syn::Error::new_spanned(
            variadic,
            "`#[idempotent]` handlers cannot be variadic",
        ));
    }
    // Type parameters are fine (a handler generic over its database is routed as
    // `post(create::<Postgres>)`); lifetimes are not: extractors are owned values.
    if let Some(lifetime) = sig
        .generics
        .params
        .iter()
        .find(|param| matches!(param, syn::GenericParam::Lifetime(_)))
    {
        errors.push(syn::Error::new_spanned(
            lifetime,
            "`#[idempotent]` handlers cannot have lifetime parameters: extractors are owned values, and the transaction's lifetime is written `'_`",
        ));
    }
    if let ReturnType::Type(_, ty) = &sig.output
        && let Some(span) = first_borrow(ty)
    {
        errors.push(syn::Error::new(
            span,
            "`#[idempotent]` handlers cannot return borrowed data: the response outlives the transaction",
        ));
    }

    let mut tx: Option<(PatType, Type)> = None;
    let mut context: Option<PatType> = None;
    let mut steps: Option<(PatType, Type)> = None;
    let mut extractors = Vec::new();
    let mut tx_attempted = false;
    let mut steps_attempted = false;
    for input in &sig.inputs {
        let arg = match input {
            FnArg::Receiver(receiver) => {
                errors.push(syn::Error::new_spanned(
                    receiver,
                    "`#[idempotent]` handlers cannot take `self`: write a free `async fn` and pass the state through an extractor such as `State`",
                ));
                continue;
            }
            FnArg::Typed(arg) => arg,
        };
        if let Some(by_value) = is_context(&arg.ty) {
            if !by_value {
                errors.push(syn::Error::new_spanned(
                    &arg.ty,
                    "take the context by value: `ctx: IdempotencyContext`",
                ));
            } else if context.is_some() {
                errors.push(syn::Error::new_spanned(
                    &arg.ty,
                    "a second `IdempotencyContext` parameter: one is enough",
                ));
            } else {
                context = Some(arg.clone());
            }
            continue;
        }
        if let Some((by_value, db)) = steps_param(&arg.ty) {
            steps_attempted = true;
            if !by_value {
                errors.push(syn::Error::new_spanned(
                    &arg.ty,
                    "take the steps by value: `steps: Steps<DB>`",
                ));
            } else if steps.is_some() {
                errors.push(syn::Error::new_spanned(
                    &arg.ty,
                    "a second `Steps` parameter: one is enough",
                ));
            } else {
                steps = Some((arg.clone(), db));
            }
            continue;
        }
        match transaction(&arg.ty) {
            TxKind::NotTransaction => extractors.push(arg.clone()),
            TxKind::MutRef(db) => {
                if tx.is_some() {
                    errors.push(syn::Error::new_spanned(
                        &arg.ty,
                        "a second transaction parameter: `#[idempotent]` handlers take exactly one `&mut Transaction`, begun and committed by the macro",
                    ));
                } else {
                    tx = Some((arg.clone(), *db));
                }
            }
            TxKind::OtherMutRef => {
                tx_attempted = true;
                errors.push(syn::Error::new_spanned(
                    &arg.ty,
                    "`&mut` parameters are not extractors: write the transaction as `&mut sqlx::Transaction<'_, DB>` (type aliases such as `PgTransaction` are not recognised)",
                ));
            }
            TxKind::Other => {
                tx_attempted = true;
                errors.push(syn::Error::new_spanned(
                    &arg.ty,
                    "take the transaction as `&mut Transaction<'_, DB>`: the macro begins and commits it, so the handler only borrows it",
                ));
            }
        }
    }
    // The mode is chosen by the signature and confirmed by the attribute, so that a handler
    // that loses its transaction parameter does not become an external one unnoticed.
    match (&tx, args.external) {
        (Some(_), Some(span)) => errors.push(syn::Error::new(
            span,
            "`external` is for handlers without a transaction parameter; this one's writes commit together with its key: drop `external`",
        )),
        // A parameter meant as the transaction was refused above, with its own fix.
        (None, None) if tx_attempted => {}
        (None, None) if steps_attempted => errors.push(syn::Error::new_spanned(
            &sig.ident,
            format!(
                "`{}` takes `Steps`, which run without a transaction parameter: write `external` in the attribute (`#[idempotent(external, ...)]`)",
                sig.ident
            ),
        )),
        (None, None) => errors.push(syn::Error::new_spanned(
            &sig.ident,
            format!(
                "`{}` has no transaction parameter: add `tx: &mut sqlx::Transaction<'_, DB>` so that its writes commit together with its key, or, if its side effect is outside the database, write `external` in the attribute (`#[idempotent(external, ...)]`): the key is then claimed with a lease before the body runs",
                sig.ident
            ),
        )),
        _ => {}
    }
    if tx.is_none()
        && args.backend.is_none()
        && !steps_attempted
        && DATABASES.len() > 1
        && let Some(span) = args.external
    {
        let names: Vec<String> = DATABASES
            .iter()
            .map(|(feature, _)| format!("`{feature}`"))
            .collect();
        let choices: Vec<String> = DATABASES
            .iter()
            .map(|(_, ty)| format!("`backend = {ty}`"))
            .collect();
        errors.push(syn::Error::new(
            span,
            format!(
                "this handler has no transaction to name its database, and idem-runtime has {} on: add {}",
                listed(&names, "and"),
                listed(&choices, "or")
            ),
        ));
    }
    if let (Some(_), Some((arg, _))) = (&tx, &steps) {
        errors.push(syn::Error::new_spanned(
            &arg.ty,
            "`Steps` are for `external` handlers, without a transaction parameter: each step commits on its own, and a retry resumes after the last one; drop the `&mut Transaction` parameter",
        ));
    }
    if let Some((arg, _)) = &steps {
        errors.extend(repeated_step_names(&arg.pat, &item.block));
    }
    if let (Some(_), Some(backend)) = (&steps, &args.backend) {
        errors.push(syn::Error::new_spanned(
            backend,
            "`backend` is not needed with a `Steps<DB>` parameter, whose `DB` names the database; drop `backend`",
        ));
    }
    if let (Some(_), Some(backend)) = (&tx, &args.backend) {
        errors.push(syn::Error::new_spanned(
            backend,
            "`backend` is for handlers without a transaction parameter; this handler's database is its transaction's",
        ));
    }
    if let (Some(_), Some(span)) = (&tx, args.lease_span) {
        errors.push(syn::Error::new(
            span,
            "`lease` applies only to `external` handlers; with a transaction the key is held by the transaction itself and freed by its end",
        ));
    }

    // External mode: the lease is counted from the claim, before the body starts, so a body
    // allowed to run as long as the lease could still be running when a retry takes it over.
    if let (None, Some((timeout, span))) = (&tx, args.timeout)
        && timeout >= args.lease_secs
    {
        let lease = match args.lease_span {
            Some(_) => format!("`lease`, {}s", args.lease_secs),
            None => format!("the default `lease`, {}s", args.lease_secs),
        };
        errors.push(syn::Error::new(
            span,
            format!("`timeout` must be shorter than the lease ({lease}): a handler still running when its lease ends can be taken over by a retry and run twice at once; shorten `timeout` or lengthen `lease`"),
        ));
    }

    for (index, arg) in extractors.iter().enumerate() {
        if index + 1 == extractors.len() {
            break;
        }
        if let Some(name) = body_extractor(&arg.ty) {
            errors.push(syn::Error::new_spanned(
                &arg.ty,
                format!("`{name}` consumes the request body, so it must be the last extractor of the handler"),
            ));
        }
    }

    let scope = match &args.scope {
        // The argument itself was wrong; its error is already reported.
        None => Some(Scope::Global),
        Some(ScopeArg::Global) => Some(Scope::Global),
        Some(ScopeArg::Param(lit)) => {
            let name = lit.value();
            let found = extractors.iter().find_map(|arg| find_binding(arg, &name));
            match found {
                Some(scope) => Some(scope),
                None => {
                    let is_tx = tx
                        .as_ref()
                        .is_some_and(|(arg, _)| find_binding(arg, &name).is_some());
                    let message = if is_tx {
                        format!(
                            "`scope = \"{name}\"` names the transaction; name the parameter that identifies the caller"
                        )
                    } else {
                        let names: Vec<String> = extractors
                            .iter()
                            .flat_map(|arg| bindings(&arg.pat))
                            .map(|ident| format!("`{ident}`"))
                            .collect();
                        if names.is_empty() {
                            format!(
                                "`scope = \"{name}\"` names no parameter of `{}`: add the parameter that identifies the caller",
                                sig.ident
                            )
                        } else {
                            format!(
                                "`scope = \"{name}\"` names no parameter of `{}`; its parameters are {}",
                                sig.ident,
                                names.join(", ")
                            )
                        }
                    };
                    errors.push(syn::Error::new(lit.span(), message));
                    None
                }
            }
        }
    };

    if let Some(error) = args::combine(errors) {
        return Err(error);
    }
    let (tx, db) = tx.unzip();
    let (steps, steps_db) = steps.unzip();
    let db = db
        .or_else(|| args.backend.clone())
        .or(steps_db.filter(|db| !matches!(db, Type::Infer(_))));
    Ok(Handler {
        item,
        tx,
        db,
        context,
        steps,
        extractors,
        scope: scope.expect("checked above"),
    })
}

enum TxKind {
    NotTransaction,
    /// A `&mut` of something else: never an extractor, most likely an aliased transaction.
    OtherMutRef,
    MutRef(Box<Type>),
    Other,
}

/// Recognises `&mut Transaction<'_, DB>` (any path ending in `Transaction`).
fn transaction(ty: &Type) -> TxKind {
    let (is_mut_ref, inner) = match ty {
        Type::Reference(reference) => (reference.mutability.is_some(), &*reference.elem),
        other => (false, other),
    };
    let Some(db) = transaction_db(inner) else {
        return if is_mut_ref {
            TxKind::OtherMutRef
        } else {
            TxKind::NotTransaction
        };
    };
    if is_mut_ref {
        TxKind::MutRef(Box::new(db))
    } else {
        TxKind::Other
    }
}

fn transaction_db(ty: &Type) -> Option<Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Transaction" {
        return None;
    }
    let PathArguments::AngleBracketed(generics) = &last.arguments else {
        return None;
    };
    generics.args.iter().rev().find_map(|arg| match arg {
        GenericArgument::Type(ty) => Some(ty.clone()),
        _ => None,
    })
}

/// `Some(true)` for `IdempotencyContext`, `Some(false)` for a reference to one.
fn is_context(ty: &Type) -> Option<bool> {
    let (by_value, inner) = match ty {
        Type::Reference(reference) => (false, &*reference.elem),
        other => (true, other),
    };
    let Type::Path(path) = inner else { return None };
    let last = path.path.segments.last()?;
    (last.ident == "IdempotencyContext").then_some(by_value)
}

/// `Some((true, DB))` for `Steps<DB>`, `Some((false, DB))` for a reference to one.
fn steps_param(ty: &Type) -> Option<(bool, Type)> {
    let (by_value, inner) = match ty {
        Type::Reference(reference) => (false, &*reference.elem),
        other => (true, other),
    };
    let Type::Path(path) = inner else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Steps" {
        return None;
    }
    let PathArguments::AngleBracketed(generics) = &last.arguments else {
        return None;
    };
    generics.args.iter().find_map(|arg| match arg {
        GenericArgument::Type(db) => Some((by_value, db.clone())),
        _ => None,
    })
}

/// Every `steps.step("name", ..)` or `steps.call("name", ..)` in `block` whose name (a string
/// literal) an earlier one already used; `steps` is the parameter's binding.
fn repeated_step_names(pat: &Pat, block: &syn::Block) -> Vec<syn::Error> {
    struct Find<'a> {
        steps: &'a Ident,
        seen: Vec<String>,
        errors: Vec<syn::Error>,
    }
    impl<'ast> Visit<'ast> for Find<'_> {
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
    let Pat::Ident(binding) = pat else {
        return Vec::new();
    };
    let mut find = Find {
        steps: &binding.ident,
        seen: Vec::new(),
        errors: Vec::new(),
    };
    find.visit_block(block);
    find.errors
}

fn body_extractor(ty: &Type) -> Option<String> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    let name = last.ident.to_string();
    BODY_EXTRACTORS.contains(&name.as_str()).then_some(name)
}

fn bindings(pat: &Pat) -> Vec<Ident> {
    struct Collect(Vec<Ident>);
    impl<'ast> Visit<'ast> for Collect {
        fn visit_pat_ident(&mut self, node: &'ast syn::PatIdent) {
            self.0.push(node.ident.clone());
            syn::visit::visit_pat_ident(self, node);
        }
    }
    let mut collect = Collect(Vec::new());
    collect.visit_pat(pat);
    collect.0
}

fn find_binding(arg: &PatType, name: &str) -> Option<Scope> {
    let ident = bindings(&arg.pat).into_iter().find(|ident| ident == name)?;
    // A plain `tenant: Tenant` reports trait errors on the type; a binding inside a pattern
    // (`Extension(tenant): Extension<Tenant>`) on the binding itself.
    let span = if matches!(&*arg.pat, Pat::Ident(_)) {
        arg.ty.span()
    } else {
        ident.span()
    };
    Some(Scope::Binding { ident, span })
}

/// The first reference or non-`'static` lifetime in `ty`.
fn first_borrow(ty: &Type) -> Option<Span> {
    struct Find(Option<Span>);
    impl<'ast> Visit<'ast> for Find {
        fn visit_type_reference(&mut self, reference: &'ast syn::TypeReference) {
            if reference.lifetime.is_none() && self.0.is_none() {
                self.0 = Some(reference.and_token.span);
            }
            syn::visit::visit_type_reference(self, reference);
        }
        fn visit_lifetime(&mut self, lifetime: &'ast syn::Lifetime) {
            if lifetime.ident != "static" && self.0.is_none() {
                self.0 = Some(lifetime.span());
            }
        }
    }
    let mut find = Find(None);
    find.visit_type(ty);
    find.0
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

/// `items` as a sentence lists them: `a`, `a and b`, `a, b and c`.
fn listed(items: &[String], last: &str) -> String {
    match items {
        [] => String::new(),
        [only] => only.clone(),
        [init @ .., tail] => format!("{} {last} {tail}", init.join(", ")),
    }
}
