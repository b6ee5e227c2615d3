//! Code generation: the handler rewritten around a claim. Expansion cannot fail; every check
//! happened in [`crate::args`] and [`crate::handler`].
//!
//! The rewritten function is put together here from its parts, each generated in a module of
//! its own: its parameters ([`params`]), the checks of `state = S` ([`state`]), the static
//! of its settings ([`policy`]), its key source ([`key`]), and the claim around the original
//! body ([`claim`]), each naming `idem-runtime` through [`paths`]. What is emitted instead when the handler is refused
//! is in [`refused`]. A tonic method's rewrite (`grpc/expand.rs`) is made of the same policy,
//! claim and paths, and of [`claimed`], [`database`], [`leading_extractors`] and [`ty_span`].

pub mod claim;
pub mod key;
mod params;
pub mod paths;
pub mod policy;
mod refused;
mod state;

use proc_macro2::TokenStream;
use quote::quote;
use syn::{ItemFn, PatType, Type};

use crate::{args::Args, handler::Handler};
use paths::{runtime_private, runtime_signature};

pub use refused::after_errors;

/// The handler, rewritten: an Axum handler of the same name that takes the key and the body
/// first (through `Input`), claims the key, runs the original body with its transaction (or
/// context, or steps), and stores its response.
pub fn handler(args: &Args, handler: &Handler) -> TokenStream {
    let private = runtime_private();
    let db = database(&private, handler.db.as_ref());
    let ItemFn {
        attrs, vis, sig, ..
    } = &handler.item;
    let ident = &sig.ident;
    let (generics, _, where_clause) = sig.generics.split_for_impl();
    let signature = runtime_signature();
    let marker = key::marker(&args.key, args.key_optional.is_some());
    let (key_type, key_registration) = marker.unzip();
    let params = params::params(args, handler, &signature, &db, key_type.as_ref());
    let state_checks = state::checks(args, handler, &signature, &db);
    let policy = policy::policy(args, handler, &private, None);
    let claimed = claimed(handler, &private, &db, claim::Protocol::Http);
    quote! {
        #(#attrs)*
        #vis async fn #ident #generics (#params) -> #private::Response #where_clause {
            #state_checks
            #policy
            #key_registration
            #claimed
        }
    }
}

/// From `__idem_request` on: the scope, the claim and the body, in the request's span.
pub fn claimed(
    handler: &Handler,
    private: &TokenStream,
    db: &TokenStream,
    protocol: claim::Protocol,
) -> TokenStream {
    let scope = claim::scope(handler, private);
    let claim_and_run = claim::claim_and_run(handler, private, db, protocol);
    quote! {
        let __idem_span = __idem_request.span();
        #private::Instrument::instrument(
            async move {
                let __idem_scope = #scope;
                let __idem_options = __IDEM_POLICY.__options();
                #claim_and_run
            },
            __idem_span,
        )
        .await
    }
}

/// The handler's database: its transaction's, its steps' or `backend`'s, else the default one.
pub fn database(private: &TokenStream, db: Option<&Type>) -> TokenStream {
    db.map_or_else(|| quote!(#private::DefaultBackend), |db| quote!(#db))
}

/// The extractors but the last, which reads the body (and is wrapped in `Input`).
pub fn leading_extractors(handler: &Handler) -> &[PatType] {
    handler
        .extractors
        .split_last()
        .map_or(&[], |(_, leading)| leading)
}

/// Whether `tokens` name one of the type or const parameters of `generics`.
fn names_generic_params(tokens: TokenStream, generics: &syn::Generics) -> bool {
    fn idents(tokens: TokenStream, found: &mut Vec<proc_macro2::Ident>) {
        for token in tokens {
            match token {
                proc_macro2::TokenTree::Ident(ident) => found.push(ident),
                proc_macro2::TokenTree::Group(group) => idents(group.stream(), found),
                _ => {}
            }
        }
    }
    let mut found = Vec::new();
    idents(tokens, &mut found);
    generics
        .type_params()
        .map(|param| &param.ident)
        .chain(generics.const_params().map(|param| &param.ident))
        .any(|ident| found.contains(ident))
}

/// `tokens`, each at `span`.
fn respan(tokens: TokenStream, span: proc_macro2::Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            if let proc_macro2::TokenTree::Group(group) = &token {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                token = proc_macro2::TokenTree::Group(inner);
            }
            token.set_span(span);
            token
        })
        .collect()
}

/// The span of a parameter's type, where errors about it are reported.
pub fn ty_span(arg: &PatType) -> proc_macro2::Span {
    syn::spanned::Spanned::span(&arg.ty)
}
