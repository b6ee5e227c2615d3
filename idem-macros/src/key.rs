//! Where the handler's key comes from: `key_header = "webhook-id"`, `key_pointer = "/id"` (a
//! field of the JSON body), `key_field = "request_id"` (a field of a tonic request message), or
//! the `Idempotency-Key` header without them; and `key_optional`. Each checked here for its
//! syntax; what they generate is in `expand/key.rs`.

use proc_macro2::Span;
use syn::{LitStr, meta::ParseNestedMeta};

use crate::fields;

/// The key's source, as the attribute gave it.
#[derive(Default)]
pub enum KeyArg {
    /// `Idempotency-Key` (or `idempotency-key` metadata).
    #[default]
    Standard,
    /// `key_header = "<name>"`, the name in lowercase, and where it was written.
    Header(String, Span),
    /// `key_pointer = "/<field>"`, and where it was written.
    Pointer(String, Span),
    /// `key_field = "<field>"`: the field of the tonic request message.
    Field(syn::Ident),
}

/// The literal string of `name = "..."`, or an error that shows the form.
fn literal(meta: &ParseNestedMeta<'_>, name: &str, example: &str) -> syn::Result<LitStr> {
    let example = format!("`{name} = \"{example}\"`");
    if !meta.input.peek(syn::Token![=]) {
        return Err(meta.error(format!("expected a value: {example}")));
    }
    match meta.value()?.parse::<syn::Expr>()? {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(lit),
            ..
        }) => Ok(lit),
        other => Err(syn::Error::new_spanned(
            other,
            format!("expected a string: {example}"),
        )),
    }
}

/// `key_header = "<name>"`: an HTTP field name (RFC 9110's token characters), kept in
/// lowercase.
///
/// # Errors
///
/// At the value when it is not a string or not a header name.
pub fn header(meta: &ParseNestedMeta<'_>) -> syn::Result<KeyArg> {
    let lit = literal(meta, "key_header", "webhook-id")?;
    let name = lit.value();
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token) {
        return Err(syn::Error::new(
            lit.span(),
            format!(
                "{name:?} is not a header name: letters, digits and `-` (as `webhook-id`, \
                 `X-GitHub-Delivery`)"
            ),
        ));
    }
    let name = name.to_ascii_lowercase();
    if name == "idempotency-key" {
        return Err(syn::Error::new(
            lit.span(),
            "`Idempotency-Key` is where the key is without `key_header`: leave the argument out",
        ));
    }
    Ok(KeyArg::Header(name, lit.span()))
}

/// `key_pointer = "/<field>"`: a JSON Pointer to a field of the body.
///
/// # Errors
///
/// At the value when it is not a string or not a pointer to a field.
pub fn pointer(meta: &ParseNestedMeta<'_>) -> syn::Result<KeyArg> {
    let lit = literal(meta, "key_pointer", "/id")?;
    let pointer = lit.value();
    fields::check_pointer(&pointer).map_err(|reason| syn::Error::new(lit.span(), reason))?;
    Ok(KeyArg::Pointer(pointer, lit.span()))
}

/// `key_field = "<field>"`: the Rust name of a field of the tonic request message.
///
/// # Errors
///
/// At the value when it is not a string or not a field name.
pub fn field(meta: &ParseNestedMeta<'_>) -> syn::Result<KeyArg> {
    let lit = literal(meta, "key_field", "request_id")?;
    let name = lit.value();
    let mut ident = syn::parse_str::<syn::Ident>(&name)
        .or_else(|_| syn::parse_str::<syn::Ident>(&format!("r#{name}")))
        .map_err(|_| {
            syn::Error::new(
                lit.span(),
                format!(
                    "{name:?} is not a field name: name the request message's field as prost \
                     writes it, e.g. `key_field = \"request_id\"`"
                ),
            )
        })?;
    // A keyword (`type`) is the raw identifier prost makes of it (`r#type`).
    ident.set_span(lit.span());
    Ok(KeyArg::Field(ident))
}
