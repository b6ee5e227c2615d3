//! The handler's settings, in a static that both drives each request and is registered for the
//! published policy and the OpenAPI document: they cannot disagree. (Reading it from the
//! handler also links it, with its registration, into any program that routes to it.)

use proc_macro2::TokenStream;
use quote::quote;

use crate::{
    args::Args,
    fields::BodyFields,
    handler::{Handler, Scope},
};

/// `static __IDEM_POLICY` and its registration; a tonic method's names the gRPC method too
/// (`grpc`: its service's name, an expression, and its own).
pub fn policy(
    args: &Args,
    handler: &Handler,
    private: &TokenStream,
    grpc: Option<(&TokenStream, &str)>,
) -> TokenStream {
    let grpc = grpc.map(|(service, method)| quote!(.__grpc(#service, #method)));
    let name = handler.item.sig.ident.to_string();
    let key_scope = key_scope(&handler.scope, private);
    let mode = mode(handler, private);
    let retention = args.retention_secs;
    let replay_5xx = args.replay_5xx;
    let lease = args.lease_secs;
    let timeout = optional_secs(args.timeout.map(|(secs, _)| secs));
    let wait = optional_secs(args.wait);
    let body_fields = body_fields(&args.body_fields, private);
    let key = super::key::policy(&args.key, args.key_optional.is_some());
    quote! {
        static __IDEM_POLICY: #private::HandlerPolicy = #private::HandlerPolicy::__new(
            #name,
            ::core::module_path!(),
            #key_scope,
            #mode,
            #retention,
            #replay_5xx,
            #lease,
            #timeout,
            #wait,
            #body_fields,
        )#grpc #key;
        #private::inventory::submit! { #private::Registered(&__IDEM_POLICY) }
    }
}

/// Whose keys these are, as published: shared, or per value of the named parameter.
fn key_scope(scope: &Scope, private: &TokenStream) -> TokenStream {
    match scope {
        Scope::Global => quote!(#private::KeyScope::Global),
        Scope::Binding { ident, .. } => {
            let name = ident.to_string();
            quote!(#private::KeyScope::Parameter(#name))
        }
    }
}

/// Transactional with a transaction parameter; else `Steps` with a steps parameter; else
/// external.
fn mode(handler: &Handler, private: &TokenStream) -> TokenStream {
    match (&handler.tx, &handler.steps) {
        (Some(_), _) => quote!(#private::Mode::Transactional),
        (None, Some(_)) => quote!(#private::Mode::Steps),
        (None, None) => quote!(#private::Mode::External),
    }
}

/// Which fields of a JSON body count in the fingerprint.
fn body_fields(fields: &BodyFields, private: &TokenStream) -> TokenStream {
    match fields {
        BodyFields::All => quote!(#private::BodyFields::All),
        BodyFields::Only(pointers) => quote!(#private::BodyFields::Only(&[#(#pointers),*])),
        BodyFields::Except(pointers) => quote!(#private::BodyFields::Except(&[#(#pointers),*])),
    }
}

/// `Some(secs)` or `None`, as the generated code writes it.
fn optional_secs(secs: Option<u64>) -> TokenStream {
    match secs {
        Some(secs) => quote!(::core::option::Option::Some(#secs)),
        None => quote!(::core::option::Option::None),
    }
}
