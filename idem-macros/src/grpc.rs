//! `#[grpc]` on the impl of a tonic service: each of its methods marked `#[idempotent(...)]` is
//! checked as a handler is (its arguments, its transaction, its scope) and rewritten to the
//! signature tonic's trait declares; the impl is left to tonic's `#[async_trait]`, which must
//! come after (below) this attribute so that the methods are still `async fn` here.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::{
    FnArg, ImplItem, ImplItemFn, ItemFn, ItemImpl, LitStr, Meta, Path, Type, spanned::Spanned,
};

use crate::{
    args::{self, Args},
    errors,
    expand::{self, GrpcTarget},
    fields::BodyFields,
    handler,
};

/// The impl, its marked methods rewritten; on errors, the errors and the impl with each
/// refused method replaced by a stand-in of the trait's signature.
pub fn service(attr: TokenStream, item: TokenStream) -> TokenStream {
    let private = expand::runtime_private();
    let mut errors = Vec::new();
    let server = parse_server(attr).unwrap_or_else(|error| {
        errors.push(error);
        None
    });
    let mut service = match syn::parse2::<ItemImpl>(item.clone()) {
        Ok(service) => service,
        Err(error) => {
            let error = syn::Error::new(
                error.span(),
                "`#[grpc]` applies to the impl of a tonic service trait: `impl Payments for PaymentsApi { ... }`",
            )
            .to_compile_error();
            return quote!(#error #item);
        }
    };
    let Some((_, trait_path, _)) = &service.trait_ else {
        let error = syn::Error::new_spanned(
            &service.self_ty,
            "`#[grpc]` applies to the impl of a tonic service trait (`impl Payments for PaymentsApi`), not to an impl without a trait",
        )
        .to_compile_error();
        return quote!(#error #service);
    };
    let server = server.unwrap_or_else(|| server_of(trait_path));
    let name = quote!(<#server<()> as #private::grpc::tonic::server::NamedService>::NAME);
    let mut refused = Vec::new();
    for item in &mut service.items {
        let ImplItem::Fn(method) = item else { continue };
        let Some(at) = method.attrs.iter().position(is_idempotent) else {
            continue;
        };
        let attr = method.attrs.remove(at);
        *item = ImplItem::Verbatim(match rewrite(&attr, method, &name) {
            Ok(rewritten) => rewritten,
            Err(error) => {
                errors.push(error);
                // Kept beside the impl, where `Self::` would name no associated type.
                let names_self = quote!(#method).to_string().contains("Self ::");
                if method.sig.asyncness.is_some() && !names_self {
                    refused.push(renamed(method, &attr));
                }
                stand_in(method)
            }
        });
    }
    let refused = (!refused.is_empty()).then(|| {
        let (generics, self_ty) = (&service.generics, &service.self_ty);
        let (impl_generics, _, where_clause) = generics.split_for_impl();
        quote! {
            #[allow(unused, dead_code, non_snake_case, clippy::all)]
            impl #impl_generics #self_ty #where_clause {
                #(#refused)*
            }
        }
    });
    if !service.attrs.iter().any(is_async_trait) {
        service
            .attrs
            .push(syn::parse_quote!(#[#private::grpc::async_trait]));
    }
    let errors = errors::combine(errors).map(|error| error.to_compile_error());
    quote!(#errors #service #refused)
}

/// A refused method, renamed, in an inherent impl of its own: its body still type-checks and
/// its imports (the attribute's too) stay in use, so that the macro's errors come alone.
fn renamed(method: &ImplItemFn, attr: &syn::Attribute) -> TokenStream {
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
    quote!(#method)
}

/// `server = path::to::PaymentsServer`: the server tonic generated for the trait, when it is
/// not the trait's path with `Server` added to its name.
fn parse_server(attr: TokenStream) -> syn::Result<Option<Path>> {
    let mut server = None;
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("server") {
            server = Some(meta.value()?.parse::<Path>()?);
            Ok(())
        } else {
            Err(meta.error(
                "`#[grpc]` takes one optional argument, `server = PaymentsServer`: the server type tonic generated for the trait",
            ))
        }
    });
    syn::parse::Parser::parse2(parser, attr)?;
    Ok(server)
}

/// The generated server of a service trait: `payments_server::Payments` is served by
/// `payments_server::PaymentsServer`.
fn server_of(trait_path: &Path) -> Path {
    let mut server = trait_path.clone();
    if let Some(last) = server.segments.last_mut() {
        last.ident = quote::format_ident!("{}Server", last.ident, span = last.ident.span());
        last.arguments = syn::PathArguments::None;
    }
    server
}

/// A method as async-trait wrote it, cut down to what the trait declares (`&self` and the
/// request, with their lifetimes) and a body that is never run: what stands in for a method
/// refused after async-trait rewrote it, so that the impl still matches its trait.
pub fn async_trait_stand_in(
    attrs: &[syn::Attribute],
    vis: &syn::Visibility,
    sig: &syn::Signature,
) -> TokenStream {
    let mut sig = sig.clone();
    let kept: Vec<FnArg> = sig
        .inputs
        .iter()
        .filter(|arg| matches!(arg, FnArg::Receiver(_)) || is_request_param(arg))
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

/// The error for `#[idempotent]` on a method that async-trait rewrote (it has async-trait's
/// `'async_trait` lifetime): a tonic service method whose impl lacks `#[grpc]`.
pub fn rewritten_by_async_trait(item: &TokenStream) -> Option<(syn::Error, ItemFn)> {
    let method = syn::parse2::<ItemFn>(item.clone()).ok()?;
    let rewritten = method
        .sig
        .generics
        .lifetimes()
        .any(|param| param.lifetime.ident == "async_trait");
    rewritten.then(|| {
        let error = syn::Error::new(
            method.sig.ident.span(),
            "`#[idempotent]` on a method of a tonic service needs `#[idem_runtime::grpc]` on its impl, above `#[tonic::async_trait]`: it rewrites the method before async-trait does",
        );
        (error, method)
    })
}

fn is_idempotent(attr: &syn::Attribute) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == "idempotent")
}

fn is_async_trait(attr: &syn::Attribute) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == "async_trait")
}

/// One marked method, checked and rewritten.
fn rewrite(
    attr: &syn::Attribute,
    method: &ImplItemFn,
    name: &TokenStream,
) -> syn::Result<TokenStream> {
    let tokens = match &attr.meta {
        Meta::Path(_) => TokenStream::new(),
        Meta::List(list) => list.tokens.clone(),
        Meta::NameValue(value) => {
            return Err(syn::Error::new_spanned(
                value,
                "write the arguments in parentheses: `#[idempotent(scope = \"tenant\", retention = \"24h\")]`",
            ));
        }
    };
    if method.sig.asyncness.is_none() {
        return Err(syn::Error::new(
            method.sig.fn_token.span(),
            "this method is not an `async fn` any more: put `#[idem_runtime::grpc]` above `#[tonic::async_trait]` on the impl, so that it sees the methods before async-trait rewrites them",
        ));
    }
    let (args, mut errors) = args::parse(tokens);
    errors.extend(grpc_only_checks(&args, attr.span()));
    errors.extend(check_rpc(args.rpc.as_ref(), &method.sig.ident));
    let item = ItemFn {
        attrs: method.attrs.clone(),
        vis: method.vis.clone(),
        sig: without_receiver(&method.sig, &mut errors),
        block: Box::new(method.block.clone()),
    };
    errors.extend(check_request_last(&item.sig));
    errors.extend(check_unary(&item.sig));
    // Analysed with the request last, where it belongs, so that its misplacement is reported
    // once, above.
    let mut item = item;
    if let Some(at) = item.sig.inputs.iter().position(is_request_param) {
        let request = item
            .sig
            .inputs
            .iter()
            .nth(at)
            .cloned()
            .expect("found above");
        let mut inputs: Vec<FnArg> = item.sig.inputs.into_iter().collect();
        inputs.remove(at);
        inputs.push(request);
        item.sig.inputs = inputs.into_iter().collect();
    }
    let handler = errors::unless_collected(errors, handler::analyse(item, &args))?;
    let target = GrpcTarget {
        service: name.clone(),
        method: args
            .rpc
            .as_ref()
            .map_or_else(|| proto_name(&method.sig.ident), LitStr::value),
        attribute: attr.path().clone(),
    };
    Ok(expand::grpc_method(&args, &handler, &target))
}

/// The arguments an Axum handler takes and a tonic method cannot.
fn grpc_only_checks(args: &Args, span: Span) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    if let Some(state) = &args.state {
        errors.push(syn::Error::new_spanned(
            state,
            "`state` is for Axum handlers: a tonic method's service provides the store itself (`Store<DB>: FromRef<Self>`)",
        ));
    }
    if !matches!(args.body_fields, BodyFields::All) {
        errors.push(syn::Error::new(
            span,
            "`fingerprint_only` and `fingerprint_except` choose fields of a JSON body; a tonic method's fingerprint covers its whole message, re-encoded",
        ));
    }
    errors
}

/// The signature without `&self`, which a tonic method takes first.
fn without_receiver(sig: &syn::Signature, errors: &mut Vec<syn::Error>) -> syn::Signature {
    let mut sig = sig.clone();
    match sig.inputs.first() {
        Some(FnArg::Receiver(receiver))
            if receiver.reference.is_some()
                && receiver.mutability.is_none()
                && receiver.colon_token.is_none() =>
        {
            sig.inputs = sig.inputs.into_iter().skip(1).collect();
        }
        Some(FnArg::Receiver(receiver)) => {
            errors.push(syn::Error::new_spanned(
                receiver,
                "a tonic method takes `&self`, as its service trait declares",
            ));
            sig.inputs = sig.inputs.into_iter().skip(1).collect();
        }
        _ => errors.push(syn::Error::new(
            sig.paren_token.span.join(),
            "a tonic method takes `&self` first, as its service trait declares",
        )),
    }
    sig
}

/// Whether `arg` is the call's `Request<Message>`.
fn is_request_param(arg: &FnArg) -> bool {
    let FnArg::Typed(arg) = arg else { return false };
    match &*arg.ty {
        Type::Path(path) => path.path.segments.last().is_some_and(|segment| {
            segment.ident == "Request"
                && matches!(segment.arguments, syn::PathArguments::AngleBracketed(_))
        }),
        _ => false,
    }
}

/// The last parameter is the call's `tonic::Request<Message>`.
fn check_request_last(sig: &syn::Signature) -> Option<syn::Error> {
    let last = match sig.inputs.last() {
        Some(FnArg::Typed(last)) => last,
        _ => {
            return Some(syn::Error::new(
                sig.paren_token.span.join(),
                "a tonic method takes its `tonic::Request<Message>` last",
            ));
        }
    };
    let is_request = sig.inputs.last().is_some_and(is_request_param);
    (!is_request).then(|| {
        syn::Error::new_spanned(
            &last.ty,
            "a tonic method takes its `tonic::Request<Message>` last, after the transaction and the values read from the metadata",
        )
    })
}

/// A streaming method is refused: a client stream's messages arrive one by one (the fingerprint
/// needs them all before the method runs), and a server stream cannot be stored and replayed.
fn check_unary(sig: &syn::Signature) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    let request = sig.inputs.iter().find(|arg| is_request_param(arg));
    if let Some(FnArg::Typed(request)) = request
        && let Some(message) = first_type_argument(&request.ty)
        && last_segment_is(message, "Streaming")
    {
        errors.push(syn::Error::new_spanned(
            message,
            "`#[idempotent]` applies to unary methods: a client-streaming call's messages arrive one by one, and its fingerprint needs them all before the method runs",
        ));
    }
    if let syn::ReturnType::Type(_, output) = &sig.output
        && let Some(ok) = first_type_argument(output)
        && let Some(reply) = first_type_argument(ok)
        && let Type::Path(path) = reply
        && path.qself.is_none()
        && path
            .path
            .segments
            .first()
            .is_some_and(|first| first.ident == "Self")
    {
        errors.push(syn::Error::new_spanned(
            reply,
            "`#[idempotent]` applies to unary methods: a server-streaming answer cannot be stored and replayed",
        ));
    }
    errors
}

