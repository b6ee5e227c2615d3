//! `fingerprint_only` and `fingerprint_except`: the JSON Pointers (RFC 6901) of the body fields
//! that count in a request's fingerprint, or that do not, checked here for their syntax.

use syn::{Expr, ExprArray, ExprLit, Lit, LitStr};

use crate::errors;

/// Which fields of a JSON body count in the fingerprint.
#[derive(Default)]
pub enum BodyFields {
    /// The whole body.
    #[default]
    All,
    /// `fingerprint_only = [...]`.
    Only(Vec<String>),
    /// `fingerprint_except = [...]`.
    Except(Vec<String>),
}

/// The pointers of `array`, each a string literal that is a JSON Pointer to a field, named
/// once.
///
/// # Errors
///
/// At each element that is not a string, is not a pointer to a field, or repeats one (all of
/// them, together); at the brackets when the list is empty.
pub fn pointers(array: &ExprArray, argument: &str) -> syn::Result<Vec<String>> {
    if array.elems.is_empty() {
        return Err(syn::Error::new_spanned(
            array,
            format!(
                "`{argument}` names no field: list JSON Pointers, e.g. `{argument} = [\"/sent_at\"]`"
            ),
        ));
    }
    let mut pointers: Vec<String> = Vec::new();
    let mut errors: Vec<syn::Error> = Vec::new();
    for element in &array.elems {
        match pointer(element, argument, &pointers) {
            Ok(pointer) => pointers.push(pointer),
            Err(error) => errors.push(error),
        }
    }
    errors::unless_collected(errors, Ok(pointers))
}

/// One element of the list: a JSON Pointer to a field not listed before it.
fn pointer(element: &Expr, argument: &str, before: &[String]) -> syn::Result<String> {
    let lit = string(element, argument)?;
    let pointer = lit.value();
    check_pointer(&pointer).map_err(|reason| syn::Error::new(lit.span(), reason))?;
    if before.contains(&pointer) {
        return Err(syn::Error::new(
            lit.span(),
            format!("`{pointer}` is listed twice"),
        ));
    }
    Ok(pointer)
}

/// A string literal, or an error that shows the list's form.
fn string<'a>(element: &'a Expr, argument: &str) -> syn::Result<&'a LitStr> {
    match element {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) => Ok(lit),
        other => Err(syn::Error::new_spanned(
            other,
            format!(
                "expected a JSON Pointer as a string, e.g. `{argument} = [\"/sent_at\", \"/trace/id\"]`"
            ),
        )),
    }
}

/// Whether `pointer` is a JSON Pointer (RFC 6901) to a field: `/` then reference tokens apart by
/// `/`, where `~` is only ever `~0` (a `~`) or `~1` (a `/`). The empty pointer names the whole
/// body, which is what leaving the argument out means.
pub fn check_pointer(pointer: &str) -> Result<(), String> {
    if pointer.is_empty() {
        return Err(
            "the empty pointer names the whole body; name a field, e.g. `\"/sent_at\"`".to_owned(),
        );
    }
    if !pointer.starts_with('/') {
        return Err(format!(
            "`{pointer}` is not a JSON Pointer: it starts with `/`, e.g. `\"/{pointer}\"`"
        ));
    }
    let mut chars = pointer.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return Err(format!(
                "`{pointer}` is not a JSON Pointer: `~` is written `~0` and `/` in a name `~1`"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_pointer;

    #[test]
    fn pointers_to_fields_are_accepted() {
        for pointer in ["/a", "/a/b", "/items/0", "/a~1b", "/a~0b", "/", "//"] {
            assert_eq!(check_pointer(pointer), Ok(()), "{pointer}");
        }
    }

    #[test]
    fn what_is_not_a_pointer_to_a_field_is_refused() {
        for pointer in ["", "a", "a/b", "/a~", "/a~2", "/~x"] {
            assert!(check_pointer(pointer).is_err(), "{pointer}");
        }
    }
}
