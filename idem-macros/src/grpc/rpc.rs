//! A tonic method's name in the `.proto`: made from the Rust name (`create_payment` is
//! `CreatePayment`), or given with `rpc = "..."` and then checked to be one tonic would have
//! made the Rust name of.

use syn::LitStr;

/// The method's name in the `.proto`: `rpc`'s when given, else the Rust name in upper camel
/// case.
pub fn proto_name_of(rpc: Option<&LitStr>, ident: &syn::Ident) -> String {
    rpc.map_or_else(|| proto_name(ident), LitStr::value)
}

/// An `rpc` name tonic would not have made `ident` of: the name in the `.proto` that its code
/// generator (prost-build's, heck's snake case) turns into the Rust method's name.
pub fn check_rpc(rpc: Option<&LitStr>, ident: &syn::Ident) -> Option<syn::Error> {
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

#[cfg(test)]
mod tests {
    use proc_macro2::Span;

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