/// The first type argument of `ty`'s last segment (`M` of `Request<M>`, `T` of
/// `Result<T, E>`).
fn first_type_argument(ty: &Type) -> Option<&Type> {
    let Type::Path(path) = ty else { return None };
    let syn::PathArguments::AngleBracketed(arguments) = &path.path.segments.last()?.arguments
    else {
        return None;
    };
    arguments.args.iter().find_map(|argument| match argument {
        syn::GenericArgument::Type(ty) => Some(ty),
        _ => None,
    })
}

fn last_segment_is(ty: &Type, name: &str) -> bool {
    matches!(ty, Type::Path(path) if path.path.segments.last().is_some_and(|segment| segment.ident == name))
}

/// An `rpc` name tonic would not have made `ident` of: the name in the `.proto` that its code
/// generator (prost-build's, heck's snake case) turns into the Rust method's name.
fn check_rpc(rpc: Option<&LitStr>, ident: &syn::Ident) -> Option<syn::Error> {
    let rpc = rpc?;
    let rust = ident.to_string();
    let rust = rust.strip_prefix("r#").unwrap_or(&rust);
    let generated = heck::ToSnakeCase::to_snake_case(rpc.value().as_str());
    (generated != rust).then(|| {
        syn::Error::new_spanned(
            rpc,
            format!(
                "tonic names the method of `rpc {}` `{generated}`, not `{rust}`: `rpc` is the name \
                 in the `.proto` of the method it marks",
                rpc.value()
            ),
        )
    })
}

