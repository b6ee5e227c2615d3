//! The scope: the binding that `scope = "<name>"` names among the extractors' patterns, or an
//! error that says what the name is instead (the transaction, or nothing) and which bindings
//! there are.

use syn::{Ident, Pat, PatType, spanned::Spanned, visit::Visit};

use super::{Scope, params::Params};
use crate::args::{Args, ScopeArg};

/// Where the scope comes from; `global` (or a `scope` argument that was itself refused) is
/// [`Scope::Global`].
pub fn resolve(args: &Args, params: &Params, handler: &Ident) -> Result<Scope, syn::Error> {
    let Some(ScopeArg::Param(lit)) = &args.scope else {
        return Ok(Scope::Global);
    };
    let name = lit.value();
    match params
        .extractors
        .iter()
        .find_map(|arg| find_binding(arg, &name))
    {
        Some(scope) => Ok(scope),
        None => Err(syn::Error::new(
            lit.span(),
            not_found(&name, params, handler),
        )),
    }
}

/// Why no extractor binds `name`: it is the transaction, or the handler has no parameter of
/// that name (with the names it has).
fn not_found(name: &str, params: &Params, handler: &Ident) -> String {
    let is_tx = params
        .tx
        .as_ref()
        .is_some_and(|(arg, _)| find_binding(arg, name).is_some());
    if is_tx {
        return format!(
            "`scope = \"{name}\"` names the transaction; name the parameter that identifies the caller"
        );
    }
    let names: Vec<String> = params
        .extractors
        .iter()
        .flat_map(|arg| bindings(&arg.pat))
        .map(|ident| format!("`{ident}`"))
        .collect();
    if names.is_empty() {
        format!(
            "`scope = \"{name}\"` names no parameter of `{handler}`: add the parameter that identifies the caller"
        )
    } else {
        format!(
            "`scope = \"{name}\"` names no parameter of `{handler}`; its parameters are {}",
            names.join(", ")
        )
    }
}

/// The binding `name` in `arg`'s pattern, with the span its type errors are reported at.
fn find_binding(arg: &PatType, name: &str) -> Option<Scope> {
    let ident = bindings(&arg.pat).into_iter().find(|ident| ident == name)?;
    // A plain `tenant: Tenant` reports trait errors on the type; a binding inside a pattern
    // (`Extension(tenant): Extension<Tenant>`) on the binding itself.
    let span = if matches!(&*arg.pat, Pat::Ident(_)) {
        arg.ty.span()
    } else {
        ident.span()
    };
    Some(Scope::Binding { ident, span })
}

/// Every identifier `pat` binds, in order.
fn bindings(pat: &Pat) -> Vec<Ident> {
    struct Collect(Vec<Ident>);
    impl<'ast> Visit<'ast> for Collect {
        fn visit_pat_ident(&mut self, node: &'ast syn::PatIdent) {
            self.0.push(node.ident.clone());
            syn::visit::visit_pat_ident(self, node);
        }
    }
    let mut collect = Collect(Vec::new());
    collect.visit_pat(pat);
    collect.0
}
