//! The paths of `idem-runtime` the generated code names, under whatever name the user's crate
//! gives it: its public items (where a compiler error may show them) and its `__private`
//! module (everything else).

use proc_macro2::TokenStream;
use quote::quote;

/// `::idem_runtime::__private`, under whatever name the user's crate gives `idem-runtime`.
pub fn runtime_private() -> TokenStream {
    let runtime = runtime();
    quote!(#runtime::__private)
}

/// `::idem_runtime::signature`: what the generated signature and checks name, which the
/// compiler's errors about a handler show (never `__private`).
pub fn runtime_signature() -> TokenStream {
    let runtime = runtime();
    quote!(#runtime::signature)
}

/// `::idem_runtime`, under whatever name the user's crate gives `idem-runtime`: the path of
/// what the generated code names where an error may show it (the public traits).
pub fn runtime() -> TokenStream {
    use proc_macro_crate::{FoundCrate, crate_name};
    match crate_name("idem-runtime") {
        Ok(FoundCrate::Name(name)) => {
            let name = syn::Ident::new(&name, proc_macro2::Span::call_site());
            quote!(::#name)
        }
        // `Itself` (idem-runtime's own doc tests) and a manifest that cannot be read both
        // mean the usual name.
        Ok(FoundCrate::Itself) | Err(_) => quote!(::idem_runtime),
    }
}
