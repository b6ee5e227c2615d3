//! `#[grpc]` on the impl of a tonic service: each of its methods marked `#[idempotent(...)]` is
//! checked as a handler is and rewritten to the signature tonic's trait declares; the impl is
//! left to tonic's `#[async_trait]`, which must come after (below) this attribute so that the
//! methods are still `async fn` here.
//!
//! The pipeline is the one of an Axum handler (see the crate's root), a method at a time: parse
//! (`grpc/parse.rs`: the attribute's argument, the impl, each method's arguments), validate
//! (`grpc/validate.rs`, the method's name in the `.proto` in `grpc/rpc.rs`), expand
//! (`grpc/expand.rs`). Every error is collected and reported at once, and each refused method
//! is replaced by a stand-in of the trait's signature (`grpc/refused.rs`), so that the impl
//! still matches its trait. A method that async-trait rewrote before it was seen is recognised
//! in `grpc/async_trait.rs`, which `#[idempotent]` also asks about a plain `fn`.

pub mod async_trait;
mod expand;
mod parse;
mod refused;
mod rpc;
mod validate;

use proc_macro2::TokenStream;
use quote::quote;
use syn::{ImplItem, spanned::Spanned};

use crate::errors;
use expand::Target;

/// The impl, its marked methods rewritten; on errors, the errors and the impl with each
/// refused method replaced by a stand-in of the trait's signature.
pub fn service(attr: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = Vec::new();
    let parse::Service {
        item: mut service,
        server,
    } = match parse::service(attr, item, &mut errors) {
        Ok(service) => service,
        Err(parse::Unreadable { error, item }) => {
            let error = error.to_compile_error();
            return quote!(#error #item);
        }
    };
    let name = expand::service_name(&server);
    let mut renamed = Vec::new();
    for item in &mut service.items {
        let ImplItem::Fn(method) = item else { continue };
        let Some(attr) = parse::take_idempotent(method) else {
            continue;
        };
        let checked = parse::arguments(&attr)
            .and_then(|(args, errors)| validate::method(method, attr.span(), args, errors));
        *item = ImplItem::Verbatim(match checked {
            Ok(checked) => {
                let target = Target {
                    service: name.clone(),
                    method: checked.rpc,
                    attribute: attr.path().clone(),
                };
                expand::method(&checked.args, &checked.handler, &target)
            }
            Err(error) => {
                errors.push(error);
                renamed.extend(refused::renamed(method, &attr));
                refused::stand_in(method)
            }
        });
    }
    let refused = refused::inherent_impl(&service, &renamed);
    expand::with_async_trait(&mut service);
    let errors = errors::combine(errors).map(|error| error.to_compile_error());
    quote!(#errors #service #refused)
}
