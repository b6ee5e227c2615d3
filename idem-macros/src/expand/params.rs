//! The rewritten handler's parameters: the state pin (with `state = S`), the extractors but the
//! last, unchanged, and the last one wrapped in `Input`, which takes the key and the body
//! first.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};

use super::{leading_extractors, ty_span};
use crate::{args::Args, handler::Handler};

/// The parameter list, between the parentheses.
pub fn params(
    args: &Args,
    handler: &Handler,
    signature: &TokenStream,
    db: &TokenStream,
    key: Option<&TokenStream>,
) -> TokenStream {
    let state_pin = args.state.as_ref().map(|state| state_pin(state, signature));
    let extractors = leading_extractors(handler).iter().map(|arg| quote!(#arg));
    let input = input(handler, signature, db, key);
    quote!(#state_pin #(#extractors,)* #input)
}

/// With `state = S`, the handler is an Axum handler for that state only, so that a router
/// built with it is not inferred to have another state (the store's) when `S` lacks the store:
/// the one error is then the missing `FromRef`, at the attribute.
fn state_pin(state: &syn::Type, signature: &TokenStream) -> TokenStream {
    quote_spanned! {syn::spanned::Spanned::span(state)=>
        _: #signature::StateIs<#state>,
    }
}

/// The last extractor wrapped in `Input`, which takes the key and the body first and hands
/// over the request (`__idem_request`); `Input<()>` when the handler has no extractor. A key
/// elsewhere than `Idempotency-Key`, or optional, is named by the type `key` (see
/// `expand::key::marker`).
fn input(
    handler: &Handler,
    signature: &TokenStream,
    db: &TokenStream,
    key: Option<&TokenStream>,
) -> TokenStream {
    let key = key.map(|key| quote!(, #key));
    match handler.extractors.last() {
        Some(last) => {
            let attrs = &last.attrs;
            let pat = &last.pat;
            let ty = &last.ty;
            quote_spanned! {ty_span(last)=>
                #(#attrs)*
                #signature::Input { value: #pat, request: __idem_request, .. }: #signature::Input<#ty, #db #key>
            }
        }
        None => quote! {
            #signature::Input { value: (), request: __idem_request, .. }: #signature::Input<(), #db #key>
        },
    }
}
