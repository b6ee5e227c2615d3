//! Code generation: the handler rewritten around a claim. Expansion cannot fail; every check
//! happened in [`crate::args`] and [`crate::handler`].

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::{ItemFn, ReturnType, Type, visit_mut::VisitMut};

use crate::{
    args,
    handler::{self, Handler, Scope},
};

/// Parses, validates and expands; errors are reported by the caller next to the original item.
pub fn idempotent(attr: TokenStream, item: TokenStream) -> Result<TokenStream, syn::Error> {
    let (args, mut errors) = args::parse(attr);
    let item: ItemFn = match syn::parse2(item) {
        Ok(item) => item,
        Err(error) => {
            errors.push(syn::Error::new(
                error.span(),
                "`#[idempotent]` applies to an `async fn` handler",
            ));
            return Err(args::combine(errors).expect("one error at least"));
        }
    };
    match handler::analyse(item, &args) {
        Ok(handler) if errors.is_empty() => Ok(expand(&args, handler)),
        Ok(_) => Err(args::combine(errors).expect("one error at least")),
        Err(more) => {
            errors.push(more);
            Err(args::combine(errors).expect("one error at least"))
        }
    }
}

fn expand(args: &args::Args, handler: Handler) -> TokenStream {
    let Handler {
        item,
        tx,
        db,
        context,
        steps,
        mut extractors,
        scope,
    } = handler;
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = item;
    let ident = &sig.ident;
    let private = runtime_private();
    let db = db.map_or_else(|| quote!(#private::DefaultBackend), |db| quote!(#db));

    // The last extractor is wrapped in `Input`, which takes the key and the body first.
    let input = match extractors.pop() {
        Some(last) => {
            let attrs = &last.attrs;
            let pat = &last.pat;
            let ty = &last.ty;
            quote_spanned! {last.ty_span()=>
                #(#attrs)*
                #private::Input { value: #pat, request: __idem_request }: #private::Input<#ty, #db>
            }
        }
        None => quote! {
            #private::Input { value: (), request: __idem_request }: #private::Input<(), #db>
        },
    };
    let state_checks = args
        .state
        .as_ref()
        .map(|state| state_checks(state, &db, &extractors, &sig.generics));

    // With `state = S`, the handler is an Axum handler for that state only, so that a router
    // built with it is not inferred to have another state (the store's) when `S` lacks the
    // store: the one error is then the missing `FromRef`, at the attribute.
    let state_pin = args.state.as_ref().map(|state| {
        quote_spanned! {syn::spanned::Spanned::span(state)=>
            _: #private::StateIs<#state>,
        }
    });
    let (generics, _, where_clause) = sig.generics.split_for_impl();
    let extractors = extractors.iter().map(|arg| quote!(#arg));

    let key_scope = match &scope {
        Scope::Global => quote!(#private::KeyScope::Global),
        Scope::Binding { ident, .. } => {
            let name = ident.to_string();
            quote!(#private::KeyScope::Parameter(#name))
        }
    };
    let mode = match (&tx, &steps) {
        (Some(_), _) => quote!(#private::Mode::Transactional),
        (None, Some(_)) => quote!(#private::Mode::Steps),
        (None, None) => quote!(#private::Mode::External),
    };
    let scope = match scope {
        Scope::Global => quote!(#private::Scope::Global),
        Scope::Binding { mut ident, span } => {
            // The binding takes the reported span, so that a missing `IdempotencyScope` impl
            // is underlined on the type alone.
            ident.set_span(span);
            quote_spanned!(span=> #private::scope_of(&#ident))
        }
    };
    let retention = args.retention_secs;
    let replay_5xx = args.replay_5xx;
    let lease = args.lease_secs;
    let timeout = match args.timeout {
        Some((secs, _)) => quote!(::core::option::Option::Some(#secs)),
        None => quote!(::core::option::Option::None),
    };
    let wait = match args.wait {
        Some(secs) => quote!(::core::option::Option::Some(#secs)),
        None => quote!(::core::option::Option::None),
    };
    let name = ident.to_string();
    // The handler's settings, in a static that both drives each request and is registered for
    // the published policy and the OpenAPI document: they cannot disagree. (Reading it from the
    // handler also links it, with its registration, into any program that routes to it.)
    let policy = quote! {
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
        );
        #private::inventory::submit! { #private::Registered(&__IDEM_POLICY) }
    };

    // Transactional mode lends the transaction to the body; external mode has none.
    let (claim, bind_tx) = match &tx {
        Some(tx) => {
            let (pat, ty) = (&tx.pat, &tx.ty);
            (
                quote!(#private::Claim::<#db>),
                quote!(let #pat: #ty = __idem_claim.transaction();),
            )
        }
        None => (quote!(#private::ExternalClaim::<#db>), quote!()),
    };
    let bind_context = context.map(|ctx| {
        let (pat, ty) = (&ctx.pat, &ctx.ty);
        quote!(let #pat: #ty = __idem_claim.context();)
    });
    let bind_steps = steps.map(|steps| {
        let (pat, ty) = (&steps.pat, &steps.ty);
        quote!(let #pat: #ty = __idem_claim.steps();)
    });
    // The declared type, with `impl Trait` in argument position, converts the body's value
    // (and keeps the user's trait imports in use); the inferred one types the body's future.
    let (declared, inferred) = match &sig.output {
        ReturnType::Default => (quote!(()), quote!(())),
        ReturnType::Type(_, ty) => {
            let mut inferred = (**ty).clone();
            InferImplTrait.visit_type_mut(&mut inferred);
            (quote!(#ty), quote!(#inferred))
        }
    };
    // The declared type converts the body's value (`impl Trait` is allowed in argument
    // position, and the user's trait imports stay in use). A nested fn cannot see the handler's
    // type parameters, so a return type that names them converts through a closure of the
    // inferred type.
    let into_response = if !mentions_type_params(&sig.output, &sig.generics) {
        quote! {
            fn __idem_into_response(__idem_output: #declared) -> #private::Response {
                #private::IntoResponse::into_response(__idem_output)
            }
        }
    } else {
        quote! {
            let __idem_into_response = |__idem_output: #inferred| -> #private::Response {
                #private::IntoResponse::into_response(__idem_output)
            };
        }
    };

    let body = quote!(#private::hint::<#inferred, _>(async move #block));
    // The body runs until its limit (its `timeout`, and in transactional mode the request's
    // database deadline); past it, the body's future (and its borrow of the claim) is dropped
    // before the claim rolls back or releases the key.
    let run = quote! {
        let __idem_limit = __idem_claim.limit();
        let __idem_output = {
            #bind_context
            #bind_steps
            #bind_tx
            #private::within(__idem_limit, #body).await
        };
        let __idem_response = match __idem_output {
            ::core::option::Option::Some(__idem_value) => __idem_into_response(__idem_value),
            ::core::option::Option::None => return __idem_claim.stopped(__idem_limit).await,
        };
    };
    // Transactional mode: each attempt at the claim lends its transaction's connection from a
    // slot of its own, declared first so that it outlives the claim; a duplicate that waits for
    // another process makes several attempts. External mode claims once.
    let claim_and_run = match &tx {
        Some(_) => quote! {
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
                    #private::Acquired::Answer(__idem_answer) => return __idem_answer,
                };
                #into_response
                #run
                return __idem_claim.complete(__idem_response).await;
            }
        },
        None => quote! {
            #[allow(unused_mut)]
            let mut __idem_claim = match #claim::acquire(
                __idem_request,
                __idem_scope,
                __idem_options,
            )
            .await
            {
                ::core::result::Result::Ok(__idem_claim) => __idem_claim,
                ::core::result::Result::Err(__idem_answer) => return __idem_answer,
            };
            #into_response
            #run
            __idem_claim.complete(__idem_response).await
        },
    };

    quote! {
        #(#attrs)*
        #vis async fn #ident #generics (#state_pin #(#extractors,)* #input) -> #private::Response #where_clause {
            #state_checks
            #policy
            let __idem_span = __idem_request.span();
            #private::Instrument::instrument(
                async move {
                    let __idem_scope = #scope;
                    let __idem_options = __IDEM_POLICY.__options();
                    #claim_and_run
                },
                __idem_span,
            )
            .await
        }
    }
}

/// With `state = S`: checks, at the handler, what Axum would otherwise report only at
/// `.route(...)` as an unsatisfied `Handler`: that `S` provides the store, and that every
/// argument but the last reads only the request's parts. Each error lands on the type at fault.
/// The checks sit in a closure that is never called, in the handler's body, where its type
/// parameters are in scope and an associated function is no obstacle. When the database is one
/// of the handler's type parameters, whether `S` provides its store is a question for each
/// instantiation, which `.route(...)` answers.
fn state_checks(
    state: &Type,
    db: &TokenStream,
    extractors: &[syn::PatType],
    generics: &syn::Generics,
) -> TokenStream {
    let private = runtime_private();
    let store = (!names_generic_params(db.clone(), generics)).then(|| {
        quote_spanned! {syn::spanned::Spanned::span(state)=>
            #private::state_provides_store::<#state, #db>();
        }
    });
    let parts = extractors.iter().map(|arg| {
        let ty = &arg.ty;
        quote_spanned! {arg.ty_span()=>
            #private::reads_only_parts::<#ty, #state>();
        }
    });
    quote! {
        let _ = || {
            #store
            #(#parts)*
        };
    }
}

/// What the attribute emits when it refuses the function: the errors; the function unchanged
/// but renamed (so that its body still type-checks and its imports stay used); and, under the
/// original name, a stand-in handler that Axum accepts, so that `.route(...)` does not add a
/// confusing `Handler` error of its own to the macro's.
pub fn after_errors(original: TokenStream, errors: &syn::Error) -> TokenStream {
    let errors = errors.to_compile_error();
    let Ok(mut item) = syn::parse2::<ItemFn>(original.clone()) else {
        return quote!(#[allow(unused)] #original #errors);
    };
    let ident = item.sig.ident.clone();
    let vis = item.vis.clone();
    let private = runtime_private();
    // The stand-in keeps the type parameters, so that `post(create::<Postgres>)` still routes;
    // lifetimes (refused anyway) are left out.
    let mut stand_in = item.sig.generics.clone();
    stand_in.params = stand_in
        .params
        .into_iter()
        .filter(|param| !matches!(param, syn::GenericParam::Lifetime(_)))
        .collect();
    let (generics, _, where_clause) = stand_in.split_for_impl();
    item.sig.ident = quote::format_ident!("__idem_refused_{}", ident);
    quote! {
        #errors
        #[allow(unused, dead_code, non_snake_case)]
        #item
        #[allow(unused, dead_code)]
        #vis async fn #ident #generics () -> #private::Response #where_clause {
            ::core::unreachable!("`#[idempotent]` refused this handler at compile time")
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

/// Whether `tokens` name one of the type or const parameters of `generics`.
fn names_generic_params(tokens: TokenStream, generics: &syn::Generics) -> bool {
    fn idents(tokens: TokenStream, found: &mut Vec<proc_macro2::Ident>) {
        for token in tokens {
            match token {
                proc_macro2::TokenTree::Ident(ident) => found.push(ident),
                proc_macro2::TokenTree::Group(group) => idents(group.stream(), found),
                _ => {}
            }
        }
    }
    let mut found = Vec::new();
    idents(tokens, &mut found);
    generics
        .type_params()
        .map(|param| &param.ident)
        .chain(generics.const_params().map(|param| &param.ident))
        .any(|ident| found.contains(ident))
}

/// `::idem_runtime::__private`, under whatever name the user's crate gives `idem-runtime`.
fn runtime_private() -> TokenStream {
    use proc_macro_crate::{FoundCrate, crate_name};
    match crate_name("idem-runtime") {
        Ok(FoundCrate::Name(name)) => {
            let name = syn::Ident::new(&name, proc_macro2::Span::call_site());
            quote!(::#name::__private)
        }
        // `Itself` (idem-runtime's own doc tests) and a manifest that cannot be read both
        // mean the usual name.
        Ok(FoundCrate::Itself) | Err(_) => quote!(::idem_runtime::__private),
    }
}

trait TySpan {
    fn ty_span(&self) -> proc_macro2::Span;
}

impl TySpan for syn::PatType {
    fn ty_span(&self) -> proc_macro2::Span {
        syn::spanned::Spanned::span(&self.ty)
    }
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