/// The method's name in the `.proto`, from the Rust name tonic made of it: `create_payment` is
/// `CreatePayment`. A name that is not in upper camel case (`GetHTTPStatus`, whose method is
/// `get_http_status`) is given with `rpc`.
fn proto_name(ident: &syn::Ident) -> String {
    let rust = ident.to_string();
    let rust = rust.strip_prefix("r#").unwrap_or(&rust);
    rust.split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_uppercase().chain(chars).collect()
            })
        })
        .collect()
}

/// A method of the trait's signature that stands in for a refused one, so that the impl is
/// complete and the macro's errors are the only ones. A method async-trait has already
/// rewritten (the attributes in the wrong order) has the trait's signature: it stays as it is.
fn stand_in(method: &ImplItemFn) -> TokenStream {
    if method.sig.asyncness.is_none() {
        return async_trait_stand_in(&method.attrs, &method.vis, &method.sig);
    }
    let attrs = method.attrs.iter().filter(|attr| !is_idempotent(attr));
    let ident = &method.sig.ident;
    let output = &method.sig.output;
    let request = match method.sig.inputs.iter().find(|arg| is_request_param(arg)) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proto_name_is_the_rust_name_in_upper_camel_case() {
        let name = |rust: &str| proto_name(&syn::Ident::new(rust, Span::call_site()));
        assert_eq!(name("create_payment"), "CreatePayment");
        assert_eq!(name("get"), "Get");
        assert_eq!(name("get_v2_item"), "GetV2Item");
    }

    #[test]
    fn an_rpc_name_is_taken_when_tonic_makes_the_methods_name_of_it() {
        let check = |rpc: &str, rust: &str| {
            check_rpc(
                Some(&LitStr::new(rpc, Span::call_site())),
                &syn::Ident::new(rust, Span::call_site()),
            )
            .map(|error| error.to_string())
        };
        assert_eq!(check("GetHTTPStatus", "get_http_status"), None);
        assert_eq!(check("CreatePayment", "create_payment"), None);
        let refused = check("GetHTTPStatus", "get_status").expect("refused");
        assert!(
            refused.contains("`get_http_status`, not `get_status`"),
            "{refused}"
        );
    }
}
