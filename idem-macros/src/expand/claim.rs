//! The claim around the original body: the scope value, the claim (transactional: in a
//! transaction, attempted again while a duplicate waits; external: committed first, with a
//! lease), the body run within its limit with its transaction, context or steps bound, and its
//! response converted and stored.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::{ReturnType, Type, visit_mut::VisitMut};

use super::{names_generic_params, paths::runtime};
use crate::handler::{Handler, Scope};

/// The value of `__idem_scope`: global, or the caller's, read from the scope parameter through
/// `IdempotencyScope`, called by its public path so that a type without the trait is reported
/// against that trait alone (no helper of the runtime in the error).
pub fn scope(handler: &Handler, private: &TokenStream) -> TokenStream {
    match &handler.scope {
        Scope::Global => quote!(#private::StoredScope::Global),
        Scope::Binding { ident, span } => {
            // The binding takes the reported span, so that a missing `IdempotencyScope` impl
            // is underlined on the type alone.
            let mut ident = ident.clone();
            ident.set_span(*span);
            let runtime = runtime();
            quote_spanned! {*span=>
                #private::StoredScope::Caller(::std::borrow::Cow::into_owned(
                    #runtime::IdempotencyScope::idempotency_scope(&#ident),
                ))
            }
        }
    }
}

/// What the rewritten function answers: an Axum response, or a tonic method's result.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http,
    Grpc,
}

impl Protocol {
    /// The function's answer for `response`, an answer of the claim.
    fn answer(self, private: &TokenStream, response: TokenStream) -> TokenStream {
        match self {
            Self::Http => response,
            Self::Grpc => quote!(#private::grpc::answer(#response).await),
        }
    }
}

/// Claims the key, runs the body and answers with its stored response, or answers for the
/// claim (a replay, a conflict, a wait) without running it.
pub fn claim_and_run(
    handler: &Handler,
    private: &TokenStream,
    db: &TokenStream,
    protocol: Protocol,
) -> TokenStream {
    let into_response = into_response(&handler.item.sig, private, protocol);
    let run = run(handler, private, protocol);
    match &handler.tx {
        Some(_) => transactional(private, db, &into_response, &run, protocol),
        None => external(private, db, &into_response, &run, protocol),
    }
}

/// Transactional mode: each attempt at the claim lends its transaction's connection from a slot
/// of its own, declared first so that it outlives the claim; a duplicate that waits for another
/// process makes several attempts.
fn transactional(
    private: &TokenStream,
    db: &TokenStream,
    into_response: &TokenStream,
    run: &TokenStream,
    protocol: Protocol,
) -> TokenStream {
    let claim = quote!(#private::Claim::<#db>);
    let answer = protocol.answer(private, quote!(__idem_answer));
    let completed = protocol.answer(
        private,
        quote!(__idem_claim.complete(__idem_response).await),
    );
    quote! {
        let mut __idem_attempt = #private::Attempt::from(__idem_request);
        loop {
            let mut __idem_slot = ::core::option::Option::None;
            #[allow(unused_mut)]
            let mut __idem_claim = match #claim::acquire(
                &mut __idem_slot,
                __idem_attempt,
                &__idem_scope,
                __idem_options,
            )
            .await
            {
                #private::Acquired::Claimed(__idem_claim) => __idem_claim,
                #private::Acquired::Again(__idem_again) => {
                    __idem_attempt = __idem_again;
                    continue;
                }
                #private::Acquired::Answer(__idem_answer) => return #answer,
            };
            #into_response
            #run
            return #completed;
        }
    }
}

/// External mode claims once, committing the claim with its lease before the body runs.
fn external(
    private: &TokenStream,
    db: &TokenStream,
    into_response: &TokenStream,
    run: &TokenStream,
    protocol: Protocol,
) -> TokenStream {
    let claim = quote!(#private::ExternalClaim::<#db>);
    let answer = protocol.answer(private, quote!(__idem_answer));
    let completed = protocol.answer(
        private,
        quote!(__idem_claim.complete(__idem_response).await),
    );
    quote! {
        #[allow(unused_mut)]
        let mut __idem_claim = match #claim::acquire(
            __idem_request,
            __idem_scope,
            __idem_options,
        )
        .await
        {
            ::core::result::Result::Ok(__idem_claim) => __idem_claim,
            ::core::result::Result::Err(__idem_answer) => return #answer,
        };
        #into_response
        #run
        #completed
    }
}

