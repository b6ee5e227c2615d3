//! The checks of the function's signature itself, its parameters aside: an `async fn`, of no
//! unusual kind, without lifetimes, returning owned data.

use proc_macro2::Span;
use syn::{ReturnType, Signature, Type, visit::Visit};

/// Every error of the signature, in the order its parts are written.
pub fn check(sig: &Signature) -> Vec<syn::Error> {
    [
        check_async(sig),
        check_not_const(sig),
        check_not_unsafe(sig),
        check_no_abi(sig),
        check_not_variadic(sig),
        check_no_lifetime_parameter(sig),
        check_returns_owned(sig),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn check_async(sig: &Signature) -> Option<syn::Error> {
    sig.asyncness.is_none().then(|| {
        syn::Error::new(
            sig.fn_token.span,
            "`#[idempotent]` handlers must be `async fn`: the macro awaits the claim and the commit",
        )
    })
}

fn check_not_const(sig: &Signature) -> Option<syn::Error> {
    let constness = sig.constness.as_ref()?;
    Some(syn::Error::new(
        constness.span,
        "`#[idempotent]` handlers cannot be `const fn`",
    ))
}

fn check_not_unsafe(sig: &Signature) -> Option<syn::Error> {
    let unsafety = sig.unsafety.as_ref()?;
    Some(syn::Error::new(
        unsafety.span,
        "`#[idempotent]` handlers cannot be `unsafe fn`",
    ))
}

fn check_no_abi(sig: &Signature) -> Option<syn::Error> {
    let abi = sig.abi.as_ref()?;
    Some(syn::Error::new_spanned(
        abi,
        "`#[idempotent]` handlers cannot have an `extern` ABI",
    ))
}

fn check_not_variadic(sig: &Signature) -> Option<syn::Error> {
    let variadic = sig.variadic.as_ref()?;
    Some(syn::Error::new_spanned(
        variadic,
        "`#[idempotent]` handlers cannot be variadic",
    ))
}

/// Type parameters are fine (a handler generic over its database is routed as
/// `post(create::<Postgres>)`); lifetimes are not: extractors are owned values.
fn check_no_lifetime_parameter(sig: &Signature) -> Option<syn::Error> {
    let lifetime = sig
        .generics
        .params
        .iter()
        .find(|param| matches!(param, syn::GenericParam::Lifetime(_)))?;
    Some(syn::Error::new_spanned(
        lifetime,
        "`#[idempotent]` handlers cannot have lifetime parameters: extractors are owned values, and the transaction's lifetime is written `'_`",
    ))
}

/// The response is stored after the transaction ends, so it cannot borrow from anything.
fn check_returns_owned(sig: &Signature) -> Option<syn::Error> {
    let ReturnType::Type(_, ty) = &sig.output else {
        return None;
    };
    let span = first_borrow(ty)?;
    Some(syn::Error::new(
        span,
        "`#[idempotent]` handlers cannot return borrowed data: the response outlives the transaction",
    ))
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
