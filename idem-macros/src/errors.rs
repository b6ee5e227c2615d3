//! Error collection: each check reports into a list instead of stopping the macro, and the list
//! becomes one `syn::Error` whose parts keep their own spans, so that the compiler shows every
//! problem at once (serde_derive's `ctxt.rs` does the same). Every other file may import this
//! one; it imports none of them.

/// Folds errors into one, so that each is reported at its own span.
pub fn combine(errors: impl IntoIterator<Item = syn::Error>) -> Option<syn::Error> {
    errors.into_iter().reduce(|mut all, next| {
        all.combine(next);
        all
    })
}

/// `result` when it is `Ok` and nothing was collected beside it; else every error, those
/// collected first, then `result`'s.
pub fn unless_collected<T>(mut errors: Vec<syn::Error>, result: syn::Result<T>) -> syn::Result<T> {
    match result {
        Ok(value) if errors.is_empty() => Ok(value),
        Ok(_) => Err(combine(errors).expect("one error at least")),
        Err(more) => {
            errors.push(more);
            Err(combine(errors).expect("one error at least"))
        }
    }
}
