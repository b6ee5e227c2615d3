//! With `state = S`: checks, at the handler, what Axum would otherwise report only at
//! `.route(...)` as an unsatisfied `Handler`: that `S` provides the store, and that every
//! argument but the last reads only the request's parts. Each error lands on the type at fault.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::Type;

use super::{leading_extractors, names_generic_params, paths::runtime, respan, ty_span};
use crate::{args::Args, handler::Handler};

/// The checks sit in a closure that is never called, in the handler's body, where its type
/// parameters are in scope and an associated function is no obstacle. Nothing without
/// `state = S`.
pub fn checks(
    args: &Args,
    handler: &Handler,
    signature: &TokenStream,
    db: &TokenStream,
) -> Option<TokenStream> {
    let state = args.state.as_ref()?;
    let store = provides_store(state, signature, db, &handler.item.sig.generics);
    let parts = leading_extractors(handler)
        .iter()
        .map(|arg| reads_only_parts(state, arg, signature));
    Some(quote! {
        let _ = || {
            #store
            #(#parts)*
        };
    })
}

/// `S` provides `Store<DB>`, at the state's type. When the database is one of the handler's
/// type parameters, whether `S` provides its store is a question for each instantiation,
/// which `.route(...)` answers.
///
/// The check names Axum's `FromRef` itself (through the runtime, which depends on the Axum its
/// handlers are for), so that the error is the missing `FromRef` impl alone, with no helper of
/// the runtime in it.
fn provides_store(
    state: &Type,
    signature: &TokenStream,
    db: &TokenStream,
    generics: &syn::Generics,
) -> Option<TokenStream> {
    if names_generic_params(db.clone(), generics) {
        return None;
    }
    // Every token at the state's type, the crates' paths too, so that the error is underlined
    // there rather than on the whole attribute.
    let runtime = runtime();
    let check = quote! {
        let _ = <#runtime::Store<#db> as #signature::FromRef<#state>>::from_ref;
    };
    Some(respan(check, syn::spanned::Spanned::span(state)))
}

/// An argument that is not the last reads only the request's parts, at its type.
fn reads_only_parts(state: &Type, arg: &syn::PatType, signature: &TokenStream) -> TokenStream {
    let ty = &arg.ty;
    quote_spanned! {ty_span(arg)=>
        #signature::reads_only_parts::<#ty, #state>();
    }
}
