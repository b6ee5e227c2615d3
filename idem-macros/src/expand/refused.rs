//! What the attribute emits when it refuses the function: the errors; the function unchanged
//! but renamed (so that its body still type-checks and its imports stay used); and, under the
//! original name, a stand-in handler that Axum accepts, so that `.route(...)` does not add a
//! confusing `Handler` error of its own to the macro's.

use proc_macro2::TokenStream;
use quote::quote;
use syn::ItemFn;

use super::paths::runtime_private;

/// The errors, with the function renamed and its stand-in; the item as it was when it is not
/// a function.
pub fn after_errors(original: TokenStream, errors: &syn::Error) -> TokenStream {
    let errors = errors.to_compile_error();
    let Ok(mut item) = syn::parse2::<ItemFn>(original.clone()) else {
        return quote!(#[allow(unused)] #original #errors);
    };
    let stand_in = stand_in(&item);
    item.sig.ident = quote::format_ident!("__idem_refused_{}", item.sig.ident);
    quote! {
        #errors
        #[allow(unused, dead_code, non_snake_case)]
        #item
        #stand_in
    }
}

/// A handler of the original name that Axum accepts. It keeps the type parameters, so that
/// `post(create::<Postgres>)` still routes; lifetimes (refused anyway) are left out.
fn stand_in(item: &ItemFn) -> TokenStream {
    let ident = &item.sig.ident;
    let vis = &item.vis;
    let private = runtime_private();
    let mut generics = item.sig.generics.clone();
    generics.params = generics
        .params
        .into_iter()
        .filter(|param| !matches!(param, syn::GenericParam::Lifetime(_)))
        .collect();
    let (generics, _, where_clause) = generics.split_for_impl();
    quote! {
        #[allow(unused, dead_code)]
        #vis async fn #ident #generics () -> #private::Response #where_clause {
            ::core::unreachable!("`#[idempotent]` refused this handler at compile time")
        }
    }
}
