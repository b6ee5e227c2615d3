//! Validation: the handler's signature checked against the arguments. Its parameters are sorted
//! by role (the transaction, the context, the steps, the extractors), then each check runs on
//! its own and every error is collected, so that all are reported at once.

mod mode;
mod params;
mod scope;
mod signature;

use proc_macro2::Span;
use syn::{Ident, ItemFn, PatType, Type};

use crate::{args::Args, errors};

/// The handler, understood.
pub struct Handler {
    pub item: ItemFn,
    /// The `&mut Transaction<'_, DB>` parameter; without one the handler is in external mode.
    pub tx: Option<PatType>,
    /// `DB` of the transaction, or `None` for the default backend.
    pub db: Option<Type>,
    /// The `IdempotencyContext` parameter, if any.
    pub context: Option<PatType>,
    /// The `Steps<DB>` parameter, if any (external mode only).
    pub steps: Option<PatType>,
    /// The extractor parameters, in order, without the transaction.
    pub extractors: Vec<PatType>,
    /// How the scope value is computed.
    pub scope: Scope,
}

/// Where the scope comes from.
pub enum Scope {
    Global,
    /// The binding named by `scope`, and the span to report type errors at.
    Binding {
        ident: Ident,
        span: Span,
    },
}

/// Checks the function against the arguments, collecting every error, in the order of the
/// function's text where they can be: the signature, each parameter, then what the parameters
/// mean together (the mode and the arguments that belong to one), the order of the extractors,
/// and the scope.
pub fn analyse(item: ItemFn, args: &Args) -> Result<Handler, syn::Error> {
    let sig = &item.sig;
    let mut errors = signature::check(sig);
    let params = params::sort(sig, &mut errors);
    errors.extend(mode::check(sig, &item.block, &params, args));
    errors.extend(check_body_extractor_last(&params.extractors));
    if let (Some(optional), Some((steps, _))) = (args.key_optional, &params.steps) {
        errors.push(syn::Error::new(
            optional,
            format!(
                "`key_optional` cannot go with steps (`{}`): a request without a key has no \
                 claim to record its steps on; leave the key required",
                quote::ToTokens::to_token_stream(&steps.pat)
            ),
        ));
    }
    let scope = scope::resolve(args, &params, &sig.ident).map_err(|error| errors.push(error));
    if let Some(error) = errors::combine(errors) {
        return Err(error);
    }
    Ok(params.into_handler(item, args, scope.expect("checked above")))
}

/// Extractors that read the request body: Axum needs them last.
const BODY_EXTRACTORS: &[&str] = &[
    "Json",
    "Form",
    "Bytes",
    "String",
    "Body",
    "Request",
    "Multipart",
    "RawForm",
    "BodyStream",
];

/// Every extractor but the last that is one of [`BODY_EXTRACTORS`].
fn check_body_extractor_last(extractors: &[PatType]) -> Vec<syn::Error> {
    let Some((_, leading)) = extractors.split_last() else {
        return Vec::new();
    };
    leading
        .iter()
        .filter_map(|arg| {
            let name = body_extractor(&arg.ty)?;
            Some(syn::Error::new_spanned(
                &arg.ty,
                format!("`{name}` consumes the request body, so it must be the last extractor of the handler"),
            ))
        })
        .collect()
}

/// The name of the body extractor `ty` is, if it is one.
fn body_extractor(ty: &Type) -> Option<String> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    let name = last.ident.to_string();
    BODY_EXTRACTORS.contains(&name.as_str()).then_some(name)
}
