//! Parsing of `#[grpc]`: its one argument (`server = ...`), the impl it marks (of a trait), the
//! `#[idempotent(...)]` attribute of each method and the arguments in it, and the recognisers
//! the other stages share (the attributes by name, the request parameter by its type).

use proc_macro2::TokenStream;
use syn::{Attribute, FnArg, ImplItemFn, ItemImpl, Meta, Path, Type};

use crate::args::{self, Args};

/// What `#[grpc]` marks: the impl of a service trait, and the server tonic generated for it.
pub struct Service {
    /// The impl, its methods as written.
    pub item: ItemImpl,
    /// The generated server that names the service (`PaymentsServer` for `Payments`).
    pub server: Path,
}

/// Why the impl cannot be read: the error, and what to emit beside it (the item unchanged).
pub struct Unreadable {
    /// The error, at the item or at its self type.
    pub error: syn::Error,
    /// The item, unchanged.
    pub item: TokenStream,
}

/// The impl and its server; an error of the argument is collected in `errors` and the impl still
/// read (its server then the trait's default one), while an impl that cannot be read stops
/// everything (the argument's error is then left out).
pub fn service(
    attr: TokenStream,
    item: TokenStream,
    errors: &mut Vec<syn::Error>,
) -> Result<Service, Unreadable> {
    let server = parse_server(attr).unwrap_or_else(|error| {
        errors.push(error);
        None
    });
    let service = match syn::parse2::<ItemImpl>(item.clone()) {
        Ok(service) => service,
        Err(error) => {
            let error = syn::Error::new(
                error.span(),
                "`#[grpc]` applies to the impl of a tonic service trait: `impl Payments for PaymentsApi { ... }`",
            );
            return Err(Unreadable { error, item });
        }
    };
    let Some((_, trait_path, _)) = &service.trait_ else {
        let error = syn::Error::new_spanned(
            &service.self_ty,
            "`#[grpc]` applies to the impl of a tonic service trait (`impl Payments for PaymentsApi`), not to an impl without a trait",
        );
        return Err(Unreadable {
            error,
            item: quote::quote!(#service),
        });
    };
    let server = server.unwrap_or_else(|| server_of(trait_path));
    Ok(Service {
        item: service,
        server,
    })
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

/// The method's `#[idempotent]` attribute, taken off it; `None` when the method has none.
pub fn take_idempotent(method: &mut ImplItemFn) -> Option<Attribute> {
    let at = method.attrs.iter().position(is_idempotent)?;
    Some(method.attrs.remove(at))
}

/// The arguments written in a method's `#[idempotent(...)]`, read as an Axum handler's are: the
/// values that could be read, and the errors of the others.
///
/// # Errors
///
/// When the attribute is written `#[idempotent = ...]`, which has no arguments to read.
pub fn arguments(attr: &Attribute) -> syn::Result<(Args, Vec<syn::Error>)> {
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
    Ok(args::parse(tokens))
}

/// Whether `attr` is `#[idempotent]`, under any path.
pub fn is_idempotent(attr: &Attribute) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == "idempotent")
}

/// Whether `attr` is `#[async_trait]`, under any path (`#[tonic::async_trait]`).
pub fn is_async_trait(attr: &Attribute) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == "async_trait")
}

/// Whether `arg` is the call's `Request<Message>`.
pub fn is_request(arg: &FnArg) -> bool {
    let FnArg::Typed(arg) = arg else { return false };
    match &*arg.ty {
        Type::Path(path) => path.path.segments.last().is_some_and(|segment| {
            segment.ident == "Request"
                && matches!(segment.arguments, syn::PathArguments::AngleBracketed(_))
        }),
        _ => false,
    }
}