/// The body runs until its limit (its `timeout`, and in transactional mode the request's
/// database deadline); past it, the body's future (and its borrow of the claim) is dropped
/// before the claim rolls back or releases the key.
fn run(handler: &Handler, private: &TokenStream, protocol: Protocol) -> TokenStream {
    let bindings = bindings(handler);
    let stopped = protocol.answer(private, quote!(__idem_claim.stopped(__idem_limit).await));
    let inferred = inferred_output(&handler.item.sig.output);
    let block = &handler.item.block;
    let body = quote!(#private::typed_body::<#inferred, _>(async move #block));
    quote! {
        let __idem_limit = __idem_claim.limit();
        let __idem_output = {
            #bindings
            #private::run_until(__idem_limit, #body).await
        };
        let __idem_response = match __idem_output {
            ::core::option::Option::Some(__idem_value) => __idem_into_response(__idem_value),
            ::core::option::Option::None => return #stopped,
        };
    }
}

/// The parameters the claim provides, bound under their own patterns: the context, the steps,
/// and the transaction (which transactional mode lends to the body; external mode has none).
fn bindings(handler: &Handler) -> TokenStream {
    let context = handler.context.as_ref().map(|ctx| {
        let (pat, ty) = (&ctx.pat, &ctx.ty);
        quote!(let #pat: #ty = __idem_claim.context();)
    });
    let steps = handler.steps.as_ref().map(|steps| {
        let (pat, ty) = (&steps.pat, &steps.ty);
        quote!(let #pat: #ty = __idem_claim.steps();)
    });
    let tx = match &handler.tx {
        Some(tx) => {
            let (pat, ty) = (&tx.pat, &tx.ty);
            quote!(let #pat: #ty = __idem_claim.transaction();)
        }
        None => quote!(),
    };
    quote!(#context #steps #tx)
}

/// `__idem_into_response`: the declared type converts the body's value (`impl Trait` is allowed
/// in argument position, and the user's trait imports stay in use). A nested fn cannot see the
/// handler's type parameters, so a return type that names them converts through a closure of
/// the inferred type. A tonic method's result is stored as its message or status; its return
/// type may name its impl's type parameters, which the macro does not see, so it converts through
/// a closure too.
fn into_response(sig: &syn::Signature, private: &TokenStream, protocol: Protocol) -> TokenStream {
    if protocol == Protocol::Grpc {
        let inferred = inferred_output(&sig.output);
        quote! {
            let __idem_into_response = |__idem_output: #inferred| -> #private::Response {
                #private::grpc::into_http(__idem_output)
            };
        }
    } else if !mentions_type_params(&sig.output, &sig.generics) {
        let declared = declared_output(&sig.output);
        quote! {
            fn __idem_into_response(__idem_output: #declared) -> #private::Response {
                #private::IntoResponse::into_response(__idem_output)
            }
        }
    } else {
        let inferred = inferred_output(&sig.output);
        quote! {
            let __idem_into_response = |__idem_output: #inferred| -> #private::Response {
                #private::IntoResponse::into_response(__idem_output)
            };
        }
    }
}

/// The return type as written, `()` when none is.
fn declared_output(output: &ReturnType) -> TokenStream {
    match output {
        ReturnType::Default => quote!(()),
        ReturnType::Type(_, ty) => quote!(#ty),
    }
}

/// The return type with each `impl Trait` made `_`, which types the body's future.
fn inferred_output(output: &ReturnType) -> TokenStream {
    match output {
        ReturnType::Default => quote!(()),
        ReturnType::Type(_, ty) => {
            let mut inferred = (**ty).clone();
            InferImplTrait.visit_type_mut(&mut inferred);
            quote!(#inferred)
        }
    }
}

/// Whether the return type names one of the handler's type or const parameters.
fn mentions_type_params(output: &ReturnType, generics: &syn::Generics) -> bool {
    let ReturnType::Type(_, ty) = output else {
        return false;
    };
    names_generic_params(quote!(#ty), generics)
}

/// `impl Trait` cannot be named in a turbofish; `_` lets the compiler infer it.
struct InferImplTrait;

impl VisitMut for InferImplTrait {
    fn visit_type_mut(&mut self, ty: &mut Type) {
        if let Type::ImplTrait(it) = ty {
            *ty = Type::Infer(syn::TypeInfer {
                underscore_token: syn::Token![_](syn::spanned::Spanned::span(it)),
            });
            return;
        }
        syn::visit_mut::visit_type_mut(self, ty);
    }
}
