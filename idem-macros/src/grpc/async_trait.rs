//! Methods async-trait rewrote before `#[idempotent]` saw them: a plain `fn` with async-trait's
//! `'async_trait` lifetime, returning a boxed future. `#[idempotent]` finds one on a tonic method
//! whose impl lacks `#[grpc]`, and `#[grpc]` one when it is written below
//! `#[tonic::async_trait]`; either refuses it, with a stand-in of the trait's signature.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{FnArg, ItemFn};

use super::parse::{is_idempotent, is_request};

/// What `#[idempotent]` emits for a method that async-trait rewrote (it has async-trait's
/// `'async_trait` lifetime), a tonic service method whose impl lacks `#[grpc]`: the error
/// alone, and a stand-in that matches the trait. `None` for any other function.
pub fn refusal(method: &ItemFn) -> Option<TokenStream> {
    let rewritten = method
        .sig
        .generics
        .lifetimes()
        .any(|param| param.lifetime.ident == "async_trait");
    rewritten.then(|| {
        let error = syn::Error::new(
            method.sig.ident.span(),
            if cfg!(feature = "grpc") {
                "`#[idempotent]` on a method of a tonic service needs `#[idem_runtime::grpc]` on its impl, above `#[tonic::async_trait]`: it rewrites the method before async-trait does".to_owned()
            } else {
                format!(
                    "`#[idempotent]` on a method of a tonic service: {}",
                    crate::errors::tonic_method_fix(false)
                )
            },
        )
        .to_compile_error();
        let stand_in = stand_in(&method.attrs, &method.vis, &method.sig);
        quote!(#error #stand_in)
    })
}

/// A method as async-trait wrote it, cut down to what the trait declares (`&self` and the
/// request, with their lifetimes) and a body that is never run: what stands in for a method
/// refused after async-trait rewrote it, so that the impl still matches its trait.
pub fn stand_in(
    attrs: &[syn::Attribute],
    vis: &syn::Visibility,
    sig: &syn::Signature,
) -> TokenStream {
    let mut sig = sig.clone();
    let kept: Vec<FnArg> = sig
        .inputs
        .iter()
        .filter(|arg| matches!(arg, FnArg::Receiver(_)) || is_request(arg))
        .cloned()
        .collect();
    let used = quote!(#(#kept)*).to_string();
    sig.inputs = kept.into_iter().collect();
    // async-trait names the lifetimes of the parameters `'life0`, `'life1`, ...: those of the
    // parameters left out go too, with their bounds.
    let dropped = |lifetime: &syn::Lifetime| {
        let name = lifetime.ident.to_string();
        name.starts_with("life") && !used.contains(&format!("'{name}"))
    };
    sig.generics.params = sig
        .generics
        .params
        .into_iter()
        .filter(
            |param| !matches!(param, syn::GenericParam::Lifetime(def) if dropped(&def.lifetime)),
        )
        .collect();
    if let Some(where_clause) = &mut sig.generics.where_clause {
        where_clause.predicates = where_clause
            .predicates
            .clone()
            .into_iter()
            .filter(|predicate| !matches!(predicate, syn::WherePredicate::Lifetime(bound) if dropped(&bound.lifetime)))
            .collect();
    }
    let attrs = attrs.iter().filter(|attr| !is_idempotent(attr));
    quote! {
        #(#attrs)*
        #[allow(unused)]
        #vis #sig {
            ::core::unreachable!("`#[idempotent]` refused this method at compile time")
        }
    }
}
