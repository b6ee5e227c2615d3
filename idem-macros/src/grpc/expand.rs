//! Expansion of `#[grpc]`: a checked method rewritten to the signature tonic's trait declares
//! (`&self` and the request), with the values the method reads from the metadata, the call
//! taken in (its key and fingerprint), and the same claim as an Axum handler's (from
//! [`crate::expand`]), every answer turned back into the method's result; and the impl given
//! the async-trait attribute it needs when it lacks one. Expansion cannot fail.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::{ItemFn, ItemImpl, Path};

use super::parse::is_async_trait;
use crate::{
    args::Args,
    expand::{
        claim, claimed, database, key as key_expand, leading_extractors,
        paths::{runtime, runtime_private},
        policy, ty_span,
    },
    handler::Handler,
    key::KeyArg,
};

/// The message of a `Request<Message>` type (the analysis checked it is one); the type
/// itself, should it not be, so that the compiler's error is about it.
fn message_of(request: &syn::Type) -> &syn::Type {
    let syn::Type::Path(path) = request else {
        return request;
    };
    let Some(syn::PathArguments::AngleBracketed(arguments)) =
        path.path.segments.last().map(|segment| &segment.arguments)
    else {
        return request;
    };
    match arguments.args.first() {
        Some(syn::GenericArgument::Type(message)) => message,
        _ => request,
    }
}

/// An expression of the service's full name: the `NamedService::NAME` of `server`, the server
/// tonic generated for the trait.
pub fn service_name(server: &Path) -> TokenStream {
    let private = runtime_private();
    quote!(<#server<()> as #private::grpc::tonic::server::NamedService>::NAME)
}

/// `#[async_trait]` added to the impl when it has none, below `#[grpc]`, so that it rewrites the
/// methods after this attribute has.
pub fn with_async_trait(service: &mut ItemImpl) {
    if !service.attrs.iter().any(is_async_trait) {
        let private = runtime_private();
        service
            .attrs
            .push(syn::parse_quote!(#[#private::grpc::async_trait]));
    }
}

/// The gRPC method a tonic method serves.
pub struct Target {
    /// An expression of the service's full name (the generated server's `NamedService::NAME`).
    pub service: TokenStream,
    /// The method's name in the `.proto` (`CreatePayment`).
    pub method: String,
    /// The path the `#[idempotent]` attribute was written with, used again in the expansion:
    /// `#[grpc]` takes the attribute off, and its import must not look unused.
    pub attribute: syn::Path,
}

/// The method, rewritten.
pub fn method(args: &Args, handler: &Handler, target: &Target) -> TokenStream {
    let private = runtime_private();
    let db = database(&private, handler.db.as_ref());
    let ItemFn {
        attrs, vis, sig, ..
    } = &handler.item;
    let ident = &sig.ident;
    let output = &sig.output;
    let request = handler
        .extractors
        .last()
        .expect("the analysis checked that the request is the last parameter");
    let (request_pat, request_ty) = (&request.pat, &request.ty);
    let policy = policy::policy(
        args,
        handler,
        &private,
        Some((&target.service, &target.method)),
    );
    let metadata = metadata_values(handler);
    let claimed = claimed(handler, &private, &db, claim::Protocol::Grpc);
    let attribute = &target.attribute;
    let accept = match &args.key {
        KeyArg::Field(field) => {
            let reader = key_expand::field_reader(field, message_of(request_ty));
            quote!(#private::grpc::accept_keyed::<#db, Self, _>(self, &__IDEM_POLICY, __idem_grpc, #reader))
        }
        _ => quote!(#private::grpc::accept::<#db, Self, _>(self, &__IDEM_POLICY, __idem_grpc)),
    };
    quote! {
        #(#attrs)*
        #vis async fn #ident(&self, __idem_grpc: #request_ty) #output {
            #[allow(unused_imports)]
            use #attribute as _;
            #policy
            #metadata
            let (#request_pat, __idem_request) =
                match #accept {
                    ::core::result::Result::Ok(__idem_accepted) => __idem_accepted,
                    ::core::result::Result::Err(__idem_status) => {
                        return ::core::result::Result::Err(__idem_status);
                    }
                };
            #claimed
        }
    }
}

/// Each parameter before the request, read from the call's metadata and extensions through
/// `FromMetadata` (called by its public path, so that a type without it is reported against
/// that trait); its status answers the call before the key is looked at.
fn metadata_values(handler: &Handler) -> TokenStream {
    let runtime = runtime();
    leading_extractors(handler)
        .iter()
        .map(|arg| {
            let (pat, ty) = (&arg.pat, &arg.ty);
            quote_spanned! {ty_span(arg)=>
                let #pat: #ty = match <#ty as #runtime::grpc::FromMetadata>::from_metadata(
                    __idem_grpc.metadata(),
                    __idem_grpc.extensions(),
                ) {
                    ::core::result::Result::Ok(__idem_value) => __idem_value,
                    ::core::result::Result::Err(__idem_status) => {
                        return ::core::result::Result::Err(__idem_status);
                    }
                };
            }
        })
        .collect()
}
