//! The parameters sorted by role: the transaction, the `IdempotencyContext`, the `Steps`, and the
//! extractors (everything else), with the errors of a parameter on its own (taken by reference,
//! twice, `self`).

use syn::{FnArg, GenericArgument, ItemFn, PatType, PathArguments, Signature, Type};

use super::{Handler, Scope};
use crate::args::Args;

/// The handler's parameters, by role.
#[derive(Default)]
pub struct Params {
    /// The transaction, with its `DB`.
    pub tx: Option<(PatType, Type)>,
    pub context: Option<PatType>,
    /// The steps, with their `DB`.
    pub steps: Option<(PatType, Type)>,
    /// Every other parameter, in order.
    pub extractors: Vec<PatType>,
    /// A parameter was meant as the transaction but refused, with its own fix.
    pub tx_attempted: bool,
    /// A parameter is a `Steps`, even if refused.
    pub steps_attempted: bool,
}

/// Sorts the parameters, adding to `errors` those of each parameter on its own.
pub fn sort(sig: &Signature, errors: &mut Vec<syn::Error>) -> Params {
    let mut params = Params::default();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(receiver) => errors.push(syn::Error::new_spanned(
                receiver,
                format!(
                    "`#[idempotent]` handlers cannot take `self`: write a free `async fn` and pass the state through an extractor such as `State`; on a tonic service method, {}",
                    crate::errors::tonic_method_fix(cfg!(feature = "grpc")),
                ),
            )),
            FnArg::Typed(arg) => errors.extend(params.add(arg)),
        }
    }
    params
}

impl Params {
    /// Files `arg` under its role, or says why it cannot have it.
    fn add(&mut self, arg: &PatType) -> Option<syn::Error> {
        if let Some(by_value) = is_context(&arg.ty) {
            return self.add_context(arg, by_value);
        }
        if let Some((by_value, db)) = steps_param(&arg.ty) {
            return self.add_steps(arg, by_value, db);
        }
        match transaction(&arg.ty) {
            TxKind::NotTransaction => {
                self.extractors.push(arg.clone());
                None
            }
            TxKind::MutRef(db) => self.add_transaction(arg, *db),
            TxKind::OtherMutRef => {
                self.tx_attempted = true;
                Some(syn::Error::new_spanned(
                    &arg.ty,
                    "`&mut` parameters are not extractors: write the transaction as `&mut sqlx::Transaction<'_, DB>` (type aliases such as `PgTransaction` are not recognised)",
                ))
            }
            TxKind::Other => {
                self.tx_attempted = true;
                Some(syn::Error::new_spanned(
                    &arg.ty,
                    "take the transaction as `&mut Transaction<'_, DB>`: the macro begins and commits it, so the handler only borrows it",
                ))
            }
        }
    }

    /// An `IdempotencyContext`: by value, once.
    fn add_context(&mut self, arg: &PatType, by_value: bool) -> Option<syn::Error> {
        if !by_value {
            return Some(syn::Error::new_spanned(
                &arg.ty,
                "take the context by value: `ctx: IdempotencyContext`",
            ));
        }
        if self.context.is_some() {
            return Some(syn::Error::new_spanned(
                &arg.ty,
                "a second `IdempotencyContext` parameter: one is enough",
            ));
        }
        self.context = Some(arg.clone());
        None
    }

    /// A `Steps<DB>`: by value, once.
    fn add_steps(&mut self, arg: &PatType, by_value: bool, db: Type) -> Option<syn::Error> {
        self.steps_attempted = true;
        if !by_value {
            return Some(syn::Error::new_spanned(
                &arg.ty,
                "take the steps by value: `steps: Steps<DB>`",
            ));
        }
        if self.steps.is_some() {
            return Some(syn::Error::new_spanned(
                &arg.ty,
                "a second `Steps` parameter: one is enough",
            ));
        }
        self.steps = Some((arg.clone(), db));
        None
    }

    /// A `&mut Transaction<'_, DB>`: once.
    fn add_transaction(&mut self, arg: &PatType, db: Type) -> Option<syn::Error> {
        if self.tx.is_some() {
            return Some(syn::Error::new_spanned(
                &arg.ty,
                "a second transaction parameter: `#[idempotent]` handlers take exactly one `&mut Transaction`, begun and committed by the macro",
            ));
        }
        self.tx = Some((arg.clone(), db));
        None
    }

    /// The handler, once every check has passed. Its database is the transaction's, else the
    /// one `backend` names, else the steps' (unless written `_`), else the default one.
    pub fn into_handler(self, item: ItemFn, args: &Args, scope: Scope) -> Handler {
        let (tx, db) = self.tx.unzip();
        let (steps, steps_db) = self.steps.unzip();
        let db = db
            .or_else(|| args.backend.clone())
            .or(steps_db.filter(|db| !matches!(db, Type::Infer(_))));
        Handler {
            item,
            tx,
            db,
            context: self.context,
            steps,
            extractors: self.extractors,
            scope,
        }
    }
}

/// What a parameter's type says about it being the transaction.
enum TxKind {
    NotTransaction,
    /// A `&mut` of something else: never an extractor, most likely an aliased transaction.
    OtherMutRef,
    MutRef(Box<Type>),
    /// A `Transaction` not taken by `&mut`.
    Other,
}

/// Recognises `&mut Transaction<'_, DB>` (any path ending in `Transaction`).
fn transaction(ty: &Type) -> TxKind {
    let (is_mut_ref, inner) = match ty {
        Type::Reference(reference) => (reference.mutability.is_some(), &*reference.elem),
        other => (false, other),
    };
    match (transaction_db(inner), is_mut_ref) {
        (None, true) => TxKind::OtherMutRef,
        (None, false) => TxKind::NotTransaction,
        (Some(db), true) => TxKind::MutRef(Box::new(db)),
        (Some(_), false) => TxKind::Other,
    }
}

/// `DB` of `Transaction<'_, DB>`: its last type argument.
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
