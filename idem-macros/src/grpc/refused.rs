//! What `#[grpc]` emits for a refused method: in the impl, a stand-in of the trait's signature,
//! so that the impl is complete and the macro's errors are the only ones; and, in an inherent
//! impl beside it, the method unchanged but renamed, so that its body still type-checks and its
//! imports stay used.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{FnArg, ImplItemFn, ItemImpl};

use super::{
    async_trait,
    parse::{is_idempotent, is_request},
};

/// A method of the trait's signature that stands in for a refused one. A method async-trait has
/// already rewritten (the attributes in the wrong order) has the trait's signature: it stays as
/// it is.
pub fn stand_in(method: &ImplItemFn) -> TokenStream {
    if method.sig.asyncness.is_none() {
        return async_trait::stand_in(&method.attrs, &method.vis, &method.sig);
    }
    let attrs = method.attrs.iter().filter(|attr| !is_idempotent(attr));
    let ident = &method.sig.ident;
    let output = &method.sig.output;
    let request = match method.sig.inputs.iter().find(|arg| is_request(arg)) {
        Some(FnArg::Typed(request)) => {
            let ty = &request.ty;
            quote!(#ty)
        }
        _ => quote!(()),
    };
    let asyncness = &method.sig.asyncness;
    quote! {
        #(#attrs)*
        #[allow(unused)]
        #asyncness fn #ident(&self, __idem_grpc: #request) #output {
            ::core::unreachable!("`#[idempotent]` refused this method at compile time")
        }
    }
}

/// The refused method renamed, with a use of the attribute's path (`attr`) in its body; `None`
/// for a method async-trait rewrote, or one that names `Self::`, which an inherent impl would
/// not resolve.
pub fn renamed(method: &ImplItemFn, attr: &syn::Attribute) -> Option<TokenStream> {
    let names_self = quote!(#method).to_string().contains("Self ::");
    if method.sig.asyncness.is_none() || names_self {
        return None;
    }
    let mut method = method.clone();
    method.sig.ident = quote::format_ident!("__idem_refused_{}", method.sig.ident);
    let path = attr.path();
    method.block.stmts.insert(
        0,
        syn::parse_quote! {
            #[allow(unused_imports)]
            use #path as _;
        },
    );
    Some(quote!(#method))
}

/// The renamed methods in an inherent impl of the service's type; nothing when there are none.
pub fn inherent_impl(service: &ItemImpl, renamed: &[TokenStream]) -> Option<TokenStream> {
    if renamed.is_empty() {
        return None;
    }
    let (generics, self_ty) = (&service.generics, &service.self_ty);
    let (impl_generics, _, where_clause) = generics.split_for_impl();
    Some(quote! {
        #[allow(unused, dead_code, non_snake_case, clippy::all)]
        impl #impl_generics #self_ty #where_clause {
            #(#renamed)*
        }
    })
}
