//! What a key source generates: the source as `idem-runtime`'s `KeySource` in the policy, the
//! type that names it in an Axum handler's `Input`, and the reader of a tonic message's key
//! field.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};

use super::paths::{runtime, runtime_signature};
use crate::key::KeyArg;

/// The source as `idem-runtime`'s `KeySource`.
fn source(key: &KeyArg) -> TokenStream {
    let runtime = runtime();
    match key {
        KeyArg::Standard => quote!(#runtime::KeySource::Standard),
        KeyArg::Header(name, _) => quote!(#runtime::KeySource::Header(#name)),
        KeyArg::Pointer(pointer, _) => quote!(#runtime::KeySource::BodyField(#pointer)),
        KeyArg::Field(ident) => {
            let name = ident.to_string();
            let name = name.strip_prefix("r#").unwrap_or(&name);
            quote!(#runtime::KeySource::MessageField(#name))
        }
    }
}

/// What the policy's static adds for a key elsewhere than `Idempotency-Key` or optional
/// (`.__key(source, optional)`); nothing otherwise.
pub fn policy(key: &KeyArg, optional: bool) -> Option<TokenStream> {
    if matches!(key, KeyArg::Standard) && !optional {
        return None;
    }
    let source = source(key);
    Some(quote!(.__key(#source, #optional)))
}

/// The type that names an Axum handler's key source in its `Input` (see `KeyFrom`), and the
/// item declaring it beside the handler: `None` for the `Idempotency-Key` header, required,
/// which `Input` takes by default.
pub fn marker(
    key: &KeyArg,
    optional: bool,
    handler: &syn::ItemFn,
) -> Option<(syn::Ident, TokenStream)> {
    if matches!(key, KeyArg::Standard) && !optional {
        return None;
    }
    let vis = &handler.vis;
    let ident = format_ident!("__idem_key_of_{}", handler.sig.ident);
    let source = source(key);
    let (runtime, signature) = (runtime(), runtime_signature());
    let doc = format!(
        "Where `{}`'s idempotency key is, for its `Input`.",
        handler.sig.ident
    );
    let item = quote! {
        #[doc = #doc]
        #[doc(hidden)]
        #[allow(non_camel_case_types)]
        #vis enum #ident {}
        impl #signature::KeyFrom for #ident {
            const SOURCE: #runtime::KeySource = #source;
            const OPTIONAL: bool = #optional;
        }
    };
    Some((ident, item))
}

/// The function a tonic method's `accept_keyed` reads the key field with, checked to be a
/// field that can hold a key (`KeyField`) with the errors at the attribute's field name.
pub fn field_reader(field: &syn::Ident, message: &syn::Type) -> TokenStream {
    let runtime = runtime();
    quote_spanned! {field.span()=>
        |__idem_message: &#message| #runtime::grpc::KeyField::key_field(&__idem_message.#field)
    }
}
