//! Validation of a marked method: checked as a handler is (its arguments, its transaction, its
//! scope, by [`crate::handler`]), with `&self` first and the request last, and for what a tonic
//! method cannot have (`state`, `fingerprint_*`, a stream, an `rpc` name tonic would not have
//! made); every error collected, so that all are reported at once.

use proc_macro2::Span;
use syn::{FnArg, ImplItemFn, ItemFn, Type, spanned::Spanned};

use super::{parse::is_request, rpc};
use crate::{
    args::Args,
    errors,
    fields::BodyFields,
    handler::{self, Handler},
    key::KeyArg,
};

/// A marked method, understood.
pub struct Method {
    /// Its arguments.
    pub args: Args,
    /// The method as a handler: without `&self`, its request last.
    pub handler: Handler,
    /// Its name in the `.proto` (`CreatePayment`).
    pub rpc: String,
}

/// Checks `method` against the arguments of its attribute (written at `attr`), with the errors
/// met reading them.
///
/// # Errors
///
/// Every error found, those of the arguments first; only one when the method is not an
/// `async fn` (async-trait rewrote it first, and nothing else about it can be told).
pub fn method(
    method: &ImplItemFn,
    attr: Span,
    args: Args,
    mut errors: Vec<syn::Error>,
) -> syn::Result<Method> {
    if method.sig.asyncness.is_none() {
        return Err(syn::Error::new(
            method.sig.fn_token.span(),
            "this method is not an `async fn` any more: put `#[idem_runtime::grpc]` above `#[tonic::async_trait]` on the impl, so that it sees the methods before async-trait rewrites them",
        ));
    }
    errors.extend(grpc_only_checks(&args, attr));
    errors.extend(rpc::check_rpc(args.rpc.as_ref(), &method.sig.ident));
    let mut item = ItemFn {
        attrs: method.attrs.clone(),
        vis: method.vis.clone(),
        sig: without_receiver(&method.sig, &mut errors),
        block: Box::new(method.block.clone()),
    };
    errors.extend(check_request_last(&item.sig));
    errors.extend(check_unary(&item.sig));
    // Analysed with the request last, where it belongs, so that its misplacement is reported
    // once, above.
    request_last(&mut item.sig);
    let handler = errors::unless_collected(errors, handler::analyse(item, &args))?;
    let rpc = rpc::proto_name_of(args.rpc.as_ref(), &method.sig.ident);
    Ok(Method { args, handler, rpc })
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
    if let KeyArg::Header(_, span) | KeyArg::Pointer(_, span) = &args.key {
        errors.push(syn::Error::new(
            *span,
            "a tonic method takes its key from `idempotency-key` metadata, or from a string field of its request message with `key_field = \"request_id\"`",
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
    let is_request = sig.inputs.last().is_some_and(is_request);
    (!is_request).then(|| {
        syn::Error::new_spanned(
            &last.ty,
            "a tonic method takes its `tonic::Request<Message>` last, after the transaction and the values read from the metadata",
        )
    })
}

/// The request moved to the end of the parameters, wherever it was written.
fn request_last(sig: &mut syn::Signature) {
    let Some(at) = sig.inputs.iter().position(is_request) else {
        return;
    };
    let mut inputs: Vec<FnArg> = sig.inputs.clone().into_iter().collect();
    let request = inputs.remove(at);
    inputs.push(request);
    sig.inputs = inputs.into_iter().collect();
}

/// A streaming method is refused: a client stream's messages arrive one by one (the fingerprint
/// needs them all before the method runs), and a server stream cannot be stored and replayed.
fn check_unary(sig: &syn::Signature) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    let request = sig.inputs.iter().find(|arg| is_request(arg));
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

/// Whether `ty` is a path whose last segment is `name`.
fn last_segment_is(ty: &Type, name: &str) -> bool {
    matches!(ty, Type::Path(path) if path.path.segments.last().is_some_and(|segment| segment.ident == name))
}
