//! What a key source generates: the source as `idem-runtime`'s `KeySource` in the policy, the
//! type that names it in an Axum handler's `Input`, and the reader of a tonic message's key
//! field.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};

use super::paths::{runtime, runtime_private, runtime_signature};
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

/// The type that names an Axum handler's key source in its `Input` (`KeyAt<number>`), and the
/// registration of that number's source, written in the handler's body: no item beside the
/// handler, which may then be an associated function. `None` for the `Idempotency-Key`
/// header, required, which `Input` takes by default.
pub fn marker(key: &KeyArg, optional: bool) -> Option<(TokenStream, TokenStream)> {
    if matches!(key, KeyArg::Standard) && !optional {
        return None;
    }
    let source = source(key);
    let id = spec_id(key, optional);
    let (private, signature) = (runtime_private(), runtime_signature());
    let ty = quote!(#signature::KeyAt<#id>);
    let registration = quote! {
        #private::inventory::submit! {
            #private::KeySpec { id: #id, source: #source, optional: #optional }
        }
    };
    Some((ty, registration))
}

/// The number a key source is registered under: FNV-1a over what tells two sources apart, the
/// same for every handler with the same source.
fn spec_id(key: &KeyArg, optional: bool) -> u64 {
    let text = match key {
        KeyArg::Standard => "standard".to_owned(),
        KeyArg::Header(name, _) => format!("header\0{name}"),
        KeyArg::Pointer(pointer, _) => format!("body\0{pointer}"),
        KeyArg::Field(ident) => format!("field\0{ident}"),
    };
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes().chain([u8::from(optional)]) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The function a tonic method's `accept_keyed` reads the key field with, checked to be a
/// field that can hold a key (`KeyField`) with the errors at the attribute's field name.
pub fn field_reader(field: &syn::Ident, message: &syn::Type) -> TokenStream {
    let runtime = runtime();
    quote_spanned! {field.span()=>
        |__idem_message: &#message| #runtime::grpc::KeyField::key_field(&__idem_message.#field)
    }
}
